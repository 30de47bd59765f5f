"""The fused SwiGLU MLP (jaxtrain/kernels/cpu/mlp.py, cpu/mlp.cc): values and gradients against float64,
rows that do not depend on the other rows (alone, among others, under vmap), the sigmoid at extreme
inputs, the named error, and when the Llama MLP takes it. (The model's values against XLA's, and the
kernels' call counts under each remat policy: test_cpu_matmul.py.)"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_cpu_matmul import on_one_device

from jaxtrain.kernels import context, ops, registry
from jaxtrain.kernels.cpu import library as cpu_fused
from jaxtrain.kernels.cpu import mlp as cpu_mlp

pytestmark = pytest.mark.kernels  # needs the C++ compiler (tests/conftest.py skips them without)

NAMES = ("cpu_matmul", "mlp_hidden")


def operands(m, d, f, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return tuple((scale * rng.standard_normal(s)).astype(np.float32) for s in ((m, d), (d, f), (d, f), (f, d), (m, d)))


def reference(x, wg, wu, wd, dout):
    """Output and the gradients of <out, dout> in float64 numpy: the SwiGLU written out by hand."""
    g, u = x @ wg, x @ wu
    s = 1.0 / (1.0 + np.exp(-g))
    h = g * s * u
    dh = dout @ wd.T
    dg, du = dh * u * s * (1 + g * (1 - s)), dh * g * s
    return h @ wd, (dg @ wg.T + du @ wu.T, x.T @ dg, x.T @ du, h.T @ dout)


@pytest.mark.parametrize("m,d,f", [
    (768, 128, 344),  # the shakespeare recipe's MLP: a last panel of 24 columns (a vector and a tail of 8)
    (37, 19, 65),     # nothing a multiple of a tile or a vector; a panel of one column
    (300, 20, 33),    # the weight gradients sum 300 tokens as two halves
    (5, 3, 1),
    (0, 16, 32),      # no token rows: the weight gradients are zeros
    (6, 0, 5),        # no embedding: every product is zeros
])
def test_values_and_gradients_match_float64(m, d, f):
    assert cpu_fused.problem() is None
    x, wg, wu, wd, dout = operands(m, d, f, scale=0.5)
    out, vjp = jax.vjp(jax.jit(lambda *a: cpu_mlp.mlp(*a, NAMES)), x, wg, wu, wd)
    grads = jax.jit(vjp)(dout)
    want, want_grads = reference(*(a.astype(np.float64) for a in (x, wg, wu, wd, dout)))
    for name, got, ref in zip(("out", "dx", "dw_gate", "dw_up", "dw_down"), (out, *grads), (want, *want_grads)):
        scale = max(1.0, float(np.abs(ref).max(initial=0.0)))
        np.testing.assert_allclose(np.asarray(got), ref, rtol=0, atol=3e-6 * scale, err_msg=name)


def test_extreme_gates_saturate_without_nans():
    # sigmoid(-200) underflows and exp(200) overflows: the kernel caps exp's argument
    x, wg, wu, wd, dout = operands(8, 4, 48)
    x = np.full_like(x, 1.0)
    wg[:, :16], wg[:, 16:32], wg[:, 32:] = 50.0, -50.0, 0.0
    out, vjp = jax.vjp(lambda *a: cpu_mlp.mlp(*a, NAMES), x, wg, wu, wd)
    grads = vjp(dout)
    want, want_grads = reference(*(a.astype(np.float64) for a in (x, wg, wu, wd, dout)))
    for got, ref in zip((out, *grads), (want, *want_grads)):
        assert np.isfinite(np.asarray(got)).all()
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-3)


def test_a_row_is_the_same_bit_for_bit_alone_or_among_others_and_under_vmap():
    x, wg, wu, wd, _ = operands(768, 128, 344)
    f = jax.jit(lambda x, wg, wu, wd: cpu_mlp.mlp(x, wg, wu, wd, NAMES))
    whole = np.asarray(f(x, wg, wu, wd))
    for rows in (slice(5, 6), slice(0, 7), slice(380, 390), slice(767, 768)):
        np.testing.assert_array_equal(np.asarray(f(x[rows], wg, wu, wd)), whole[rows])
    members = np.stack([x[:64], x[64:128]])
    shared = np.asarray(jax.jit(jax.vmap(f, (0, None, None, None)))(members, wg, wu, wd))  # one call over both
    each = np.asarray(jax.jit(jax.vmap(f, (0, 0, None, None)))(members, np.stack([wg, wg]), wu, wd))
    np.testing.assert_array_equal(shared, whole[:128].reshape(2, 64, 128))
    np.testing.assert_array_equal(each, whole[:128].reshape(2, 64, 128))


def test_operands_it_does_not_take_are_a_named_error():
    x, wg, wu, wd, _ = operands(4, 8, 16)
    with pytest.raises(ValueError) as err:
        cpu_mlp.mlp(x, wg, wu, wd.T, NAMES)
    assert str(err.value) == ("model.matmul=cpu_fused: the SwiGLU MLP takes 2-D float32 x [tokens, embed], w_gate "
                              "and w_up [embed, mlp], w_down [mlp, embed]; got x float32[4, 8], w_gate float32[8, 16], "
                              "w_up float32[8, 16], w_down float32[8, 16]")
    with pytest.raises(ValueError, match=r"x bfloat16\[4, 8\]"):
        cpu_mlp.mlp(jnp.asarray(x, jnp.bfloat16), wg, wu, wd, NAMES)


def test_the_llama_mlp_takes_it_where_the_projections_do_and_no_activation_is_offloaded():
    x, wg, wu, wd = (jnp.asarray(a) for a in operands(2 * 64, 128, 344)[:4])
    x = x.reshape(2, 64, 128)

    def fused(implementation):
        return ops.swiglu_mlp(x, wg, wu, wd, implementation, NAMES) is not None

    with on_one_device():
        assert fused("cpu_fused") and fused("auto") and not fused("xla")
        # a run whose plan offloads named activations: XLA's SwiGLU, so that mlp_hidden is its value
        facts = registry.Facts("cpu", devices=1, dtype="float32", offloaded_activations=True)
        with context.planned(registry.plan({"matmul": "cpu_fused"}, facts)):
            assert not fused("cpu_fused") and not fused("auto")


def test_per_example_gradients_under_vmap_match_xla():
    """jax.vmap(jax.grad(...)) through the MLP's, the norm's and the q/k/v kernels (each backward call
    sequential under vmap) gives XLA's per-example gradients."""
    from jaxtrain.kernels.cpu import matmul as cpu_matmul
    from jaxtrain.kernels.cpu import norm as cpu_norm
    x, wg, wu, wd, _ = operands(4 * 6, 8, 12, scale=0.5)
    x = x.reshape(4, 6, 8)
    scale = np.linspace(0.5, 1.5, 8).astype(np.float32)

    def loss(x, wg, wu, wd, fused):
        if fused:
            h = cpu_norm.rms_norm(x, scale, 1e-5)
            q, k = cpu_matmul.matmuls(h, (wg, wu))
            return (cpu_mlp.mlp(h, wg, wu, wd, NAMES) ** 2).sum() + (q * k).sum()
        h = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5) * scale
        out = (jax.nn.silu(h @ wg) * (h @ wu)) @ wd
        return (out ** 2).sum() + ((h @ wg) * (h @ wu)).sum()

    grads = {fused: jax.jit(jax.vmap(jax.grad(lambda *a: loss(*a, fused), argnums=(0, 1, 2, 3)),
                                     (0, None, None, None)))(x, wg, wu, wd) for fused in (True, False)}
    for got, want in zip(grads[True], grads[False]):
        assert got.shape == want.shape
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
