"""Mixtral-style sparse decoder in Flax NNX (Jiang et al. 2024; HF ``MixtralForCausalLM``).

The llama family's attention (RMSNorm, rotary GQA attention; ``models/llama/model.py``) with the
SwiGLU MLP replaced by a sparse mixture of SwiGLU experts (``models/mixtral/moe.py``), in the
shared decoder (``models/decoder.py``: embedding, scanned or unrolled block stack, final norm, head).

Parameter layout (logical names), the llama one except for the MLP:
  layers.i.moe.router   [embed, E]          (replicated over the expert dim: every device routes)
  layers.i.moe.w_gate   [exp, embed, mlp]   w_up: same   w_down: [exp, mlp, embed]

The forward also returns router statistics, averaged over layers: the load-balancing and
z-losses, the fraction of dropped copies, and each expert's share of the copies per layer.
"""
from __future__ import annotations

from typing import Optional

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.models.decoder import Decoder
from jaxtrain.models.layers import RMSNorm
from jaxtrain.models.llama.model import Attention
from jaxtrain.models.mixtral.config import MixtralConfig
from jaxtrain.models.mixtral.moe import MoE
from jaxtrain.parallel.activations import constrain

LOGICAL_AXES = ("batch", "length", "residual_length", "kv_length", "embed", "vocab", "heads", "kv_heads",
                "kv", "mlp", "exp", "layers")


class Block(nnx.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then + moe(norm(.)).

    x [batch, length, embed] -> (x, stats): the MoE's router statistics ({'aux', 'z', 'dropped'}
    scalars, 'frac' [E]; see :class:`MoE`). ``mask`` [batch, length] (0: padding, routed nowhere).
    Named activations as the llama block's: ``attn_in``, ``qkv``, ``attn_out`` and ``mlp_in`` (the MoE's normed
    input, which the router and the experts' weight gradients read).
    """

    def __init__(self, cfg: MixtralConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg)
        self.moe = MoE(cfg, rngs)

    def __call__(self, x: jax.Array, positions: Optional[jax.Array], segment_ids: Optional[jax.Array] = None,
                 mask: Optional[jax.Array] = None) -> tuple[jax.Array, dict]:
        x = x + self.attn(checkpoint_name(self.attn_norm(x), "attn_in"), positions, segment_ids)
        y, stats = self.moe(checkpoint_name(self.mlp_norm(x), "mlp_in"), mask)
        return constrain(x + y, "batch", "residual_length", "embed"), stats


class Mixtral(Decoder):
    """Sparse decoder-only LM. tokens [batch, length] int32 -> logits [batch, length, vocab] float32.

    The shared decoder around MoE blocks; :meth:`forward` also returns the router statistics.
    """

    block_type = Block
    block_returns_aux = True  # each block's router statistics, stacked over layers by the decoder

    def __call__(self, tokens: jax.Array, positions: Optional[jax.Array] = None,
                 segment_ids: Optional[jax.Array] = None) -> jax.Array:
        """Logits only (see :meth:`forward`)."""
        return self.forward(tokens, positions, segment_ids)[0]

    def forward(self, tokens: jax.Array, positions: Optional[jax.Array] = None,
                segment_ids: Optional[jax.Array] = None, mask: Optional[jax.Array] = None) -> tuple[jax.Array, dict]:
        """tokens, positions, segment_ids, mask [batch, length] int32 -> (logits [batch, length, vocab]
        float32, stats): 'aux', 'z', 'dropped' averaged over layers, 'frac' [layers, E]. ``mask`` 0
        marks padding, which the experts never see (None: every token is real)."""
        logits, stats = self.decode(tokens, positions, segment_ids, mask=mask)  # stats: [layers, ...]
        return logits, summarize(stats)

    def block_inputs(self, batch: dict) -> dict:
        """The decoder's inputs, and the loss mask: padding is routed to no expert."""
        return {**super().block_inputs(batch), "mask": batch["loss_mask"]}


def summarize(stats: dict) -> dict:
    """Per-layer router statistics [layers, ...] -> 'aux', 'z', 'dropped' averaged over layers, 'frac' [layers, E]."""
    return {**{k: stats[k].mean() for k in ("aux", "z", "dropped")}, "frac": stats["frac"]}
