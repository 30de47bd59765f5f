"""The training loop: take a batch, run the step, let every hook look (nanoGPT's ``train()`` shape).

Everything that is not the step (preemption, the non-finite guard, logging, evaluation,
checkpoints, profiling, the progress bar, sampling) is a :class:`Hook` in
``jaxtrain.train.hooks``; a new concern is a new hook, not a new branch here.

The loop owns the cadence and the shared state. A hook declares when it runs (``every``: a
config key such as ``train.eval_every``; ``at``: also at the last or final step) and what it
gives other hooks (``produces``: a field of :class:`StepRecord`, set from its ``after_step``'s
return value) or takes from them (``reads``). The loop orders the hooks by those declarations,
so the order they are given in changes nothing else, and each hook sees an immutable record.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import jax
import numpy as np

from jaxtrain.errors import NonFiniteError
from jaxtrain.kernels import hooks as provider_hooks
from jaxtrain.metrics.console import Reporter
from jaxtrain.metrics.sinks import Sinks
from jaxtrain.train.assembly import Setup
from jaxtrain.train.lookahead import Lookahead

# Train steps dispatched but not finished: XLA:CPU deadlocks on ~100 unread multi-device programs in
# flight, and more than two buys no overlap that two do not.
MAX_IN_FLIGHT = 2
# The likely cause named when the loop waits too long for a batch (jaxtrain.runtime.watchdog)
DATA_STUCK = "the data pipeline never returned a batch: a read that hangs (a remote store, a network filesystem)"


def stop_diverged(ckpt: Any, message: str, step: Optional[int] = None) -> None:
    """Lets a save already under way commit (it holds params from before the divergence), unless it
    is of ``step`` itself (the step found diverged: its save is abandoned), then raises
    :class:`NonFiniteError` with ``message`` and the last good checkpoint."""
    last = None
    if ckpt is not None:
        if step is not None:
            ckpt.abandon(step, NonFiniteError(message))
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


@dataclass(frozen=True)
class Skipped:
    """Non-finite (skipped) steps as far as the guard has counted: it reads a step's flag one step
    late, so the host never waits on the step just dispatched."""

    total: int = 0  # skipped steps of this process, through step ``through``
    streak: int = 0  # of them in a row, ending at ``through``
    through: int = 0  # the last step counted


@dataclass(frozen=True)
class StepRecord:
    """What the loop knows of one step. The fields after ``last`` are produced by hooks (their
    ``produces``), each from the step's own start: a hook that was not due leaves its default."""

    step: int
    metrics: dict  # the step's metrics as device arrays (reading one waits for the step)
    last: bool  # step == train.steps
    stop: str = ""  # StopOnSignal: the signal's name when this is the final step of a stopped run
    skipped: Skipped = Skipped()  # NonFiniteGuard
    row: Optional[dict] = None  # LogMetrics: the train row written at this step
    evaluation: Optional[dict] = None  # Evaluate: ``{'val_loss', ...}`` when evaluated at this step
    committed: Optional[int] = None  # Checkpointing: at a stop, the latest committed step after the final save

    @property
    def final(self) -> bool:
        """The final step of this process: ``train.steps``, or the step a stop was agreed at."""
        return self.last or bool(self.stop)


class Hook:
    """One concern of the loop. Every method is optional; ``loop`` is the :class:`TrainLoop`.

    Declarations (class attributes, or set in :meth:`on_start`):
      every: run ``after_step`` only at steps divisible by this: an int, or a config key
        (``"train.log_every"``) read at the start; 0 never; None every step.
      at: also run at the ``"last"`` step (``train.steps``) or the ``"final"`` one (last or stopped).
      produces: the :class:`StepRecord` field ``after_step``'s return value sets for the hooks after it.
      reads: the produced fields it reads (the loop runs it after their producers).
      pauses: the loop counts the wall time of its ``after_step`` (less any evaluation inside it) as
        time that was not training, under this name (e.g. ``"checkpoint"``); train rows leave it out.
    """

    every: Union[int, str, None] = None
    at: Optional[str] = None
    produces: Optional[str] = None
    reads: tuple[str, ...] = ()
    pauses: Optional[str] = None

    def on_start(self, loop: "TrainLoop") -> None:
        """Before the first step."""

    def on_compile(self, loop: "TrainLoop", compiled: Any, seconds: float) -> None:
        """After the train step compiled (on the first batch)."""

    def before_step(self, loop: "TrainLoop", step: int) -> None:
        """Before step ``step`` is dispatched (every step)."""

    def after_step(self, loop: "TrainLoop", rec: StepRecord) -> Any:
        """After the step was dispatched, when due; returns the value of ``produces`` (if any)."""

    def on_end(self, loop: "TrainLoop", ok: bool) -> None:
        """After the loop (in the same order); ``ok`` is False when an exception ends it."""


def ordered(hooks: Sequence[Hook]) -> list[Hook]:
    """``hooks`` ordered so each runs after the producers of what it reads; otherwise in the given order.

    Raises:
      ValueError: a hook reads a field no hook produces, two hooks produce one field, or the reads
        form a cycle (each named).
    """
    producer: dict[str, Hook] = {}
    for h in hooks:
        if h.produces and h.produces in producer:
            raise ValueError(f"{type(h).__name__} and {type(producer[h.produces]).__name__} both produce "
                             f"'{h.produces}'")
        if h.produces:
            producer[h.produces] = h
    for h in hooks:
        unknown = [f for f in h.reads if f not in producer]
        if unknown:
            raise ValueError(f"{type(h).__name__} reads '{unknown[0]}', which no hook produces")
    out: list[Hook] = []
    done: set[str] = set()
    left = list(hooks)
    while left:
        ready = next((h for h in left if all(f in done for f in h.reads)), None)
        if ready is None:
            raise ValueError("hooks read each other's fields in a cycle: "
                             + ", ".join(type(h).__name__ for h in left))
        left.remove(ready)
        out.append(ready)
        if ready.produces:
            done.add(ready.produces)
    return out


@dataclass
class TrainLoop:
    """The loop and everything it owns: the run, the live state, where rows go, the timers, the
    latest evaluation and step record. Hooks read these; only the loop (and its own methods) write."""

    setup: Setup
    state: dict
    batches: Iterator
    val: list  # the validation batches on the mesh, in pieces: [{field: [piece, micro, ...]}, ...]
    sinks: Sinks
    out: Reporter
    result: RunResult
    start: int
    ckpt: Any = None  # the run's Checkpointer (None: checkpoint.enabled=false)
    precompiled: Any = None  # the step, evaluation and sample compiled meanwhile (jaxtrain.train.precompile)
    watch: Any = None  # the hang watchdog (jaxtrain.runtime.watchdog.Watchdog); None: unwatched
    # Seconds summed since the start: waiting for batches, and time that was not training, by cause
    # ('evaluation', 'checkpoint'); train rows report per-interval differences of these.
    data_wait_s: float = 0.0
    paused: dict = field(default_factory=lambda: {"evaluation": 0.0, "checkpoint": 0.0})
    last_eval: dict = field(default_factory=dict)  # {'step', 'val_loss', ...} of the latest evaluation
    record: Optional[StepRecord] = None  # the latest step's, after every hook ran
    failure: Optional[BaseException] = None  # what ended run() early, for the hooks' on_end
    # fn(loop, step), called as an evaluation starts, just before its program is dispatched (e.g.
    # Checkpointing starts the last step's save then, so Orbax writes while the devices evaluate); the
    # time it takes is its own to add to ``paused``, not the evaluation's.
    while_evaluating: list[Callable[["TrainLoop", int], None]] = field(default_factory=list)
    # () -> the stop signal's name, or "" (StopOnSignal's; many processes: agreed, the same on every
    # one); the evaluation asks it between its pieces. None: nothing stops an evaluation.
    stop_poll: Optional[Callable[[], str]] = None
    interrupted: str = ""  # the stop that cut an evaluation short: this step becomes the final one

    @property
    def cfg(self):
        return self.setup.cfg

    @property
    def n_val(self) -> int:
        """The number of validation batches."""
        return sum(next(iter(piece.values())).shape[0] for piece in self.val)

    def begin(self, what: str, step: int = -1, scale: Optional[float] = 1.0, cause: Optional[str] = None):
        """Announces device work to the hang watchdog (:meth:`Watchdog.begin`)."""
        return self.watch.begin(what, step, scale, cause) if self.watch is not None else _Unwatched()

    @contextlib.contextmanager
    def drawing(self, step: int):
        """The loop waiting for the data pipeline (the next batch, or the one it draws ahead), bounded
        as a step is (``train.hang_timeout_s``): a source that never returns ends the run by name."""
        work = self.begin("the next batch from the data pipeline", step, cause=DATA_STUCK)
        try:
            yield
        finally:
            work.end()

    @contextlib.contextmanager
    def compiling(self, what: str) -> Iterator[None]:
        """The block waits for a compile (``what``: "the train step's compile"): announced to the hang
        watchdog, limited by ``train.compile_timeout_s`` (:meth:`Watchdog.begin_compile`)."""
        limit = self.cfg.train.compile_timeout_s
        work = self.watch.begin_compile(what, limit) if self.watch is not None else _Unwatched()
        try:
            yield
        finally:
            work.end()

    def write(self, step: int, values: dict) -> None:
        """One metrics row: to the sinks, and to the result."""
        self.sinks.write(step, values)
        self.result.rows.append({"step": step, **values})

    def evaluate(self, step: int, record: bool = True) -> Optional[dict]:
        """The current params on the validation batches (once per step: a second call at the same step
        returns the first's row); returns (and records) ``{'val_<k>'}`` and ``eval_time_s`` (wall
        seconds, after the train steps in flight finished; counted as paused, not training).

        Each batch's metrics are weighted by its ``weight`` (e.g. its loss-mask tokens). The batches
        run piece by piece (one program each, :func:`jaxtrain.train.evaluation.eval_piece`); after
        each piece but the last the loop asks :attr:`stop_poll` (StopOnSignal's: every process gets
        the same answer at the same piece) and, at a stop, abandons the evaluation: returns None and
        sets :attr:`interrupted`, so the step becomes the run's final one and its save goes ahead
        within the grace period (an evaluation of the whole set could use the grace up).

        Raises:
          NonFiniteError: the validation loss is NaN or infinite (recorded first; nothing more is saved).
        """
        if record and self.last_eval.get("step") == step:
            return {k: v for k, v in self.last_eval.items() if k != "step"}
        jax.block_until_ready(self.state)  # the steps in flight are training time, not evaluation
        params, pieces, evaluate = self.state["params"], self.val, None
        if self.precompiled is not None:
            with self.compiling("the evaluation's compile"):
                evaluate = self.precompiled.evaluation(params, pieces[0])
        evaluate = evaluate or self.setup.fns.evaluate
        # Before the dispatch: a one-device CPU program may run inline (provider_hooks.runs_inline), so
        # a save started after it would begin only once the evaluation ended. Not evaluation time: each
        # callback counts its own (the last step's save: 'checkpoint').
        for fn in self.while_evaluating:
            fn(self, step)
        t0, parts = time.perf_counter(), []
        for i, piece in enumerate(pieces):
            n = next(iter(piece.values())).shape[0]
            work = self.begin("the evaluation", step, scale=max(1.0, n / self.cfg.train.grad_accum))
            out = evaluate(params, piece)  # one program for the piece's batches
            work.until(out["loss"])
            parts.append(out)
            stop = self.stop_poll() if self.stop_poll is not None and i + 1 < len(pieces) else ""
            if stop:
                self.paused["evaluation"] += time.perf_counter() - t0
                self.interrupted = stop
                self.out.info(f"{stop} during the evaluation at step {step}: evaluation abandoned after {i + 1} of "
                              f"{len(pieces)} pieces; saving the step")
                return None
        got = jax.device_get(parts)  # each {'loss', 'weight', ...: [piece]}
        outs = {k: np.concatenate([np.asarray(g[k], np.float64) for g in got]) for k in got[0]}
        w = outs.pop("weight")
        keys = ["loss", *sorted(k for k in outs if k != "loss")]
        row = {f"val_{k}": float(np.average(outs[k], weights=w)) for k in keys}
        row["eval_time_s"] = time.perf_counter() - t0
        self.paused["evaluation"] += row["eval_time_s"]
        if record:
            self.write(step, row)
            self.last_eval = {"step": step, **row}
        if not np.isfinite(row["val_loss"]):
            stop_diverged(self.ckpt, f"the validation loss is {row['val_loss']} at step {step}: the run diverged",
                          step)
        return row

    def run(self, hooks: Sequence[Hook]) -> None:
        """Steps ``start + 1 .. train.steps``, or until a hook produces a stop; every hook's
        ``on_end`` runs even if one of them raises (the first error is raised after)."""
        hooks = ordered(hooks)
        step_fn, ok = None, False
        try:
            for hook in hooks:
                hook.on_start(self)
            cadence = [(h, self._every(h)) for h in hooks]
            if not isinstance(self.batches, Lookahead):  # after on_start: a hook may have wrapped them
                self.batches = Lookahead(self.batches, threaded=provider_hooks.runs_inline(len(self.setup.devices)))
            for step in range(self.start + 1, self.cfg.train.steps + 1):
                t0 = time.perf_counter()
                with self.drawing(step):
                    batch = next(self.batches)
                self.data_wait_s += time.perf_counter() - t0
                if step_fn is None:
                    step_fn = self._compile(hooks, batch)
                for hook in hooks:
                    hook.before_step(self, step)
                if self.watch is not None:  # at most MAX_IN_FLIGHT steps queued on the devices
                    self.watch.wait_oldest(MAX_IN_FLIGHT - 1)
                if step < self.cfg.train.steps and self.batches.threaded:
                    self.batches.fetch()  # the next batch, drawn on its thread while this step runs inline
                work = self.begin("the train step", step)
                self.state, metrics = step_fn(self.state, batch)
                work.until(metrics["loss"])
                if step < self.cfg.train.steps:  # the next batch, assembled while this step runs
                    t0 = time.perf_counter()
                    with self.drawing(step + 1):
                        self.batches.fetch()
                    self.data_wait_s += time.perf_counter() - t0
                rec = self._after_step(cadence, StepRecord(step, metrics, step == self.cfg.train.steps))
                if rec.stop:
                    break
            ok = True
        except BaseException as err:
            self.failure = err
            raise
        finally:
            if isinstance(self.batches, Lookahead):
                self.batches.close()
            self.result.state = self.state
            error = None
            for hook in hooks:
                try:
                    hook.on_end(self, ok)
                except Exception as err:  # noqa: BLE001 - re-raised below, the first one wins
                    error = error or err
            if error is not None and ok:
                raise error

    def _every(self, hook: Hook) -> Optional[int]:
        every = hook.every
        if isinstance(every, str):  # a config key, e.g. 'train.eval_every'
            section, key = every.split(".")
            every = getattr(getattr(self.cfg, section), key)
        return every

    def _compile(self, hooks: Sequence[Hook], batch: dict):
        """The train step compiled for the first real batch (ahead of it, when that compile fits the
        batch and the state), timed, for the hooks to report."""
        t0 = time.perf_counter()
        with self.compiling("the train step's compile"), self.out.status("compiling the train step"):
            step_fn = self.precompiled.train_step(self.state, batch) if self.precompiled is not None else None
            if step_fn is None:
                step_fn = self.setup.fns.train_step.lower(self.state, batch).compile()
                self.result.compile_s = time.perf_counter() - t0
            else:
                self.result.compile_s = self.precompiled.seconds
        for hook in hooks:
            hook.on_compile(self, step_fn, self.result.compile_s)
        return step_fn

    def _after_step(self, cadence, rec: StepRecord) -> StepRecord:
        for hook, every in cadence:
            due = (every is None or (every > 0 and rec.step % every == 0)
                   or (hook.at == "last" and rec.last) or (hook.at == "final" and rec.final))
            if not due:
                continue
            t0, counted = time.perf_counter(), sum(self.paused.values())
            value = hook.after_step(self, rec)
            if hook.pauses:
                inside = sum(self.paused.values()) - counted  # already counted (an evaluation, a save it began)
                self.paused[hook.pauses] = self.paused.get(hook.pauses, 0.0) + time.perf_counter() - t0 - inside
            if hook.produces:
                rec = dataclasses.replace(rec, **{hook.produces: value})
            if self.interrupted and not rec.stop:  # a stop agreed during an evaluation: this is the final step
                rec = dataclasses.replace(rec, stop=self.interrupted)
        self.record = rec
        self.result.preempted = rec.stop or self.result.preempted
        self.result.nonfinite_steps = rec.skipped.total
        return rec


class _Unwatched:
    """What :meth:`TrainLoop.begin` returns without a watchdog."""

    def until(self, array: Any) -> Any:
        return array

    def end(self) -> None:
        pass
