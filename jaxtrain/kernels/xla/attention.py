"""The XLA provider's attentions: ``jax.nn.dot_product_attention`` (XLA's ops, or cuDNN's fused flash
attention on GPU), causal attention by query blocks (:mod:`.blockwise`) and ring attention over the mesh
axis that splits 'length' (:mod:`.ring`).

Shapes: q [batch, q_len, heads, head_dim]; k, v [batch, kv_len, kv_heads, head_dim]; segment_ids
[batch, length] int32 or None. Causal masks are bottom-right aligned when q_len != kv_len
(:mod:`.reference`). Each returns [batch, q_len, heads, head_dim] in q's dtype.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jaxtrain.kernels.xla import blockwise, reference, ring


def xla_attention(q, k, v, segment_ids=None, causal=True, window=None):
    """``jax.nn.dot_product_attention(implementation='xla')`` with the shared mask convention."""
    if segment_ids is not None or window is not None or q.shape[1] != k.shape[1]:
        mask = reference.attention_mask(q.shape[1], k.shape[1], segment_ids, segment_ids, causal, window)
        return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation="xla")
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")


def blockwise_attention(q, k, v, segment_ids=None, causal=True, window=None):
    """Causal self-attention by query blocks (:func:`.blockwise.blockwise_attention`).

    Raises:
      ValueError: not causal.
    """
    if not causal:
        raise ValueError("model.attention=blockwise: only causal attention is supported")
    return blockwise.blockwise_attention(q, k, v, segment_ids, window=window)


def cudnn_attention(q, k, v, segment_ids=None, causal=True, window=None):
    """``jax.nn.dot_product_attention`` through cuDNN (fused flash attention on GPU)."""
    mask = None
    if segment_ids is not None:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    local = (window - 1, 0 if causal else window - 1) if window is not None else None
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, local_window_size=local,
                                        implementation="cudnn")


def ring_attention(q, k, v, segment_ids=None, causal=True, window=None):
    """Ring attention over the mesh axis the rules give 'length' (:func:`.ring.ring_attention`)."""
    return ring.ring_attention(q, k, v, segment_ids, causal=causal)


def cudnn_fits(q, k, segment_ids, window) -> Optional[str]:
    """None if cuDNN's flash attention takes this call, else why not."""
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"dtype {q.dtype} (cuDNN needs bf16/fp16)"
    d = q.shape[-1]
    if d > 128 or d % 8:
        return f"head_dim {d} (cuDNN needs <= 128 and a multiple of 8)"
    if q.shape[1] != k.shape[1]:
        return "q_len != kv_len"
    if segment_ids is not None:
        return "segment_ids (ours masks packed documents without a dense mask)"
    if window is not None:
        return "sliding window"
    return None


def cudnn_problem(facts) -> Optional[str]:
    """What of cuDNN's constraints the run's facts already break (unknown facts pass)."""
    if facts.dtype is not None and facts.dtype not in ("bfloat16", "float16"):
        return f"dtype {facts.dtype} (cuDNN needs bf16/fp16)"
    d = facts.head_dim
    if d is not None and (d > 128 or d % 8):
        return f"head_dim {d} (cuDNN needs <= 128 and a multiple of 8)"
    if facts.segment_ids:
        return "segment_ids (ours masks packed documents without a dense mask)"
    if facts.window is not None:
        return "sliding window"
    return None
