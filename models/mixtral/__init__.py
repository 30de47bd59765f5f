"""The mixtral family: a sparse mixture-of-experts decoder (Jiang et al. 2024; HF ``MixtralForCausalLM``).

``config.py`` holds its ``model:`` keys, ``moe.py`` the router, experts and router losses,
``model.py`` the NNX module, ``loss.py`` the training loss with the router losses,
``flops.py`` its FLOPs per token (active parameters), ``hf.py`` the Hugging Face converter.
"""
from jaxtrain.models.family import Family
from jaxtrain.models.mixtral.config import MixtralConfig
from jaxtrain.models.mixtral.flops import flops_per_token
from jaxtrain.models.mixtral.hf import MixtralHF
from jaxtrain.models.mixtral.loss import moe_head_loss, moe_loss
from jaxtrain.models.mixtral.model import LOGICAL_AXES, Mixtral

FAMILY = Family(name="mixtral", config=MixtralConfig, model=Mixtral, flops_per_token=flops_per_token,
                logical_axes=LOGICAL_AXES, loss=moe_loss, head_loss=moe_head_loss, hf=MixtralHF(), eval_loss="ce_loss")

__all__ = ["FAMILY", "Mixtral", "MixtralConfig"]
