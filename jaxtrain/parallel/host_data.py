"""Host values that every process holds alike, put on the mesh without any communication.

``jax.device_put`` of a host array onto a sharding that spans processes first checks that every
process passed the same value: an all-gather of the whole array, whose size grows with the
process count (validation sets, imported weights). Here each process cuts its own devices'
shards from its copy (``jax.make_array_from_callback``) instead.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np


def put(tree: Any, shardings: Any) -> Any:
    """``tree`` (numpy arrays or scalars, the same on every process) as global arrays on ``shardings``
    (one sharding for every leaf, or a matching pytree of them)."""
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree_util.tree_map(lambda _: shardings, tree)

    def one(value, sharding):
        value = np.asarray(value)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])
    return jax.tree_util.tree_map(one, tree, shardings)
