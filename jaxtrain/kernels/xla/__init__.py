"""The XLA provider: every operation in JAX's own ops, on every backend (the one always there).

``model.attention``: ``xla`` (``jax.nn.dot_product_attention``), ``blockwise`` (causal self-attention by
query blocks, CPU's fallback), ``cudnn`` (GPU) and ``ring`` (over the mesh axis that splits 'length').
``model.matmul``: ``xla`` (XLA's dots). ``model.grouped_matmul``: ``ragged_dot`` (GPU and TPU),
``windows`` (CPU's fallback) and ``blocks``. ``optimizer.implementation``: ``xla`` (the step's optax
update). See :mod:`jaxtrain.kernels.registry` for what each field means.
"""
from __future__ import annotations

from jaxtrain.kernels.registry import Implementation

BACKENDS = ("cpu", "gpu", "tpu")


def _blockwise_refuses(call, auto, facts):
    if not call.causal:
        return "only causal attention"
    if call.q.shape[1] != call.k.shape[1]:
        return "not self-attention (q_len != kv_len)"
    if auto and facts.length_split:
        return "the rules split the length over devices"
    return None


def _length_split(facts):
    if facts.length_split:
        return "the rules split the length over devices: XLA moves the query blocks between them (use ring or xla)"
    return None


def _cudnn_refuses(call, auto, facts):
    from jaxtrain.kernels.xla.attention import cudnn_fits
    return cudnn_fits(call.q, call.k, call.segment_ids, call.window) if auto else None


def _ring_refuses(call, auto, facts):
    return "a sliding window" if call.window is not None else None


def _matmul(x, w):
    return x @ w


class XlaProvider:
    name = "xla"

    def implementations(self):
        # imported here: this module is loaded before JAX is (the command line's start-up hooks)
        from jaxtrain.kernels.xla import attention as attn
        from jaxtrain.kernels.xla import grouped
        from jaxtrain.kernels.xla.grouped_blocks import blocked_swiglu
        from jaxtrain.kernels.xla.grouped_windows import windowed_swiglu
        return [
            Implementation("attention", "xla", BACKENDS, {"attention": attn.xla_attention},
                           auto={"cpu": 20, "gpu": 20, "tpu": 20}, reason="XLA's attention"),
            Implementation("attention", "blockwise", BACKENDS, {"attention": attn.blockwise_attention},
                           refuses=_blockwise_refuses, auto_problem=_length_split, auto={"cpu": 10},
                           reason="causal self-attention by query blocks"),
            Implementation("attention", "cudnn", ("gpu",), {"attention": attn.cudnn_attention},
                           refuses=_cudnn_refuses, auto_problem=attn.cudnn_problem, auto={"gpu": 0},
                           reason="cuDNN constraints hold"),
            Implementation("attention", "ring", BACKENDS, {"attention": attn.ring_attention}, refuses=_ring_refuses),
            Implementation("matmul", "xla", BACKENDS, {"matmul": _matmul}, auto={"cpu": 10, "gpu": 0, "tpu": 0},
                           reason="XLA's dots"),
            Implementation("grouped_matmul", "ragged_dot", BACKENDS,
                           {"grouped": grouped.ragged_swiglu, "buffers": grouped.buffers_swiglu},
                           auto={"gpu": 0, "tpu": 0}, reason="grouped GEMMs (jax.lax.ragged_dot)"),
            Implementation("grouped_matmul", "windows", BACKENDS,
                           {"grouped": windowed_swiglu, "buffers": grouped.buffers_swiglu}, auto={"cpu": 10},
                           reason="2-D matmuls over windows of each expert's rows"),
            Implementation("grouped_matmul", "blocks", BACKENDS,
                           {"grouped": blocked_swiglu, "buffers": grouped.buffers_swiglu},
                           reason="batched matmuls over blocks of each expert's rows"),
            Implementation("optimizer", "xla", BACKENDS, auto={"cpu": 10, "gpu": 0, "tpu": 0},
                           reason="optax's clip and AdamW"),
        ]


PROVIDER = XlaProvider()
