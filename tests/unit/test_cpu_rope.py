"""Rotary embedding inside the CPU attention kernel (jaxtrain/kernels/cpu/attention.cc, the rope handlers):
the kernel with tables against the kernel on q and k rotated by XLA (jaxtrain.models.attention.rotate),
attention(rope=...) on the other implementations, and when the Llama attention hands its rotary to the
kernel (model values against XLA's attention and rotary)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_cpu_matmul import on_one_device

from jaxtrain.kernels.cpu import attention as cpu_attention
from jaxtrain.kernels.cpu import library as cpu_fused
from jaxtrain.models import attention as attn
from jaxtrain.models.llama.model import rotary, rotary_tables

pytestmark = pytest.mark.kernels  # needs the C++ compiler (tests/conftest.py skips them without)


def qkv(b, t, h, kvh, d, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(s).astype(np.float32)
                 for s in ((b, t, h, d), (b, t, kvh, d), (b, t, kvh, d), (b, t, h, d)))


@pytest.mark.parametrize("b,t,h,kvh,d", [(12, 64, 4, 4, 32), (2, 48, 4, 2, 16), (1, 16, 2, 1, 64), (3, 32, 6, 3, 32)])
def test_the_kernels_rotary_gives_xlas_rotation_then_the_kernel(b, t, h, kvh, d):
    assert cpu_fused.problem() is None
    q, k, v, do = qkv(b, t, h, kvh, d)
    cos, sin = rotary_tables(t, d, 10000.0)
    inside = jax.jit(lambda q, k, v: cpu_attention.fused_attention(q, k, v, (cos, sin)))
    outside = jax.jit(lambda q, k, v: cpu_attention.fused_attention(
        attn.rotate(q, cos[:, None], sin[:, None]), attn.rotate(k, cos[:, None], sin[:, None]), v))
    o1, vjp1 = jax.vjp(inside, q, k, v)
    o2, vjp2 = jax.vjp(outside, q, k, v)
    # the same rotation (up to fused multiply-adds: XLA's depend on its flags), then the same kernel
    np.testing.assert_allclose(o1, o2, rtol=0, atol=2e-6 * float(np.abs(o2).max()))
    for name, g1, g2 in zip("qkv", vjp1(do), vjp2(do)):  # rotated back in the kernel, or by XLA's transpose
        np.testing.assert_allclose(g1, g2, rtol=0, atol=2e-6 * float(np.abs(g2).max()), err_msg=f"d{name}")


def test_tables_of_the_wrong_shape_are_a_named_error():
    q, k, v, _ = qkv(1, 16, 2, 2, 32)
    cos, sin = rotary_tables(32, 32, 10000.0)
    with pytest.raises(ValueError) as err:
        cpu_attention.fused_attention(q, k, v, (cos, sin))
    assert str(err.value) == ("model.attention=cpu_fused: rope tables must be [length, head_dim / 2] = [16, 16], "
                              "got [[32, 16], [32, 16]]")


@pytest.mark.parametrize("implementation", ["xla", "blockwise"])
def test_other_implementations_rotate_with_xla_first(implementation):
    q, k, v, _ = qkv(2, 32, 4, 2, 16)
    cos, sin = rotary_tables(32, 16, 500.0)
    got = attn.attention(q, k, v, implementation=implementation, rope=(cos, sin))
    want = attn.attention(rotary(q, None, 500.0), rotary(k, None, 500.0), v, implementation=implementation)
    np.testing.assert_array_equal(got, want)


def llama_loss_and_grads(attention, positions=False):
    from flax import nnx

    from jaxtrain.models.llama.config import LlamaConfig
    from jaxtrain.models.llama.model import Llama
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 65, (2, 32)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(32), (2, 32)) if positions else None
    cfg = LlamaConfig(vocab_size=65, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, matmul="xla",
                      attention=attention)
    graph, params = nnx.split(Llama(cfg, nnx.Rngs(0)), nnx.Param)

    def loss(p):
        logits = nnx.merge(graph, p)(tokens, positions=pos)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], -1))
    with on_one_device():
        compiled = jax.jit(jax.value_and_grad(loss)).lower(params).compile()
    text = compiled.as_text()
    calls = {t: text.count(f'custom_call_target="{t}"') for t in (cpu_fused.FORWARD, cpu_fused.ROPE_FORWARD,
                                                                  cpu_fused.ROPE_BACKWARD)}
    return compiled(params), calls


def test_the_llama_attention_hands_its_rotary_to_the_kernel_with_xlas_values():
    (want, want_grads), xla_calls = llama_loss_and_grads("xla")
    (got, got_grads), calls = llama_loss_and_grads("cpu_fused")
    assert set(xla_calls.values()) == {0}
    assert calls == {cpu_fused.FORWARD: 0, cpu_fused.ROPE_FORWARD: 2, cpu_fused.ROPE_BACKWARD: 2}  # one a layer
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # positions given (packed documents' restarts): XLA's rotary, the kernel without it
    (given, _), given_calls = llama_loss_and_grads("cpu_fused", positions=True)
    assert given_calls == {cpu_fused.FORWARD: 2, cpu_fused.ROPE_FORWARD: 0, cpu_fused.ROPE_BACKWARD: 0}
    np.testing.assert_allclose(given, want, rtol=1e-6)
