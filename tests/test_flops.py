"""FLOPs accounting against XLA's own count, the peak table, and MFU n/a for unknown devices."""
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from flax import nnx

from jaxtrain import config as cfglib, flops, step as steplib
from jaxtrain.mesh import build_mesh
from jaxtrain.models import Llama, count_params
from jaxtrain.partitioning import Rules

SHAKESPEARE_VOCAB = 65  # distinct characters of tinyshakespeare's training split


def test_formula_matches_xla_cost_analysis(corpus_path):
    """6N + 12LHQT vs compiled.cost_analysis() of the shakespeare train step: within 10%."""
    cfg = cfglib.load("shakespeare_char", [f"data.path={corpus_path}", "mesh.data=1"])
    trainer = steplib.build(cfg, build_mesh(cfg.mesh, jax.devices()[:1]), Rules.load("fsdp_tp"),
                            SHAKESPEARE_VOCAB)
    batch = jax.ShapeDtypeStruct((1, cfg.train.global_batch, cfg.data.seq_len + 1), np.int32,
                                 sharding=trainer.batch_sharding)
    compiled = trainer.train_step.lower(jax.eval_shape(trainer.init), batch).compile()
    xla = flops.xla_flops(compiled)
    formula = flops.flops_per_token(cfg, SHAKESPEARE_VOCAB) * cfg.train.global_batch * cfg.data.seq_len
    assert xla is not None
    assert abs(xla / formula - 1) < 0.10, (xla, formula)

    # N of the 6N term is every parameter except the embedding table and the norm scales.
    abstract = nnx.eval_shape(lambda: Llama(steplib.llama_config(cfg, SHAKESPEARE_VOCAB), nnx.Rngs(0)))
    m = cfg.model
    norms = (2 * m.n_layers + 1) * m.d_model
    assert flops.matmul_params(cfg, SHAKESPEARE_VOCAB) == count_params(abstract) - SHAKESPEARE_VOCAB * m.d_model - norms


def fake(kind: str, platform: str = "gpu"):
    return SimpleNamespace(device_kind=kind, platform=platform)


@pytest.mark.parametrize("kind,dtype,peak", [
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989e12),
    ("NVIDIA H100 PCIe", "bfloat16", 756e12),
    ("NVIDIA H200", "bfloat16", 989e12),
    ("NVIDIA A100-SXM4-80GB", "bfloat16", 312e12),
    ("NVIDIA A100-SXM4-80GB", "float32", 156e12),
    ("TPU v4", "bfloat16", 275e12),
    ("TPU v5 lite", "bfloat16", 197e12),
    ("TPU v5", "bfloat16", 459e12),
    ("TPU v6 lite", "bfloat16", 918e12),
    ("TPU v4", "float32", None),  # not published: n/a rather than a guess
    ("NVIDIA GeForce RTX 4090", "bfloat16", None),
])
def test_peak_table(kind, dtype, peak):
    assert flops.device_peak_flops(fake(kind), dtype) == peak


def test_unknown_device_gives_na_unless_overridden():
    cfg = cfglib.load(None, ["model.dtype=bfloat16"])
    peak, why = flops.total_peak_flops(cfg, [fake("NVIDIA GeForce RTX 4090")] * 2)
    assert peak is None and "set train.peak_tflops" in why
    assert flops.mfu(1e6, 1e9, peak) is None
    over = cfglib.load(None, ["model.dtype=bfloat16", "train.peak_tflops=165"])
    assert flops.total_peak_flops(over, [fake("NVIDIA GeForce RTX 4090")] * 2) == (330e12, "config train.peak_tflops")
    assert flops.total_peak_flops(cfg, [fake("TPU v5 lite")] * 4)[0] == 4 * 197e12


def test_cpu_peak_is_measured_in_process():
    cfg = cfglib.load(None, [])
    peak, why = flops.total_peak_flops(cfg, jax.devices()[:8])
    assert why == "calibrated host float32 matmul"
    assert 1e8 < peak < 1e14  # a real measurement of this host, not multiplied by the 8 simulated devices
    assert flops.mfu(1000.0, 1e6, peak) == pytest.approx(1e9 / peak)


def test_gpu_benchmark_config_validates_and_lowers():
    """configs/llama_1b_h200.yaml (benchmarks/gpu_h200.sh): valid, ~1.1B, and its step traces on CPU."""
    cfg = cfglib.load("llama_1b_h200", ["mesh.data=1"])
    assert cfg.model.dtype == "bfloat16" and cfg.data.seq_len == 2048 and cfg.model.scan_layers
    trainer = steplib.build(cfg, build_mesh(cfg.mesh, jax.devices()[:1]), Rules.load("fsdp_tp"), cfg.model.vocab_size)
    state = jax.eval_shape(trainer.init)
    n = sum(x.size for x in jax.tree_util.tree_leaves(state["params"]))
    assert 1.0e9 < n < 1.2e9
    assert flops.flops_per_token(cfg, cfg.model.vocab_size) == pytest.approx(7.04e9, rel=0.01)
    batch = jax.ShapeDtypeStruct((1, cfg.micro_batch, cfg.data.seq_len + 1), np.int32,
                                 sharding=trainer.batch_sharding)
    assert "while" in trainer.train_step.lower(state, batch).as_text()  # the scan over layers
