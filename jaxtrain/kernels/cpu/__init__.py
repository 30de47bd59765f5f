"""The ``cpu`` provider: jaxtrain's C++ XLA:CPU kernels, ``cpu_fused`` for every kernel key, and the
warm-start machinery of one-device CPU runs.

Kernels (XLA FFI, built on first use with the machine's C++ compiler: :mod:`.library`): causal
self-attention with the rotary embedding inside (:mod:`.attention`), the projections' matmul
(:mod:`.matmul`), the SwiGLU MLP (:mod:`.mlp`), RMSNorm (:mod:`.norm`), the MoE experts' grouped SwiGLU
(:mod:`.grouped`) and the guarded AdamW update (:mod:`.adamw`). Each runs on one device (a custom call
is opaque to XLA's partitioner; the grouped kernels also inside the trainer's ``shard_map``), in
float32. Without a compiler nothing here runs and ``auto`` picks the XLA provider.

Runtime hooks (:mod:`.hooks`): the exported-program cache (:mod:`.program_cache`), the prefetch of a
warm start's executables (:mod:`.prefetch`), inline dispatch of one-device programs (:mod:`.dispatch`),
a leaner first import of the JAX stack (:mod:`.lean_imports`) and the CPU's peak FLOP/s (:mod:`.peak`).
"""
from __future__ import annotations

from typing import Optional

from jaxtrain.kernels.registry import Facts, Implementation

CPU = ("cpu",)
# model.matmul=auto takes the kernel for products of fewer FLOPs only. Measured on a 2-core Intel Xeon,
# one op at a time against XLA's dots: the shakespeare-char model's (17-68 MFLOP) 1.4-2.2x as fast, the
# 25M model's (1.1-2.9 GFLOP) 0.65-1.06x, and its train step 1.17-1.24x as slow (docs/benchmarks.md).
AUTO_MAX_FLOPS = 256e6


def available() -> Optional[str]:
    """None once the kernels' library is built and registered (:func:`.library.problem`)."""
    from jaxtrain.kernels.cpu import library
    return library.problem()


def _one_device(facts: Facts) -> Optional[str]:
    return f"runs on one device, here {facts.devices}" if facts.devices > 1 else None


def _float32(facts: Facts) -> Optional[str]:
    if facts.dtype is not None and facts.dtype != "float32":
        return f"computes in float32, model.dtype is {facts.dtype}"
    return None


def _matmul_problem(facts: Facts) -> Optional[str]:
    return _one_device(facts) or _float32(facts)


# --- attention

def _attention_problem(facts: Facts) -> Optional[str]:
    from jaxtrain.kernels.cpu.attention import MAX_LENGTH
    if facts.devices > 1:
        return _one_device(facts)
    if facts.segment_ids:
        return "segment ids (packed or padded documents: data.mode)"
    if facts.window is not None:
        return "a sliding window"
    if facts.seq_len is not None and (facts.seq_len % 16 or facts.seq_len > MAX_LENGTH):
        return f"length {facts.seq_len} (data.seq_len) is not a multiple of 16 up to {MAX_LENGTH}"
    if facts.head_dim is not None and facts.head_dim % 16:
        return f"head_dim {facts.head_dim} (model.d_model / model.n_heads) is not a multiple of 16"
    return None


def _attention_refuses(call, auto: bool, facts: Facts) -> Optional[str]:
    from jaxtrain.kernels.cpu.attention import shape_problem
    return _one_device(facts) or shape_problem(call.q.shape, call.k.shape, call.causal, call.segment_ids, call.window)


def _attention(q, k, v, segment_ids=None, causal=True, window=None, rope=None):
    from jaxtrain.kernels.cpu.attention import fused_attention
    return fused_attention(q, k, v, rope)


# --- the matmul key: projections, the SwiGLU MLP, RMSNorm

def _matmul_refuses(call, auto: bool, facts: Facts) -> Optional[str]:
    import jax.numpy as jnp
    if facts.devices > 1:
        return _one_device(facts)
    if call.kind == "norm":
        x = call.x
        return None if x.dtype == jnp.float32 and x.ndim >= 1 else f"an RMSNorm of {x.dtype}{list(x.shape)}"
    from jaxtrain.kernels.cpu.matmul import shape_problem
    x = call.x.reshape(-1, call.x.shape[-1]) if call.kind == "mlp" else call.x
    why = shape_problem(x, call.w)
    if why is None and auto and 2 * x.shape[0] * x.shape[1] * call.w.shape[1] >= AUTO_MAX_FLOPS:
        why = (f"a {list(x.shape)} x {list(call.w.shape)} product: {AUTO_MAX_FLOPS / 1e6:.0f} MFLOP or more, "
               f"where XLA's dots are as fast")
    if why is None and call.kind == "mlp" and facts.offloaded_activations:
        why = "activations are offloaded (offload.activations places XLA's named values; the kernel's are its own)"
    return why


def _matmul(x, w):
    from jax.ad_checkpoint import checkpoint_name

    from jaxtrain.kernels.cpu import matmul
    from jaxtrain.kernels.ops import MATMUL_NAME
    return checkpoint_name(matmul.matmul(x, w), MATMUL_NAME)


def _matmuls(x, ws):
    from jax.ad_checkpoint import checkpoint_name

    from jaxtrain.kernels.cpu import matmul
    from jaxtrain.kernels.ops import MATMUL_NAME
    return tuple(checkpoint_name(o, MATMUL_NAME) for o in matmul.matmuls(x, ws))


def _mlp(x, w_gate, w_up, w_down, names):
    from jaxtrain.kernels.cpu import mlp
    return mlp.mlp(x.reshape(-1, x.shape[-1]), w_gate, w_up, w_down, names).reshape(x.shape)


def _rms_norm(x, scale, eps):
    from jaxtrain.kernels.cpu import norm
    return norm.rms_norm(x.reshape(-1, x.shape[-1]), scale, eps).reshape(x.shape)


# --- the MoE experts

def _grouped_refuses(call, auto: bool, facts: Facts) -> Optional[str]:
    if not facts.sharded and facts.devices > 1:
        return f"outside the trainer's sharding context on {facts.devices} devices"
    from jaxtrain.kernels.cpu.grouped import shape_problem
    return shape_problem(call.rows, call.w_gate, call.w_up, call.w_down)


def _grouped(rows, expert, w_gate, w_up, w_down):
    from jaxtrain.kernels.cpu import grouped
    return grouped.grouped_swiglu(rows, expert, w_gate, w_up, w_down)


def _buffers(rows, w_gate, w_up, w_down):
    from jaxtrain.kernels.cpu import grouped
    return grouped.buffers_swiglu(rows, w_gate, w_up, w_down)


# --- the optimizer update

def _update_problem(facts: Facts) -> Optional[str]:
    if facts.devices > 1:
        return _one_device(facts)
    if facts.host_state:
        return "the state lives in host memory (offload.optimizer or offload.params)"
    low = sorted(set(facts.state_dtypes) - {"float32"})
    if low:
        return f"float32 params and moments only, here {', '.join(low)} (optimizer.master_weights=false)"
    return None


def _guarded_update(*args):
    from jaxtrain.kernels.cpu import adamw
    return adamw.guarded_update(*args)


class CpuProvider:
    name = "cpu"

    @property
    def hooks(self):
        from jaxtrain.kernels.cpu.hooks import HOOKS
        return HOOKS

    def implementations(self):
        rank = {"cpu": 0}
        return [
            Implementation("attention", "cpu_fused", CPU, {"attention": _attention}, problem=_attention_problem,
                           refuses=_attention_refuses, auto=rank, available=available, rope_inside=True,
                           reason="one fused kernel per (batch, kv head), the rotary embedding inside"),
            Implementation("matmul", "cpu_fused", CPU,
                           {"matmul": _matmul, "matmuls": _matmuls, "mlp": _mlp, "rms_norm": _rms_norm},
                           problem=_matmul_problem, refuses=_matmul_refuses, auto=rank, available=available,
                           reason=f"float32 products under {AUTO_MAX_FLOPS / 1e6:.0f} MFLOP, the SwiGLU MLP and "
                                  f"RMSNorm in kernels"),
            Implementation("grouped_matmul", "cpu_fused", CPU, {"grouped": _grouped, "buffers": _buffers},
                           problem=_float32, refuses=_grouped_refuses, auto=rank, available=available,
                           reason="a task per run of one expert's rows"),
            Implementation("optimizer", "cpu_fused", CPU, {"guarded_update": _guarded_update},
                           problem=_update_problem, auto=rank, available=available,
                           reason="one kernel over every parameter"),
        ]


PROVIDER = CpuProvider()
