"""XLA's GPU performance flags, on by default when this process will run on an NVIDIA GPU.

XLA keeps collectives and compute in program order unless told otherwise; the flags below let it
overlap them, the same set MaxText's GPU recipes and NVIDIA's JAX-Toolbox performance guide set
for FSDP-style training (``xla/debug_options_flags.cc`` documents each):

* ``xla_gpu_enable_latency_hiding_scheduler``: schedule asynchronous collectives to overlap compute;
* ``xla_gpu_enable_pipelined_{all_gather,reduce_scatter,all_reduce}``: start the next layer's
  all-gather (and finish the previous one's reduce-scatter) inside the scanned layer loop;
* ``xla_gpu_enable_while_loop_double_buffering``: unroll the scan by two so that pipelining has room;
* ``xla_gpu_*_combine_threshold_bytes``: combine small collectives into large ones (1 GiB for
  all-reduce; all-gather and reduce-scatter at 1/8 and 1/16 of it: MaxText's values for 8 GPUs a node).

:func:`apply_gpu_defaults` adds the flags to ``XLA_FLAGS`` before JAX starts its backend (XLA reads
the variable once, then) when a CUDA plugin is installed and ``JAX_PLATFORMS`` does not exclude it.
A flag the user already set keeps the user's value; ``JAXTRAIN_XLA_GPU_FLAGS=0`` adds none (the A/B
of ``benchmarks/gpu_h200.sh``). XLA aborts the process on a flag it does not know, so the names are
checked against the installed jaxlib in tests/unit/test_xla_flags.py (its CPU build parses the GPU
flags too).
"""
from __future__ import annotations

import importlib.util
import os
import re

GPU_FLAGS = {
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    "xla_gpu_enable_pipelined_all_gather": "true",
    "xla_gpu_enable_pipelined_reduce_scatter": "true",
    "xla_gpu_enable_pipelined_all_reduce": "true",
    "xla_gpu_enable_while_loop_double_buffering": "true",
    "xla_gpu_all_reduce_combine_threshold_bytes": str(1 << 30),
    "xla_gpu_all_gather_combine_threshold_bytes": str(1 << 27),
    "xla_gpu_reduce_scatter_combine_threshold_bytes": str(1 << 26),
}
CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin")
OPT_OUT = "JAXTRAIN_XLA_GPU_FLAGS"


def gpu_expected(env: os._Environ | dict = os.environ) -> bool:
    """Whether this process will start a CUDA backend: a CUDA plugin is installed and ``JAX_PLATFORMS``
    (when set) names ``cuda`` or ``gpu``."""
    platforms = env.get("JAX_PLATFORMS", "").lower()
    if platforms and not re.search(r"\b(cuda|gpu)\b", platforms):
        return False
    return any(importlib.util.find_spec(p) is not None for p in CUDA_PLUGINS)


def with_gpu_flags(xla_flags: str) -> str:
    """``xla_flags`` (an ``XLA_FLAGS`` value) plus every :data:`GPU_FLAGS` entry it does not set already."""
    given = set(re.findall(r"--(\w+)", xla_flags))
    added = [f"--{name}={value}" for name, value in GPU_FLAGS.items() if name not in given]
    return " ".join([xla_flags.strip(), *added]).strip()


def apply_gpu_defaults(env: os._Environ | dict = os.environ) -> bool:
    """Adds :data:`GPU_FLAGS` to ``env['XLA_FLAGS']`` when a GPU is expected and the user did not opt out
    (``JAXTRAIN_XLA_GPU_FLAGS=0``). Call before anything starts JAX's backend. Returns whether it did."""
    if env.get(OPT_OUT, "1") == "0" or not gpu_expected(env):
        return False
    env["XLA_FLAGS"] = with_gpu_flags(env.get("XLA_FLAGS", ""))
    return True
