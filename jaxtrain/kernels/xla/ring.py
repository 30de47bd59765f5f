"""Ring attention over the mesh axis that shards the sequence (context parallelism).

Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
Context": each device keeps its query block and passes its key/value block (with its segment
ids) around the ring with ``ppermute``; the per-block partial results merge with an online
softmax (log-sum-exp). The backward pass is a second ring (custom VJP): dK/dV accumulators
travel with their K/V block and arrive home after a full turn, so no device ever holds more
than two K/V blocks, whatever the sequence length.

Causal load balancing uses the **zig-zag** layout (as in Llama 3's context parallelism and
zhuzilin/ring-flash-attention): the sequence is cut into ``2n`` chunks and device ``d`` holds
chunks ``d`` and ``2n-1-d``. Then at every ring step past the first, each device does exactly
half a block pair of unmasked work (all its queries against the earlier source's first chunk,
or its second query chunk against the later source's whole block), so no device idles on
masked blocks. The re-layout happens inside the shard_map with two ``ppermute``s each way.

The mesh comes from :func:`jaxtrain.partitioning.active_sharding`, the context the trainer
sets while tracing; model code never sees it. Per-block math is plain jnp (XLA).
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxtrain.errors import RingAttentionError
from jaxtrain.kernels.context import active_sharding
from jaxtrain.kernels.xla import reference

F32 = jnp.float32


# ------------------------------------------------------------------ per-block math (f32)

def _scores(q, k, scale):
    b, t, h, d = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, d).astype(F32)
    return jnp.einsum("bqkgd,bskd->bqkgs", qg, k.astype(F32)) * scale  # [b, tq, kvh, g, tk]


def _mask(qseg, kvseg, causal_pos=None):
    """[b, tq, 1, 1, tk] bool; causal_pos = (q positions [tq], kv positions [tk]) or None."""
    m = qseg[:, :, None] == kvseg[:, None, :]
    if causal_pos is not None:
        qp, kp = causal_pos
        m = m & (kp[None, None, :] <= qp[None, :, None])
    return m[:, :, None, None, :]


def _block_fwd(q, k, v, mask, scale):
    """Attention of q against one K/V block: (o f32 [b, tq, h, d], lse f32 [b, tq, h])."""
    b, t, h, d = q.shape
    s = jnp.where(mask, _scores(q, k, scale), -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bqkgs,bskd->bqkgd", p, v.astype(F32)) / jnp.where(l == 0, 1.0, l)
    lse = jnp.where(l == 0, -jnp.inf, m + jnp.log(jnp.where(l == 0, 1.0, l)))[..., 0]
    return o.reshape(b, t, h, d), lse.reshape(b, t, h)


def _block_bwd(q, k, v, mask, scale, lse, delta, do):
    """Gradients of one block given the final lse/delta [b, tq, h]: (dq, dk, dv) in f32."""
    b, t, h, d = q.shape
    kvh = k.shape[2]
    g = h // kvh
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0).reshape(b, t, kvh, g, 1)
    p = jnp.where(mask, jnp.exp(_scores(q, k, scale) - lse), 0.0)
    dog = do.reshape(b, t, kvh, g, d).astype(F32)
    dv = jnp.einsum("bqkgs,bqkgd->bskd", p, dog)
    dp = jnp.einsum("bqkgd,bskd->bqkgs", dog, v.astype(F32))
    ds = p * (dp - delta.reshape(b, t, kvh, g, 1))
    dq = jnp.einsum("bqkgs,bskd->bqkgd", ds, k.astype(F32)).reshape(b, t, h, d) * scale
    dk = jnp.einsum("bqkgs,bqkgd->bskd", ds, q.reshape(b, t, kvh, g, d).astype(F32)) * scale
    return dq, dk, dv


def _merge(o1, lse1, o2, lse2):
    lse = jnp.logaddexp(lse1, lse2)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    w1, w2 = jnp.exp(lse1 - safe)[..., None], jnp.exp(lse2 - safe)[..., None]
    return o1 * w1 + o2 * w2, lse


# ------------------------------------------------------------------ the ring (inside shard_map)

def _shift(x, axis, n):  # device i -> i + 1
    return lax.ppermute(x, axis, [(i, (i + 1) % n) for i in range(n)])


def _zigzag_positions(me, n, c):
    """Global positions [2c] of the two chunks (me, 2n-1-me) a device holds."""
    r = jnp.arange(c)
    return jnp.concatenate([me * c + r, (2 * n - 1 - me) * c + r])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _ring(q, k, v, seg, axis, n, causal):
    return _ring_fwd(q, k, v, seg, axis, n, causal)[0]


def _diag_mask(seg, me, n, c, causal):
    pos = _zigzag_positions(me, n, c) if causal else None
    return _mask(seg, seg, (pos, pos) if causal else None)


def _ring_fwd(q, k, v, seg, axis, n, causal):
    scale = 1.0 / math.sqrt(q.shape[-1])
    me = lax.axis_index(axis)
    c = q.shape[1] // 2
    o, lse = _block_fwd(q, k, v, _diag_mask(seg, me, n, c, causal), scale)

    def past(k, v, kvseg):  # source earlier than me: all my queries vs its first chunk
        return _block_fwd(q, k[:, :c], v[:, :c], _mask(seg, kvseg[:, :c]), scale)

    def future(k, v, kvseg):  # source later than me: my second query chunk vs its whole block
        o2, lse2 = _block_fwd(q[:, c:], k, v, _mask(seg[:, c:], kvseg), scale)
        return (jnp.concatenate([jnp.zeros_like(o2), o2], 1),
                jnp.concatenate([jnp.full_like(lse2, -jnp.inf), lse2], 1))

    def full(k, v, kvseg):
        return _block_fwd(q, k, v, _mask(seg, kvseg), scale)

    def body(s, carry):
        o, lse, k, v, kvseg = carry
        k, v, kvseg = _shift(k, axis, n), _shift(v, axis, n), _shift(kvseg, axis, n)
        src = (me - s) % n
        if causal:
            ob, lseb = lax.cond(src < me, past, future, k, v, kvseg)
        else:
            ob, lseb = full(k, v, kvseg)
        o, lse = _merge(o, lse, ob, lseb)
        return o, lse, k, v, kvseg

    o, lse, *_ = lax.fori_loop(1, n, body, (o, lse, k, v, seg))
    o = o.astype(q.dtype)
    return o, (q, k, v, seg, o, lse)


def _ring_bwd(axis, n, causal, res, do):
    q, k, v, seg, o, lse = res
    scale = 1.0 / math.sqrt(q.shape[-1])
    me = lax.axis_index(axis)
    c = q.shape[1] // 2
    delta = jnp.sum(o.astype(F32) * do.astype(F32), axis=-1)  # [b, t, h]
    dq, dk, dv = _block_bwd(q, k, v, _diag_mask(seg, me, n, c, causal), scale, lse, delta, do)

    def past(k, v, kvseg):
        dq_, dk_, dv_ = _block_bwd(q, k[:, :c], v[:, :c], _mask(seg, kvseg[:, :c]), scale, lse, delta, do)
        pad = lambda x: jnp.concatenate([x, jnp.zeros_like(x)], 1)  # noqa: E731
        return dq_, pad(dk_), pad(dv_)

    def future(k, v, kvseg):
        dq_, dk_, dv_ = _block_bwd(q[:, c:], k, v, _mask(seg[:, c:], kvseg), scale, lse[:, c:],
                                   delta[:, c:], do[:, c:])
        return jnp.concatenate([jnp.zeros_like(dq_), dq_], 1), dk_, dv_

    def full(k, v, kvseg):
        return _block_bwd(q, k, v, _mask(seg, kvseg), scale, lse, delta, do)

    def body(s, carry):
        dq, k, v, kvseg, dk, dv = carry
        k, v, kvseg, dk, dv = (_shift(x, axis, n) for x in (k, v, kvseg, dk, dv))
        src = (me - s) % n
        if causal:
            dq_, dk_, dv_ = lax.cond(src < me, past, future, k, v, kvseg)
        else:
            dq_, dk_, dv_ = full(k, v, kvseg)
        return dq + dq_, k, v, kvseg, dk + dk_, dv + dv_

    dq, _, _, _, dk, dv = lax.fori_loop(1, n, body, (dq, k, v, seg, dk, dv))
    dk, dv = _shift(dk, axis, n), _shift(dv, axis, n)  # the last holder is one step short of home
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_ring.defvjp(lambda q, k, v, seg, axis, n, causal: _ring_fwd(q, k, v, seg, axis, n, causal), _ring_bwd)


def _zigzag(x, axis, n):
    """Contiguous layout (device d: chunks 2d, 2d+1) -> zig-zag (device d: chunks d, 2n-1-d)."""
    c = x.shape[1] // 2
    dest = lambda chunk: chunk if chunk < n else 2 * n - 1 - chunk  # noqa: E731
    a = lax.ppermute(x[:, :c], axis, [(d, dest(2 * d)) for d in range(n)])
    b = lax.ppermute(x[:, c:], axis, [(d, dest(2 * d + 1)) for d in range(n)])
    even = lax.axis_index(axis) % 2 == 0
    return jnp.where(even, jnp.concatenate([a, b], 1), jnp.concatenate([b, a], 1))


def _unzigzag(x, axis, n):
    """Inverse of :func:`_zigzag`."""
    c = x.shape[1] // 2
    even = lax.axis_index(axis) % 2 == 0
    first, second = x[:, :c], x[:, c:]
    evens = jnp.where(even, first, second)  # the even-numbered chunk this device holds
    odds = jnp.where(even, second, first)
    even_chunk = lambda t: t if t % 2 == 0 else 2 * n - 1 - t  # noqa: E731
    odd_chunk = lambda t: 2 * n - 1 - t if t % 2 == 0 else t  # noqa: E731
    e = lax.ppermute(evens, axis, [(t, even_chunk(t) // 2) for t in range(n)])
    o = lax.ppermute(odds, axis, [(t, odd_chunk(t) // 2) for t in range(n)])
    return jnp.concatenate([e, o], 1)


def _local(q, k, v, seg, axis, n, causal):
    if causal and n > 1:
        q, k, v, seg = (_zigzag(x, axis, n) for x in (q, k, v, seg))
    o = _ring(q, k, v, seg, axis, n, causal)
    return _unzigzag(o, axis, n) if causal and n > 1 else o


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: Optional[jax.Array] = None,
                   causal: bool = True) -> jax.Array:
    """Attention with the sequence sharded over the mesh axis the rules give 'length'.

    Args:
      q: [batch, length, heads, head_dim]; k, v: [batch, length, kv_heads, head_dim].
      segment_ids: [batch, length] int32 or None (packed documents).
    Returns: [batch, length, heads, head_dim] in q's dtype, sharded like q.

    Outside the trainer's :func:`~jaxtrain.partitioning.activation_sharding` context (or when
    'length' is not sharded) this is plain attention. Raises RingAttentionError if the length
    is not divisible by 2 * (sequence shards) (the zig-zag layout's chunks).
    """
    if q.shape[1] != k.shape[1]:
        raise RingAttentionError(f"ring attention: q_len {q.shape[1]} != kv_len {k.shape[1]}")
    active = active_sharding()
    if segment_ids is None:
        segment_ids = jnp.zeros(q.shape[:2], jnp.int32)
    if active is None:
        return reference.attention(q, k, v, segment_ids, segment_ids, causal=causal)
    rules, mesh = active
    q_spec = rules.partition_spec("ring attention q", ("batch", "length", "heads", "kv"), q.shape, mesh)
    kv_spec = rules.partition_spec("ring attention k/v", ("batch", "length", "kv_heads", "kv"), k.shape, mesh)
    axis = q_spec[1]
    if axis is None:
        return reference.attention(q, k, v, segment_ids, segment_ids, causal=causal)
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    n = math.prod(mesh.shape[a] for a in names)
    if q.shape[1] % (2 * n):
        raise RingAttentionError(
            f"ring attention: length {q.shape[1]} ('length' dimension) is not divisible by 2 * mesh axis "
            f"{'*'.join(names)} = {2 * n} (the zig-zag layout needs two chunks per device)")
    seg_spec = P(q_spec[0], axis)
    fn = jax.shard_map(functools.partial(_local, axis=axis, n=n, causal=causal), mesh=mesh,
                       in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=q_spec)
    return fn(q, k, v, segment_ids.astype(jnp.int32))
