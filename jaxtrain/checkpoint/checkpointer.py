"""Async, sharded Orbax checkpoints with our own commit markers, retention policy and checks.

Layout: ``DIR/<step>/`` is an Orbax step directory (items ``state``: the train
state, every process writing its own shards; ``data``: the data-iterator
position, JSON; ``config``: the resolved config, JSON) plus ``COMMIT.json``,
written by the primary process only after Orbax reports the async save
finished. ``DIR`` is ``RUN_DIR/checkpoints`` or ``checkpoint.dir`` (a local
path, ``gs://`` or ``s3://``; for S3, Orbax writes to ``RUN_DIR/checkpoints_staging``
and each process uploads its own files before the marker is written, see
:mod:`jaxtrain.checkpoint.storage`).

Crash consistency: a step directory without a readable marker is never
restored and is deleted when the next :class:`Checkpointer` starts (Orbax
itself lists such directories as valid steps). Deletion removes the marker
first, so a half-deleted directory is never mistaken for a complete one.
The marker also records every leaf's shape and dtype, so a restore into a
different model is refused with the list of mismatched paths before Orbax
reads anything.
"""
from __future__ import annotations

import json
import re
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import orbax.checkpoint as ocp
from etils import epath

from jaxtrain.checkpoint import storage
from jaxtrain.config import Config
from jaxtrain.errors import InputError
from jaxtrain.parallel.rules import path_str

MARKER = "COMMIT.json"
FORMAT = 1
_STEP_DIR = re.compile(r"^(\d+)(\.orbax-checkpoint-tmp.*)?$")


class CheckpointError(InputError, RuntimeError):
    """A checkpoint cannot be saved or restored into the current run."""


def tree_summary(tree: Any) -> dict[str, list]:
    """``{'params.layers.0.attn.wq': [[64, 4, 16], 'float32'], ...}`` for every array leaf."""
    return {path_str(p): [list(x.shape), str(x.dtype)] for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def mismatches(saved: dict[str, list], expected: dict[str, list]) -> list[str]:
    """Human-readable differences between two :func:`tree_summary` results (empty if they match)."""
    out = []
    for path in sorted(set(saved) | set(expected)):
        s, e = saved.get(path), expected.get(path)
        if s is None:
            out.append(f"{path}: missing in checkpoint (expected shape {tuple(e[0])} {e[1]})")
        elif e is None:
            out.append(f"{path}: not in the current model (saved shape {tuple(s[0])} {s[1]})")
        elif s != e:
            out.append(f"{path}: saved shape {tuple(s[0])} {s[1]}, expected {tuple(e[0])} {e[1]}")
    return out


def _primary() -> bool:
    return jax.process_index() == 0


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        ocp.multihost.sync_global_processes(name)


class Checkpointer:
    """Saves and restores ``{'state', 'data', 'config'}`` steps; see the module docstring.

    Args:
      cfg: the run config (``checkpoint.*`` drives the policy).
      run_dir: the run directory (local); checkpoints go to ``run_dir/checkpoints`` by default.
      mesh_shape: ``{axis: size}`` of the live mesh, recorded in each marker.
      report: called with a dict for every committed or failed save (the train loop logs it).

    Raises:
      CheckpointError: the directory cannot be used (e.g. an ``s3://`` path without s3fs).
    """

    def __init__(self, cfg: Config, run_dir: Path, mesh_shape: Optional[dict] = None,
                 report: Optional[Callable[[dict], None]] = None):
        c = self.options = cfg.checkpoint
        try:
            self.store = storage.open_store(c.dir or str(Path(run_dir, "checkpoints").absolute()), c.s3_endpoint)
        except storage.StorageError as err:
            raise CheckpointError(str(err)) from None
        self.remote = isinstance(self.store, storage.S3Store)
        if self.remote:  # Orbax writes here; finished steps are uploaded, then removed
            self.directory = epath.Path(Path(run_dir, "checkpoints_staging").absolute())
            shutil.rmtree(self.directory, ignore_errors=True)
            self._uploader = ThreadPoolExecutor(1, thread_name_prefix="jaxtrain-ckpt-upload")
        else:
            self.directory = self.store.root
        self.config_dict = cfg.to_dict()
        self.mesh_shape = dict(mesh_shape or {})
        self.report = report or (lambda row: None)
        self._pending: Optional[dict] = None
        self._last_step: Optional[int] = None  # the last step this process started saving
        self._last_save_time = time.monotonic()
        self.removed = self._cleanup_uncommitted() if _primary() else []
        _sync("jaxtrain_ckpt_cleanup")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None, enable_async_checkpointing=c.async_save, create=True)  # we do the GC
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    # ------------------------------------------------------------------ listing

    def _marker(self, step: int) -> Optional[dict]:
        try:
            info = json.loads(self.store.read_text(f"{step}/{MARKER}"))
        except (OSError, ValueError):
            return None
        return info if isinstance(info, dict) and info.get("step") == step else None

    def committed(self) -> dict[int, dict]:
        """``{step: marker}`` for every committed step directory."""
        out = {}
        for name in self.store.names():
            m = _STEP_DIR.match(name)
            if m and not m.group(2):
                info = self._marker(int(m.group(1)))
                if info is not None:
                    out[info["step"]] = info
        return dict(sorted(out.items()))

    def latest_step(self) -> Optional[int]:
        steps = list(self.committed())
        return steps[-1] if steps else None

    def _cleanup_uncommitted(self) -> list[str]:
        """Deletes step directories without a marker and Orbax temporaries. Returns their names."""
        removed = []
        for name in self.store.names():
            m = _STEP_DIR.match(name)
            if m and (m.group(2) or self._marker(int(m.group(1))) is None):
                self.store.rmtree(name)
                removed.append(name)
        return sorted(removed)

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
        """
        self.finish()
        t0 = time.perf_counter()
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(self.config_dict)), force=True)
        blocking = time.perf_counter() - t0
        self._last_save_time = time.monotonic()
        self._last_step = step
        self._pending = {"step": step, "metrics": metrics or {}, "tree": tree_summary(state),
                         "t0": t0, "blocking_s": blocking}
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
        if "upload" not in p and not self.manager.is_saving_in_progress():
            if not self.remote:
                self.finish()
                return
            self._start_upload(p)
        if "upload" in p and p["upload"].done():
            self.finish()

    def _orbax_done(self, p: dict) -> None:
        """Waits for Orbax; raises if the async write failed."""
        self.manager.wait_until_finished()
        self.manager.check_for_errors()
        if not (self.directory / str(p["step"])).exists():
            raise CheckpointError(f"Orbax finished without creating {self.directory / str(p['step'])}")

    def _start_upload(self, p: dict) -> None:
        step = p["step"]
        fut: Future = Future()
        try:
            self._orbax_done(p)
        except Exception as err:  # noqa: BLE001
            fut.set_exception(err)
        else:
            def upload() -> int:
                return self.store.upload(Path(self.directory / str(step)), str(step))
            fut = self._uploader.submit(upload)
        p["upload"] = fut

    def finish(self) -> Optional[bool]:
        """Waits for the pending save; commits it (True), or reports its failure (False). None: nothing pending."""
        p, self._pending = self._pending, None
        if p is None:
            return None
        step = p["step"]
        try:
            if self.remote:
                if "upload" not in p:
                    self._start_upload(p)
                p["uploaded_bytes"] = p["upload"].result()
            else:
                self._orbax_done(p)
        except Exception as err:  # noqa: BLE001 - any failure of the async write is reported, not raised
            if _primary():
                for name in self.store.names():
                    if name == str(step) or name.startswith(f"{step}.orbax-checkpoint-tmp"):
                        self.store.rmtree(name)
            self._drop_staging(step)
            self.manager.reload()
            self.report({"step": step, "checkpoint_failed": f"{type(err).__name__}: {err}",
                         "latest_committed": self.latest_step()})
            return False
        total = time.perf_counter() - p["t0"]
        if _primary():
            marker = {"format": FORMAT, "step": step, "time": time.time(), "metrics": p["metrics"],
                      "mesh": self.mesh_shape, "process_count": jax.process_count(), "tree": p["tree"]}
            self.store.write_text(f"{step}/{MARKER}", json.dumps(marker))
        _sync("jaxtrain_ckpt_commit")
        self._drop_staging(step)
        removed = self.collect_garbage() if _primary() else []
        _sync("jaxtrain_ckpt_gc")
        self.report({"step": step, "checkpoint_saved": step, "save_blocking_s": p["blocking_s"],
                     "save_total_s": total, "checkpoints_removed": removed})
        return True

    def keep_set(self, committed: dict[int, dict]) -> set[int]:
        """Steps the policy keeps: the last ``keep``, the best ``keep_best`` by ``best_metric``, and
        every multiple of ``keep_period``."""
        c = self.options
        steps = sorted(committed)
        keep = set(steps[-c.keep:])
        if c.keep_period:
            keep |= {s for s in steps if s % c.keep_period == 0}
        if c.keep_best:
            scored = [(committed[s]["metrics"][c.best_metric], s) for s in steps
                      if isinstance(committed[s].get("metrics", {}).get(c.best_metric), (int, float))]
            scored.sort(reverse=c.best_mode == "max")
            keep |= {s for _, s in scored[:c.keep_best]}
        return keep

    def collect_garbage(self) -> list[int]:
        """Deletes committed steps outside :meth:`keep_set` (marker first). Returns their steps."""
        committed = self.committed()
        doomed = sorted(set(committed) - self.keep_set(committed))
        for step in doomed:
            self.store.unlink(f"{step}/{MARKER}")
            self.store.rmtree(str(step))
        if doomed and not self.remote:
            self.manager.reload()
        return doomed

    def _drop_staging(self, step: int) -> None:
        if self.remote:
            shutil.rmtree(Path(self.directory / str(step)), ignore_errors=True)
            self.manager.reload()

    # ------------------------------------------------------------------ restoring

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restores committed ``step`` into the shardings and dtypes of ``abstract_state``
        (ShapeDtypeStructs with shardings: any mesh, any device count).

        Raises:
          CheckpointError: ``step`` is not committed, or the saved tree differs from the current
            model: the message lists every mismatched path with saved and expected shape/dtype.
        """
        info = self._marker(step)
        if info is None:
            raise CheckpointError(f"checkpoint step {step} in {self.store.url} is not committed "
                                  f"(no valid {MARKER}); committed steps: {list(self.committed())}")
        bad = mismatches(info["tree"], tree_summary(abstract_state))
        if bad:
            raise CheckpointError(
                f"checkpoint step {step} in {self.store.url} does not match the current config "
                f"({len(bad)} mismatched paths):\n  " + "\n  ".join(bad))
        if self.remote:
            t0 = time.perf_counter()
            nbytes = self.store.download(str(step), Path(self.directory / str(step)))
            self.last_download = {"bytes": nbytes, "seconds": time.perf_counter() - t0}
            self.manager.reload()
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        except (ValueError, KeyError, TypeError, FileNotFoundError) as err:
            raise CheckpointError(f"checkpoint step {step} in {self.store.url} cannot be read: {err}") from err
        finally:
            self._drop_staging(step)
        return out["state"], dict(out["data"])

    def saved_mesh(self, step: int) -> dict:
        return dict((self._marker(step) or {}).get("mesh", {}))

    def wait(self) -> None:
        self.finish()

    def close(self) -> None:
        self.finish()
        self.manager.close()
        if self.remote:
            self._uploader.shutdown()


def abstract_like(state: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs with the given shardings: a restore target that keeps saved dtypes."""
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
