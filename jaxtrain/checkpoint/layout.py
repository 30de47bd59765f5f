"""The layout of a checkpoint directory (``DIR``, a :class:`~jaxtrain.checkpoint.storage.Store`'s root):
what each name in it means, and the operations on those names that keep it crash consistent.

Names under ``DIR``:

- ``<step>/``: an Orbax step directory (items ``state``, ``data``, ``config``). It is committed
  once ``<step>/COMMIT.json`` (the *marker*, :func:`Layout.commit`) is in it and readable; Orbax
  itself lists a step directory without one as a valid step, so we never trust its listing.
- ``<step>.orbax-checkpoint-tmp*``: Orbax's temporary while it writes ``<step>``.
- ``<step>.jaxtrain-pending``: this trainer is writing or deleting ``<step>`` (:func:`pending_name`).
- ``<step>.corrupt`` / ``<step>.corrupt<N>``: a committed step moved aside by ``checkpoint.fallback``;
  kept for a person to look at, never restored.
- anything else: not ours; listed, never touched.

Crash consistency: before a save begins, a pending marker is written, and removed once the step is
committed; deleting a step (garbage collection, a failed save) writes it again first. So at the
next start :meth:`Layout.cleanup_unfinished` deletes exactly the unfinished steps it can prove this
trainer wrote: those with a pending marker. Any other unmarked step directory (a step copied in by
hand, a user's own ``7/``) is left alone and reported, and saving over it is refused.

A :class:`Layout` acts on the store as one process would: which process writes (the primary), the
barriers around it and Orbax's own view of the directory are the Checkpointer's business
(:mod:`jaxtrain.checkpoint.checkpointer`). The store's ``OSError`` passes through every method,
except that a marker which cannot be read counts as absent. Times in the files are UNIX seconds.
"""
from __future__ import annotations

import json
import re
import time
from typing import Optional

from jaxtrain.checkpoint import storage

MARKER = "COMMIT.json"
FORMAT = 2  # 2: the marker lists every file's size and CRC32C
PENDING = ".jaxtrain-pending"  # DIR/<step>.jaxtrain-pending: this trainer is writing or deleting <step>
_STEP_DIR = re.compile(r"^(\d+)(\.orbax-checkpoint-tmp.*)?$")
_PENDING = re.compile(r"^(\d+)" + re.escape(PENDING) + "$")
_SET_ASIDE = re.compile(r"^\d+\.corrupt\d*$")  # moved out of the way by checkpoint.fallback


def pending_name(step: int) -> str:
    """The pending marker's name for ``step``, relative to ``DIR``."""
    return f"{step}{PENDING}"


class Layout:
    """The names of one checkpoint directory; see the module docstring.

    Args:
      store: where ``DIR`` is (local, ``gs://`` or ``s3://``).
    """

    def __init__(self, store: storage.Store):
        self.store = store
        self.remote = isinstance(store, storage.S3Store)  # S3: Orbax writes to a local staging copy

    # ------------------------------------------------------------------ reading markers

    def marker_state(self, step: int) -> tuple[Optional[dict], Optional[str]]:
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

    def marker(self, step: int) -> Optional[dict]:
        """``step``'s marker, or None when it is not committed (or its marker is damaged)."""
        return self.marker_state(step)[0]

    def markers(self) -> tuple[dict[int, dict], dict[int, str]]:
        """(``{step: marker}`` of every committed step, ``{step: what is wrong}`` of every step whose
        marker is damaged), both by step."""
        good, bad = {}, {}
        for name in self.store.names():
            m = _STEP_DIR.match(name)
            if m and not m.group(2):
                step = int(m.group(1))
                info, why = self.marker_state(step)
                if info is not None:
                    good[step] = info
                elif why:
                    bad[step] = why
        return dict(sorted(good.items())), dict(sorted(bad.items()))

    def committed(self) -> dict[int, dict]:
        """``{step: marker}`` for every committed step directory, by step."""
        return self.markers()[0]

    def restorable(self) -> list[int]:
        """Steps to try restoring, newest last: the committed ones and those whose marker is damaged
        (their restore is a CorruptCheckpointError, never a silent step back)."""
        good, bad = self.markers()
        return sorted(set(good) | set(bad))

    def latest_step(self) -> Optional[int]:
        """The newest committed step, or None."""
        steps = list(self.committed())
        return steps[-1] if steps else None

    def set_aside_names(self) -> list[str]:
        """The names of the steps moved aside as corrupt, sorted."""
        return sorted(n for n in self.store.names() if _SET_ASIDE.match(n))

    def occupied(self, step: int) -> bool:
        """Whether anything named ``<step>`` already exists in ``DIR`` (a save never overwrites it)."""
        if self.remote:  # no directories on S3: a name is there while any object under it is
            return str(step) in self.store.names()
        return (self.store.root / str(step)).exists()

    # ------------------------------------------------------------------ writing (the primary only)

    def cleanup_unfinished(self) -> tuple[list[str], list[str]]:
        """Deletes the uncommitted step directories (and Orbax temporaries) that have a pending marker,
        then the markers. Returns (removed names, uncommitted names left alone: not ours), sorted."""
        names = self.store.names()
        pending = {int(m.group(1)) for m in map(_PENDING.match, names) if m}
        removed, ignored = [], []
        for name in names:
            m = _STEP_DIR.match(name)
            if not m:
                continue
            state = (None, None) if m.group(2) else self.marker_state(int(m.group(1)))
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

    def begin(self, step: int) -> None:
        """Writes ``step``'s pending marker: before any file of the step is written."""
        self.store.write_text(pending_name(step), json.dumps({"step": step, "time": time.time()}))

    def commit(self, step: int, *, metrics: dict, mesh: dict, process_count: int, tree: dict[str, list],
               files: dict[str, list]) -> None:
        """Writes ``step``'s marker (one atomic write), then removes its pending marker.

        Args:
          metrics: the metrics at ``step`` (``keep_best`` reads them).
          mesh: ``{axis: size}`` of the mesh that saved it.
          process_count: how many processes saved it.
          tree: ``{leaf path: [shape, dtype]}`` (:func:`jaxtrain.checkpoint.integrity.tree_summary`).
          files: ``{relative path: [bytes, CRC32C hex]}`` of every file of the step.
        """
        marker = {"format": FORMAT, "step": step, "time": time.time(), "metrics": metrics, "mesh": mesh,
                  "process_count": process_count, "tree": tree, "files": files}
        self.store.write_text(f"{step}/{MARKER}", json.dumps(marker))
        self.store.unlink(pending_name(step))

    def discard(self, step: int) -> None:
        """Removes a failed save of ``step`` (its directory and Orbax temporaries), then its pending marker."""
        for name in self.store.names():
            if name == str(step) or name.startswith(f"{step}.orbax-checkpoint-tmp"):
                self.store.rmtree(name)
        self.store.unlink(pending_name(step))

    def delete(self, steps: list[int]) -> None:
        """Deletes committed ``steps``, each marker first (the step is no longer committed at once)."""
        for step in steps:  # pending marker first: a crash part-way leaves a step the next start removes
            self.store.write_text(pending_name(step), json.dumps({"step": step, "deleting": True}))
            self.store.unlink(f"{step}/{MARKER}")
            self.store.rmtree(str(step))
            self.store.unlink(pending_name(step))

    def set_aside_name(self, step: int) -> str:
        """The first free name of ``<step>.corrupt``, ``<step>.corrupt2``, ... (every process computes it)."""
        name, n = f"{step}.corrupt", 1
        names = set(self.store.names())
        while name in names:
            n += 1
            name = f"{step}.corrupt{n}"
        return name

    def move_aside(self, step: int, name: str) -> None:
        """Renames committed ``step`` to ``name`` (from :meth:`set_aside_name`), marker and all."""
        self.store.rename(str(step), name)
