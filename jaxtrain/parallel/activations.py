"""Activation shardings by logical name: what model code sees instead of a mesh.

While the train step is traced inside :func:`activation_sharding`, :func:`constrain`
turns ``constrain(h, 'batch', 'length', 'embed')`` into a sharding constraint through the
active rule set and mesh; outside it (plain single-device use of a model) it is a no-op.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Optional, Sequence

import jax
from jax.sharding import Mesh, NamedSharding

from jaxtrain.parallel.rules import Rules

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("jaxtrain_activation_sharding", default=None)


@contextlib.contextmanager
def activation_sharding(rules: Rules, mesh: Mesh):
    """While tracing inside this context, :func:`constrain` applies ``rules`` on ``mesh``."""
    token = _ACTIVE.set((rules, mesh))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x: jax.Array, *logical: Optional[str]) -> jax.Array:
    """Sharding constraint by logical names, e.g. ``constrain(h, 'batch', 'length', 'embed')``.

    A no-op when no :func:`activation_sharding` context is active (plain
    single-device use of the model). Raises ShardingError like :meth:`Rules.partition_spec`.
    """
    active = _ACTIVE.get()
    if active is None:
        return x
    rules, mesh = active
    spec = rules.partition_spec(f"activation{logical}", logical, x.shape, mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def active_sharding() -> Optional[tuple[Rules, Mesh]]:
    """(rules, mesh) of the enclosing :func:`activation_sharding` context, or None.

    For kernels that must run under ``shard_map`` (ring attention); model code never calls it.
    """
    return _ACTIVE.get()


def devices_along(shape: Sequence[int], logical: Sequence[Optional[str]], dim: int) -> int:
    """How many devices the active rules split dimension ``dim`` of an activation over (1 outside
    :func:`activation_sharding`). Lets model code pick an algorithm without naming the mesh."""
    active = _ACTIVE.get()
    if active is None:
        return 1
    rules, mesh = active
    axes = rules.partition_spec(f"activation{tuple(logical)}", logical, shape, mesh)[dim]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[a] for a in axes)
