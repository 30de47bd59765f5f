"""Activation shardings by logical name: what model code sees instead of a mesh.

While the train step is traced inside :func:`activation_sharding`, :func:`constrain`
turns ``constrain(h, 'batch', 'length', 'embed')`` into a sharding constraint through the
active rule set and mesh; outside it (plain single-device use of a model) it is a no-op.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import jax
from jax.sharding import Mesh, NamedSharding

from jaxtrain.kernels.context import active_sharding, devices_along, sharded
from jaxtrain.parallel.rules import Rules

__all__ = ["activation_sharding", "active_sharding", "constrain", "devices_along"]


@contextlib.contextmanager
def activation_sharding(rules: Rules, mesh: Mesh):
    """While tracing inside this context, :func:`constrain` applies ``rules`` on ``mesh`` (kept where the
    kernels read it too: :func:`jaxtrain.kernels.context.active_sharding`, :func:`devices_along`)."""
    with sharded(rules, mesh):
        yield


def constrain(x: jax.Array, *logical: Optional[str]) -> jax.Array:
    """Sharding constraint by logical names, e.g. ``constrain(h, 'batch', 'length', 'embed')``.

    A no-op when no :func:`activation_sharding` context is active (plain
    single-device use of the model). Raises ShardingError like :meth:`Rules.partition_spec`.
    """
    active = active_sharding()
    if active is None:
        return x
    rules, mesh = active
    spec = rules.partition_spec(f"activation{logical}", logical, x.shape, mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
