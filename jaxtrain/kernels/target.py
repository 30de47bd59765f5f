"""The backend the kernels are traced for: the local one, or another for cross-platform lowering.

Kernel dispatch (attention ``auto``, Pallas interpret mode, the MoE grouped matmul) asks
:func:`backend` instead of ``jax.default_backend()``. Inside :func:`lowering_for`, a CPU
machine traces the code a GPU or TPU would run, so ``jit(...).trace(...).lower(
lowering_platforms=("cuda",))`` in CI lowers the real GPU train step (Triton kernels and all).
"""
from __future__ import annotations

import contextlib
import contextvars

import jax

_TARGET: contextvars.ContextVar = contextvars.ContextVar("jaxtrain_target_backend", default=None)


def backend() -> str:
    """'cpu', 'gpu' or 'tpu': the :func:`lowering_for` target, else ``jax.default_backend()``."""
    return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def lowering_for(target: str):
    """Trace kernels as on ``target`` ('gpu' or 'tpu') while inside (lower only: nothing runs here)."""
    if target not in ("cpu", "gpu", "tpu"):
        raise ValueError(f"lowering_for: unknown backend '{target}' (cpu, gpu or tpu)")
    token = _TARGET.set(target)
    try:
        yield
    finally:
        _TARGET.reset(token)
