"""The mixtral family's training loss: next-token cross-entropy plus the weighted router losses."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.models.family import masked_cross_entropy
from jaxtrain.models.mixtral.model import summarize


def moe_loss(model: nnx.Module, batch: dict) -> tuple[jax.Array, dict]:
    """loss = ce + aux_loss_weight * aux + z_loss_weight * z over a batch of [batch, length] int32 arrays.

    Metrics (scalars): ``ce_loss`` (the cross-entropy alone, to compare with a dense model),
    ``moe_aux_loss``, ``moe_z_loss``, ``moe_dropped_frac`` (copies past capacity), and
    ``moe_expert_frac_min`` / ``_max``: the smallest and largest share of the routed copies any
    expert of any layer received (1/n_experts each when balanced). Padding (``loss_mask`` 0) is
    routed nowhere and left out of the router losses. The validation loss is ``ce_loss``
    (``FAMILY.eval_loss``): the number to compare with a dense model.
    """
    return moe_head_loss(model, *model.decode(batch["inputs"], **model.block_inputs(batch)), batch)


def moe_head_loss(model: nnx.Module, logits: jax.Array, layer_stats: dict, batch: dict) -> tuple[jax.Array, dict]:
    """:func:`moe_loss` from the decoder's outputs: logits [batch, length, vocab] and the router
    statistics of every layer ([layers, ...]); what a pipeline computes at its last stage."""
    cfg, stats = model.cfg, summarize(layer_stats)
    ce, weight = masked_cross_entropy(logits, batch["targets"], batch["loss_mask"])
    loss = ce + cfg.aux_loss_weight * stats["aux"] + cfg.z_loss_weight * stats["z"]
    return loss, {"weight": weight, "ce_loss": ce, "moe_aux_loss": stats["aux"], "moe_z_loss": stats["z"],
                  "moe_dropped_frac": stats["dropped"], "moe_expert_frac_min": jnp.min(stats["frac"]),
                  "moe_expert_frac_max": jnp.max(stats["frac"])}
