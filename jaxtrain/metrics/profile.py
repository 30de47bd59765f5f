"""``profile.start_step`` / ``profile.steps``: a jax.profiler trace of a few train steps in the run dir.

The trace (``<run.dir>/profile/plugins/profile/<time>/``: an XPlane file for
TensorBoard's profile plugin or xprof, and a Perfetto/Chrome ``*.trace.json.gz``)
covers steps ``start_step .. start_step + steps - 1``. The last traced step is
waited for before the trace stops, so its device time is inside the trace.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import jax

from jaxtrain.config import Config


class StepProfiler:
    """Call :meth:`before` before dispatching step ``s`` and :meth:`after` with its outputs."""

    def __init__(self, cfg: Config, run_dir: Path):
        self.first = cfg.profile.start_step
        self.last = cfg.profile.start_step + cfg.profile.steps - 1
        self.enabled = cfg.profile.steps > 0
        self.dir = Path(run_dir) / "profile"
        self.active = False

    def before(self, step: int) -> None:
        if self.enabled and step == self.first:
            self.dir.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.dir), create_perfetto_trace=True)
            self.active = True

    def after(self, step: int, outputs: Any) -> None:
        if self.active and step >= self.last:
            jax.block_until_ready(outputs)
            self.stop()

    def stop(self) -> None:
        """Ends an open trace (also when the loop ends before the last traced step)."""
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
