"""Causal self-attention as one fused XLA:CPU kernel (``attention.cc``), float32, with its gradient
likewise: ``model.attention=cpu_fused``.

Why: a short sequence's attention on a CPU is many tiny matmuls (one per batch element and head) that
XLA runs at a fraction of the matmul rate. The kernel does one (batch, kv head) pair per task, with its
keys and values in cache, its score tiles in vector registers and its rows' softmax in between; the
backward recomputes the probabilities from the forward's log-sum-exp, as in FlashAttention (Dao et al.
2022). Each task writes only its own outputs, so results do not depend on the thread count or on the
other rows of the batch. The rotary embedding (HF's rotate_half) can be applied inside.
"""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.kernels.cpu.library import BACKWARD, FORWARD, ROPE_BACKWARD, ROPE_FORWARD, problem

MAX_LENGTH = 1024  # two [length, length] float32 tiles per thread: 8 MiB at 1024


def shape_problem(q_shape, k_shape, causal: bool, segment_ids, window) -> Optional[str]:
    """Why the kernel cannot run attention of these shapes and options, or None."""
    b, t, h, d = q_shape
    if not causal or k_shape[1] != t:
        return "not causal self-attention"
    if segment_ids is not None or window is not None:
        return "segment ids (packed or padded documents) or a sliding window"
    if t % 16:
        return f"length {t} is not a multiple of 16"
    if d % 16:
        return f"head_dim {d} is not a multiple of 16"
    if h % k_shape[2]:
        return f"{h} heads are not a multiple of {k_shape[2]} kv heads"
    if t > MAX_LENGTH:
        return f"length {t} > {MAX_LENGTH}"
    return None


def _forward(q, k, v, rope):
    b, t, h, d = q.shape
    call = jax.ffi.ffi_call(FORWARD if rope is None else ROPE_FORWARD,
                            (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct((b, h, t), jnp.float32)),
                            vmap_method="sequential")
    return call(q, k, v, *(rope or ()), scale=np.float32(1 / math.sqrt(d)))


@jax.custom_vjp
def _attention(q, k, v, rope):
    return _forward(q, k, v, rope)[0]


def _attention_fwd(q, k, v, rope):
    o, lse = _forward(q, k, v, rope)
    return o, (q, k, v, o, lse, rope)


def _attention_bwd(res, do):
    q, k, v, o, lse, rope = res
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, k, v))
    grads = jax.ffi.ffi_call(BACKWARD if rope is None else ROPE_BACKWARD, shapes, vmap_method="sequential")(
        q, k, v, o, lse, do, *(rope or ()), scale=np.float32(1 / math.sqrt(q.shape[-1])))
    return (*grads, None if rope is None else tuple(jnp.zeros_like(x) for x in rope))  # the tables: constants


_attention.defvjp(_attention_fwd, _attention_bwd)


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array, rope=None) -> jax.Array:
    """Causal softmax(q k^T / sqrt(head_dim)) v on the CPU, computed in float32.

    Args:
      q: [batch, length, heads, head_dim]; k, v: [batch, length, kv_heads, head_dim], heads a
        multiple of kv_heads (grouped-query attention without repeating K/V); length and head_dim
        multiples of 16, length at most :data:`MAX_LENGTH`.
      rope: None, or ``(cos, sin)`` [length, head_dim / 2] float32: q and k are rotated by them first
        (rotary embedding, HF's rotate_half; ``jaxtrain.models.attention.rotate``) inside the kernel,
        which saves XLA a pass over each in the forward and another in the backward.
    Returns: [batch, length, heads, head_dim] in q's dtype.
    Raises:
      RuntimeError: the kernel is not available (:func:`problem` says why).
      ValueError: shapes the kernel does not take.
    """
    why = problem()
    if why:
        raise RuntimeError(f"the XLA:CPU attention kernel: {why}")
    shape_why = shape_problem(q.shape, k.shape, True, None, None)
    if shape_why:
        raise ValueError(f"model.attention=cpu_fused: {shape_why}")
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    if rope is not None:
        rope = tuple(jnp.asarray(x, jnp.float32) for x in rope)
        if any(x.shape != (q.shape[1], q.shape[3] // 2) for x in rope):
            raise ValueError(f"model.attention=cpu_fused: rope tables must be [length, head_dim / 2] = "
                             f"{[q.shape[1], q.shape[3] // 2]}, got {[list(x.shape) for x in rope]}")
    return _attention(*f32, rope).astype(q.dtype)
