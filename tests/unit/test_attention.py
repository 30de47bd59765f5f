"""Our Pallas flash attention (GPU/Triton variant, interpret mode) against the jnp reference.

A lean grid: every listed value appears at least once (causal / non-causal; GQA ratio 1, 2,
4; head dims 64, 96, 128, 256; lengths 32, 40 (not a block multiple), 64; q_len != kv_len
both ways; f32 and bf16; segment ids; a sliding window), with blocks of 16 so that every
case spans several blocks.
"""
import jax.numpy as jnp
import numpy as np
import pytest
from attention_helpers import assert_matches_reference, inputs, value_and_grads

from jaxtrain.kernels.pallas import flash_gpu


def flash(q, k, v, qseg=None, kvseg=None, **kw):
    return flash_gpu.flash_attention(q, k, v, qseg, kvseg, block_q=16, block_k=16, **kw)


F32, BF16 = jnp.float32, jnp.bfloat16
GRID = [  # dtype, causal, heads, kv_heads, head_dim, q_len, kv_len, window
    (F32, True, 2, 2, 64, 32, 32, None),
    (F32, False, 4, 2, 128, 40, 40, None),
    (F32, True, 4, 1, 64, 64, 64, 7),
    (F32, True, 2, 1, 64, 24, 40, None),
    (F32, False, 2, 2, 64, 40, 24, None),
    (F32, True, 2, 1, 96, 24, 24, None),
    (F32, True, 2, 2, 256, 24, 24, None),
    (BF16, True, 4, 2, 128, 40, 40, None),
]


@pytest.mark.parametrize("dtype,causal,h,kvh,d,tq,tk,window", GRID)
def test_matches_reference(dtype, causal, h, kvh, d, tq, tk, window):
    q, k, v, do = inputs(2, tq, tk, h, kvh, d, dtype)
    assert_matches_reference(flash, q, k, v, do, causal=causal, window=window)


def test_packed_documents_are_isolated():
    q, k, v, do = inputs(1, 40, 40, 4, 2, 64)
    seg = jnp.asarray([[0] * 13 + [1] * 19 + [2] * 8], jnp.int32)
    assert_matches_reference(flash, q, k, v, do, seg, seg)
    base = value_and_grads(flash, q, k, v, do, seg, seg)
    doc1 = (seg[0] == 1)

    def noise(x):  # change every token outside doc 1
        return x + 3.0 * (~doc1)[None, :, None, None]
    other = value_and_grads(flash, noise(q), noise(k), noise(v), do, seg, seg)
    for a, b in zip([base[0], *base[1]], [other[0], *other[1]]):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_array_equal(a[:, np.asarray(doc1)], b[:, np.asarray(doc1)])
        assert np.abs(a[:, ~np.asarray(doc1)] - b[:, ~np.asarray(doc1)]).max() > 1e-3  # others did change


def test_fully_masked_rows_give_zeros():
    # Queries 0-3 are padding in a segment no key has; with q_len > kv_len (bottom-right causal)
    # queries 4-7 come before every key. Both kinds of row see nothing.
    q, k, v, do = inputs(1, 40, 32, 2, 1, 64)
    qseg = jnp.asarray([[9] * 4 + [0] * 36], jnp.int32)
    kvseg = jnp.zeros((1, 32), jnp.int32)
    o, (dq, dk, dv) = value_and_grads(flash, q, k, v, do, qseg, kvseg)
    for x in (o, dq, dk, dv):
        assert not np.isnan(np.asarray(x)).any()
    np.testing.assert_array_equal(np.asarray(o)[0, :8], 0.0)
    np.testing.assert_array_equal(np.asarray(dq)[0, :8], 0.0)
    assert np.abs(np.asarray(o)[0, 8:]).min(axis=-1).max() > 0  # the other rows are not zeroed
    assert_matches_reference(flash, q, k, v, do, qseg, kvseg)


def test_causal_boundary_one_hot_probe():
    # q = k = 0 gives uniform weights over the visible keys; v[j] = e_j reads them off.
    t = 40
    q = jnp.zeros((1, t, 1, 64))
    v = jnp.eye(t, 64)[None, :, None, :]
    onehot = lambda i: jnp.zeros((1, t, 1, 64)).at[0, i, 0, 0].set(1.0)  # noqa: E731
    runs = {i: value_and_grads(flash, q, q, v, onehot(i)) for i in (0, 15, 16, 39)}  # one compile
    o = np.asarray(runs[0][0])[0, :, 0, :t]
    visible = np.tril(np.ones((t, t)))
    np.testing.assert_allclose(o, visible / visible.sum(1, keepdims=True), rtol=1e-6, atol=0)
    assert (o[np.triu_indices(t, 1)] == 0).all()  # i never sees i + 1 (or later)
    # Backward: a cotangent on row i (block edges 15/16) reaches dV only at keys j <= i.
    for i, (_, (_, _, dv)) in runs.items():
        reached = np.nonzero(np.asarray(dv)[0, :, 0, 0])[0]
        assert list(reached) == list(range(i + 1)), i


def test_rejects_bad_shapes():
    q, k, v, _ = inputs(1, 16, 16, 3, 2, 64)
    with pytest.raises(ValueError, match="heads=3 is not divisible by kv_heads=2"):
        flash(q, k, v)
    with pytest.raises(ValueError, match="window must be >= 1"):
        flash(q[:, :, :2], k, v, window=0)
