"""The training loop: take a batch, run the step, let every hook look (nanoGPT's ``train()`` shape).

Everything that is not the step (preemption, the non-finite guard, logging, evaluation,
checkpoints, profiling, the progress bar, sampling) is a :class:`Hook` in
``jaxtrain.train.hooks``; a new concern is a new hook, not a new branch here.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import jax
import numpy as np

from jaxtrain.metrics.console import Reporter
from jaxtrain.metrics.sinks import Sinks
from jaxtrain.train.setup import Setup
from jaxtrain.errors import NonFiniteError


# Train steps dispatched but not finished: XLA:CPU deadlocks on ~100 unread multi-device programs in
# flight, and more than two buys no overlap that two do not.
MAX_IN_FLIGHT = 2


def stop_diverged(ckpt: Any, message: str) -> None:
    """Lets a save already under way commit (it holds params from before the divergence), then raises
    :class:`NonFiniteError` with ``message`` and the last good checkpoint."""
    last = None
    if ckpt is not None:
        ckpt.wait()
        last = ckpt.latest_step()
    where = f"step {last} in {ckpt.store.url}" if last is not None else "none (no checkpoint saved)"
    raise NonFiniteError(f"{message}; stopping. The last good checkpoint is {where}")


@dataclass
class RunResult:
    """What a run did, for the caller (tests, notebooks, the CLI)."""

    run_dir: Path
    rows: list[dict] = field(default_factory=list)  # every metrics row written by this process
    val_loss: Optional[float] = None
    sample: str = ""
    start_step: int = 0
    compile_s: float = 0.0
    preempted: str = ""  # the signal name when the run stopped early on SIGTERM/SIGINT
    nonfinite_steps: int = 0  # steps skipped by the non-finite guard in this process
    state: Any = None  # the final train state

    @property
    def losses(self) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in self.rows if "loss" in r}


@dataclass
class Loop:
    """What the hooks share: the run, the live state, where rows go, and what happened so far."""

    setup: Setup
    state: dict
    batches: Iterator
    val: dict  # the validation batches {field: [n_batches, micro, ...]} on the mesh
    sinks: Sinks
    out: Reporter
    result: RunResult
    start: int
    stopping: str = ""  # set by a hook (the signal's name on SIGTERM/SIGINT): the loop ends after this step
    last_eval: dict = field(default_factory=dict)  # {'step', 'val_loss', ...} of the latest evaluation
    committed: Optional[int] = None  # the latest committed checkpoint step, when checkpointing
    uncounted_flag: Any = None  # the current step's non-finite flag until the guard has counted it
    nonfinite_streak: int = 0  # skipped steps in a row, as far as the guard has counted
    # Seconds, summed since the start: waiting for batches, and loop time that was not training
    # (evaluation, checkpoint saves); train rows report per-interval differences of these.
    data_wait_s: float = 0.0
    paused_s: float = 0.0
    checkpoint_block_s: float = 0.0
    ckpt: Any = None  # the run's Checkpointer (None: checkpoint.enabled=false)
    watch: Any = None  # the hang watchdog (jaxtrain.runtime.watchdog.Watchdog); None: unwatched

    def begin(self, what: str, step: int = -1, scale: Optional[float] = 1.0):
        """Announces device work to the hang watchdog (:meth:`Watchdog.begin`)."""
        return self.watch.begin(what, step, scale) if self.watch is not None else _Unwatched()

    @property
    def n_val(self) -> int:
        """The number of validation batches."""
        return next(iter(self.val.values())).shape[0]

    @property
    def cfg(self):
        return self.setup.cfg

    def is_last(self, step: int) -> bool:
        """The final step of this process: ``train.steps`` or the step a stop was requested at."""
        return step == self.cfg.train.steps or bool(self.stopping)

    def record(self, step: int, values: dict) -> None:
        self.sinks.write(step, values)
        self.result.rows.append({"step": step, **values})

    def evaluate(self, step: int, record: bool = True) -> dict:
        """Evaluates the current params on the validation batches; returns (and records) ``{'val_<k>'}``
        and ``eval_time_s`` (wall seconds, after the train steps in flight finished; not training time).

        Each batch's metrics are weighted by its ``weight`` (e.g. its loss-mask tokens).

        Raises:
          NonFiniteError: the validation loss is NaN or infinite (recorded first; nothing more is saved).
        """
        jax.block_until_ready(self.state)  # the steps in flight are training time, not evaluation
        t0 = time.perf_counter()
        work = self.begin("the evaluation", step, scale=max(1.0, self.n_val / self.cfg.train.grad_accum))
        outs = self.setup.fns.evaluate(self.state["params"], self.val)  # one program
        work.until(outs["loss"])
        outs = {k: np.asarray(v, np.float64) for k, v in jax.device_get(outs).items()}
        w = outs.pop("weight")
        keys = ["loss", *sorted(k for k in outs if k != "loss")]
        row = {f"val_{k}": float(np.average(outs[k], weights=w)) for k in keys}
        row["eval_time_s"] = time.perf_counter() - t0
        self.paused_s += row["eval_time_s"]
        if record:
            self.record(step, row)
            self.last_eval = {"step": step, **row}
        if not np.isfinite(row["val_loss"]):
            stop_diverged(self.ckpt, f"the validation loss is {row['val_loss']} at step {step}: the run diverged")
        return row


class _Unwatched:
    """What :meth:`Loop.begin` returns without a watchdog."""

    def until(self, array: Any) -> Any:
        return array

    def end(self) -> None:
        pass


class Hook:
    """One concern of the loop. Every method is optional; ``loop`` is the shared :class:`Loop`."""

    def on_start(self, loop: Loop) -> None:
        """Before the first step."""

    def on_compile(self, loop: Loop, compiled: Any, seconds: float) -> None:
        """After the train step compiled (on the first batch)."""

    def before_step(self, loop: Loop, step: int) -> None:
        """Before step ``step`` is dispatched."""

    def after_step(self, loop: Loop, step: int, metrics: dict) -> None:
        """After step ``step`` was dispatched; ``metrics`` are device arrays (reading one waits)."""

    def on_end(self, loop: Loop, ok: bool) -> None:
        """After the loop; ``ok`` is False when an exception ends it."""


def train_loop(loop: Loop, hooks: Sequence[Hook]) -> None:
    """Steps ``loop.start + 1 .. train.steps``, or until a hook sets ``loop.stopping``."""
    step_fn, ok = None, False
    try:
        for hook in hooks:
            hook.on_start(loop)
        for step in range(loop.start + 1, loop.cfg.train.steps + 1):
            t0 = time.perf_counter()
            batch = next(loop.batches)
            loop.data_wait_s += time.perf_counter() - t0
            if step_fn is None:  # compile on the first real batch, timed, for the hooks to report
                t0 = time.perf_counter()
                with loop.out.status("compiling the train step"):
                    step_fn = loop.setup.fns.train_step.lower(loop.state, batch).compile()
                loop.result.compile_s = time.perf_counter() - t0
                for hook in hooks:
                    hook.on_compile(loop, step_fn, loop.result.compile_s)
            for hook in hooks:
                hook.before_step(loop, step)
            if loop.watch is not None:  # at most MAX_IN_FLIGHT steps queued on the devices
                loop.watch.wait_oldest(MAX_IN_FLIGHT - 1)
            work = loop.begin("the train step", step)
            loop.state, metrics = step_fn(loop.state, batch)
            work.until(metrics["loss"])
            for hook in hooks:
                hook.after_step(loop, step, metrics)
            if loop.stopping:
                break
        ok = True
    finally:
        loop.result.state = loop.state
        error = None
        for hook in hooks:  # every hook ends (closes its files) even if one of them raises
            try:
                hook.on_end(loop, ok)
            except Exception as err:  # noqa: BLE001 - re-raised below, the first one wins
                error = error or err
        if error is not None and ok:
            raise error
