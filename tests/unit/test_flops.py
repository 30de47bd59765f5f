"""FLOPs accounting against XLA's own count, the peak table, and MFU n/a for unknown devices."""
import json
from types import SimpleNamespace

import jax
import pytest

from jaxtrain import config as cfglib
from jaxtrain.kernels.cpu import peak as peak_cache
from jaxtrain.metrics import flops
from jaxtrain.models.llama import flops as llama_flops
from jaxtrain.train import setup
from jaxtrain.train.step import count_params

SHAKESPEARE_VOCAB = 65  # distinct characters of tinyshakespeare's training split


def test_formula_matches_xla_cost_analysis(corpus_path):
    """6N + 12LHQT vs compiled.cost_analysis() of the shakespeare train step: within 10%. With XLA's dots:
    XLA counts no FLOPs in a custom call, and model.matmul=auto takes the fused CPU kernel on one device."""
    cfg = cfglib.load("shakespeare_char", [f"data.path={corpus_path}", "mesh.data=1", "model.matmul=xla"])
    s = setup(cfg, jax.devices()[:1], vocab=SHAKESPEARE_VOCAB)
    compiled, abstract = s.compile_abstract()
    xla = flops.xla_flops(compiled)
    assert s.model_spec.flops_per_unit == llama_flops.flops_per_token(s.model_config, cfg.data.seq_len)
    formula = s.model_spec.flops_per_unit * cfg.train.global_batch * cfg.data.seq_len
    assert xla is not None
    assert abs(xla / formula - 1) < 0.10, (xla, formula)

    # N of the 6N term is every parameter except the embedding table and the norm scales.
    m = cfg.model
    norms = (2 * m.n_layers + 1) * m.d_model
    assert llama_flops.matmul_params(s.model_config) == \
        count_params(abstract["params"]) - SHAKESPEARE_VOCAB * m.d_model - norms


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


def test_cpu_peak_is_measured_in_process(monkeypatch):
    assert 0 < peak_cache.xla_matmul_peak(n=256, repeats=2) < float("inf")  # a real, finite measurement
    # The host's rate, not multiplied by the 8 simulated devices (they share one thread pool).
    monkeypatch.setattr(peak_cache, "host_peak", lambda dtype: {"float32": (123e9, "what")}[dtype])
    cfg = cfglib.load(None, [])
    assert flops.total_peak_flops(cfg, jax.devices()[:8]) == (123e9, "what")
    assert flops.mfu(1000.0, 1e6, 123e9) == pytest.approx(1e9 / 123e9)
    assert flops.mfu(1000.0, None, 123e9) is None  # a model without a FLOPs formula: MFU n/a


def test_the_cpu_peak_is_the_best_measured_on_the_host_that_day_once_the_cli_enables_it(monkeypatch, tmp_path):
    """A figure measured while another process held a core is lower: the best of the day is kept, so the
    steps of a run never beat its peak (MFU over 100%)."""
    measured = iter([100e9, 101e9, 90e9, 110e9, 80e9, 70e9, 60e9])
    monkeypatch.setattr(peak_cache, "fma_peak", lambda: next(measured))
    monkeypatch.setattr(peak_cache, "theoretical", lambda: None)
    what = f"float32 FMA throughput of {peak_cache.cpus()} CPUs, measured"
    peak_cache.forget()
    try:
        assert peak_cache.host_peak() == (100e9, what)  # not enabled: measured once per process
        assert peak_cache.host_peak() == (100e9, what)
        peak_cache.forget()
        assert peak_cache.host_peak()[0] == 101e9  # not kept across processes
        path = tmp_path / "cache" / "peak.json"
        peak_cache.enable(path)
        peak_cache.forget()
        assert peak_cache.host_peak()[0] == 90e9 and len(json.loads(path.read_text())) == 1
        peak_cache.forget()
        assert peak_cache.host_peak()[0] == 110e9  # higher: kept
        peak_cache.forget()
        best, said = peak_cache.host_peak()  # lower (another process ran): the day's best
        assert best == 110e9 and said == f"{what}; the best today, 0 min ago (now 80.0 GFLOP/s)"
        entries = json.loads(path.read_text())
        key = peak_cache.host_key("fma float32")
        entries[key]["at"] -= peak_cache.MAX_AGE_S  # a day later: measured anew
        path.write_text(json.dumps(entries))
        peak_cache.forget()
        assert peak_cache.host_peak()[0] == 70e9
        path.write_text("{not json")  # a damaged file is only a miss
        peak_cache.forget()
        assert peak_cache.host_peak()[0] == 60e9 and key in json.loads(path.read_text())
    finally:
        peak_cache.disable()


def test_gpu_benchmark_config_validates_and_lowers():
    """configs/llama_1b_h200.yaml (benchmarks/gpu_h200.sh): valid, ~1.1B, and its step traces on CPU."""
    cfg = cfglib.load("llama_1b_h200", ["mesh.data=1"])
    assert cfg.model.dtype == "bfloat16" and cfg.data.seq_len == 2048 and cfg.model.scan_layers
    s = setup(cfg, jax.devices()[:1])
    n = count_params(s.abstract_state()["params"])
    assert 1.0e9 < n < 1.2e9
    assert s.model_spec.flops_per_unit == pytest.approx(7.04e9, rel=0.01)
    assert "while" in s.fns.train_step.lower(s.abstract_state(), s.abstract_batch()).as_text()  # the layer scan
