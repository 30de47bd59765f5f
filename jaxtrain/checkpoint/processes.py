"""The processes of a multi-process run acting as one checkpointer: who writes, barriers, agreement."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxtrain.errors import PeerSaveError


def primary() -> bool:
    """Process 0: it writes markers and deletes; every process writes its own shards."""
    return jax.process_index() == 0


def sync(name: str) -> None:
    """A barrier of every process (nothing with one)."""
    if jax.process_count() > 1:
        ocp.multihost.sync_global_processes(name)


# Orbax splits each replicated array's write across its replicas. That pays across processes (each
# host writes a part); within one process it only adds an eager, compiled slice per part: 550 of them
# for a 5-leaf-per-layer model on 8 simulated CPU devices, about a second a save. Parts under 1 MiB
# are not worth a dispatch in any case.
REPLICA_PARALLEL_MIN_BYTES = 1 << 20


def use_replica_parallel_writes() -> None:
    """Orbax's writer of ``jax.Array``: replica-parallel (parts of at least
    :data:`REPLICA_PARALLEL_MIN_BYTES`) only when there is more than one process, and no ``_sharding``
    file. Orbax keeps one handler per type for the whole process, so this sets it there (with the
    per-array metadata store its default handler has).

    The ``_sharding`` file records each array's saved sharding, for a restore given no target
    sharding. jaxtrain always restores into the live shardings (:mod:`jaxtrain.checkpoint.restoring`),
    so it never reads it, and writing it (one tensorstore open and write per array, ~120 for the
    shakespeare config's params and Adam moments) was ~0.08 s of a ~0.3 s save's Python. Steps saved
    with it (before 2026-12-03) restore the same."""
    from orbax.checkpoint._src.metadata.array_metadata_store import Store  # no public name in 0.12
    absl = logging.getLogger("absl")  # Orbax warns of the override, which is the point: not on every run
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        ocp.type_handlers.register_type_handler(jax.Array, ocp.type_handlers.ArrayHandler(
            use_replica_parallel=jax.process_count() > 1, array_metadata_store=Store(),
            min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_BYTES, enable_write_sharding_file=False),
            override=True)
    finally:
        absl.setLevel(level)


def agree(error: Optional[BaseException], what: str) -> Optional[BaseException]:
    """Many processes: every one learns whether any failed (``error`` here, else a PeerSaveError
    naming them). A collective: every process calls it at the same point. One process: ``error``."""
    if jax.process_count() == 1:
        return error
    from jax.experimental import multihost_utils
    failed = np.asarray(multihost_utils.process_allgather(np.array(error is not None)))
    if error is None and failed.any():
        error = PeerSaveError(f"process(es) {', '.join(map(str, np.flatnonzero(failed)))} failed {what}")
    return error


def check_shared(directory: Any, key: str) -> None:
    """Many processes: every one must see the same local ``directory`` (Orbax writes one step from all
    of them; on disks of their own each would wait for ever for the others' parts). A probe file
    written by the primary is read by all. Object stores (``gs://``) are shared by nature.

    Raises:
      CheckpointError: on every process, naming the ones that do not see it.
    """
    from jaxtrain.errors import CheckpointError
    if jax.process_count() == 1 or str(directory).startswith(("gs://", "s3://")):
        return
    from jax.experimental import multihost_utils
    path = Path(str(directory), ".jaxtrain-shared-probe")
    nonce = int.from_bytes(os.urandom(3), "little")  # fits the int32 a broadcast carries without x64
    if primary():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(str(nonce))
    nonce = int(multihost_utils.broadcast_one_to_all(np.int32(nonce)))
    try:
        seen = path.read_text() == str(nonce)
    except OSError:
        seen = False
    blind = np.flatnonzero(~np.asarray(multihost_utils.process_allgather(np.array(seen))))
    sync("jaxtrain_ckpt_probe")
    if primary():
        path.unlink(missing_ok=True)
    if blind.size:
        raise CheckpointError(f"{key}: process(es) {', '.join(map(str, blind))} do not see {directory} as process 0 "
                              f"writes it: a multi-process run needs a checkpoint directory every host shares (a "
                              f"shared filesystem, gs:// or s3://). Nothing was trained")
