"""FLOPs per token, peak FLOP/s per device, and MFU.

MFU (model FLOPs utilisation, Chowdhery et al. 2022, "PaLM", appendix B) is
``tokens_per_sec * flops_per_token / (n_devices * peak_flops_per_device)``,
with the *model* FLOPs of a training step (forward + backward, no remat
recompute) per token:

    6 * N  +  12 * L * H * Q * T

N counts the matmul parameters (every weight matrix, including the LM head,
excluding the input-embedding lookup, which is a gather); L layers, H query
heads, Q head dim, T sequence length. The attention term counts the full
T x T score and value matmuls, as PaLM does, not only the causal half.
"""
from __future__ import annotations

import time
from typing import Optional

import jax
import jax.numpy as jnp

from jaxtrain.config import Config

# Dense (no sparsity) peak FLOP/s per chip, bf16 unless noted.
PEAK_FLOPS = {
    "h100": 989e12,  # NVIDIA H100 SXM datasheet, BF16 Tensor Core 1979 TFLOPS with sparsity -> 989 dense
    "h200": 989e12,  # NVIDIA H200 datasheet, same Hopper tensor cores as H100 SXM
    "a100": 312e12,  # NVIDIA A100 datasheet, BF16 Tensor Core 312 TFLOPS dense
    "tpu v4": 275e12,  # Google Cloud TPU v4 docs: 275 TFLOPS bf16 per chip
    "tpu v5 lite": 197e12,  # Cloud TPU v5e docs: 197 TFLOPS bf16 per chip
    "tpu v5e": 197e12,
    "tpu v5p": 459e12,  # Cloud TPU v5p docs: 459 TFLOPS bf16 per chip
    "tpu v6 lite": 918e12,  # Cloud TPU v6e (Trillium) docs: 918 TFLOPS bf16 per chip
    "tpu v6e": 918e12,
}


def matmul_params(cfg: Config, vocab_size: int) -> int:
    """Parameters that take part in matmuls (N of the 6N term)."""
    m = cfg.model
    hd = m.d_model // m.n_heads
    attn = m.d_model * hd * (2 * m.n_heads + 2 * m.n_kv_heads)
    mlp = 3 * m.d_model * m.d_ff
    head = m.d_model * vocab_size  # the LM head (tied or not, it is one matmul)
    return m.n_layers * (attn + mlp) + head


def flops_per_token(cfg: Config, vocab_size: int) -> float:
    """Training FLOPs per token: 6N + 12*L*H*Q*T (PaLM appendix B)."""
    m = cfg.model
    hd = m.d_model // m.n_heads
    return 6.0 * matmul_params(cfg, vocab_size) + 12.0 * m.n_layers * m.n_heads * hd * cfg.data.seq_len


def device_peak_flops(device: jax.Device) -> Optional[float]:
    """Table peak for a device's kind, or None if unknown."""
    kind = device.device_kind.lower()
    for name, peak in PEAK_FLOPS.items():
        if name in kind:
            return peak
    return None


def calibrate_cpu_flops(n: int = 1024, repeats: int = 5) -> float:
    """Measured f32 matmul FLOP/s of this host (best of ``repeats``, n x n x n).

    CPU throughput swings a lot between minutes on shared machines, so MFU on
    CPU uses this same-process measurement rather than a constant.
    """
    cpu = jax.devices("cpu")[0]
    a = jax.device_put(jnp.ones((n, n), jnp.float32), cpu)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * n ** 3 / best


def total_peak_flops(cfg: Config, devices) -> tuple[Optional[float], str]:
    """Peak FLOP/s of the whole mesh and where it came from.

    Returns (None, reason) for an unknown accelerator without ``train.peak_tflops``:
    MFU is then reported as n/a, never computed from another chip's peak.
    Simulated CPU devices share one host, so on CPU the peak is the host's
    calibrated matmul rate, not multiplied by the device count.
    """
    devices = list(devices)
    if cfg.train.peak_tflops is not None:
        return cfg.train.peak_tflops * 1e12 * len(devices), "config train.peak_tflops"
    if devices[0].platform == "cpu":
        return calibrate_cpu_flops(), "calibrated host matmul"
    peak = device_peak_flops(devices[0])
    if peak is None:
        return None, f"unknown device kind '{devices[0].device_kind}' (set train.peak_tflops)"
    return peak * len(devices), f"table ({devices[0].device_kind})"
