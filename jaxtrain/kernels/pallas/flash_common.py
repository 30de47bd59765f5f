"""What the Pallas flash-attention variants share: parameters, block masks, padding, custom VJP.

The algorithm is FlashAttention-2 (Dao 2023, "FlashAttention-2: Faster Attention with Better
Parallelism and Work Partitioning"): the forward pass walks key/value blocks with an online
softmax and saves the per-row log-sum-exp; the backward pass recomputes the probabilities from
it (dQ in one kernel over query blocks, dK/dV in one over key blocks). The mask convention is
the one of :mod:`jaxtrain.kernels.xla.reference`.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax

NEG_INF = float("-inf")
F32 = jnp.float32


# The in-kernel matmuls of both lowerings, on 2-D blocks: float32 results whatever the input
# dtype (bf16 blocks would otherwise give bf16 scores and gradients).
def dot(a, b):
    """a [m, k] @ b [k, n] -> [m, n] float32."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=F32)


def dot_t(a, b):
    """a [m, k] @ b [n, k]^T -> [m, n] float32 (scores q k^T without transposing k)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=F32)


def t_dot(a, b):
    """a [k, m]^T @ b [k, n] -> [m, n] float32 (dK/dV: contract over the query rows)."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=F32)


@dataclass(frozen=True)
class FlashParams:
    """Static parameters of one kernel launch (hashable: a custom_vjp nondiff argument)."""

    causal: bool
    window: Optional[int]
    scale: float  # 1/sqrt(real head_dim)
    q_len: int  # real (unpadded) lengths
    kv_len: int
    block_q: int
    block_k: int
    interpret: object  # False, True, or a backend-specific interpret-params object

    @property
    def offset(self) -> int:  # query i sits at key position i + offset (bottom-right causal)
        return self.kv_len - self.q_len


def block_mask(q_pos, kv_pos, q_seg, kv_seg, p: FlashParams):
    """[bq, bk] bool. q_pos/q_seg: [bq, 1]; kv_pos/kv_seg: [1, bk]. Padded keys are masked."""
    mask = (kv_pos < p.kv_len) & (q_seg == kv_seg)
    if p.causal:
        mask &= kv_pos <= q_pos
    if p.window is not None:
        mask &= q_pos - kv_pos < p.window
        if not p.causal:
            mask &= kv_pos - q_pos < p.window
    return mask


def kv_block_range(i, n_kv_blocks: int, p: FlashParams):
    """[lo, hi) key blocks that query block ``i`` can see (skips fully masked causal blocks)."""
    lo, hi = jnp.int32(0), jnp.int32(n_kv_blocks)
    if p.causal:
        last = (i + 1) * p.block_q - 1 + p.offset  # position of the block's last query
        hi = jnp.minimum(hi, jnp.maximum(last + p.block_k, 0) // p.block_k)
        if p.window is not None:
            first = i * p.block_q + p.offset
            lo = jnp.maximum(first - p.window + 1, 0) // p.block_k
    return lo, hi


def q_block_range(j, n_q_blocks: int, p: FlashParams):
    """[lo, hi) query blocks that can see key block ``j``."""
    lo, hi = jnp.int32(0), jnp.int32(n_q_blocks)
    if p.causal:
        lo = jnp.maximum(j * p.block_k - p.offset, 0) // p.block_q
        if p.window is not None:
            last = (j + 1) * p.block_k - 2 + p.window - p.offset  # last query index that sees the block
            hi = jnp.minimum(hi, jnp.maximum(last + p.block_q, 0) // p.block_q)
    return lo, hi


def online_softmax_update(m, l, acc, s, mask, v, dot_pv: Callable):
    """One FlashAttention-2 step. s: [bq, bk] f32 scores; m, l: [bq]; acc: [bq, d] f32.

    Rows with nothing visible so far keep m = -inf and contribute exactly zero (no NaN).
    """
    s = jnp.where(mask, s, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
    alpha = jnp.exp(m - m_safe)
    prob = jnp.where(mask, jnp.exp(s - m_safe[:, None]), 0.0)
    l = alpha * l + jnp.sum(prob, axis=1)
    acc = acc * alpha[:, None] + dot_pv(prob.astype(v.dtype), v)
    return m_new, l, acc


def finalize(m, l, acc):
    """(normalised output f32 [bq, d], lse [bq]); lse = -inf and output 0 for empty rows."""
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    return acc / l_safe[:, None], jnp.where(empty, NEG_INF, m + jnp.log(l_safe))


def safe_lse(lse):
    return jnp.where(lse == NEG_INF, 0.0, lse)


def row_delta(o, do):
    """rowsum(dO * O) of the backward pass: o, do [batch, len, heads, head_dim] -> [batch, heads, len] f32."""
    return jnp.einsum("bthd,bthd->bht", o.astype(F32), do.astype(F32))


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def pick_block(requested: int, length: int, minimum: int) -> int:
    """The requested block, shrunk (to a power of two >= minimum) for short sequences."""
    return max(minimum, min(requested, 1 << max(0, (length - 1).bit_length())))


FwdImpl = Callable[..., tuple]  # (q, k, v, qseg, kvseg, params) -> (o, lse[b, h, tq])
BwdImpl = Callable[..., tuple]  # (q, k, v, qseg, kvseg, o, lse, do, params) -> (dq, dk, dv)


def make_flash(fwd: FwdImpl, bwd: BwdImpl):
    """jax.custom_vjp around a Pallas forward (saving lse) and a Pallas backward."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
    def flash(q, k, v, qseg, kvseg, params):
        return fwd(q, k, v, qseg, kvseg, params)[0]

    def flash_fwd(q, k, v, qseg, kvseg, params):
        o, lse = fwd(q, k, v, qseg, kvseg, params)
        return o, (q, k, v, qseg, kvseg, o, lse)

    def flash_bwd(params, res, do):
        q, k, v, qseg, kvseg, o, lse = res
        dq, dk, dv = bwd(q, k, v, qseg, kvseg, o, lse, do, params)
        return dq, dk, dv, None, None

    flash.defvjp(flash_fwd, flash_bwd)
    return flash


def run_flash(flash, q, k, v, q_segment_ids, kv_segment_ids, *, causal, window, block_q, block_k,
              interpret, min_block: int, head_dim_multiple: Optional[int] = None,
              pow2_head_dim: bool = False):
    """Validates shapes, pads lengths to the blocks (and head_dim if the backend needs it), runs.

    Raises:
      ValueError: mismatched shapes, heads not divisible by kv_heads, window < 1, or
        segment ids given for only one side when q_len != kv_len.
    """
    b, tq, h, d = q.shape
    if k.ndim != 4 or k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"flash attention: k {k.shape} / v {v.shape} do not match q {q.shape} "
                         "([batch, len, kv_heads, head_dim])")
    tk, kvh = k.shape[1], k.shape[2]
    if h % kvh:
        raise ValueError(f"flash attention: heads={h} is not divisible by kv_heads={kvh}")
    if window is not None and window < 1:
        raise ValueError(f"flash attention: window must be >= 1, got {window}")
    if kv_segment_ids is None:
        if q_segment_ids is not None and tq != tk:
            raise ValueError("flash attention: q_len != kv_len needs both q_segment_ids and kv_segment_ids")
        kv_segment_ids = q_segment_ids
    if q_segment_ids is None:
        q_segment_ids = jnp.zeros((b, tq), jnp.int32)
        kv_segment_ids = jnp.zeros((b, tk), jnp.int32)
    bq, bk = pick_block(block_q, tq, min_block), pick_block(block_k, tk, min_block)
    dp = d
    if pow2_head_dim:
        dp = 1 << (d - 1).bit_length()
    if head_dim_multiple:
        dp = _round_up(dp, head_dim_multiple)
    pad_q, pad_k = _round_up(tq, bq) - tq, _round_up(tk, bk) - tk
    q = jnp.pad(q, ((0, 0), (0, pad_q), (0, 0), (0, dp - d)))
    k = jnp.pad(k, ((0, 0), (0, pad_k), (0, 0), (0, dp - d)))
    v = jnp.pad(v, ((0, 0), (0, pad_k), (0, 0), (0, dp - d)))
    qseg = jnp.pad(q_segment_ids.astype(jnp.int32), ((0, 0), (0, pad_q)))
    kvseg = jnp.pad(kv_segment_ids.astype(jnp.int32), ((0, 0), (0, pad_k)))
    params = FlashParams(causal=causal, window=window, scale=1.0 / math.sqrt(d), q_len=tq, kv_len=tk,
                         block_q=bq, block_k=bk, interpret=interpret)
    return flash(q, k, v, qseg, kvseg, params)[:, :tq, :, :d]
