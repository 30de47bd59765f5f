"""The ``pallas_gpu`` provider: ``model.attention=pallas`` on GPU (Triton), and on CPU in interpret mode."""
from __future__ import annotations

from jaxtrain.kernels.registry import Implementation


def flash_attention(q, k, v, segment_ids=None, causal=True, window=None):
    """:func:`jaxtrain.kernels.pallas.flash_gpu.flash_attention` (imported on first call)."""
    from jaxtrain.kernels.pallas import flash_gpu
    return flash_gpu.flash_attention(q, k, v, segment_ids, causal=causal, window=window)


class PallasGpuProvider:
    name = "pallas_gpu"

    def implementations(self):
        return [Implementation("attention", "pallas", ("gpu", "cpu"), {"attention": flash_attention},
                               auto={"gpu": 10}, reason="our FlashAttention-2 (Triton)")]


PROVIDER = PallasGpuProvider()
