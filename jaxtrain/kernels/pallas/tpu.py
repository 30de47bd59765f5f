"""The ``pallas_tpu`` provider: ``model.attention=pallas`` on TPU (Mosaic)."""
from __future__ import annotations

from jaxtrain.kernels.registry import Implementation


def flash_attention(q, k, v, segment_ids=None, causal=True, window=None):
    """:func:`jaxtrain.kernels.pallas.flash_tpu.flash_attention` (imported on first call)."""
    from jaxtrain.kernels.pallas import flash_tpu
    return flash_tpu.flash_attention(q, k, v, segment_ids, causal=causal, window=window)


class PallasTpuProvider:
    name = "pallas_tpu"

    def implementations(self):
        return [Implementation("attention", "pallas", ("tpu",), {"attention": flash_attention},
                               auto={"tpu": 0}, reason="our FlashAttention-2 (Mosaic)")]


PROVIDER = PallasTpuProvider()
