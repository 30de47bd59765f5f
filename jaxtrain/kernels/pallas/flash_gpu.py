"""Flash attention for GPUs: Pallas kernels for the Triton lowering (fwd + bwd).

FlashAttention-2 (Dao 2023). One program per (batch, head, query block) walks the key blocks
with ``fori_loop``, skipping blocks that causal/window masking hides entirely; it writes the
output and the row log-sum-exp. The backward pass is two kernels: dQ over query blocks, and
dK/dV over key blocks, which loops over the ``heads // kv_heads`` query heads that share the
key/value head (grouped-query attention without materialising repeated K/V). Layout is the
model's own [batch, len, heads, head_dim]; no transposes.

Off a GPU the kernels run with ``interpret=True`` (how the test suite runs them on CPU).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxtrain.kernels import target
from jaxtrain.kernels.pallas.flash_common import (
    F32,
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

# Positions come from 1-D aranges (broadcast), the simplest form for the Triton lowering.


def _fwd_kernel(qseg_ref, kvseg_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, p: FlashParams, n_kv: int):
    bq, bk = p.block_q, p.block_k
    i = pl.program_id(2)
    q = q_ref[...]
    q_pos = i * bq + jnp.arange(bq, dtype=jnp.int32)[:, None] + p.offset
    q_seg = qseg_ref[...][:, None]

    def body(j, carry):
        m, l, acc = carry
        start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        kv_pos = start + jnp.arange(bk, dtype=jnp.int32)[None, :]
        mask = block_mask(q_pos, kv_pos, q_seg, kvseg_ref[pl.ds(start, bk)][None, :], p)
        s = dot_t(q, k) * p.scale
        return online_softmax_update(m, l, acc, s, mask, v, dot)

    lo, hi = kv_block_range(i, n_kv, p)
    init = (jnp.full((bq,), -jnp.inf, F32), jnp.zeros((bq,), F32), jnp.zeros((bq, q.shape[-1]), F32))
    m, l, acc = lax.fori_loop(lo, hi, body, init)
    o, lse = finalize(m, l, acc)
    o_ref[...] = o.astype(o_ref.dtype)
    lse_ref[...] = lse


def _dq_kernel(qseg_ref, kvseg_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *,
               p: FlashParams, n_kv: int):
    bq, bk = p.block_q, p.block_k
    i = pl.program_id(2)
    q, do = q_ref[...], do_ref[...]
    lse, delta = safe_lse(lse_ref[...])[:, None], delta_ref[...][:, None]
    q_pos = i * bq + jnp.arange(bq, dtype=jnp.int32)[:, None] + p.offset
    q_seg = qseg_ref[...][:, None]

    def body(j, dq):
        start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        kv_pos = start + jnp.arange(bk, dtype=jnp.int32)[None, :]
        mask = block_mask(q_pos, kv_pos, q_seg, kvseg_ref[pl.ds(start, bk)][None, :], p)
        prob = jnp.where(mask, jnp.exp(dot_t(q, k) * p.scale - lse), 0.0)
        ds = prob * (dot_t(do, v) - delta)
        return dq + dot(ds.astype(k.dtype), k)

    lo, hi = kv_block_range(i, n_kv, p)
    dq = lax.fori_loop(lo, hi, body, jnp.zeros(q.shape, F32))
    dq_ref[...] = (dq * p.scale).astype(dq_ref.dtype)


def _dkdv_kernel(qseg_ref, kvseg_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                 p: FlashParams, n_q: int, group: int):
    bq, bk = p.block_q, p.block_k
    j = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]
    kv_pos = j * bk + jnp.arange(bk, dtype=jnp.int32)[None, :]
    kv_seg = kvseg_ref[...][None, :]
    lo, hi = q_block_range(j, n_q, p)
    dk = jnp.zeros(k.shape, F32)
    dv = jnp.zeros(v.shape, F32)
    for r in range(group):  # the query heads that share this kv head
        def body(i, carry, r=r):
            dk, dv = carry
            start = pl.multiple_of(i * bq, bq)
            q = q_ref[pl.ds(start, bq), r, :]
            do = do_ref[pl.ds(start, bq), r, :]
            lse = safe_lse(lse_ref[r, pl.ds(start, bq)])[:, None]
            delta = delta_ref[r, pl.ds(start, bq)][:, None]
            q_pos = start + jnp.arange(bq, dtype=jnp.int32)[:, None] + p.offset
            mask = block_mask(q_pos, kv_pos, qseg_ref[pl.ds(start, bq)][:, None], kv_seg, p)
            prob = jnp.where(mask, jnp.exp(dot_t(q, k) * p.scale - lse), 0.0)
            dv = dv + t_dot(prob.astype(do.dtype), do)
            ds = prob * (dot_t(do, v) - delta)
            dk = dk + t_dot(ds.astype(q.dtype), q)
            return dk, dv

        dk, dv = lax.fori_loop(lo, hi, body, (dk, dv))
    dk_ref[...] = (dk * p.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _query_block_specs(bq: int, tk: int, d: int, g: int) -> list:
    """Blocks for grid (batch, head, q block): q segment ids, all kv segment ids, the q block,
    and the whole K and V of this head's KV group (head h reads KV head h // g)."""
    return [
            pl.BlockSpec((None, bq), lambda b_, h_, i: (b_, i)),
            pl.BlockSpec((None, tk), lambda b_, h_, i: (b_, 0)),
            pl.BlockSpec((None, bq, None, d), lambda b_, h_, i: (b_, i, h_, 0)),
            pl.BlockSpec((None, tk, None, d), lambda b_, h_, i: (b_, 0, h_ // g, 0)),
            pl.BlockSpec((None, tk, None, d), lambda b_, h_, i: (b_, 0, h_ // g, 0)),
    ]


def _triton():
    """Triton compiler parameters: they make the kernels lower through Triton, not Mosaic GPU (the
    default of ``jax_pallas_use_mosaic_gpu`` in jax 0.10-0.11, which cannot lower these kernels)."""
    return pltriton.CompilerParams(num_warps=4, num_stages=2)


def _fwd(q, k, v, qseg, kvseg, p: FlashParams):
    b, tq, h, d = q.shape
    tk, kvh = k.shape[1], k.shape[2]
    g, bq, bk = h // kvh, p.block_q, p.block_k
    n_kv = tk // bk
    o, lse = pl.pallas_call(
        lambda *refs: _fwd_kernel(*refs, p=p, n_kv=n_kv),
        grid=(b, h, tq // bq),
        in_specs=_query_block_specs(bq, tk, d, g),
        out_specs=[
            pl.BlockSpec((None, bq, None, d), lambda b_, h_, i: (b_, i, h_, 0)),
            pl.BlockSpec((None, None, bq), lambda b_, h_, i: (b_, h_, i)),
        ],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, tq), F32)],
        interpret=p.interpret,
        compiler_params=_triton(),
        name="jaxtrain_flash_fwd",
    )(qseg, kvseg, q, k, v)
    return o, lse


def _bwd(q, k, v, qseg, kvseg, o, lse, do, p: FlashParams):
    b, tq, h, d = q.shape
    tk, kvh = k.shape[1], k.shape[2]
    g, bq, bk = h // kvh, p.block_q, p.block_k
    delta = row_delta(o, do)  # [b, h, tq]
    dq = pl.pallas_call(
        lambda *refs: _dq_kernel(*refs, p=p, n_kv=tk // bk),
        grid=(b, h, tq // bq),
        in_specs=_query_block_specs(bq, tk, d, g) + [
            pl.BlockSpec((None, bq, None, d), lambda b_, h_, i: (b_, i, h_, 0)),
            pl.BlockSpec((None, None, bq), lambda b_, h_, i: (b_, h_, i)),
            pl.BlockSpec((None, None, bq), lambda b_, h_, i: (b_, h_, i)),
        ],
        out_specs=pl.BlockSpec((None, bq, None, d), lambda b_, h_, i: (b_, i, h_, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=p.interpret,
        compiler_params=_triton(),
        name="jaxtrain_flash_bwd_dq",
    )(qseg, kvseg, q, k, v, do, lse, delta)
    dk, dv = pl.pallas_call(
        lambda *refs: _dkdv_kernel(*refs, p=p, n_q=tq // bq, group=g),
        grid=(b, kvh, tk // bk),
        in_specs=[
            pl.BlockSpec((None, tq), lambda b_, h_, j: (b_, 0)),
            pl.BlockSpec((None, bk), lambda b_, h_, j: (b_, j)),
            pl.BlockSpec((None, tq, g, d), lambda b_, h_, j: (b_, 0, h_, 0)),
            pl.BlockSpec((None, bk, None, d), lambda b_, h_, j: (b_, j, h_, 0)),
            pl.BlockSpec((None, bk, None, d), lambda b_, h_, j: (b_, j, h_, 0)),
            pl.BlockSpec((None, tq, g, d), lambda b_, h_, j: (b_, 0, h_, 0)),
            pl.BlockSpec((None, g, tq), lambda b_, h_, j: (b_, h_, 0)),
            pl.BlockSpec((None, g, tq), lambda b_, h_, j: (b_, h_, 0)),
        ],
        out_specs=[pl.BlockSpec((None, bk, None, d), lambda b_, h_, j: (b_, j, h_, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        interpret=p.interpret,
        compiler_params=_triton(),
        name="jaxtrain_flash_bwd_dkdv",
    )(qseg, kvseg, q, k, v, do, lse, delta)
    return dq, dk, dv


_flash = make_flash(_fwd, _bwd)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_segment_ids: Optional[jax.Array] = None,
                    kv_segment_ids: Optional[jax.Array] = None, *, causal: bool = True,
                    window: Optional[int] = None, block_q: int = 64, block_k: int = 64,
                    interpret: Optional[bool] = None) -> jax.Array:
    """FlashAttention-2 with the Pallas Triton lowering; differentiable (custom VJP, Pallas backward).

    Args:
      q: [batch, q_len, heads, head_dim]; k, v: [batch, kv_len, kv_heads, head_dim].
      q_segment_ids, kv_segment_ids: [batch, q_len] / [batch, kv_len] int32 (packed documents).
      causal, window: see :mod:`jaxtrain.kernels.xla.reference` for the mask convention.
      block_q, block_k: tile sizes (shrunk for short sequences; lengths are zero-padded to a
        multiple internally and the padding masked). head_dim is padded to a power of two
        (Triton tiles must be), so 96 runs as 128.
      interpret: None = interpret unless running on a GPU.
    Returns: [batch, q_len, heads, head_dim] in q's dtype.
    """
    if interpret is None:
        interpret = target.backend() != "gpu"
    return run_flash(_flash, q, k, v, q_segment_ids, kv_segment_ids, causal=causal, window=window,
                     block_q=block_q, block_k=block_k, interpret=interpret, min_block=16, pow2_head_dim=True)
