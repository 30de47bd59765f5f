"""Async, sharded Orbax checkpoints with our own commit markers, retention policy and checks.

Layout: ``DIR/<step>/`` is an Orbax step directory (items ``state``: the train
state, every process writing its own shards; ``data``: the data-iterator
position, JSON; ``config``: the resolved config, JSON) plus ``COMMIT.json``,
written by the primary process only after Orbax reports the async save
finished. ``DIR`` is ``RUN_DIR/checkpoints`` or ``checkpoint.dir`` (a local
path, ``gs://`` or ``s3://``; for S3, Orbax writes to ``RUN_DIR/checkpoints_staging``
and the primary uploads the step before the marker is written, see
:mod:`jaxtrain.checkpoint.storage`). Many processes agree before a commit: the marker
is written only once every process's part is written (and uploaded), and a failure on
any process fails the save on all (:mod:`jaxtrain.checkpoint.processes`).

Crash consistency: a step directory without a readable marker is never
restored (Orbax itself lists such directories as valid steps). Before a save
begins, the primary writes ``DIR/<step>.jaxtrain-pending``, and removes it
once the step is committed; deleting a step (garbage collection, a failed
save) writes it again first. So when the next :class:`Checkpointer` starts,
it deletes exactly the unfinished steps it can prove this trainer wrote: those
with a pending marker. Any other unmarked directory (a step copied in by hand,
a user's own ``7/``) is left alone and listed in :attr:`Checkpointer.ignored`,
and saving over it is refused.

Integrity: the marker records every leaf's shape and dtype (a restore into a
different model is refused with the list of mismatched paths before Orbax
reads anything) and every file's size and CRC32C, computed off the training
thread (``jaxtrain.checkpoint.integrity``); a restore compares them first, so a
truncated or altered committed step is a named error naming the step and file.

A save that has not finished ``checkpoint.save_timeout_s`` after it began ends
the run with :class:`SaveTimeoutError` (exit code 4); progress lines are logged
while the loop waits for it.
"""
from __future__ import annotations

import json
import logging
import re
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import orbax.checkpoint as ocp
from etils import epath

from jaxtrain.checkpoint import integrity, retention, storage
from jaxtrain.checkpoint import processes
from jaxtrain.checkpoint.processes import agree, primary, sync
from jaxtrain.checkpoint.integrity import mismatches, tree_summary
from jaxtrain.config import Config
from jaxtrain.errors import CheckpointError, SaveTimeoutError, StorageError

MARKER = "COMMIT.json"
FORMAT = 2  # 2: the marker lists every file's size and CRC32C
PENDING = ".jaxtrain-pending"  # DIR/<step>.jaxtrain-pending: this trainer is writing or deleting <step>
_STEP_DIR = re.compile(r"^(\d+)(\.orbax-checkpoint-tmp.*)?$")
_PENDING = re.compile(r"^(\d+)" + re.escape(PENDING) + "$")
_SET_ASIDE = re.compile(r"^\d+\.corrupt\d*$")  # moved out of the way by checkpoint.fallback
FIRST_NOTE_S, NOTE_EVERY_S = 5.0, 30.0  # progress lines while the loop waits for a save


def pending_name(step: int) -> str:
    return f"{step}{PENDING}"


class Checkpointer:
    """Saves and restores ``{'state', 'data', 'config'}`` steps; see the module docstring.

    Args:
      cfg: the run config (``checkpoint.*`` drives the policy).
      run_dir: the run directory (local); checkpoints go to ``run_dir/checkpoints`` by default.
      mesh_shape: ``{axis: size}`` of the live mesh, recorded in each marker.
      report: called with a dict for every committed or failed save (the train loop logs it).
      log: called with a line while the loop waits for a slow save (default: the jaxtrain logger).

    Raises:
      CheckpointError: the directory cannot be used (e.g. an ``s3://`` path without s3fs).
    """

    def __init__(self, cfg: Config, run_dir: Path, mesh_shape: Optional[dict] = None,
                 report: Optional[Callable[[dict], None]] = None, log: Optional[Callable[[str], None]] = None):
        c = self.options = cfg.checkpoint
        try:
            self.store = storage.open_store(c.dir or str(Path(run_dir, "checkpoints").absolute()), c.s3_endpoint)
        except StorageError as err:
            raise CheckpointError(str(err)) from None
        self.remote = isinstance(self.store, storage.S3Store)
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
        self._pending: Optional[dict] = None
        self._last_step: Optional[int] = None  # the last step this process started saving
        self._last_save_time = time.monotonic()
        self.removed, self.ignored = self._cleanup_unfinished() if primary() else ([], [])
        self.set_aside_names = sorted(n for n in self.store.names() if _SET_ASIDE.match(n)) if primary() else []
        sync("jaxtrain_ckpt_cleanup")
        processes.check_shared(self.directory, "checkpoint.dir" if not self.remote else "run.dir (its S3 staging)")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None, enable_async_checkpointing=c.async_save, create=True)  # we do the GC
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    # ------------------------------------------------------------------ listing

    def _marker_state(self, step: int) -> tuple[Optional[dict], Optional[str]]:
        """(marker, None) for a committed step; (None, None) without a marker; (None, what is wrong)
        for a marker that exists but is damaged (ours are written atomically, so that is corruption)."""
        try:
            text = self.store.read_text(f"{step}/{MARKER}")
        except OSError:
            return None, None
        try:
            info = json.loads(text)
        except ValueError as err:
            return None, f"is not valid JSON ({err})"
        if not isinstance(info, dict) or info.get("step") != step:
            return None, f"does not record step {step}"
        if not info.get("files") or not isinstance(info["files"], dict) or not isinstance(info.get("tree"), dict):
            return None, "has no list of files and leaves to check"
        return info, None

    def _marker(self, step: int) -> Optional[dict]:
        return self._marker_state(step)[0]

    def markers(self) -> tuple[dict[int, dict], dict[int, str]]:
        """(``{step: marker}`` of every committed step, ``{step: what is wrong}`` of every step whose
        marker is damaged)."""
        good, bad = {}, {}
        for name in self.store.names():
            m = _STEP_DIR.match(name)
            if m and not m.group(2):
                step = int(m.group(1))
                info, why = self._marker_state(step)
                if info is not None:
                    good[step] = info
                elif why:
                    bad[step] = why
        return dict(sorted(good.items())), dict(sorted(bad.items()))

    def committed(self) -> dict[int, dict]:
        """``{step: marker}`` for every committed step directory."""
        return self.markers()[0]

    def restorable(self) -> list[int]:
        """Steps to try restoring, newest last: the committed ones and those whose marker is damaged
        (their restore is a CorruptCheckpointError, never a silent step back)."""
        good, bad = self.markers()
        return sorted(set(good) | set(bad))

    def latest_step(self) -> Optional[int]:
        steps = list(self.committed())
        return steps[-1] if steps else None

    def _cleanup_unfinished(self) -> tuple[list[str], list[str]]:
        """Deletes the uncommitted step directories (and Orbax temporaries) that have a pending marker,
        then the markers. Returns (removed names, uncommitted names left alone: not ours)."""
        names = self.store.names()
        pending = {int(m.group(1)) for m in map(_PENDING.match, names) if m}
        removed, ignored = [], []
        for name in names:
            m = _STEP_DIR.match(name)
            if not m:
                continue
            state = (None, None) if m.group(2) else self._marker_state(int(m.group(1)))
            if state[0] is not None or (state[1] and int(m.group(1)) not in pending):
                continue  # committed, or a damaged marker of a finished save: a restore names it
            if int(m.group(1)) in pending:
                self.store.rmtree(name)
                removed.append(name)
            else:
                ignored.append(name)
        for step in pending:  # the directory is gone or committed: the marker has done its job
            self.store.unlink(pending_name(step))
        return sorted(removed), sorted(ignored)

    def _wait(self, p: dict, done: Callable[[], bool], what: str) -> None:
        """Waits until ``done()``, logging progress; raises SaveTimeoutError past ``save_timeout_s``."""
        limit, started = self.options.save_timeout_s, p["started"]
        note_at = time.monotonic() + FIRST_NOTE_S
        while not done():
            now = time.monotonic()
            if limit is not None and now - started > limit:
                last = self.latest_step()
                where = (f"the last committed checkpoint is step {last} in {self.store.url}" if last is not None
                         else "no checkpoint is committed yet")
                raise SaveTimeoutError(
                    f"checkpoint.save_timeout_s: checkpoint step {p['step']} was still {what} {limit:g} s after "
                    f"it began; stopping. {where[0].upper()}{where[1:]}; the unfinished step is removed on the "
                    f"next start")
            if now >= note_at:
                budget = f" of checkpoint.save_timeout_s={limit:g}" if limit is not None else ""
                self.log(f"waiting for checkpoint step {p['step']}: still {what} ({now - started:.0f} s{budget})")
                note_at = now + NOTE_EVERY_S
            time.sleep(0.02)

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
        if (self.store.root / str(step)).exists() if not self.remote else str(step) in self.store.names():
            raise CheckpointError(f"checkpoint.dir: {self.store.url}/{step} already exists but is not a committed "
                                  f"checkpoint of this run; it is left as it is. Move it away, or use another "
                                  f"checkpoint.dir")
        if primary():
            self.store.write_text(pending_name(step), json.dumps({"step": step, "time": time.time()}))
        sync("jaxtrain_ckpt_pending")  # no process writes a file of the step before its pending marker exists
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(self.config_dict)), force=True)
        blocking = time.perf_counter() - t0
        self._last_save_time = time.monotonic()
        self._last_step = step
        self._pending = {"step": step, "metrics": metrics or {}, "tree": tree_summary(state),
                         "t0": t0, "started": time.monotonic(), "blocking_s": blocking}
        if not self.options.async_save:
            self.finish()
        return blocking

    def poll(self) -> None:
        """Commits the pending save if it has finished (cheap; call once per step).

        Multi-process runs commit at the next save or close instead, where every process
        arrives at the same point (the commit has a barrier).
        """
        p = self._pending
        if p is None or jax.process_count() > 1:
            return
        if "work" not in p and not self.manager.is_saving_in_progress():
            self._start_work(p)
        if "work" in p and p["work"].done():
            self.finish()

    def _orbax_done(self, p: dict) -> None:
        """Waits for Orbax; raises if the async write failed."""
        self._wait(p, lambda: not self.manager.is_saving_in_progress(), "being written")
        self.manager.wait_until_finished()
        self.manager.check_for_errors()
        if primary() and not (self.directory / str(p["step"])).exists():  # the primary finalizes the step
            raise CheckpointError(f"Orbax finished without creating {self.directory / str(p['step'])}")

    def _start_work(self, p: dict) -> None:
        """Once Orbax is done: checksums (and for S3 the upload) on the worker thread, in ``p['work']``.

        Many processes: only after every process's Orbax write finished (they agree first), the
        primary checksums and uploads the step (the staging directory is shared, like Orbax's own).
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
            fut = self._worker.submit(self._commit_work, p["step"])
        p["work"] = fut

    def _commit_work(self, step: int) -> dict:
        """The step's file manifest (sizes and CRC32C) and, for S3, its upload: the primary's work."""
        t0, out = time.perf_counter(), {"files": {}, "uploaded_bytes": 0}
        local = Path(self.directory / str(step))
        if primary():
            out["files"] = integrity.local_manifest(local) if self.remote else self.store.manifest(str(step))
        out["checksum_s"] = time.perf_counter() - t0
        if self.remote and primary():
            out["uploaded_bytes"] = self.store.upload(local, str(step))
        return out

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
        step, work, error = p["step"], None, None
        try:
            if "work" not in p:
                self._start_work(p)
            self._wait(p, p["work"].done, "being uploaded" if self.remote else "being checksummed")
            work = p["work"].result()
        except SaveTimeoutError:
            raise
        except Exception as err:  # noqa: BLE001 - any failure of the async write is reported, not raised
            error = err
        error = agree(error, "checksumming or uploading")
        if error is not None:
            if primary():
                for name in self.store.names():
                    if name == str(step) or name.startswith(f"{step}.orbax-checkpoint-tmp"):
                        self.store.rmtree(name)
                self.store.unlink(pending_name(step))
            sync("jaxtrain_ckpt_failed")
            self._drop_staging(step)
            self.manager.reload()
            self.report({"step": step, "checkpoint_failed": f"{type(error).__name__}: {error}",
                         "latest_committed": self.latest_step()})
            return False
        total = time.perf_counter() - p["t0"]
        if primary():
            marker = {"format": FORMAT, "step": step, "time": time.time(), "metrics": p["metrics"],
                      "mesh": self.mesh_shape, "process_count": jax.process_count(), "tree": p["tree"],
                      "files": work["files"]}
            self.store.write_text(f"{step}/{MARKER}", json.dumps(marker))
            self.store.unlink(pending_name(step))
        sync("jaxtrain_ckpt_commit")
        self._drop_staging(step)
        removed = self.collect_garbage() if primary() else []
        sync("jaxtrain_ckpt_gc")
        self.report({"step": step, "checkpoint_saved": step, "save_blocking_s": p["blocking_s"],
                     "save_total_s": total, "checksum_s": work["checksum_s"], "checkpoints_removed": removed})
        return True

    def keep_set(self, committed: dict[int, dict]) -> set[int]:
        """Steps the policy keeps (:func:`jaxtrain.checkpoint.retention.keep_set`)."""
        return retention.keep_set(self.options, committed)

    def collect_garbage(self) -> list[int]:
        """Deletes committed steps outside :meth:`keep_set` (marker first). Returns their steps."""
        committed = self.committed()
        doomed = sorted(set(committed) - self.keep_set(committed))
        for step in doomed:  # pending marker first: a crash part-way leaves a step the next start removes
            self.store.write_text(pending_name(step), json.dumps({"step": step, "deleting": True}))
            self.store.unlink(f"{step}/{MARKER}")
            self.store.rmtree(str(step))
            self.store.unlink(pending_name(step))
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

    # ------------------------------------------------------------------ restoring

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restores committed ``step`` into the shardings and dtypes of ``abstract_state``
        (ShapeDtypeStructs with shardings: any mesh, any device count).

        Raises:
          CheckpointError: ``step`` is not committed, or the saved tree differs from the current
            model: the message lists every mismatched path with saved and expected shape/dtype.
          CorruptCheckpointError: a file of ``step`` differs in size or CRC32C from its marker.
        """
        info, why = self._marker_state(step)
        if why:
            raise integrity.corrupt(step, self.store.url, [f"{MARKER} {why}"])
        if info is None:
            raise CheckpointError(f"checkpoint step {step} in {self.store.url} is not committed "
                                  f"(no valid {MARKER}); committed steps: {list(self.committed())}")
        bad = mismatches(info["tree"], tree_summary(abstract_state))
        if bad:
            raise CheckpointError(
                f"checkpoint step {step} in {self.store.url} does not match the current config "
                f"({len(bad)} mismatched paths):\n  " + "\n  ".join(bad))
        if self.remote:  # into the staging directory, shared by the processes like Orbax's own
            t0 = time.perf_counter()
            nbytes = self.store.download(str(step), Path(self.directory / str(step))) if primary() else 0
            sync("jaxtrain_ckpt_downloaded")
            self.last_download = {"bytes": nbytes, "seconds": time.perf_counter() - t0}
            self.manager.reload()
        try:
            local = Path(self.directory / str(step))
            actual = integrity.local_manifest(local) if self.remote else self.store.manifest(str(step))
            integrity.check(step, self.store.url, info.get("files"), actual)
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        except (ValueError, KeyError, TypeError, FileNotFoundError) as err:
            raise CheckpointError(f"checkpoint step {step} in {self.store.url} cannot be read: {err}") from err
        finally:
            if self.remote:
                sync("jaxtrain_ckpt_restored")
            self._drop_staging(step)
        return out["state"], dict(out["data"])

    def set_aside(self, step: int) -> str:
        """Moves committed ``step`` out of the way as ``<step>.corrupt`` (kept, never restored). Returns the name."""
        name, n = f"{step}.corrupt", 1
        names = set(self.store.names())
        while name in names:
            n += 1
            name = f"{step}.corrupt{n}"
        if primary():
            self.store.rename(str(step), name)
        sync("jaxtrain_ckpt_set_aside")
        if not self.remote:
            self.manager.reload()
        return name

    def saved_mesh(self, step: int) -> dict:
        return dict((self._marker(step) or {}).get("mesh", {}))

    def wait(self) -> None:
        self.finish()

    def close(self) -> None:
        self.finish()
        self.manager.close()
        self._worker.shutdown()


def abstract_like(state: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs with the given shardings: a restore target that keeps saved dtypes."""
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
