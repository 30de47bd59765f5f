"""The loop's hooks: each one concern of a run that is not the train step itself.

``jaxtrain.train.fit`` runs them in this order after every step: the young-generation garbage
collection (every ``train.gc_every`` steps), a stop request (which
makes this the last step), the non-finite guard (which may end the run), the metrics row,
evaluation, checkpointing (which may need that evaluation, and commits before a stop), the
profiler, the progress bar; the sample comes at the end.
"""
from __future__ import annotations

import gc
import signal
import time
from typing import Any, Optional

import jax
import numpy as np

from jaxtrain.checkpoint.checkpointer import Checkpointer
from jaxtrain.metrics import flops, memory
from jaxtrain.metrics.profile import StepProfiler
from jaxtrain.train import preempt
from jaxtrain.train.loop import Hook, Loop, stop_diverged
from jaxtrain.train.sample import generate


class GarbageCollection(Hook):
    """Python's automatic garbage collection is off during the loop; a young-generation collection
    (generations 0 and 1) runs after every ``train.gc_every``-th step is dispatched, so it overlaps
    the device's work. An automatic full collection can stop a process for seconds when the heap is
    large, and in a many-process run every other process waits at the next collective for it.
    ``train.gc_every: 0`` leaves Python's automatic collection on. As torchtitan's ``training.gc_freq``.
    """

    def on_start(self, loop: Loop) -> None:
        self.every, self.was_enabled = loop.cfg.train.gc_every, gc.isenabled()
        if self.every:
            gc.collect(1)
            gc.disable()

    def after_step(self, loop: Loop, step: int, metrics: dict) -> None:
        if self.every and step % self.every == 0:
            gc.collect(1)

    def on_end(self, loop: Loop, ok: bool) -> None:
        if self.every and self.was_enabled:
            gc.enable()


class CompileReport(Hook):
    """After compiling: the compile time, per-device memory, and what ``allow_fallback`` replicated."""

    def on_compile(self, loop: Loop, compiled: Any, seconds: float) -> None:
        loop.out.info(f"compiled train step in {seconds:.1f} s")
        loop.out.info(memory.state_report(loop.state, loop.setup.fns.state_shardings, compiled).summary())
        if loop.setup.rules.fallbacks:  # after tracing, so activation fallbacks are listed too
            loop.out.warn_table("sharding.allow_fallback replicated these dimensions", loop.setup.rules.fallbacks)


class StopOnSignal(Hook):
    """SIGTERM/SIGINT: the current step is the last (the checkpoint hook saves and commits it), then the
    run ends with exit 0; ``checkpoint.grace_period_s`` bounds the wait (``jaxtrain.train.preempt``).

    Many processes: a signal that reaches any one of them stops all of them at the same step; they
    agree every ``distributed.stop_check_every`` steps (:class:`jaxtrain.train.preempt.StopAgreement`),
    so the stop comes one check after the signal.

    The handlers stay in until :meth:`release` (``fit`` calls it after every hook has ended), so a
    signal during the final evaluation, save or sample lets them finish too.
    """

    def on_start(self, loop: Loop) -> None:
        self.loop = loop
        waiting_for = loop.watch.waiting_for if loop.watch is not None else None
        self.signals = preempt.Preemption(loop.cfg.checkpoint.grace_period_s, waiting_for=waiting_for).__enter__()
        preempt.startup_over()  # after: no moment without a handler that stops cleanly
        self.agreement = preempt.StopAgreement(loop.setup.mesh.devices) if jax.process_count() > 1 else None

    def after_step(self, loop: Loop, step: int, metrics: dict) -> None:
        if self.agreement is None:
            signum = self.signals.signum
        elif step % loop.cfg.distributed.stop_check_every == 0 and step < loop.cfg.train.steps:
            work = loop.begin("the stop agreement (a collective of every process)", step)
            signum = self.agreement.exchange(self.signals.signum)
            work.until(self.agreement.pending)
        else:
            return
        if signum:
            loop.stopping = loop.result.preempted = signal.Signals(signum).name
            self.step = step

    def on_end(self, loop: Loop, ok: bool) -> None:
        if hasattr(self, "signals") and ok and loop.stopping:
            self.signals.finished()
            saved = "committed" if loop.committed == self.step else "NOT saved"
            other = " (received by another process)" if self.signals.signum is None else ""
            loop.out.info(f"{loop.stopping}{other}: stopped after step {self.step}; checkpoint {saved}; "
                          f"rerun to resume")

    def release(self, ok: bool) -> None:
        """Restores the previous handlers; says so if a signal came after the last step."""
        if not hasattr(self, "signals"):
            return
        if ok and self.signals.signum is not None and not self.loop.stopping:
            self.loop.out.info(f"{self.signals.name} after the last step: the run had finished; nothing was lost")
        self.signals.__exit__(None, None, None)


class NonFiniteGuard(Hook):
    """Counts skipped (non-finite) steps; raises NonFiniteError after ``train.max_nonfinite_steps`` in a
    row, or at the end of a run whose every step was skipped.

    A step's flag is read one step late, so the host never waits on the step just dispatched.
    """

    def __init__(self):
        self.in_a_row, self.pending = 0, None

    def after_step(self, loop: Loop, step: int, metrics: dict) -> None:
        if self.pending is not None:
            self._count(loop, int(self.pending), step - 1)
        self.pending = loop.uncounted_flag = metrics["nonfinite"]
        if loop.is_last(step):
            self._count(loop, int(self.pending), step)
            self.pending = loop.uncounted_flag = None
        self.last = step

    def on_end(self, loop: Loop, ok: bool) -> None:
        """A run that trained nothing at all failed (after its rows and final save are written)."""
        last = getattr(self, "last", loop.start)
        if ok and not loop.result.preempted and last > loop.start and loop.result.nonfinite_steps == last - loop.start:
            stop_diverged(loop.ckpt, f"every step of this run ({loop.start + 1}..{last}) had a non-finite "
                                     f"loss or gradient and was skipped")

    def _count(self, loop: Loop, flag: int, step: int) -> None:
        loop.nonfinite_streak = self.in_a_row = 0 if not flag else self.in_a_row + 1
        if not flag:
            return
        loop.result.nonfinite_steps += 1
        limit = loop.cfg.train.max_nonfinite_steps
        if self.in_a_row >= limit:
            stop_diverged(loop.ckpt, f"train.max_nonfinite_steps: {self.in_a_row} steps in a row (steps "
                                     f"{step - self.in_a_row + 1}..{step}) had a non-finite loss or gradient and "
                                     f"were skipped")


class LogMetrics(Hook):
    """Every ``train.log_every`` steps (and the last): one train row, the loop's only host sync.

    ``step_time_s`` is the mean wall time per training step since the previous row, leaving out
    what the loop did besides training (evaluations, checkpoint saves: reported as their own
    ``eval_time_s`` and ``checkpoint_block_s``) and the compile (``compile_s``, on the first row);
    waiting for batches is part of it and shown as ``data_wait_s``, seconds per step.
    ``<unit>_per_sec`` and ``mfu`` follow from ``step_time_s`` (``jaxtrain.metrics.flops``).
    """

    def __init__(self, peak: Optional[float]):
        self.peak, self.t_last, self.s_last, self.first = peak, time.perf_counter(), 0, True
        self.waited = self.paused = self.blocked = 0.0  # the loop's totals at the previous row

    def on_start(self, loop: Loop) -> None:
        self.s_last = loop.start

    def on_compile(self, loop: Loop, compiled: Any, seconds: float) -> None:
        self.t_last = time.perf_counter()  # the first batch's wait stays in: it belongs to step 1

    def after_step(self, loop: Loop, step: int, metrics: dict) -> None:
        if step % loop.cfg.train.log_every and not loop.is_last(step):
            return
        m = jax.device_get(metrics)
        now = time.perf_counter()
        spec, t, n = loop.setup.spec, loop.cfg.train, step - self.s_last
        dt = (now - self.t_last - (loop.paused_s - self.paused)) / n
        rate = t.global_batch * spec.units_per_example / dt
        skipped = loop.result.nonfinite_steps + (int(m["nonfinite"]) if loop.uncounted_flag is not None else 0)
        row = {"loss": float(m.pop("loss")), "lr": float(m.pop("lr")), "grad_norm": float(m.pop("grad_norm")),
               f"{spec.unit}_per_sec": rate, "step_time_s": dt, "mfu": flops.mfu(rate, spec.flops_per_unit, self.peak),
               "nonfinite_steps": skipped, "data_wait_s": (loop.data_wait_s - self.waited) / n,
               "checkpoint_block_s": loop.checkpoint_block_s - self.blocked}
        if self.first:
            row["compile_s"], self.first = loop.result.compile_s, False
        m.pop("nonfinite")
        row.update({k: float(v) for k, v in m.items()})  # the loss's own metrics (aux)
        loop.record(step, row)
        self.t_last, self.s_last = time.perf_counter(), step
        self.waited, self.paused, self.blocked = loop.data_wait_s, loop.paused_s, loop.checkpoint_block_s


class Evaluate(Hook):
    """Every ``train.eval_every`` steps and at the last step; at the end, the final validation loss."""

    def after_step(self, loop: Loop, step: int, metrics: dict) -> None:
        if step % loop.cfg.train.eval_every == 0 or step == loop.cfg.train.steps:
            loop.evaluate(step)

    def on_end(self, loop: Loop, ok: bool) -> None:
        if not ok or loop.result.preempted:
            return
        last = loop.last_eval or loop.evaluate(loop.start, record=False)  # nothing trained: evaluate as is
        loop.result.val_loss = last["val_loss"]
        n = loop.n_val
        loop.out.info(f"validation loss {loop.result.val_loss:.4f} (mean over {n} batches)")


class Checkpointing(Hook):
    """Saves when due (``checkpoint.every``, ``every_seconds``, the last step, a stop request);
    commits finished saves; keeps the best K by an eval metric (evaluating first if needed)."""

    def __init__(self, ckpt: Checkpointer):
        self.ckpt = ckpt

    def after_step(self, loop: Loop, step: int, metrics: dict) -> None:
        ckpt, final = self.ckpt, step == loop.cfg.train.steps
        # During a run of skipped steps the params do not change: a periodic save would only rotate
        # older (good) checkpoints away.
        saving = loop.stopping or (ckpt.due(step, final=final) and (final or not loop.nonfinite_streak))
        if saving and loop.cfg.checkpoint.keep_best and loop.last_eval.get("step") != step:
            loop.evaluate(step)  # best-K needs this step's metric
        if saving:
            jax.block_until_ready(loop.state)  # the steps in flight are training time, not the save's
        t0 = time.perf_counter()
        if saving:
            at_step = loop.last_eval.get("step") == step
            metrics_now = {k: v for k, v in loop.last_eval.items() if k not in ("step", "eval_time_s")}
            ckpt.save(step, loop.state, loop.batches.get_state(), metrics_now if at_step else {})
        ckpt.poll()
        if loop.stopping:  # let the save commit before the process exits
            work = loop.begin("the checkpoint save to commit", step, scale=None)  # bounded by save_timeout_s
            ckpt.wait()
            work.end()
            loop.committed = ckpt.latest_step()
        blocked = time.perf_counter() - t0
        loop.paused_s += blocked
        loop.checkpoint_block_s += blocked

    def on_end(self, loop: Loop, ok: bool) -> None:
        if ok:
            self.ckpt.close()


class Profile(Hook):
    """``profile.start_step`` / ``profile.steps``: a jax.profiler trace of those steps in the run dir."""

    def __init__(self, profiler: StepProfiler):
        self.profiler = profiler

    def before_step(self, loop: Loop, step: int) -> None:
        self.profiler.before(step)

    def after_step(self, loop: Loop, step: int, metrics: dict) -> None:
        self.profiler.after(step, metrics)

    def on_end(self, loop: Loop, ok: bool) -> None:
        self.profiler.stop()


class Progress(Hook):
    """The rich progress bar on a terminal (``run.progress``): step/total, elapsed, ETA, and the latest
    loss, throughput and MFU."""

    def on_start(self, loop: Loop) -> None:
        self._bar = loop.out.progress(loop.start)
        self._bar.__enter__()

    def after_step(self, loop: Loop, step: int, metrics: dict) -> None:
        row = loop.result.rows[-1] if loop.result.rows else {}
        rate = f"{loop.setup.spec.unit}_per_sec"
        stats = None
        if row.get("step") == step and rate in row:
            mfu = f" | MFU {100 * row['mfu']:.1f}%" if row.get("mfu") is not None else ""
            stats = f"loss {row['loss']:.4f} | {row[rate]:,.0f} {loop.setup.spec.unit}/s{mfu}"
        loop.out.advance(step, stats)

    def on_end(self, loop: Loop, ok: bool) -> None:
        if hasattr(self, "_bar"):
            self._bar.__exit__(None, None, None)


class Sample(Hook):
    """At the end of a language model's run: ``train.sample_tokens`` tokens after ``train.sample_prompt``."""

    def __init__(self, tokenizer, bos_id: Optional[int]):
        self.tokenizer, self.bos_id = tokenizer, bos_id

    def on_end(self, loop: Loop, ok: bool) -> None:
        if not ok or loop.result.preempted:
            return
        t, tok = loop.cfg.train, self.tokenizer
        prompt = tok.encode(t.sample_prompt)
        if self.bos_id is not None:
            prompt = np.concatenate([[self.bos_id], prompt]).astype(np.int32)
        unk = getattr(tok, "unk", None)
        work = loop.begin("the sample", scale=max(1.0, t.sample_tokens / 8))
        ids = generate(loop.setup.fns.apply, loop.state["params"], prompt, t.sample_tokens, loop.cfg.data.seq_len,
                       t.sample_temperature, t.seed, banned=() if unk is None else (unk,),
                       vocab_limit=tok.vocab_size)
        work.end()
        loop.result.sample = tok.decode(ids)
        loop.out.text("sample", loop.result.sample)
