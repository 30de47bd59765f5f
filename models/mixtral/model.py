"""Mixtral-style sparse decoder in Flax NNX (Jiang et al. 2024; HF ``MixtralForCausalLM``).

The llama family's block (RMSNorm, rotary GQA attention; ``models/llama/model.py``) with its
SwiGLU MLP replaced by a sparse mixture of SwiGLU experts (``models/mixtral/moe.py``).

Parameter layout (logical names), the llama one except for the MLP:
  layers.i.moe.router   [embed, E]          (replicated over the expert dim: every device routes)
  layers.i.moe.w_gate   [exp, embed, mlp]   w_up: same   w_down: [exp, mlp, embed]

The forward also returns router statistics, averaged over layers: the load-balancing and
z-losses, the fraction of dropped copies, and each expert's share of the copies per layer.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.models.llama.model import Attention, Llama, RMSNorm, _checkpoint, project
from jaxtrain.models.mixtral.config import MixtralConfig
from jaxtrain.models.mixtral.moe import MoE
from jaxtrain.parallel.activations import constrain

LOGICAL_AXES = ("batch", "length", "residual_length", "kv_length", "embed", "vocab", "heads", "kv_heads",
                "kv", "mlp", "exp", "layers")


class Block(nnx.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then + moe(norm(.)). Returns (x, router stats)."""

    def __init__(self, cfg: MixtralConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg)
        self.moe = MoE(cfg, rngs)

    def __call__(self, x: jax.Array, positions: Optional[jax.Array], segment_ids: Optional[jax.Array] = None,
                 mask: Optional[jax.Array] = None):
        x = x + self.attn(self.attn_norm(x), positions, segment_ids)
        y, stats = self.moe(self.mlp_norm(x), mask)
        return constrain(x + y, "batch", "residual_length", "embed"), stats


def _run(block: Block, x, positions, segment_ids, mask, remat: str):
    if remat == "none":
        return block(x, positions, segment_ids, mask)
    graphdef, state = nnx.split(block)
    return _checkpoint(lambda h, st: nnx.merge(graphdef, st)(h, positions, segment_ids, mask), remat)(x, state)


class Mixtral(Llama):
    """Sparse decoder-only LM. tokens [batch, length] int32 -> logits [batch, length, vocab] float32.

    The llama module's embedding, final norm and head (``Llama.__init__``) around MoE blocks.
    """

    block_type = Block

    def __call__(self, tokens: jax.Array, positions: Optional[jax.Array] = None,
                 segment_ids: Optional[jax.Array] = None) -> jax.Array:
        """Logits only (see :meth:`forward`)."""
        return self.forward(tokens, positions, segment_ids)[0]

    def forward(self, tokens: jax.Array, positions: Optional[jax.Array] = None,
                segment_ids: Optional[jax.Array] = None, mask: Optional[jax.Array] = None) -> tuple[jax.Array, dict]:
        """tokens, positions, segment_ids, mask [batch, length] int32 -> (logits [batch, length, vocab]
        float32, stats): 'aux', 'z', 'dropped' averaged over layers, 'frac' [layers, E]. ``mask`` 0
        marks padding, which the experts never see (None: every token is real)."""
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        table = constrain(self.embed.embedding[...], "vocab", None)  # gather FSDP shards before the lookup
        x = constrain(table[tokens].astype(dt), "batch", "residual_length", "embed")
        if cfg.scan_layers:
            graphdef, state = nnx.split(self.layers)

            def body(h, layer_state):
                return nnx.merge(graphdef, layer_state)(h, positions, segment_ids, mask)

            x, stats = jax.lax.scan(_checkpoint(body, cfg.remat, prevent_cse=False), x, state)
        else:
            per_layer = []
            for block in self.layers:
                x, s = _run(block, x, positions, segment_ids, mask, cfg.remat)
                per_layer.append(s)
            stats = jax.tree_util.tree_map(lambda *v: jnp.stack(v), *per_layer)
        x = self.final_norm(x)
        head = self.embed.embedding[...].T if cfg.tie_embeddings else self.lm_head[...]
        logits = constrain(project(x, head.astype(dt)).astype(jnp.float32), "batch", "length", "vocab")
        summary = {k: stats[k].mean() for k in ("aux", "z", "dropped")}
        return logits, {**summary, "frac": stats["frac"]}
