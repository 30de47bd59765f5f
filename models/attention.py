"""Attention for the model families: the rotary embedding, and the one call every implementation
shares (the implementations themselves are the kernel registry's: :mod:`jaxtrain.kernels.ops`).

Shapes: q [batch, q_len, heads, head_dim]; k, v [batch, kv_len, kv_heads, head_dim]
(grouped-query attention when kv_heads < heads); segment_ids [batch, length] int32
(tokens attend only within their own segment: packed documents). Returns
[batch, q_len, heads, head_dim] in q's dtype. Causal masks are bottom-right aligned
when q_len != kv_len.

``model.attention`` names the implementation: ``auto`` (the run's plan picks one per backend and run:
``resolved.json`` says which and why), or one the registry lists (``python -m jaxtrain.train --help``
and docs/attention.md: ``xla``, ``blockwise``, ``cudnn``, ``pallas``, ``ring``, and the CPU provider's
fused kernel).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jaxtrain.kernels import ops


def rotate(x: jax.Array, cos, sin) -> jax.Array:
    """Rotary position embedding (Su et al. 2021), HF's rotate_half convention: per half of the last dim,
    ``x1 cos - x2 sin`` and ``x2 cos + x1 sin``, computed in float32 (one concatenate, no rotated copy).

    x: [batch, length, heads, head_dim]; cos, sin: broadcastable to [batch, length, heads, head_dim / 2]
    (e.g. [length, 1, head_dim / 2]). Returns x's shape and dtype.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def rotates_inside(implementation: str, q, k, segment_ids=None, window: Optional[int] = None) -> bool:
    """Whether the attention running this call applies rotary tables itself (pass ``rope`` to
    :func:`attention` instead of rotating q and k first: a pass over each fewer, both ways)."""
    return ops.rotates_inside(implementation, q, k, segment_ids, window)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: Optional[jax.Array] = None,
              implementation: str = "auto", *, causal: bool = True, window: Optional[int] = None,
              rope=None) -> jax.Array:
    """Attention through the implementation ``implementation`` resolves to (see the module docstring).

    Args:
      window: sliding-window size in keys (query sees keys with q_pos - k_pos < window), or None.
      rope: None, or rotary tables ``(cos, sin)`` [length, head_dim / 2] float32 for positions
        0..length-1, applied to q and k first (:func:`rotate`): inside the kernel where it rotates
        itself (:func:`rotates_inside`), else by :func:`rotate` before the implementation runs.
    Raises:
      ConfigError: an unknown implementation; AttentionBackendError: an explicit one that cannot run
        this call here (another backend, shapes its kernel does not take).
    """
    if rope is not None and not ops.rotates_inside(implementation, q, k, segment_ids, window, causal):
        cos, sin = (x[:, None, :] for x in rope)  # [length, 1, half]: every batch element and head
        q, k, rope = rotate(q, cos, sin), rotate(k, cos, sin), None
    return ops.attention(q, k, v, segment_ids, implementation, causal=causal, window=window, rope=rope)
