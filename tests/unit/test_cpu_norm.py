"""The RMSNorm kernel (jaxtrain/kernels/cpu/norm.py, cpu/norm.cc): values and gradients against float64,
rows that do not depend on the other rows (alone, among others, under vmap), the named error, and when
the decoders' RMSNorm takes it. (The same bits on one core or two: test_cpu_matmul.py; the model's
values against XLA's and the kernels' call counts: test_cpu_matmul.py.)"""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_cpu_fused import on_mesh

from jaxtrain.kernels import ops
from jaxtrain.kernels.cpu import library as cpu_fused
from jaxtrain.kernels.cpu import norm as cpu_norm
from jaxtrain.models import layers

pytestmark = pytest.mark.kernels  # needs the C++ compiler (tests/conftest.py skips them without)


def operands(m, d, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((m, d)).astype(np.float32), rng.standard_normal(d).astype(np.float32),
            rng.standard_normal((m, d)).astype(np.float32))


@pytest.mark.parametrize("m,d", [(768, 128), (37, 20), (5, 1), (0, 16), (3, 0)])
def test_values_and_gradients_match_float64(m, d):
    assert cpu_fused.problem() is None
    x, scale, dy = operands(m, d)
    out, vjp = jax.vjp(jax.jit(lambda x, s: cpu_norm.rms_norm(x, s, 1e-5)), x, scale)
    dx, dscale = jax.jit(vjp)(dy)
    x64, s64, dy64 = (a.astype(np.float64) for a in (x, scale, dy))
    r = 1 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-5) if d else np.zeros((m, 1))
    g = dy64 * s64
    want = (x64 * r * s64, r * g - x64 * r ** 3 * (g * x64).mean(-1, keepdims=True) if d else g,
            (dy64 * x64 * r).sum(0))
    for name, got, ref, depth in zip(("y", "dx", "dscale"), (out, dx, dscale), want, (1, 1, max(m, 1))):
        np.testing.assert_allclose(np.asarray(got), ref, rtol=0, atol=2e-6 * max(d, 1) ** 0.5 * depth ** 0.5,
                                   err_msg=name)


def test_a_row_is_the_same_bit_for_bit_alone_or_among_others_and_under_vmap():
    x, scale, _ = operands(768, 128)
    f = jax.jit(lambda x, s: cpu_norm.rms_norm(x, s, 1e-5))
    whole = np.asarray(f(x, scale))
    for rows in (slice(5, 6), slice(380, 390), slice(767, 768)):
        np.testing.assert_array_equal(np.asarray(f(x[rows], scale)), whole[rows])
    members = np.stack([x[:64], x[64:128]])
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(f, (0, None)))(members, scale)),
                                  whole[:128].reshape(2, 64, 128))


def test_operands_it_does_not_take_are_a_named_error():
    x, scale, _ = operands(4, 8)
    with pytest.raises(ValueError) as err:
        cpu_norm.rms_norm(x, scale[:4], 1e-5)
    assert str(err.value) == ("model.matmul=cpu_fused: the RMSNorm kernel takes float32 x [tokens, embed] and scale "
                              "[embed]; got x float32[4, 8], scale float32[4]")


def test_the_decoders_norm_takes_it_with_the_cpu_kernels_on_one_float32_device():
    x, ones = jnp.zeros((2, 64, 128)), jnp.ones((128,))

    def fused(implementation, x):
        return ops.rms_norm(x, ones, 1e-5, implementation) is not None

    with on_mesh(1):
        assert fused("auto", x) and fused("cpu_fused", x)
        assert not fused("xla", x) and not fused("auto", x.astype(jnp.bfloat16))
    with on_mesh(2):
        assert not fused("auto", x)
    cfg = types.SimpleNamespace(norm_eps=1e-5, matmul="auto", d_model=128, param_dtype="float32")
    x = jnp.asarray(operands(2 * 64, 128)[0]).reshape(2, 64, 128)
    with on_mesh(1):
        norm = layers.RMSNorm(cfg)
        fused = norm(x)
        assert cpu_fused.RMSNORM_FORWARD in str(jax.make_jaxpr(norm)(x))
        cfg.matmul = "xla"
        np.testing.assert_allclose(np.asarray(fused), np.asarray(layers.RMSNorm(cfg)(x)), rtol=1e-6, atol=1e-6)
