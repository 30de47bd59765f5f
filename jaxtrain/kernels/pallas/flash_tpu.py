"""Flash attention for TPUs: Pallas kernels for the Mosaic lowering (fwd + bwd).

The same FlashAttention-2 algorithm (Dao 2023) and masks as :mod:`flash_gpu`, written the
Mosaic way: the key blocks are the innermost, sequential ("arbitrary") grid dimension, the
running max / sum / accumulator live in VMEM scratch, and ``pl.when`` skips blocks that
causal/window masking hides. Arrays are laid out [batch, heads, len, head_dim] so that the
blocks' last two dims are (len, head_dim). The dK/dV kernel's innermost grid dimension runs
over (query head in the group, query block) pairs: grouped-query attention without repeated
K/V. Off a TPU the kernels run in Pallas' TPU interpret mode (~100x slower than jnp: tests
keep these cases tiny).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxtrain.kernels import target
from jaxtrain.kernels.pallas.flash_common import (
    F32,
    NEG_INF,
    FlashParams,
    block_mask,
    dot,
    dot_t,
    finalize,
    kv_block_range,
    make_flash,
    online_softmax_update,
    q_block_range,
    row_delta,
    run_flash,
    safe_lse,
    t_dot,
)


def _positions(i, j, p: FlashParams):
    q_pos = i * p.block_q + lax.broadcasted_iota(jnp.int32, (p.block_q, 1), 0) + p.offset
    kv_pos = j * p.block_k + lax.broadcasted_iota(jnp.int32, (1, p.block_k), 1)
    return q_pos, kv_pos


def _fwd_kernel(qseg_ref, kvseg_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc, *,
                p: FlashParams, n_kv: int):
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, NEG_INF, F32)
        l_sc[...] = jnp.zeros(l_sc.shape, F32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, F32)

    lo, hi = kv_block_range(i, n_kv, p)

    @pl.when((j >= lo) & (j < hi))
    def _compute():
        q_pos, kv_pos = _positions(i, j, p)
        mask = block_mask(q_pos, kv_pos, qseg_ref[...], kvseg_ref[...], p)
        s = dot_t(q_ref[...], k_ref[...]) * p.scale
        m, l, acc = online_softmax_update(m_sc[...][:, 0], l_sc[...][:, 0], acc_sc[...], s, mask, v_ref[...],
                                          dot)
        m_sc[...], l_sc[...], acc_sc[...] = m[:, None], l[:, None], acc

    @pl.when(j == n_kv - 1)
    def _finish():
        o, lse = finalize(m_sc[...][:, 0], l_sc[...][:, 0], acc_sc[...])
        o_ref[...] = o.astype(o_ref.dtype)
        lse_ref[...] = lse[:, None]


def _dq_kernel(qseg_ref, kvseg_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dq_sc, *,
               p: FlashParams, n_kv: int):
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, F32)

    lo, hi = kv_block_range(i, n_kv, p)

    @pl.when((j >= lo) & (j < hi))
    def _compute():
        q_pos, kv_pos = _positions(i, j, p)
        mask = block_mask(q_pos, kv_pos, qseg_ref[...], kvseg_ref[...], p)
        k = k_ref[...]
        prob = jnp.where(mask, jnp.exp(dot_t(q_ref[...], k) * p.scale - safe_lse(lse_ref[...])), 0.0)
        ds = prob * (dot_t(do_ref[...], v_ref[...]) - delta_ref[...])
        dq_sc[...] += dot(ds.astype(k.dtype), k)

    @pl.when(j == n_kv - 1)
    def _finish():
        dq_ref[...] = (dq_sc[...] * p.scale).astype(dq_ref.dtype)


def _dkdv_kernel(qseg_ref, kvseg_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref,
                 dk_sc, dv_sc, *, p: FlashParams, n_q: int, group: int):
    j, t = pl.program_id(2), pl.program_id(3)  # t runs over (head in group, query block)
    i = t % n_q

    @pl.when(t == 0)
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, F32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, F32)

    lo, hi = q_block_range(j, n_q, p)

    @pl.when((i >= lo) & (i < hi))
    def _compute():
        q_pos, kv_pos = _positions(i, j, p)
        mask = block_mask(q_pos, kv_pos, qseg_ref[...], kvseg_ref[...], p)
        q, do = q_ref[...], do_ref[...]
        prob = jnp.where(mask, jnp.exp(dot_t(q, k_ref[...]) * p.scale - safe_lse(lse_ref[...])), 0.0)
        dv_sc[...] += t_dot(prob.astype(do.dtype), do)
        ds = prob * (dot_t(do, v_ref[...]) - delta_ref[...])
        dk_sc[...] += t_dot(ds.astype(q.dtype), q)

    @pl.when(t == group * n_q - 1)
    def _finish():
        dk_ref[...] = (dk_sc[...] * p.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _call(kernel, p: FlashParams, **kw):
    interpret = pltpu.InterpretParams() if p.interpret else False
    params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))
    return pl.pallas_call(kernel, interpret=interpret, compiler_params=params, **kw)


def _specs(p: FlashParams, g: int):
    """BlockSpecs on the (b, h, i, j) grid: segs, q-like, kv-like, row stats."""
    bq, bk = p.block_q, p.block_k
    return dict(
        qseg=pl.BlockSpec((None, bq, 1), lambda b, h, i, j: (b, i, 0)),
        kvseg=pl.BlockSpec((None, 1, bk), lambda b, h, i, j: (b, 0, j)),
        q=lambda d: pl.BlockSpec((None, None, bq, d), lambda b, h, i, j: (b, h, i, 0)),
        kv=lambda d: pl.BlockSpec((None, None, bk, d), lambda b, h, i, j: (b, h // g, j, 0)),
        row=pl.BlockSpec((None, None, bq, 1), lambda b, h, i, j: (b, h, i, 0)),
    )


def _fwd(q, k, v, qseg, kvseg, p: FlashParams):
    # q [b, tq, h, d] -> [b, h, tq, d]; segs [b, t] -> [b, t, 1] / [b, 1, t]
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    b, h, tq, d = q.shape
    kvh, tk = k.shape[1], k.shape[2]
    s = _specs(p, h // kvh)
    n_kv = tk // p.block_k
    o, lse = _call(
        lambda *r: _fwd_kernel(*r, p=p, n_kv=n_kv), p,
        grid=(b, h, tq // p.block_q, n_kv),
        in_specs=[s["qseg"], s["kvseg"], s["q"](d), s["kv"](d), s["kv"](d)],
        out_specs=[s["q"](d), s["row"]],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, tq, 1), F32)],
        scratch_shapes=[pltpu.VMEM((p.block_q, 1), F32), pltpu.VMEM((p.block_q, 1), F32),
                        pltpu.VMEM((p.block_q, d), F32)],
    )(qseg[:, :, None], kvseg[:, None, :], q, k, v)
    return o.transpose(0, 2, 1, 3), lse


def _bwd(q, k, v, qseg, kvseg, o, lse, do, p: FlashParams):
    delta = row_delta(o, do)[..., None]  # [b, h, tq, 1]: rows of the (len, head_dim) blocks
    q, k, v, do = (x.transpose(0, 2, 1, 3) for x in (q, k, v, do))
    b, h, tq, d = q.shape
    kvh, tk = k.shape[1], k.shape[2]
    g, n_q, n_kv = h // kvh, tq // p.block_q, tk // p.block_k
    s = _specs(p, g)
    qseg, kvseg = qseg[:, :, None], kvseg[:, None, :]
    dq = _call(
        lambda *r: _dq_kernel(*r, p=p, n_kv=n_kv), p,
        grid=(b, h, n_q, n_kv),
        in_specs=[s["qseg"], s["kvseg"], s["q"](d), s["kv"](d), s["kv"](d), s["q"](d), s["row"], s["row"]],
        out_specs=s["q"](d),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_shapes=[pltpu.VMEM((p.block_q, d), F32)],
    )(qseg, kvseg, q, k, v, do, lse, delta)
    bq, bk = p.block_q, p.block_k
    # grid (b, kv head, key block j, t = r * n_q + i): query head kvh * g + r, query block i
    qh = lambda h_, t: h_ * g + t // n_q  # noqa: E731
    q_spec = pl.BlockSpec((None, None, bq, d), lambda b_, h_, j, t: (b_, qh(h_, t), t % n_q, 0))
    row_spec = pl.BlockSpec((None, None, bq, 1), lambda b_, h_, j, t: (b_, qh(h_, t), t % n_q, 0))
    kv_spec = pl.BlockSpec((None, None, bk, d), lambda b_, h_, j, t: (b_, h_, j, 0))
    dk, dv = _call(
        lambda *r: _dkdv_kernel(*r, p=p, n_q=n_q, group=g), p,
        grid=(b, kvh, n_kv, g * n_q),
        in_specs=[pl.BlockSpec((None, bq, 1), lambda b_, h_, j, t: (b_, t % n_q, 0)),
                  pl.BlockSpec((None, 1, bk), lambda b_, h_, j, t: (b_, 0, j)),
                  q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec],
        out_specs=[kv_spec, kv_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        scratch_shapes=[pltpu.VMEM((bk, d), F32), pltpu.VMEM((bk, d), F32)],
    )(qseg, kvseg, q, k, v, do, lse, delta)
    return tuple(x.transpose(0, 2, 1, 3) for x in (dq, dk, dv))


_flash = make_flash(_fwd, _bwd)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_segment_ids: Optional[jax.Array] = None,
                    kv_segment_ids: Optional[jax.Array] = None, *, causal: bool = True,
                    window: Optional[int] = None, block_q: int = 128, block_k: int = 128,
                    interpret: Optional[bool] = None) -> jax.Array:
    """FlashAttention-2 with the Pallas Mosaic (TPU) lowering; differentiable (custom VJP).

    Same arguments, shapes and mask convention as :func:`jaxtrain.kernels.pallas.flash_gpu.flash_attention`.
    Blocks are at least 8 rows (TPU sublanes); lengths are padded to a multiple of the block.
    interpret: None = TPU interpret mode unless running on a TPU.
    """
    if interpret is None:
        interpret = target.backend() != "tpu"
    return run_flash(_flash, q, k, v, q_segment_ids, kv_segment_ids, causal=causal, window=window,
                     block_q=block_q, block_k=block_k, interpret=interpret, min_block=8)
