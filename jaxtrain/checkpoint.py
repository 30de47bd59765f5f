"""Async, sharded Orbax checkpoints in ``RUN_DIR/checkpoints``.

Each step directory holds the train state (every process writes its own
shards; nothing is gathered) and the data-iterator position as JSON. Restore
targets carry the live shardings and the saved dtypes, so a restore lands
directly in the current layout.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

from jaxtrain.config import Config


class CheckpointError(RuntimeError):
    """A checkpoint cannot be restored into the current run."""


class Checkpointer:
    """Thin wrapper over ``ocp.CheckpointManager`` for {'state', 'data'} items."""

    def __init__(self, cfg: Config, run_dir: Path):
        c = cfg.checkpoint
        self.every = c.every
        self.directory = (run_dir / "checkpoints").absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=c.keep, enable_async_checkpointing=c.async_save, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    def maybe_save(self, step: int, state: Any, data_state: dict, force: bool = False) -> bool:
        """Starts an async save at ``step`` if it is due (every N steps) or ``force``d."""
        if not force and step % self.every:
            return False
        if step in self.manager.all_steps():
            return False
        return self.manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)),
            force=True)

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restores ``step`` into the shardings and dtypes of ``abstract_state`` (ShapeDtypeStructs).

        Raises:
          CheckpointError: the saved tree does not match the current model (shapes or structure).
        """
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        except (ValueError, KeyError, TypeError) as err:
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} does not match the current config: {err}") from err
        return out["state"], dict(out["data"])

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_like(state: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs with the given shardings: a restore target that keeps saved dtypes."""
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
