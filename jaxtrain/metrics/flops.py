"""Peak FLOP/s per device, MFU, and XLA's own FLOP count of a compiled program.

MFU (model FLOPs utilisation, Chowdhery et al. 2022, "PaLM: Scaling Language
Modeling with Pathways", appendix B) is
``units_per_sec * flops_per_unit / peak_flops``: the *model* FLOPs of a training step
(forward + backward, no remat recompute) per token (or per example), which each model
family defines (e.g. ``models/llama/flops.py``: 6N + 12*L*H*Q*T), over the peak of
the devices the run uses.

Known gaps of a family's formula against XLA's count (``compiled.cost_analysis()``):
XLA also counts elementwise work (norms, softmax, optimizer) and remat recompute, and
counts a ``while`` body (``model.scan_layers``, ``train.grad_accum > 1``) once, not
times its trip count; compare against the unrolled, single-micro-batch step.
"""
from __future__ import annotations

from typing import Any, Optional

import jax

from jaxtrain.config import Config

# Dense (no sparsity) peak FLOP/s per chip and matmul dtype, checked in order (first
# substring of the lowercased ``device_kind`` wins, so specific names come first).
# GPU float32 entries are the TF32 tensor-core figures: XLA uses TF32 for f32 dots on
# Ampere/Hopper at default precision. TPUs publish bf16 only; f32 there is n/a.
PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    # NVIDIA H100 datasheet (PCIe): BF16 1513 TFLOPS / TF32 756 with sparsity -> half dense.
    ("h100 pcie", {"bfloat16": 756e12, "float32": 378e12}),
    # NVIDIA H100 datasheet (NVL): BF16 1671 / TF32 835 with sparsity.
    ("h100 nvl", {"bfloat16": 835e12, "float32": 417e12}),
    # NVIDIA H100 datasheet (SXM): BF16 1979 / TF32 989 with sparsity -> 989 / 494 dense.
    ("h100", {"bfloat16": 989e12, "float32": 494e12}),
    # NVIDIA H200 datasheet (SXM): same tensor cores as H100 SXM, 1979 / 989 with sparsity.
    ("h200", {"bfloat16": 989e12, "float32": 494e12}),
    # NVIDIA A100 datasheet: BF16 312 dense (624 sparse), TF32 156 dense (312 sparse).
    ("a100", {"bfloat16": 312e12, "float32": 156e12}),
    # Cloud TPU docs, system architecture pages: per-chip bf16 peak.
    ("tpu v4", {"bfloat16": 275e12}),  # TPU v4: 275 TFLOPS bf16
    ("tpu v5 lite", {"bfloat16": 197e12}),  # v5e (device_kind "TPU v5 lite"): 197 TFLOPS bf16
    ("tpu v5e", {"bfloat16": 197e12}),
    ("tpu v5p", {"bfloat16": 459e12}),  # v5p: 459 TFLOPS bf16
    ("tpu v5", {"bfloat16": 459e12}),  # v5p reports device_kind "TPU v5"
    ("tpu v6 lite", {"bfloat16": 918e12}),  # v6e Trillium (device_kind "TPU v6 lite"): 918 TFLOPS bf16
    ("tpu v6e", {"bfloat16": 918e12}),
]


def xla_flops(compiled: Any) -> Optional[float]:
    """FLOPs of one call of a compiled function by XLA's cost analysis, or None if unavailable.

    ``compiled`` is a ``jax.stages.Compiled``; its ``cost_analysis()`` is a dict (custom calls, such as
    jaxtrain's fused CPU kernels, count nothing)
    in jax >= 0.4.30 and a one-element list of dicts before.
    """
    try:
        cost = compiled.cost_analysis()
    except Exception:  # some backends do not implement it
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    if not cost or "flops" not in cost:
        return None
    return float(cost["flops"])


def device_peak_flops(device: Any, dtype: str = "bfloat16") -> Optional[float]:
    """Table peak FLOP/s of one device for matmuls in ``dtype``, or None if not in the table."""
    kind = str(getattr(device, "device_kind", "")).lower()
    for name, peaks in PEAK_FLOPS:
        if name in kind:
            return peaks.get(dtype)
    return None


def total_peak_flops(cfg: Config, devices, calibrate: bool = True) -> tuple[Optional[float], str]:
    """Peak FLOP/s of the whole mesh and where it came from.

    Order: ``train.peak_tflops`` (per device, x device count) if set; on CPU the peak a kernel provider
    measures for one host (the ``cpu`` provider: the host's float32 FMA throughput,
    :mod:`jaxtrain.kernels.cpu.peak`; not multiplied by the number of simulated devices, times the
    number of processes: each measures its own host; ``calibrate=False`` skips it -> None); else the
    table for the device kind and ``model.dtype`` (float32 when the model section has none, e.g.
    ``family: custom``). Returns (None, reason) for an unknown accelerator or dtype without
    ``train.peak_tflops``: MFU is then reported as n/a, never computed from another chip's peak.
    """
    devices = list(devices)
    dtype = getattr(cfg.model, "dtype", "float32")
    if cfg.train.peak_tflops is not None:
        return cfg.train.peak_tflops * 1e12 * len(devices), "config train.peak_tflops"
    if devices[0].platform == "cpu":
        if not calibrate:
            return None, "cpu (calibration skipped)"
        from jaxtrain.kernels import hooks as provider_hooks
        found = provider_hooks.peak_flops(devices, dtype)
        if found is None:
            return None, "no kernel provider measures this CPU (set train.peak_tflops)"
        hosts = jax.process_count()  # each process measures its own host; the mesh spans them all
        return found[0] * hosts, found[1] + (f" x {hosts} processes" if hosts > 1 else "")
    peak = device_peak_flops(devices[0], dtype)
    if peak is None:
        return None, f"no peak for device kind '{devices[0].device_kind}' / {dtype} (set train.peak_tflops)"
    return peak * len(devices), f"table ({devices[0].device_kind}, {dtype})"


def mfu(units_per_sec: float, flops_per_unit: Optional[float], peak: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation (fraction), or None when the peak or the model's FLOPs are unknown."""
    if not peak or not flops_per_unit:
        return None
    return units_per_sec * flops_per_unit / peak
