"""Blockwise causal attention (the CPU path of model.attention=auto) against the jnp reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_helpers import assert_matches_reference, inputs

from jaxtrain.config import MeshConfig
from jaxtrain.errors import AttentionBackendError
from jaxtrain.kernels import ops
from jaxtrain.kernels.xla.blockwise import blockwise_attention, default_block
from jaxtrain.models import attention as attn
from jaxtrain.parallel.activations import activation_sharding
from jaxtrain.parallel.mesh import build_mesh
from jaxtrain.parallel.rules import Rules


def blockwise(block):
    def fn(q, k, v, qseg, kvseg, causal=True, window=None):
        assert causal  # self-attention: the tests pass kvseg = qseg
        return blockwise_attention(q, k, v, qseg, window=window, block=block)
    return fn


@pytest.mark.parametrize("h,kvh,t,block,window", [
    (4, 4, 64, 16, None),   # MHA, 4 whole blocks
    (4, 2, 40, 16, None),   # GQA, last block partial
    (4, 1, 40, 64, None),   # MQA, one block
    (2, 2, 48, 16, 20),     # sliding window: key blocks before the window are skipped
])
def test_matches_reference_with_gradients(h, kvh, t, block, window):
    q, k, v, do = inputs(2, t, t, h, kvh, 16, seed=t + h)
    assert_matches_reference(blockwise(block), q, k, v, do, causal=True, window=window)


def test_packed_documents():
    q, k, v, do = inputs(2, 40, 40, 4, 2, 16, seed=3)
    seg = jnp.asarray(np.sort(np.random.default_rng(1).integers(0, 4, (2, 40))), jnp.int32)
    assert_matches_reference(blockwise(16), q, k, v, do, seg, seg, causal=True)


def test_default_block_bounds_the_block_count():
    assert [default_block(t) for t in (64, 256, 512, 2048, 8192)] == [64, 64, 64, 256, 1024]


def test_rejects_cross_attention():
    q, k, v, _ = inputs(1, 8, 12, 2, 2, 16)
    with pytest.raises(ValueError, match=r"blockwise attention needs q_len == kv_len and heads % kv_heads == 0; "
                                         r"got q \(1, 8, 2, 16\), k \(1, 12, 2, 16\)"):
        blockwise_attention(q, k, v)
    with pytest.raises(AttentionBackendError) as e:
        attn.attention(q, q, q, implementation="blockwise", causal=False)
    assert str(e.value) == "model.attention=blockwise cannot run here: only causal attention (use auto or xla)"
    with pytest.raises(ValueError, match=r"blockwise attention needs window >= 1 \(a query must see itself\); got 0"):
        blockwise_attention(q, q, q, window=0)


def choose(implementation, q, k, causal=True):
    """The attention that runs this call, as the registry picks it (this process has 8 devices: not cpu_fused)."""
    return ops.pick("attention", implementation, ops.AttentionCall(q, k, None, None, causal)).name


def test_auto_on_cpu():
    q, k, _, _ = inputs(2, 16, 16, 4, 4, 8)
    kx, _, _, _ = inputs(2, 24, 24, 4, 4, 8)
    assert choose("auto", q, k) == "blockwise"
    assert choose("auto", q, k, causal=False) == "xla"
    assert choose("auto", q, kx) == "xla"
    # A rule set that splits 'length' (sp on sequence=2): blocks would cut across devices.
    with activation_sharding(Rules.load("sp"), build_mesh(MeshConfig(data=1, sequence=2), jax.devices()[:2])):
        assert choose("auto", q, k) == "xla"
        assert choose("blockwise", q, k) == "blockwise"  # explicit: honoured, with a warning
        assert ops.choice("attention", "blockwise", ops.AttentionCall(q, k, None, None, True)).warning == (
            "the rules split the length over devices: XLA moves the query blocks between them (use ring or xla)")
    with activation_sharding(Rules.load("fsdp"), build_mesh(MeshConfig(data=1, fsdp=2), jax.devices()[:2])):
        assert choose("auto", q, k) == "blockwise"
