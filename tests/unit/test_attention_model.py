"""model.attention: selection, named errors, and training with our kernel."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_helpers import corpus_windows
from conftest import put_windows

from jaxtrain.config import check_against_mesh
from jaxtrain.errors import AttentionBackendError, ConfigError
from jaxtrain.kernels import ops, registry
from jaxtrain.models import attention as attn
from jaxtrain.train import setup


def choose(q, k, segment_ids=None, backend="cpu"):
    """What auto runs for this call on ``backend``, as the registry resolves it outside a run (one device)."""
    facts = registry.Facts(backend=backend, devices=1, segment_ids=segment_ids is not None)
    chosen = registry.choose("attention", "auto", facts, available=backend == "cpu")
    call = ops.AttentionCall(q, k, segment_ids, None, True)
    impl = next(i for i in (chosen.impl, *chosen.fallbacks) if i.refuses(call, True, facts) is None)
    return impl.name, chosen


def test_auto_picks_per_backend_and_says_why():
    q16 = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    q32 = jnp.zeros((1, 8, 2, 64), jnp.float32)
    seg = jnp.zeros((1, 8), jnp.int32)
    # this q is 8 long: the fused CPU kernel takes multiples of 16 (tests/unit/test_cpu_fused.py)
    assert choose(q32, q32)[0] == "blockwise"
    assert choose(q16, q16, backend="gpu")[0] == "cudnn"
    assert choose(q32, q32, backend="gpu")[0] == "pallas"  # cuDNN takes bf16/fp16 only
    assert choose(q32, q32, backend="tpu")[0] == "pallas"
    name, chosen = choose(q16, q16, seg, backend="gpu")
    assert name == "pallas" and chosen.line() == (
        "model.attention=auto -> pallas (cudnn: segment_ids (ours masks packed documents without a dense mask); "
        "our FlashAttention-2 (Triton))")


CUDNN_ON_CPU = ("model.attention: cudnn runs on gpu; the backend is 'cpu' "
                "(use auto, xla, blockwise, ring, pallas or cpu_fused)")


def test_explicit_choice_that_cannot_run_is_a_named_error(small_cfg):
    q = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    with pytest.raises(AttentionBackendError) as e:
        attn.attention(q, q, q, implementation="cudnn")
    assert str(e.value) == CUDNN_ON_CPU
    with pytest.raises(ConfigError) as e:
        attn.attention(q, q, q, implementation="flash")
    assert str(e.value) == ("model.attention: unknown implementation 'flash' "
                            "(known: auto, xla, blockwise, cudnn, ring, pallas, cpu_fused)")
    with pytest.raises(ConfigError) as e:  # the same check and message, before anything is built
        check_against_mesh(small_cfg("model.attention=cudnn"), {a: 1 for a in
                           ("data", "fsdp", "tensor", "sequence", "expert")}, "cpu")
    assert str(e.value) == CUDNN_ON_CPU
    with pytest.raises(ConfigError, match="data.seq_len: 36 is not divisible by 2 \\* mesh.sequence = 8"):
        check_against_mesh(small_cfg("model.attention=ring", "data.seq_len=36"),
                           {"data": 2, "fsdp": 1, "tensor": 1, "sequence": 4, "expert": 1})


def test_xla_dispatch_follows_the_shared_mask_convention():
    from attention_helpers import inputs

    from jaxtrain.kernels.xla import reference
    q, k, v, _ = inputs(2, 12, 12, 4, 2, 16)
    seg = jnp.asarray(np.sort(np.random.default_rng(0).integers(0, 3, (2, 12))), jnp.int32)
    for s in (None, seg):
        got = jax.jit(lambda *a: attn.attention(*a, implementation="xla"))(q, k, v, s)
        want = jax.jit(reference.attention)(q, k, v, s, s)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_training_with_pallas_matches_xla(small_cfg, corpus_path):
    # Five real train steps (the jitted step: forward, our custom-VJP backward, AdamW) on the same
    # token windows; only the attention implementation differs.
    windows = corpus_windows(corpus_path)
    losses = {}
    for impl in ("xla", "pallas"):
        cfg = small_cfg("mesh.data=1", "model.n_layers=1", f"model.attention={impl}")
        fns = setup(cfg, jax.devices()[:1], vocab=256).fns
        state, losses[impl] = fns.init(), []
        for batch in windows:
            state, metrics = fns.train_step(state, put_windows(batch, fns.batch_sharding))
            losses[impl].append(float(metrics["loss"]))
    assert losses["xla"][4] < losses["xla"][0]  # it trains
    np.testing.assert_allclose(losses["pallas"], losses["xla"], rtol=0, atol=1e-4)
