"""The loop's hooks: each one concern of a run that is not the train step itself.

What each gives the others is a field of the step record (``produces``/``reads``), and the loop
(``jaxtrain.train.loop``) orders them by it: a stop request (``stop``: this step is the last), the
non-finite guard (``skipped``; it may end the run), the metrics row (``row``), evaluation
(``evaluation``), checkpointing (``committed``: it reads the stop, the skipped streak and the
evaluation, and commits before a stop), the progress bar (reads the row). The garbage collection,
the compile report and the profiler need nothing from the others; the sample comes at the end.
"""
from __future__ import annotations

import gc
import signal
import time
from typing import Any, Optional

import jax
import numpy as np

from jaxtrain.checkpoint.checkpointer import Checkpointer
from jaxtrain.errors import CheckpointError, PeerSaveError, SaveTimeoutError, StorageError
from jaxtrain.metrics import flops, memory
from jaxtrain.metrics.profile import StepProfiler
from jaxtrain.runtime import signals
from jaxtrain.runtime.agreement import StopAgreement
from jaxtrain.train.loop import Hook, Skipped, StepRecord, TrainLoop, stop_diverged
from jaxtrain.train.sample import generate


class GarbageCollection(Hook):
    """Python's automatic garbage collection is off during the loop; a young-generation collection
    (generations 0 and 1) runs after every ``train.gc_every``-th step is dispatched, so it overlaps
    the device's work. What is alive when the loop starts is frozen (``gc.freeze``) out of every
    collection until it ends. An automatic full collection can stop a process for seconds when the heap is
    large, and in a many-process run every other process waits at the next collective for it.
    ``train.gc_every: 0`` leaves Python's automatic collection on. As torchtitan's ``training.gc_freq``.
    """

    every = "train.gc_every"

    def on_start(self, loop: TrainLoop) -> None:
        self.on, self.was_enabled = bool(loop.cfg.train.gc_every), gc.isenabled()
        self.froze = False
        if self.on:
            gc.disable()
            # The objects alive now (modules, traced programs, the model's graph) live for the whole
            # run: frozen out of every later collection, not traversed once more here. A collection at
            # this point traversed ~200,000 objects in ~0.18 s of a 4 s one-step run (the command
            # runs with the collector off, so all were still young) and found ~3,000 to free.
            self.froze = gc.get_freeze_count() == 0  # someone else's frozen objects are theirs to release
            gc.freeze()

    def after_step(self, loop: TrainLoop, rec: StepRecord) -> None:
        gc.collect(1)

    def on_end(self, loop: TrainLoop, ok: bool) -> None:
        if getattr(self, "froze", False):
            gc.unfreeze()  # back to the oldest generation: a fit() called in-process leaves the collector as it was
        if getattr(self, "on", False) and self.was_enabled:
            gc.enable()


class CompileReport(Hook):
    """After compiling: the compile time, per-device memory, and what ``allow_fallback`` replicated."""

    every = 0

    def on_compile(self, loop: TrainLoop, compiled: Any, seconds: float) -> None:
        cached = " (its traced program read from the program cache)" if getattr(compiled, "loaded", False) else ""
        loop.out.info(f"compiled train step in {seconds:.1f} s{cached}")
        report = memory.state_report(loop.state, loop.setup.fns.state_shardings, compiled)
        loop.out.info(report.summary())
        memory.check_fits(report, loop.setup.devices)
        if loop.setup.rules.fallbacks:  # after tracing, so activation fallbacks are listed too
            loop.out.warn_table("sharding.allow_fallback replicated these dimensions", loop.setup.rules.fallbacks)


class StopOnSignal(Hook):
    """SIGTERM/SIGINT: the current step is the last (checkpointing saves and commits it), then the
    run ends with exit 0; ``checkpoint.grace_period_s`` bounds the wait (``jaxtrain.runtime.signals``).

    Many processes: a signal that reaches any one of them stops all of them at the same step; they
    agree every ``distributed.stop_check_every`` steps (:class:`jaxtrain.runtime.agreement.StopAgreement`),
    so the stop comes one check after the signal.

    The handlers stay in until :meth:`release` (``fit`` calls it after every hook has ended), so a
    signal during the final evaluation, save or sample lets them finish too.
    """

    produces = "stop"

    def on_start(self, loop: TrainLoop) -> None:
        self.loop = loop
        waiting_for = loop.watch.waiting_for if loop.watch is not None else None
        self.signals = signals.Preemption(loop.cfg.checkpoint.grace_period_s, waiting_for=waiting_for).__enter__()
        signals.startup_over()  # after: no moment without a handler that stops cleanly
        self.agreement = StopAgreement(loop.setup.mesh.devices) if jax.process_count() > 1 else None
        self.every = None if self.agreement is None else loop.cfg.distributed.stop_check_every
        loop.stop_poll = lambda: self.poll(loop.record.step + 1 if loop.record else loop.start, now=True)

    def poll(self, step: int, now: bool = False) -> str:
        """The signal's name if one came, else "". Many processes: a signal to any of them, as agreed
        at the previous exchange (``now``: at this one, waiting for it), so every process gets the
        same answer at the same call."""
        if self.agreement is None:
            signum = self.signals.signum
        else:
            work = self.loop.begin("the stop agreement (a collective of every process)", step)
            exchange = self.agreement.exchange_now if now else self.agreement.exchange
            signum = exchange(self.signals.signum)
            work.until(self.agreement.pending)
        return signal.Signals(signum).name if signum else ""

    def after_step(self, loop: TrainLoop, rec: StepRecord) -> str:
        if self.agreement is not None and rec.last:  # the run ends here anyway; no exchange all must match
            return ""
        return self.poll(rec.step)

    def on_end(self, loop: TrainLoop, ok: bool) -> None:
        rec = loop.record
        if hasattr(self, "signals") and ok and rec is not None and rec.stop:
            self.signals.finished()
            saved = "committed" if rec.committed == rec.step else "NOT saved"
            other = " (received by another process)" if self.signals.signum is None else ""
            loop.out.info(f"{rec.stop}{other}: stopped after step {rec.step}; checkpoint {saved}; rerun to resume")

    def release(self, ok: bool) -> None:
        """Restores the previous handlers; says so if a signal came after the last step."""
        if not hasattr(self, "signals"):
            return
        stopped = self.loop.record is not None and self.loop.record.stop
        if ok and self.signals.signum is not None and not stopped:
            self.loop.out.info(f"{self.signals.name} after the last step: the run had finished; nothing was lost")
        self.signals.__exit__(None, None, None)


class NonFiniteGuard(Hook):
    """Counts skipped (non-finite) steps; raises NonFiniteError after ``train.max_nonfinite_steps`` in a
    row, or at the end of a run whose every step was skipped.

    A step's flag is read one step late, so the host never waits on the step just dispatched; the
    final step's is read at once.
    """

    produces, reads = "skipped", ("stop",)

    def __init__(self):
        self.count, self.pending, self.last = Skipped(), None, None

    def after_step(self, loop: TrainLoop, rec: StepRecord) -> Skipped:
        if self.pending is not None:
            self._count(loop, int(self.pending), rec.step - 1)
        self.pending = rec.metrics["nonfinite"]
        if rec.final:
            self._count(loop, int(self.pending), rec.step)
            self.pending = None
        self.last = rec.step
        return self.count

    def on_end(self, loop: TrainLoop, ok: bool) -> None:
        """A run that trained nothing at all failed (after its rows and final save are written)."""
        last = self.last if self.last is not None else loop.start
        stopped = loop.record is not None and loop.record.stop
        if ok and not stopped and last > loop.start and self.count.total == last - loop.start:
            stop_diverged(loop.ckpt, f"every step of this run ({loop.start + 1}..{last}) had a non-finite "
                                     f"loss or gradient and was skipped")

    def _count(self, loop: TrainLoop, flag: int, step: int) -> None:
        c = self.count
        self.count = Skipped(c.total + bool(flag), c.streak + 1 if flag else 0, step)
        limit = loop.cfg.train.max_nonfinite_steps
        if flag and self.count.streak >= limit:
            n = self.count.streak
            stop_diverged(loop.ckpt, f"train.max_nonfinite_steps: {n} steps in a row (steps {step - n + 1}..{step}) "
                                     f"had a non-finite loss or gradient and were skipped")


class LogMetrics(Hook):
    """Every ``train.log_every`` steps (and the final one): one train row, the loop's only host sync.

    ``step_time_s`` is the mean wall time per training step since the previous row was measured
    (writing that row counts, as printing does in nanoGPT's per-iteration ``dt``), leaving out
    what the loop did besides training (evaluations, checkpoint saves: reported as their own
    ``eval_time_s`` and ``checkpoint_block_s``) and the compile (``compile_s``, on the first row);
    waiting for batches is part of it and shown as ``data_wait_s``, seconds per step.
    ``<unit>_per_sec`` and ``mfu`` follow from ``step_time_s`` (``jaxtrain.metrics.flops``).
    """

    every, at, produces, reads = "train.log_every", "final", "row", ("skipped", "stop")

    def __init__(self, peak: Optional[float]):
        self.peak, self.t_last, self.s_last, self.first = peak, time.perf_counter(), 0, True
        self.waited, self.paused, self.blocked = 0.0, 0.0, 0.0  # the loop's totals at the previous row

    def on_start(self, loop: TrainLoop) -> None:
        self.s_last = loop.start

    def on_compile(self, loop: TrainLoop, compiled: Any, seconds: float) -> None:
        self.t_last = time.perf_counter()  # the first batch's wait stays in: it belongs to step 1

    def after_step(self, loop: TrainLoop, rec: StepRecord) -> dict:
        m = jax.device_get(rec.metrics)
        now, paused = time.perf_counter(), sum(loop.paused.values())
        model_spec, t, n = loop.setup.model_spec, loop.cfg.train, rec.step - self.s_last
        dt = (now - self.t_last - (paused - self.paused)) / n
        rate = t.global_batch * model_spec.units_per_example / dt
        uncounted = int(m["nonfinite"]) if rec.skipped.through < rec.step else 0  # read one step late
        row = {"loss": float(m.pop("loss")), "lr": float(m.pop("lr")), "grad_norm": float(m.pop("grad_norm")),
               f"{model_spec.unit}_per_sec": rate, "step_time_s": dt,
               "mfu": flops.mfu(rate, model_spec.flops_per_unit, self.peak),
               "nonfinite_steps": rec.skipped.total + uncounted, "data_wait_s": (loop.data_wait_s - self.waited) / n,
               "checkpoint_block_s": loop.paused.get("checkpoint", 0.0) - self.blocked}
        if self.first:
            row["compile_s"], self.first = loop.result.compile_s, False
        m.pop("nonfinite")
        row.update({k: float(v) for k, v in m.items()})  # the loss's own metrics (aux)
        loop.write(rec.step, row)
        self.t_last, self.s_last = now, rec.step  # writing this row is the next rows' time, as in nanoGPT's dt
        self.waited, self.paused, self.blocked = loop.data_wait_s, paused, loop.paused.get("checkpoint", 0.0)
        return row


class Evaluate(Hook):
    """Every ``train.eval_every`` steps and at ``train.steps``; at the end, the final validation loss.
    Not at a step a stop signal ends the run at: the grace period is the save's. A stop that comes
    during an evaluation abandons it between two of its pieces (:meth:`TrainLoop.evaluate`), and the
    step is saved as the run's final one."""

    every, at, produces, reads = "train.eval_every", "last", "evaluation", ("stop",)

    def after_step(self, loop: TrainLoop, rec: StepRecord) -> Optional[dict]:
        return None if rec.stop else loop.evaluate(rec.step)

    def on_end(self, loop: TrainLoop, ok: bool) -> None:
        if not ok or (loop.record is not None and loop.record.stop):
            return
        last = loop.last_eval or loop.evaluate(loop.start, record=False)  # nothing trained: evaluate as is
        loop.result.val_loss = last["val_loss"]
        batches = f"{loop.n_val} batch" + ("es" if loop.n_val != 1 else "")
        loop.out.info(f"validation loss {loop.result.val_loss:.4f} (mean over {batches})")


class Checkpointing(Hook):
    """Saves when due (``checkpoint.every``, ``every_seconds``, the last step, a stop request);
    commits finished saves; keeps the best K by an eval metric (evaluating first if needed).
    Produces, at a stop, the latest committed step once the final save committed (listing the store
    every step would cost a request per step on S3 or GCS)."""

    produces, reads, pauses = "committed", ("stop", "skipped", "evaluation"), "checkpoint"

    def __init__(self, ckpt: Checkpointer):
        self.ckpt = ckpt

    def on_start(self, loop: TrainLoop) -> None:
        loop.while_evaluating.append(self.save_last_early)

    def save_last_early(self, loop: TrainLoop, step: int) -> None:
        """Starts the last step's save while its evaluation runs (the state is final; the marker gets
        the evaluation's metrics before it is committed), so the two overlap: a one-step shakespeare
        run spent ~0.2 s after the evaluation waiting for Orbax. Async saves only (a synchronous
        save commits at once); a save the evaluation finds diverged is abandoned (``stop_diverged``)."""
        ckpt = self.ckpt
        last = step == loop.cfg.train.steps and step > loop.start  # trained here (not a resumed final step)
        if last and ckpt.options.async_save and ckpt.due(step, final=True):
            t0 = time.perf_counter()
            jax.block_until_ready(loop.state)
            ckpt.save(step, loop.state, loop.batches.get_state())
            loop.paused["checkpoint"] = loop.paused.get("checkpoint", 0.0) + time.perf_counter() - t0

    def after_step(self, loop: TrainLoop, rec: StepRecord) -> Optional[int]:
        ckpt = self.ckpt
        # During a run of skipped steps the params do not change: a periodic save would only rotate
        # older (good) checkpoints away.
        due = ckpt.due(rec.step, final=rec.last) and (rec.last or not rec.skipped.streak)
        evaluation = rec.evaluation
        if evaluation is None and loop.cfg.checkpoint.keep_best and not rec.stop and (due or ckpt.started(rec.step)):
            evaluation = loop.evaluate(rec.step)  # best-K needs this step's metric (kept as the newest)
        stop = rec.stop or loop.interrupted  # that evaluation may have been cut short by a stop
        if stop or due or ckpt.started(rec.step):
            metrics = {k: v for k, v in (evaluation or {}).items() if k != "eval_time_s"}
            if ckpt.started(rec.step):  # started while the step was evaluated
                ckpt.set_metrics(rec.step, metrics)
            else:
                jax.block_until_ready(loop.state)  # the steps in flight are training time, not the save's
                ckpt.save(rec.step, loop.state, loop.batches.get_state(), metrics)
        ckpt.poll()
        if not stop:
            return None
        work = loop.begin("the checkpoint save to commit", rec.step, scale=None)  # bounded by save_timeout_s
        ckpt.wait()  # the save commits before the process exits
        work.end()
        return ckpt.latest_step()

    def on_end(self, loop: TrainLoop, ok: bool) -> None:
        if ok:
            self.ckpt.close()
        elif commits_after(loop.failure):
            # A run that failed elsewhere (an evaluation, a hook) still commits the save it had started,
            # as a diverged one does: bounded by checkpoint.save_timeout_s; the failure is what is raised.
            self.ckpt.wait()


def commits_after(failure: Optional[BaseException]) -> bool:
    """Whether a run ended by ``failure`` waits for its checkpoint save in flight: an ordinary error in one
    process, not the checkpointer's own (a save that failed or timed out), a forced stop (KeyboardInterrupt)
    or one of many processes (whose peers may not be there to agree on the commit)."""
    return (isinstance(failure, Exception) and not isinstance(failure, (CheckpointError, SaveTimeoutError,
                                                                         StorageError, PeerSaveError))
            and jax.process_count() == 1)


class Profile(Hook):
    """``profile.start_step`` / ``profile.steps``: a jax.profiler trace of those steps in the run dir."""

    def __init__(self, profiler: StepProfiler):
        self.profiler = profiler

    def before_step(self, loop: TrainLoop, step: int) -> None:
        self.profiler.before(step)

    def after_step(self, loop: TrainLoop, rec: StepRecord) -> None:
        self.profiler.after(rec.step, rec.metrics)

    def on_end(self, loop: TrainLoop, ok: bool) -> None:
        self.profiler.stop()


class Progress(Hook):
    """The rich progress bar on a terminal (``run.progress``): step/total, elapsed, ETA, and the latest
    loss, throughput and MFU."""

    reads = ("row",)

    def on_start(self, loop: TrainLoop) -> None:
        self._bar = loop.out.progress(loop.start)
        self._bar.__enter__()

    def after_step(self, loop: TrainLoop, rec: StepRecord) -> None:
        unit, row, stats = loop.setup.model_spec.unit, rec.row, None
        if row is not None:
            mfu = f" | MFU {100 * row['mfu']:.1f}%" if row.get("mfu") is not None else ""
            stats = f"loss {row['loss']:.4f} | {row[f'{unit}_per_sec']:,.0f} {unit}/s{mfu}"
        loop.out.advance(rec.step, stats)

    def on_end(self, loop: TrainLoop, ok: bool) -> None:
        if hasattr(self, "_bar"):
            self._bar.__exit__(None, None, None)


class Sample(Hook):
    """At the end of a language model's run: ``train.sample_tokens`` tokens after ``train.sample_prompt``."""

    every = 0

    def __init__(self, tokenizer, bos_id: Optional[int]):
        self.tokenizer, self.bos_id = tokenizer, bos_id

    def on_end(self, loop: TrainLoop, ok: bool) -> None:
        t, tok = loop.cfg.train, self.tokenizer
        if not ok or (loop.record is not None and loop.record.stop) or t.sample_tokens <= 0:
            return  # train.sample_tokens=0 asks for no sample: nothing is printed
        prompt = tok.encode(t.sample_prompt)
        if self.bos_id is not None:
            prompt = np.concatenate([[self.bos_id], prompt]).astype(np.int32)
        unk = getattr(tok, "unk", None)
        if loop.precompiled is not None:
            with loop.compiling("the sample's compile"):
                loop.precompiled.wait("sample")
        work = loop.begin("the sample", scale=max(1.0, t.sample_tokens / 8))
        ids = generate(loop.setup.fns.apply, loop.state["params"], prompt, t.sample_tokens, loop.cfg.data.seq_len,
                       t.sample_temperature, t.seed, banned=() if unk is None else (unk,),
                       vocab_limit=tok.vocab_size)
        work.end()
        loop.result.sample = tok.decode(ids)
        loop.out.text("sample", loop.result.sample)
