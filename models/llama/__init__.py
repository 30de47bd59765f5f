"""The llama family: a Llama-style decoder (Touvron et al. 2023; HF ``LlamaForCausalLM``).

``config.py`` holds its ``model:`` keys, ``model.py`` the NNX module and its logical axis
names, ``hf.py`` the Hugging Face converter, ``flops.py`` its FLOPs per token.
"""
from jaxtrain.models.family import Family
from jaxtrain.models.llama.config import LlamaConfig
from jaxtrain.models.llama.flops import flops_per_token
from jaxtrain.models.llama.hf import LlamaHF
from jaxtrain.models.llama.model import LOGICAL_AXES, Llama

FAMILY = Family(name="llama", config=LlamaConfig, model=Llama, flops_per_token=flops_per_token,
                logical_axes=LOGICAL_AXES, hf=LlamaHF())

__all__ = ["FAMILY", "Llama", "LlamaConfig"]
