"""The Pallas GPU kernels lower for ``cuda`` on this CPU machine (cross-platform lowering), so a
lowering failure shows up in CI and not on a rare, short GPU loan. Before Triton compiler params
were passed, jax 0.10-0.11 lowered them through Mosaic GPU, which fails ("Failed to infer the
output layout of the iota")."""
import jax
import jax.numpy as jnp
import pytest

from jaxtrain.kernels.pallas.flash_gpu import flash_attention


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


MOE_GPU = ["model.attention=pallas", "model.dtype=bfloat16", "data.path=stdlib", "data.tokenizer=byte"]


@pytest.mark.parametrize("config, overrides, expect, absent", [
    # The one-H200 benchmark's 1.1B step with our Pallas attention: Triton kernels in the module.
    ("llama_1b_h200", ["model.attention=pallas"], "jaxtrain_flash_fwd", None),
    # The MoE family's dropless experts: ragged_dot (grouped GEMM) on GPU, not the CPU windowed path;
    # with model.grouped_matmul=blocks, batched matmuls and no ragged_dot.
    ("moe_shakespeare", MOE_GPU, "ragged", None),
    ("moe_shakespeare", [*MOE_GPU, "model.grouped_matmul=blocks"], "dot_general", "ragged"),
])
def test_train_steps_lower_for_cuda(config, overrides, expect, absent):
    from jaxtrain import config as cfglib
    from jaxtrain.kernels.target import lowering_for
    from jaxtrain.train import setup
    s = setup(cfglib.load(config, overrides), jax.devices()[:1], vocab=256)
    step = s.fns.train_step
    with lowering_for("gpu"):
        text = step.inner.trace(s.abstract_state(), s.abstract_batch(), step.hparams).lower(
            lowering_platforms=("cuda",)).as_text()
    assert expect in text and "__gpu$xla.gpu.triton" in text
    assert absent is None or absent not in text


def test_the_expert_parallel_moe_step_lowers_for_cuda_with_ragged_all_to_all():
    """On GPU the dropless exchange is jax.lax.ragged_all_to_all (CPU emulates it densely), and its
    transpose in the backward pass lowers too."""
    from jaxtrain import config as cfglib
    from jaxtrain.kernels.target import lowering_for
    from jaxtrain.train import setup
    cfg = cfglib.load("moe_shakespeare", ["data.path=stdlib", "data.tokenizer=byte", "sharding.rules=ep",
                                          "mesh.expert=8", "model.n_layers=1"])
    s = setup(cfg, jax.devices()[:8], vocab=256)
    step = s.fns.train_step
    with lowering_for("gpu"):
        text = step.inner.trace(s.abstract_state(), s.abstract_batch(), step.hparams).lower(
            lowering_platforms=("cuda",)).as_text()
    assert text.count("ragged_all_to_all") >= 4, text.count("ragged_all_to_all")  # 2 forward, 2 backward


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_two_stage_pipelined_1b_step_lowers_for_cuda(schedule):
    """The one-H200 benchmark's 1.1B model on 2 pipeline stages: the stacked layers on the stage axis
    (the partitioner turns the rolls between stages into collective permutes) and the Pallas kernels
    inside each stage."""
    from jaxtrain import config as cfglib
    from jaxtrain.kernels.target import lowering_for
    from jaxtrain.train import setup
    cfg = cfglib.load("llama_1b_h200", ["model.attention=pallas", "mesh.stage=2", "mesh.data=1",
                                        "train.global_batch=4", f"pipeline.schedule={schedule}"])
    s = setup(cfg, jax.devices()[:2], vocab=256)
    step = s.fns.train_step
    with lowering_for("gpu"):
        text = step.inner.trace(s.abstract_state(), s.abstract_batch(), step.hparams).lower(
            lowering_platforms=("cuda",)).as_text()
    assert '{"stage"}' in text and "__gpu$xla.gpu.triton" in text
