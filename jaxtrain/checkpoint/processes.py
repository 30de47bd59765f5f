"""The processes of a multi-process run acting as one checkpointer: who writes, barriers, agreement."""
from __future__ import annotations

from typing import Optional

import jax
import numpy as np
import orbax.checkpoint as ocp


def primary() -> bool:
    """Process 0: it writes markers and deletes; every process writes its own shards."""
    return jax.process_index() == 0


def sync(name: str) -> None:
    """A barrier of every process (nothing with one)."""
    if jax.process_count() > 1:
        ocp.multihost.sync_global_processes(name)


class PeerSaveError(RuntimeError):
    """Another process of the job failed its part of a save (its own log says why)."""


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
