"""The hang watchdog: device work that makes no progress for too long ends the process by name.

The train loop announces each piece of device work before dispatching it (a train step, an
evaluation, a stop agreement, the sample) and hands over one of its output arrays; a thread polls
``Array.is_ready()`` on the oldest unfinished piece. Work is queued on the devices in order, so a
piece's own time starts when it was announced or when the one before it finished, whichever is
later. A piece that runs longer than its limit (``train.hang_timeout_s`` times its scale) means the
process is alive but stuck: a collective whose peers never arrive, a deadlocked runtime. JAX's own
heartbeat cannot see that case (jax-ml/jax#38503), because every process still answers.

Then the watchdog writes every thread's Python stack (:mod:`faulthandler`) to
``<run dir>/hang_stacks.process<N>.txt`` (and stderr), prints a named error and ends the process
with :data:`HANG_EXIT`; in a multi-process job it tells the others first, so they end the same way
(``jaxtrain.runtime.heartbeat.leave``). The loop's wait for a compile (the train step's, a
precompiled evaluation's or sample's) has a limit of its own, ``train.compile_timeout_s``
(null: none), timed from when the loop needs the program and named in its message. Checkpoint saves keep their own bound
(``checkpoint.save_timeout_s``): they are described (for the grace-period message of a SIGTERM)
but not limited here.

With ``train.hang_timeout_s: null`` the limit of one step is ``max(HANG_FLOOR_S, HANG_FACTOR x``
the slowest step measured so far), so no healthy step reaches it; in a multi-process job it is also
beyond the time the heartbeat takes to name a dead peer (``distributed.peer_timeout_s`` and one beat),
so a process waiting in a collective for a peer that died is told which one died, not that it hangs.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Optional

from jaxtrain.errors import HANG_EXIT
from jaxtrain.runtime import heartbeat

HANG_FLOOR_S = 300.0  # the automatic limit of one step is never below this
HANG_FACTOR = 20.0  # ... and is this many times the slowest step measured so far
HANG_MARGIN_S = 30.0  # ... and this much beyond the heartbeat's naming of a dead peer
STUCK = "a collective whose peers never arrive, or a deadlocked runtime"  # device work's likely cause


def seconds(x: float) -> str:
    """``x`` seconds for a message: whole seconds from 10 s, two significant digits below (a limit of
    0.001 s reads as such, not as 0 s)."""
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"


class Work:
    """One piece of device work the loop waits for (see :meth:`Watchdog.begin`)."""

    def __init__(self, what: str, step: int, scale: Optional[float], limit_s: Optional[float] = None,
                 cause: Optional[str] = None):
        self.what, self.step, self.scale, self.cause = what, step, scale, cause
        self.limit_s = limit_s  # a compile's own limit (train.compile_timeout_s), not scaled from a step's
        self.begun = time.monotonic()
        self.array: Any = None
        self.ended: Optional[float] = None

    def until(self, array: Any) -> Any:
        """The work is done when ``array`` (one of its outputs) is ready; returns it."""
        self.array = array
        return array

    def end(self) -> None:
        """The work is done (for work without an output array to watch)."""
        self.ended = self.ended or time.monotonic()

    def done(self) -> bool:
        if self.ended is None and self.array is not None and self.array.is_ready():
            self.ended = time.monotonic()
        return self.ended is not None

    def describe(self, now: float, since: float) -> str:
        at = f" at step {self.step}" if self.step >= 0 else ""
        return f"{self.what}{at} ({seconds(now - since)} s so far)"


class Watchdog:
    """Watches the announced device work from a daemon thread (see the module docstring).

    Args:
      limit_s: seconds one train step may take (``train.hang_timeout_s``); None: automatic.
      run_dir: where the stacks file goes.
      process: this process's index (the stacks file's name).
      on_hang: called with the error message after the stacks are written; ends the process
        (the default prints and exits :data:`HANG_EXIT`, telling a multi-process job's peers).
    """

    def __init__(self, limit_s: Optional[float], run_dir: Path, process: int = 0,
                 on_hang: Optional[Callable[[str], None]] = None, poll_s: Optional[float] = None):
        self.limit_s, self.run_dir, self.process = limit_s, Path(run_dir), process
        self.on_hang = on_hang or _exit_hung
        self.queue: deque[Work] = deque()
        self.slowest_step = 0.0  # seconds, of the steps measured so far (the first one excluded)
        self.measured = 0
        self.free_since = time.monotonic()  # when the devices last finished a piece of work
        self.lock = threading.Lock()
        self.stop = threading.Event()
        poll = poll_s if poll_s is not None else min(1.0, (limit_s or HANG_FLOOR_S) / 20)
        self.thread = threading.Thread(target=self._run, args=(poll,), name="jaxtrain-hang-watchdog", daemon=True)
        self.thread.start()

    def begin(self, what: str, step: int = -1, scale: Optional[float] = 1.0, cause: Optional[str] = None) -> Work:
        """Announces device work before it is dispatched. ``scale``: its limit in steps' limits
        (an evaluation: its batches); None: described but not limited (a save has its own bound).
        ``cause``: what being stuck there likely means, for the message (default: a collective or the
        runtime). The host's own waits in the loop's order (the next batch) are announced the same way."""
        return self._queue(Work(what, step, scale, cause=cause))

    def begin_compile(self, what: str, limit_s: Optional[float]) -> Work:
        """Announces a compile the caller waits for (``what``: "the train step's compile"); it ends
        with :meth:`Work.end`. ``limit_s``: ``train.compile_timeout_s`` (None: described, not limited)."""
        return self._queue(Work(what, -1, None, limit_s))

    def _queue(self, work: Work) -> Work:
        with self.lock:
            self.queue.append(work)
        return work

    def limit(self, scale: float) -> float:
        """The limit of work of ``scale`` steps, in seconds."""
        if self.limit_s is not None:
            return self.limit_s * scale
        floor = max(HANG_FLOOR_S, heartbeat.detection_s() + HANG_MARGIN_S)
        return max(floor, HANG_FACTOR * self.slowest_step) * scale

    def waiting_for(self) -> str:
        """What the process waits for now, in words ('' when nothing): for a SIGTERM's grace message."""
        with self.lock:
            self._retire(time.monotonic())
            if not self.queue:
                return ""
            work, now = self.queue[0], time.monotonic()
            return work.describe(now, max(work.begun, self.free_since))

    def wait_oldest(self, keep: int) -> None:
        """Blocks until at most ``keep`` pieces of work are unfinished (bounds what is in flight)."""
        while True:
            with self.lock:
                self._retire(time.monotonic())
                pending = [w for w in self.queue if w.array is not None]
                if len(self.queue) <= keep or not pending:
                    return
                oldest = pending[0].array
            oldest.block_until_ready()

    def close(self) -> None:
        self.stop.set()

    def _retire(self, now: float) -> None:
        """Pops the finished work at the head of the queue, measuring the steps."""
        while self.queue and self.queue[0].done():
            work = self.queue.popleft()
            start = max(work.begun, self.free_since)
            if work.what == "the train step" and work.scale:
                self.measured += 1
                if self.measured > 1:  # the first execution may still set things up
                    self.slowest_step = max(self.slowest_step, (work.ended - start) / work.scale)
            self.free_since = max(self.free_since, work.ended)

    def _run(self, poll: float) -> None:
        while not self.stop.wait(poll):
            with self.lock:
                now = time.monotonic()
                self._retire(now)
                if not self.queue:
                    continue
                work = self.queue[0]
                limit = work.limit_s if work.limit_s is not None or work.scale is None else self.limit(work.scale)
                since = max(work.begun, self.free_since)
                if limit is None or now - since < limit:
                    continue
            self._hung(work, now - since, limit)
            return

    def _hung(self, work: Work, waited: float, limit: float) -> None:
        path = self.run_dir / f"hang_stacks.process{self.process}.txt"
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:
                faulthandler.dump_traceback(file=f, all_threads=True)
            where = f"Every thread's Python stack is in {path}"
        except OSError as err:
            where = f"The stacks could not be written to {path} ({err}); they are on stderr"
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if work.limit_s is not None:
            self.on_hang(f"train.compile_timeout_s: {work.what} did not finish in {seconds(waited)} s (limit "
                         f"{seconds(limit)} s): the compiler is stuck, or this program needs a longer limit "
                         f"(raise train.compile_timeout_s; null: no limit). {where}. Committed checkpoints are "
                         f"intact; rerun to resume")
            return
        auto = "" if self.limit_s is not None else ", automatic: set train.hang_timeout_s to choose it"
        at = f" at step {work.step}" if work.step >= 0 else ""
        self.on_hang(f"train.hang_timeout_s: {work.what}{at} made no progress for {seconds(waited)} s "
                     f"(limit {seconds(limit)} s{auto}); the process is alive but stuck ({work.cause or STUCK}). "
                     f"{where}. Committed checkpoints are intact; rerun to resume")


def _exit_hung(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    if heartbeat.joined():  # the others stop with the same code
        heartbeat.leave(HANG_EXIT)
    os._exit(HANG_EXIT)
