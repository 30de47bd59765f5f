"""What the kernels are traced under: the trainer's activation sharding and the run's kernel plan.

Both are context variables set around tracing (the train step, the evaluation, the sample), so a model
called on its own (a test, a notebook) sees neither: its kernels are then chosen from the call alone.

- :func:`sharded` holds ``(rules, mesh)`` while the trainer traces inside
  ``jaxtrain.parallel.activations.activation_sharding``: ring attention and the MoE experts run under
  ``shard_map`` on that mesh, and a one-device kernel must know that there are several devices. The
  rules are used through their ``partition_spec`` method only (this layer does not import them).
- :func:`planned` holds the run's :class:`jaxtrain.kernels.registry.KernelPlan`: what ``auto`` resolved
  to, once, for every kernel key.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Optional, Sequence

_SHARDING: contextvars.ContextVar = contextvars.ContextVar("jaxtrain_activation_sharding", default=None)
_PLAN: contextvars.ContextVar = contextvars.ContextVar("jaxtrain_kernel_plan", default=None)


@contextlib.contextmanager
def sharded(rules: Any, mesh: Any):
    """While inside, :func:`active_sharding` is ``(rules, mesh)``."""
    token = _SHARDING.set((rules, mesh))
    try:
        yield
    finally:
        _SHARDING.reset(token)


def active_sharding() -> Optional[tuple[Any, Any]]:
    """(rules, mesh) of the enclosing :func:`sharded` context, or None."""
    return _SHARDING.get()


def devices_along(shape: Sequence[int], logical: Sequence[Optional[str]], dim: int) -> int:
    """How many devices the active rules split dimension ``dim`` of an activation over (1 outside
    :func:`sharded`). Raises ShardingError as the rules' ``partition_spec`` does."""
    active = _SHARDING.get()
    if active is None:
        return 1
    rules, mesh = active
    axes = rules.partition_spec(f"activation{tuple(logical)}", logical, shape, mesh)[dim]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[a] for a in axes)


def devices() -> int:
    """The devices the traced program spans: the active mesh's, else every device JAX has."""
    active = _SHARDING.get()
    if active is not None:
        return active[1].size
    import jax
    return jax.device_count()


@contextlib.contextmanager
def planned(kernel_plan: Any):
    """While inside, the kernels follow ``kernel_plan`` (None: each call chooses for itself)."""
    token = _PLAN.set(kernel_plan)
    try:
        yield
    finally:
        _PLAN.reset(token)


def active_plan() -> Any:
    """The enclosing :func:`planned` context's KernelPlan, or None."""
    return _PLAN.get()
