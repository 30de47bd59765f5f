"""Plain ``jnp`` attention: the reference every kernel in this package is tested against.

Mask convention shared by all implementations (reference, Pallas GPU/TPU, ring):

* causal masks are bottom-right aligned (FlashAttention >= 2.1): query ``i`` sits at
  position ``i + kv_len - q_len`` and sees keys ``j <= that position``. With
  ``q_len == kv_len`` this is the usual lower-triangular mask.
* ``window`` (sliding window, Beltagy et al. 2020 / Mistral) keeps keys with
  ``q_pos - j < window`` (and ``j - q_pos < window`` when not causal).
* ``q_segment_ids`` / ``kv_segment_ids`` ([batch, len] int32): a query sees only keys of
  its own segment (packed documents).
* A query row that sees no key at all returns zeros (never NaN), and so do its gradients.
"""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp


def attention_mask(q_len: int, kv_len: int, q_segment_ids: Optional[jax.Array] = None,
                   kv_segment_ids: Optional[jax.Array] = None, causal: bool = True,
                   window: Optional[int] = None) -> jax.Array:
    """Boolean mask [batch or 1, q_len, kv_len]; True = the query may attend to the key."""
    q_pos = jnp.arange(q_len)[:, None] + (kv_len - q_len)
    kv_pos = jnp.arange(kv_len)[None, :]
    mask = jnp.ones((q_len, kv_len), bool)
    if causal:
        mask &= kv_pos <= q_pos
    if window is not None:
        mask &= q_pos - kv_pos < window
        if not causal:
            mask &= kv_pos - q_pos < window
    mask = mask[None]
    if q_segment_ids is not None:
        mask = mask & (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])
    return mask


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_segment_ids: Optional[jax.Array] = None,
              kv_segment_ids: Optional[jax.Array] = None, causal: bool = True,
              window: Optional[int] = None) -> jax.Array:
    """Softmax(q k^T / sqrt(head_dim) + mask) v, computed in float32.

    Args:
      q: [batch, q_len, heads, head_dim]; k, v: [batch, kv_len, kv_heads, head_dim] with
        heads % kv_heads == 0 (query head ``h`` uses kv head ``h // (heads // kv_heads)``).
      q_segment_ids, kv_segment_ids: [batch, q_len] / [batch, kv_len] int32, or None.
    Returns: [batch, q_len, heads, head_dim] in q's dtype.
    """
    b, tq, h, d = q.shape
    kvh = k.shape[2]
    if kv_segment_ids is None:
        kv_segment_ids = q_segment_ids
    qg = q.astype(jnp.float32).reshape(b, tq, kvh, h // kvh, d)
    s = jnp.einsum("bqkgd,bskd->bkgqs", qg, k.astype(jnp.float32)) / math.sqrt(d)
    mask = attention_mask(tq, k.shape[1], q_segment_ids, kv_segment_ids, causal, window)[:, None, None]
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # fully masked row: avoid -inf - -inf
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(l == 0.0, 1.0, l)
    o = jnp.einsum("bkgqs,bskd->bqkgd", p, v.astype(jnp.float32))
    return o.reshape(b, tq, h, d).astype(q.dtype)
