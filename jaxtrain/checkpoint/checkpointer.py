"""Async, sharded Orbax checkpoints: the save → commit → restore state machine of one run.

``DIR/<step>/`` is an Orbax step directory (items ``state``: the train state, every process
writing its own shards; ``data``: the data-iterator position, JSON; ``config``: the resolved
config, JSON) plus ``COMMIT.json``, written by the primary process only after Orbax reports the
async save finished. ``DIR`` is ``RUN_DIR/checkpoints`` or ``checkpoint.dir`` (a local path,
``gs://`` or ``s3://``; for S3, Orbax writes to ``RUN_DIR/checkpoints_staging`` and the primary
uploads the step before the marker is written, see :mod:`jaxtrain.checkpoint.storage`). What each
name in ``DIR`` means, the markers, the clean-up of unfinished saves after a crash and the moving
aside of corrupt steps are :mod:`jaxtrain.checkpoint.layout`; which steps are kept is
:mod:`jaxtrain.checkpoint.retention`.

One save at a time is in flight, as a :class:`~jaxtrain.checkpoint.pending.PendingSave`:
:meth:`Checkpointer.save` writes the pending marker and starts Orbax's async write; once Orbax is
done, a worker thread checksums (and for S3 uploads) the step; :meth:`Checkpointer.finish` (or
:meth:`Checkpointer.poll`, which never blocks) then commits it (marker, garbage collection) or
discards it and reports the failure. Many processes agree before a commit: the marker is written
only once every process's part is written (and uploaded), and a failure on any process fails the
save on all (:mod:`jaxtrain.checkpoint.processes`).

Integrity: the marker records every leaf's shape and dtype (a restore into a different model is
refused with the list of mismatched paths before Orbax reads anything) and every file's size and
CRC32C, computed off the training thread (:mod:`jaxtrain.checkpoint.integrity`); a restore compares
them first, so a truncated or altered committed step is a named error naming the step and file.

A save that has not finished ``checkpoint.save_timeout_s`` seconds after it began ends the run with
:class:`~jaxtrain.errors.SaveTimeoutError` (exit code 4); progress lines are logged while the loop
waits for it. A directory or step that cannot be used is a ``CheckpointError``, a step that fails its
check a ``CorruptCheckpointError`` (both exit code 2; all errors live in :mod:`jaxtrain.errors`).
"""
from __future__ import annotations

import logging
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import orbax.checkpoint as ocp
from etils import epath

from jaxtrain.checkpoint import integrity, processes, retention, storage
from jaxtrain.checkpoint.integrity import tree_summary
from jaxtrain.checkpoint.layout import FORMAT, MARKER, PENDING, Layout, pending_name
from jaxtrain.checkpoint.pending import FIRST_NOTE_S, NOTE_EVERY_S, CommitWork, PendingSave, wait_for
from jaxtrain.checkpoint.processes import agree, primary, sync
from jaxtrain.checkpoint.restoring import Restoring
from jaxtrain.config import Config
from jaxtrain.errors import CheckpointError, SaveTimeoutError, StorageError

# Names other modules and tests import from here, wherever they are defined now.
__all__ = ["Checkpointer", "abstract_like", "MARKER", "FORMAT", "PENDING", "pending_name", "Layout",
           "PendingSave", "CommitWork", "FIRST_NOTE_S", "NOTE_EVERY_S", "CheckpointError"]


class Checkpointer(Restoring):
    """Saves and restores ``{'state', 'data', 'config'}`` steps; see the module docstring.

    Args:
      cfg: the run config (``checkpoint.*`` drives the policy).
      run_dir: the run directory (local); checkpoints go to ``run_dir/checkpoints`` by default.
      mesh_shape: ``{axis: size}`` of the live mesh, recorded in each marker.
      report: called with a dict for every committed or failed save (the train loop logs it).
      log: called with a line while the loop waits for a slow save (default: the jaxtrain logger).

    Attributes:
      store, layout: where ``DIR`` is, and its names (:class:`~jaxtrain.checkpoint.layout.Layout`).
      directory: where Orbax writes: ``DIR`` itself, or the local staging directory for ``s3://``.
      remote: whether ``DIR`` is ``s3://`` (staged).
      removed, ignored: unfinished saves of an earlier run this start deleted, and uncommitted step
        directories left alone (not ours); set_aside_names: corrupt steps moved aside earlier.
        All three are listed by the primary process only (empty on the others).

    Raises:
      CheckpointError: the directory cannot be used (e.g. an ``s3://`` path without s3fs, or a local
        directory the processes of a multi-process run do not all see).
    """

    def __init__(self, cfg: Config, run_dir: Path, mesh_shape: Optional[dict] = None,
                 report: Optional[Callable[[dict], None]] = None, log: Optional[Callable[[str], None]] = None):
        c = self.options = cfg.checkpoint
        try:
            self.store = storage.open_store(c.dir or str(Path(run_dir, "checkpoints").absolute()), c.s3_endpoint)
        except StorageError as err:
            raise CheckpointError(str(err)) from None
        self.layout = Layout(self.store)
        self.remote = self.layout.remote
        if self.remote:  # Orbax writes here; finished steps are uploaded, then removed
            self.directory = epath.Path(Path(run_dir, "checkpoints_staging").absolute())
            shutil.rmtree(self.directory, ignore_errors=True)
        else:
            self.directory = self.store.root
        self.config_dict = cfg.to_dict()
        self.mesh_shape = dict(mesh_shape or {})
        self.report = report or (lambda row: None)
        self.log = log or logging.getLogger("jaxtrain").warning
        # Checksums and uploads run here, off the training thread.
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="jaxtrain-ckpt")
        self._pending: Optional[PendingSave] = None  # the save in flight, if any
        self._last_step: Optional[int] = None  # the last step this process started saving
        self._last_save_time = time.monotonic()
        self.removed, self.ignored = self.layout.cleanup_unfinished() if primary() else ([], [])
        self.set_aside_names = self.layout.set_aside_names() if primary() else []
        sync("jaxtrain_ckpt_cleanup")
        processes.check_shared(self.directory, "checkpoint.dir" if not self.remote else "run.dir (its S3 staging)")
        processes.use_replica_parallel_writes()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None, enable_async_checkpointing=c.async_save, create=True)  # we do the GC
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    # ------------------------------------------------------------------ listing (see layout.Layout)

    def markers(self) -> tuple[dict[int, dict], dict[int, str]]:
        """(``{step: marker}`` of every committed step, ``{step: what is wrong}`` of every step whose
        marker is damaged)."""
        return self.layout.markers()

    def committed(self) -> dict[int, dict]:
        """``{step: marker}`` for every committed step directory."""
        return self.layout.committed()

    def restorable(self) -> list[int]:
        """Steps to try restoring, newest last: the committed ones and those whose marker is damaged
        (their restore is a CorruptCheckpointError, never a silent step back)."""
        return self.layout.restorable()

    def latest_step(self) -> Optional[int]:
        """The newest committed step, or None."""
        return self.layout.latest_step()

    def saved_mesh(self, step: int) -> dict:
        """``{axis: size}`` of the mesh that saved ``step`` ({} when unknown or not committed)."""
        return dict((self.layout.marker(step) or {}).get("mesh", {}))

    # ------------------------------------------------------------------ saving

    def due(self, step: int, final: bool = False) -> bool:
        """Whether a save is due after ``step``: every N steps, every T seconds, or the last step."""
        c = self.options
        due = final or step % c.every == 0
        if not due and c.every_seconds:
            due = time.monotonic() - self._last_save_time >= c.every_seconds
            if jax.process_count() > 1:  # clocks differ: process 0 decides for everyone
                from jax.experimental import multihost_utils
                due = bool(multihost_utils.broadcast_one_to_all(due))
        return due and step != self._last_step

    def save(self, step: int, state: Any, data_state: dict, metrics: Optional[dict] = None) -> float:
        """Starts an async save of ``step``; returns the seconds the caller was blocked.

        The previous pending save is waited for and committed first.

        Raises:
          CheckpointError: ``DIR/<step>`` already exists (not written by this run: never overwritten).
          SaveTimeoutError: the previous save is past ``checkpoint.save_timeout_s``.
        """
        self.finish()
        t0 = time.perf_counter()
        if self.layout.occupied(step):
            raise CheckpointError(f"checkpoint.dir: {self.store.url}/{step} already exists but is not a committed "
                                  f"checkpoint of this run; it is left as it is. Move it away, or use another "
                                  f"checkpoint.dir")
        if primary():
            self.layout.begin(step)
        sync("jaxtrain_ckpt_pending")  # no process writes a file of the step before its pending marker exists
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(self.config_dict)), force=True)
        blocking = time.perf_counter() - t0
        self._last_save_time = time.monotonic()
        self._last_step = step
        tree = tree_summary(state)
        self._pending = PendingSave(step=step, began_s=t0, started_s=time.monotonic(), blocking_s=blocking,
                                    metrics=metrics or {}, tree=tree)
        if not self.options.async_save:
            self.finish()
        return blocking

    def started(self, step: int) -> bool:
        """Whether a save of ``step`` is pending: started, neither committed nor discarded yet."""
        return self._pending is not None and self._pending.step == step

    def set_metrics(self, step: int, metrics: dict) -> None:
        """The metrics the marker of pending ``step`` records, for a save started before its step's
        evaluation was done (``checkpoint.keep_best`` ranks by them at the commit)."""
        if self.started(step):
            self._pending.metrics = dict(metrics)

    def abandon(self, step: int, error: BaseException) -> None:
        """Pending ``step`` is never committed: once Orbax has written it, its files are removed and
        ``error`` is reported as its failure (a save started before its step's evaluation found a
        non-finite loss). Nothing happens when no save of ``step`` is pending.

        Raises:
          SaveTimeoutError: Orbax's write is past ``checkpoint.save_timeout_s``.
        """
        if not self.started(step):
            return
        p, self._pending = self._pending, None
        try:
            self._orbax_done(p)
        except SaveTimeoutError:
            raise
        except Exception as write_error:  # noqa: BLE001 - discarded either way, but a storage fault is said
            self.log(f"checkpoint step {step}: its write failed too ({type(write_error).__name__}: {write_error}); "
                     f"it is removed either way")
        self._discard(p, error)

    def poll(self) -> None:
        """Commits the pending save if it has finished (cheap; call once per step).

        Multi-process runs commit at the next save or close instead, where every process
        arrives at the same point (the commit has a barrier).

        Raises:
          SaveTimeoutError: as :meth:`finish`.
        """
        p = self._pending
        if p is None or jax.process_count() > 1:
            return
        if not p.written and not self.manager.is_saving_in_progress():
            self._start_work(p)
        if p.ready:
            self.finish()

    def _wait(self, p: PendingSave, done: Callable[[], bool], what: str) -> None:
        """Waits until ``done()``, logging progress; raises SaveTimeoutError past ``save_timeout_s``."""
        wait_for(p, done, what, self.options.save_timeout_s, self.log, self._last_commit)

    def _last_commit(self) -> str:
        """Where a run stopped by a save timeout resumes from, for its message."""
        last = self.latest_step()
        return (f"the last committed checkpoint is step {last} in {self.store.url}" if last is not None
                else "no checkpoint is committed yet")

    def _orbax_done(self, p: PendingSave) -> None:
        """Waits for Orbax; raises if the async write failed."""
        self._wait(p, lambda: not self.manager.is_saving_in_progress(), "being written")
        self.manager.wait_until_finished()
        self.manager.check_for_errors()
        if primary() and not (self.directory / str(p.step)).exists():  # the primary finalizes the step
            raise CheckpointError(f"Orbax finished without creating {self.directory / str(p.step)}")

    def _start_work(self, p: PendingSave) -> None:
        """Once Orbax is done: checksums (and for S3 the upload) on the worker thread, in ``p.work``.

        Many processes: only after every process's Orbax write finished (they agree first), the
        primary checksums and uploads the step (the staging directory is shared, like Orbax's own).
        A failure is kept in ``p.work`` for :meth:`finish` to report; only a timeout is raised.
        """
        fut: Future = Future()
        error = None
        try:
            self._orbax_done(p)
        except SaveTimeoutError:
            raise
        except Exception as err:  # noqa: BLE001 - reported by finish()
            error = err
        error = agree(error, "writing its shards")
        if error is not None:
            fut.set_exception(error)
        else:
            fut = self._worker.submit(self._commit_work, p.step)
        p.work = fut

    def _commit_work(self, step: int) -> CommitWork:
        """The step's file manifest (sizes and CRC32C) and, for S3, its upload: the primary's work."""
        t0, work = time.perf_counter(), CommitWork()
        local = Path(self.directory / str(step))
        if primary():
            work.files = integrity.local_manifest(local) if self.remote else self.store.manifest(str(step))
        work.checksum_s = time.perf_counter() - t0
        if self.remote and primary():
            work.uploaded_bytes = self.store.upload(local, str(step))
        return work

    def finish(self) -> Optional[bool]:
        """Waits for the pending save; commits it (True), or reports its failure (False). None: nothing pending.

        Many processes agree on the outcome first: the commit marker is written (by the primary) only
        when every process's part is durable, and a failure on any process is a failure on all.

        Raises:
          SaveTimeoutError: the save is past ``checkpoint.save_timeout_s`` (nothing is committed).
        """
        p, self._pending = self._pending, None
        if p is None:
            return None
        work, error = None, None
        try:
            if not p.written:
                self._start_work(p)
            self._wait(p, p.work.done, "being uploaded" if self.remote else "being checksummed")
            work = p.work.result()
        except SaveTimeoutError:
            raise
        except Exception as err:  # noqa: BLE001 - any failure of the async write is reported, not raised
            error = err
        error = agree(error, "checksumming or uploading")
        if error is not None:
            self._discard(p, error)
            return False
        self._commit(p, work)
        return True

    def _discard(self, p: PendingSave, error: BaseException) -> None:
        """A failed save, on every process: its files are removed (by the primary) and it is reported."""
        if primary():
            self.layout.discard(p.step)
        sync("jaxtrain_ckpt_failed")
        self._drop_staging(p.step)
        self.manager.reload()
        self.report({"step": p.step, "checkpoint_failed": f"{type(error).__name__}: {error}",
                     "latest_committed": self.latest_step()})

    def _commit(self, p: PendingSave, work: CommitWork) -> None:
        """A finished save, on every process: the primary writes its marker, then collects garbage."""
        total = time.perf_counter() - p.began_s
        if primary():
            self.layout.commit(p.step, metrics=p.metrics, mesh=self.mesh_shape, process_count=jax.process_count(),
                               tree=p.tree, files=work.files)
        sync("jaxtrain_ckpt_commit")
        self._drop_staging(p.step)
        removed = self.collect_garbage() if primary() else []
        sync("jaxtrain_ckpt_gc")
        self.report({"step": p.step, "checkpoint_saved": p.step, "save_blocking_s": p.blocking_s,
                     "save_total_s": total, "checksum_s": work.checksum_s, "checkpoints_removed": removed})

    def keep_set(self, committed: dict[int, dict]) -> set[int]:
        """Steps the policy keeps (:func:`jaxtrain.checkpoint.retention.keep_set`)."""
        return retention.keep_set(self.options, committed)

    def collect_garbage(self) -> list[int]:
        """Deletes committed steps outside :meth:`keep_set` (marker first). Returns their steps."""
        committed = self.committed()
        doomed = sorted(set(committed) - self.keep_set(committed))
        self.layout.delete(doomed)
        if doomed and not self.remote:
            self.manager.reload()
        return doomed

    def _drop_staging(self, step: int) -> None:
        """Removes the step's staged files (the primary), then every process re-reads the listing: after
        a barrier, or another process could list the step and then find it gone (a collective)."""
        if self.remote:
            if primary():
                shutil.rmtree(Path(self.directory / str(step)), ignore_errors=True)
            sync("jaxtrain_ckpt_staging_dropped")
            self.manager.reload()

    def wait(self) -> None:
        """Waits for the pending save and commits it (as :meth:`finish`, without the outcome)."""
        self.finish()

    def close(self) -> None:
        """Finishes the pending save, then releases Orbax and the worker thread."""
        self.finish()
        self.manager.close()
        self._worker.shutdown()


def abstract_like(state: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs with the given shardings: a restore target that keeps saved dtypes."""
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
