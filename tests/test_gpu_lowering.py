"""The Pallas GPU kernels lower for ``cuda`` on this CPU machine (cross-platform lowering), so a
lowering failure shows up in CI and not on a rare, short GPU loan. Before Triton compiler params
were passed, jax 0.10-0.11 lowered them through Mosaic GPU, which fails ("Failed to infer the
output layout of the iota")."""
import jax
import jax.numpy as jnp
import pytest

from jaxtrain.kernels.flash_gpu import flash_attention


@pytest.mark.parametrize("shape, kv_heads", [((2, 256, 4, 64), 4), ((1, 128, 8, 128), 2)])
def test_flash_attention_forward_and_backward_lower_for_cuda(shape, kv_heads):
    b, t, h, d = shape
    q = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, t, kv_heads, d), jnp.bfloat16)

    def loss(q, k, v):
        return flash_attention(q, k, v, interpret=False).astype(jnp.float32).sum()

    fwd = jax.jit(lambda q, k, v: flash_attention(q, k, v, interpret=False))
    text = fwd.trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    assert "jaxtrain_flash_fwd" in text and "__gpu$xla.gpu.triton" in text
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    text = grads.trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    assert "jaxtrain_flash_bwd_dq" in text and "jaxtrain_flash_bwd_dkdv" in text
