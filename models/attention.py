"""Attention dispatch: one signature for every implementation the model can use.

Shapes: q [batch, q_len, heads, head_dim]; k, v [batch, kv_len, kv_heads, head_dim]
(grouped-query attention when kv_heads < heads); segment_ids [batch, length] int32
(tokens attend only within their own segment: packed documents). Returns
[batch, q_len, heads, head_dim] in q's dtype.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: Optional[jax.Array] = None,
                  causal: bool = True) -> jax.Array:
    """``jax.nn.dot_product_attention`` (XLA) with a causal and a same-segment mask."""
    mask = None
    if segment_ids is not None:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # [b, 1, q, kv]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation="xla")


IMPLEMENTATIONS = {"xla": xla_attention}


def attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: Optional[jax.Array] = None,
              implementation: str = "xla") -> jax.Array:
    """Causal attention through the named implementation. Raises ValueError for an unknown name."""
    try:
        fn = IMPLEMENTATIONS[implementation]
    except KeyError:
        raise ValueError(f"model.attention: unknown implementation '{implementation}' "
                         f"(known: {', '.join(IMPLEMENTATIONS)})") from None
    return fn(q, k, v, segment_ids=segment_ids)
