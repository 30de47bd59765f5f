"""The save in flight: its typed record (:class:`PendingSave`), what the worker thread hands back
(:class:`CommitWork`), and how the training thread waits for it within ``checkpoint.save_timeout_s``
(:func:`wait_for`).

A save moves through three phases, read off the record:

1. Orbax writes the step asynchronously (``work`` is None);
2. the worker thread checksums the files and, for ``s3://``, uploads them (``work`` not done);
3. the work is done: the Checkpointer agrees with the other processes and commits (or discards) it.

Times are seconds: ``began_s`` on :func:`time.perf_counter` (the save's total time is measured from
it), ``started_s`` on :func:`time.monotonic` (the timeout is measured from it).
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Optional

from jaxtrain.errors import SaveTimeoutError

FIRST_NOTE_S, NOTE_EVERY_S = 5.0, 30.0  # progress lines while the loop waits for a save
POLL_S = 0.02  # how often a wait checks its condition


@dataclass
class CommitWork:
    """What the worker thread computed for one step (the primary's work; others hand back empty files).

    Attributes:
      files: ``{relative path: [bytes, CRC32C hex]}`` of every file of the step, for its marker.
      checksum_s: seconds spent listing and checksumming the files.
      uploaded_bytes: bytes uploaded to ``s3://`` (0 for local and ``gs://`` directories).
    """
    files: dict[str, list] = field(default_factory=dict)
    checksum_s: float = 0.0
    uploaded_bytes: int = 0


@dataclass
class PendingSave:
    """One save between ``Checkpointer.save`` and its commit or failure; at most one exists at a time.

    Attributes:
      step: the training step being saved.
      began_s: ``time.perf_counter()`` when the save began (after the previous one was finished).
      started_s: ``time.monotonic()`` once Orbax's async write was started; ``save_timeout_s`` counts from here.
      blocking_s: seconds the caller was blocked in ``save`` (the synchronous part of Orbax's write).
      metrics: the metrics at ``step`` to record in the marker (``checkpoint.keep_best`` reads them).
      tree: ``{leaf path: [shape, dtype]}`` of the saved state, to record in the marker.
      work: the worker thread's :class:`CommitWork` (or the error of any process), set once Orbax is
        done; None while Orbax still writes.
    """
    step: int
    began_s: float
    started_s: float
    blocking_s: float
    metrics: dict
    tree: dict[str, list]
    work: Optional[Future[CommitWork]] = None

    @property
    def written(self) -> bool:
        """Whether Orbax's write is over (the worker has been handed the step, or its failure)."""
        return self.work is not None

    @property
    def ready(self) -> bool:
        """Whether the worker's part is over too: :meth:`Future.result` will not block."""
        return self.work is not None and self.work.done()


def wait_for(pending: PendingSave, done: Callable[[], bool], what: str, limit: Optional[float],
             log: Callable[[str], None], last_commit: Callable[[], str]) -> None:
    """Blocks until ``done()``; logs a progress line after ``FIRST_NOTE_S``, then every ``NOTE_EVERY_S``.

    Args:
      what: the phase, for the lines (``"being written"``, ``"being checksummed"``, ``"being uploaded"``).
      limit: ``checkpoint.save_timeout_s`` (None: wait for ever).
      last_commit: says where the last committed step is (only called when the limit is passed).

    Raises:
      SaveTimeoutError: ``limit`` seconds passed since ``pending.started_s``.
    """
    started = pending.started_s
    note_at = time.monotonic() + FIRST_NOTE_S
    while not done():
        now = time.monotonic()
        if limit is not None and now - started > limit:
            where = last_commit()
            raise SaveTimeoutError(
                f"checkpoint.save_timeout_s: checkpoint step {pending.step} was still {what} {limit:g} s after "
                f"it began; stopping. {where[0].upper()}{where[1:]}; the unfinished step is removed on the "
                f"next start")
        if now >= note_at:
            budget = f" of checkpoint.save_timeout_s={limit:g}" if limit is not None else ""
            log(f"waiting for checkpoint step {pending.step}: still {what} ({now - started:.0f} s{budget})")
            note_at = now + NOTE_EVERY_S
        time.sleep(POLL_S)
