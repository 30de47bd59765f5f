"""Shared by the attention tests: random inputs and kernel-vs-reference comparison."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.kernels.xla import reference

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def inputs(b, tq, tk, h, kvh, d, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    make = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)  # noqa: E731
    return make(b, tq, h, d), make(b, tk, kvh, d), make(b, tk, kvh, d), make(b, tq, h, d)


@functools.lru_cache(maxsize=None)
def _jitted(fn, kw_items):
    def loss(q, k, v, do, qseg, kvseg):
        o = fn(q, k, v, qseg, kvseg, **dict(kw_items))
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)), o

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    return jax.jit(lambda *a: (lambda r: (r[0][1], r[1]))(grad(*a)))


def value_and_grads(fn, q, k, v, do, qseg=None, kvseg=None, **kw):
    """(output, (dq, dk, dv)) of sum(fn(q, k, v, qseg, kvseg, **kw) * do); one compile per (fn, kw, shapes)."""
    return _jitted(fn, tuple(sorted(kw.items())))(q, k, v, do, qseg, kvseg)


def assert_matches_reference(fn, q, k, v, do, qseg=None, kvseg=None, **kw):
    """fn's output and dQ/dK/dV equal the f32 jnp reference within the dtype's tolerance."""
    got = value_and_grads(fn, q, k, v, do, qseg, kvseg, **kw)
    want = value_and_grads(reference.attention, q.astype(jnp.float32), k.astype(jnp.float32),
                           v.astype(jnp.float32), do.astype(jnp.float32), qseg, kvseg, **kw)
    tol = TOL[q.dtype.type]
    for name, a, b in zip(("out", "dq", "dk", "dv"), [got[0], *got[1]], [want[0], *want[1]]):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert a.shape == b.shape and not np.isnan(a).any(), name
        # absolute tolerance relative to the tensor's scale (gradients grow with length)
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(1.0, np.abs(b).max()), err_msg=name)


def corpus_windows(path, steps=5, batch=8, length=33):
    """[steps, 1, batch, length] int32 byte windows of the test corpus (learnable, unlike noise)."""
    data = np.frombuffer(open(path, "rb").read(steps * batch * length), np.uint8).astype(np.int32)
    return data.reshape(steps, 1, batch, length)
