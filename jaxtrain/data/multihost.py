"""Multi-process helpers: which batch rows this process owns, global arrays from local rows, start-up.

Each process materialises only the rows of the global batch that live on its
own devices and hands them to ``jax.make_array_from_process_local_data``.
"""
from __future__ import annotations

from typing import Optional

import jax
import numpy as np
from jax.sharding import NamedSharding


def local_rows(sharding: NamedSharding, global_shape: tuple[int, ...], axis: int = 1) -> tuple[int, int]:
    """[lo, hi) of dimension ``axis`` (the batch) held by this process's devices under ``sharding``.

    Raises:
      ValueError: this process's rows are not one contiguous block (a mesh whose device order
        interleaves processes along the batch axes).
    """
    spans = sorted({(idx[axis].start or 0, global_shape[axis] if idx[axis].stop is None else idx[axis].stop)
                    for idx in sharding.addressable_devices_indices_map(global_shape).values()})
    lo, hi = spans[0][0], spans[0][1]
    for a, b in spans[1:]:
        if a > hi:
            raise ValueError(f"process {jax.process_index()} owns non-contiguous batch rows {spans}")
        hi = max(hi, b)
    return lo, hi


def to_global(local: dict[str, np.ndarray], sharding: NamedSharding, micro: int) -> dict[str, jax.Array]:
    """Per-process rows ``[accum, hi - lo, ...]`` of each field -> global ``[accum, micro, ...]``
    jax.Arrays on ``sharding`` (the micro-batch assembled from every process's rows)."""
    if sharding.is_fully_addressable:  # one process holds every row: one transfer of the whole dict
        return jax.device_put(local, sharding)
    return {k: jax.make_array_from_process_local_data(sharding, v, (v.shape[0], micro, *v.shape[2:]))
            for k, v in local.items()}


def initialize(coordinator: str, num_processes: int, process_id: int,
               local_device_ids: Optional[list[int]] = None) -> None:
    """``jax.distributed.initialize`` with gloo CPU collectives (needed for multi-process CPU meshes)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id, local_device_ids=local_device_ids)
