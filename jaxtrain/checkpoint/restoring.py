"""Restoring a committed step: the marker checked first (tree, then file sizes and CRC32C), then
Orbax's read into any mesh; a corrupt step set aside. The half of :class:`~jaxtrain.checkpoint.
checkpointer.Checkpointer` that reads, as a base class: it uses the Checkpointer's ``layout``,
``store``, ``remote``, ``directory``, ``manager``, ``committed`` and ``_drop_staging``.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from jaxtrain.checkpoint import integrity, layer_layout
from jaxtrain.checkpoint.integrity import mismatches, tree_summary
from jaxtrain.checkpoint.layout import MARKER
from jaxtrain.checkpoint.processes import primary, sync
from jaxtrain.errors import CheckpointError


class Restoring:
    """:meth:`restore`, :meth:`set_aside` (see the module docstring)."""

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restores committed ``step`` into the shardings and dtypes of ``abstract_state``
        (ShapeDtypeStructs with shardings: any mesh, any device count).

        Raises:
          CheckpointError: ``step`` is not committed, or the saved tree differs from the current
            model: the message lists every mismatched path with saved and expected shape/dtype.
          CorruptCheckpointError: a file of ``step`` differs in size or CRC32C from its marker.
        """
        info, as_saved = self._checked_marker(step, abstract_state)
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
                state=ocp.args.StandardRestore(as_saved), data=ocp.args.JsonRestore()))
        except (ValueError, KeyError, TypeError, FileNotFoundError) as err:
            raise CheckpointError(f"checkpoint step {step} in {self.store.url} cannot be read: {err}") from err
        finally:
            if self.remote:
                sync("jaxtrain_ckpt_restored")
            self._drop_staging(step)
        return layer_layout.convert(out["state"], abstract_state), dict(out["data"])

    def _checked_marker(self, step: int, abstract_state: Any) -> tuple[dict, Any]:
        """(``step``'s marker, ``abstract_state`` in the layer layout it was saved in), once it is
        known to fit (before any file is read; :mod:`jaxtrain.checkpoint.layer_layout`).

        Raises:
          CorruptCheckpointError: the marker is damaged.
          CheckpointError: there is no marker, or the saved tree differs from ``abstract_state``.
        """
        info, why = self.layout.marker_state(step)
        if why:
            raise integrity.corrupt(step, self.store.url, [f"{MARKER} {why}"])
        if info is None:
            raise CheckpointError(f"checkpoint step {step} in {self.store.url} is not committed "
                                  f"(no valid {MARKER}); committed steps: {list(self.committed())}")
        as_saved = layer_layout.saved_layout(abstract_state, info["tree"])
        if as_saved is None:
            bad = mismatches(info["tree"], tree_summary(abstract_state))
            raise CheckpointError(
                f"checkpoint step {step} in {self.store.url} does not match the current config "
                f"({len(bad)} mismatched paths):\n  " + "\n  ".join(bad))
        return info, as_saved

    def set_aside(self, step: int) -> str:
        """Moves committed ``step`` out of the way as ``<step>.corrupt`` (kept, never restored). Returns the name."""
        name = self.layout.set_aside_name(step)
        if primary():
            self.layout.move_aside(step, name)
        sync("jaxtrain_ckpt_set_aside")
        if not self.remote:
            self.manager.reload()
        return name
