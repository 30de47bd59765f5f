"""The processes of a job watch each other: a heartbeat through the coordination service, one
exit code for all when one leaves or dies, and one voice (process 0 writes output).

Every process bumps a counter in the coordinator's key-value store; one that stays still for
``distributed.peer_timeout_s`` ends the others with :data:`jaxtrain.errors.PEER_EXIT` and a line
naming it (:class:`Heartbeat`). A process that ends early (:func:`leave`) tells the others first.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
import time
from typing import Callable, Optional

from jaxtrain import errors
from jaxtrain.errors import PEER_EXIT, InputError, JaxtrainError
from jaxtrain.runtime import outlive

EXIT_CODE = PEER_EXIT
log = logging.getLogger("jaxtrain")


def _every(seconds: float, stop: threading.Event, tick: Callable[[float], bool], name: str) -> threading.Thread:
    """A daemon thread calling ``tick(elapsed)`` every ``seconds`` until ``stop`` is set or tick is False."""
    def run() -> None:
        t0 = time.monotonic()
        while not stop.wait(seconds):
            if not tick(time.monotonic() - t0):
                return
    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def die(message: str, code: int = EXIT_CODE) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    if _heartbeat["current"] is not None:  # joined: tell the others
        leave(code)
    os._exit(code)


class Heartbeat:
    """Every process bumps a counter in the coordinator's key-value store. Process 0 watches every
    counter, the others watch process 0's: one that stays still for ``distributed.peer_timeout_s``
    (killed, out of memory, a lost node), or a coordinator that stops answering, ends this process
    with :data:`EXIT_CODE` and a line naming it, and the others hear of it (:func:`leave`). A process
    that finished marks itself done first, so its silence is not taken for a death; one that left
    (:func:`leave`) ends the others with its exit code.
    """

    def __init__(self, peer_timeout_s: float):
        from jax._src import distributed as jd
        state = jd.global_state
        self.client, self.pid, self.n = state.client, state.process_id, state.num_processes
        self.timeout, self.count, self.looks, self.stop = peer_timeout_s, 0, 0, threading.Event()
        self.seen: dict[int, tuple[str, float]] = {}
        self.failing_since: Optional[float] = None
        self.ended = False  # the run ended normally; a process other than 0 says so last (end_run, last_word)
        self.interval = max(0.5, min(5.0, peer_timeout_s / 6))
        outlive.announce(self.client, self.pid)  # where process 0 can watch this one end (end_run, leave)
        # It beats once an interval and looks twice: a dead peer's last beat is seen at most half an interval
        # late and its silence checked every half, so it is named within peer_timeout_s and one interval
        # of its death (looking once an interval took up to two, and the hang watchdog's floor came first).
        self.thread = _every(self.interval / 2, self.stop, self._tick, "jaxtrain-heartbeat")

    def _tick(self, elapsed: float) -> bool:
        now = time.monotonic()
        try:
            self.looks += 1
            if self.looks % 2:
                self.count += 1
                self.client.key_value_set(f"jaxtrain/alive/{self.pid}", str(self.count), allow_overwrite=True)
            # Process 0 watches everyone, the others watch process 0 (which then tells them): O(N) reads.
            if self.pid == 0:
                alive = dict(self.client.key_value_dir_get("jaxtrain/alive/"))
            else:
                alive = {"jaxtrain/alive/0": self._try_get("jaxtrain/alive/0")}
            done = {k.rsplit("/", 1)[-1] for k, _ in self.client.key_value_dir_get("jaxtrain/done/")}
            left = {int(k.rsplit("/", 1)[-1]): v for k, v in self.client.key_value_dir_get("jaxtrain/exit/")}
            self.failing_since = None
        except Exception as err:  # noqa: BLE001 - the coordinator (process 0) is gone or unreachable
            if self.stop.is_set():
                return False
            self.failing_since = self.failing_since or now
            if now - self.failing_since >= self.timeout:
                die(f"distributed.peer_timeout_s: the coordinator (process 0) has not answered for "
                     f"{now - self.failing_since:.0f} s ({type(err).__name__}); it died or its node was lost. "
                     f"Stopping process {self.pid} too; committed checkpoints are intact, rerun to resume")
            return True
        for p, code in sorted(left.items()):
            if p != self.pid and not self.stop.is_set():
                self._peer_left(p, int(code))
        for p in (range(self.n) if self.pid == 0 else [0]):
            value = alive.get(f"jaxtrain/alive/{p}", "")
            if p == self.pid or str(p) in done:
                continue
            if self.seen.get(p, (None,))[0] != value:
                self.seen[p] = (value, now)
            elif now - self.seen[p][1] >= self.timeout and not self.stop.is_set():
                die(f"distributed.peer_timeout_s: process {p} of {self.n} sent no heartbeat for "
                     f"{now - self.seen[p][1]:.0f} s; it died or hangs (killed, out of memory, a lost node). "
                     f"Stopping process {self.pid} too; committed checkpoints are intact, rerun to resume")
        return True

    def _try_get(self, key: str) -> str:
        try:
            return self.client.key_value_try_get(key)
        except Exception as err:  # noqa: BLE001 - not written yet (NOT_FOUND); anything else is re-raised
            if "NOT_FOUND" in str(err) or "not found" in str(err).lower():
                return ""
            raise

    def _peer_left(self, p: int, code: int) -> None:
        """Process ``p`` ended early (:func:`leave`): the others cannot go on without it."""
        self.stop.set()
        if code == 0:  # a signal before the first step: nothing was trained anywhere
            print(f"process {p} of {self.n} stopped on a signal before the first training step; stopping process "
                  f"{self.pid} too: nothing was trained, so nothing was saved; rerun to continue",
                  file=sys.stderr, flush=True)
            leave(0)
        die(f"process {p} of {self.n} ended with exit code {code} (its own log says why); stopping process "
             f"{self.pid} too with the same code; committed checkpoints are intact", code)

    def finished(self) -> None:
        """This process is done: peers stop watching it, and it stops watching them."""
        if self.stop.is_set():
            return
        self.stop.set()
        try:
            self.client.key_value_set(f"jaxtrain/done/{self.pid}", "1", allow_overwrite=True)
        except Exception:  # noqa: BLE001 - the job is ending anyway
            pass


_heartbeat: dict = {"current": None}


def joined() -> bool:
    """This process is part of a multi-process run (joined, with its :class:`Heartbeat` running)."""
    return _heartbeat["current"] is not None


def finished() -> None:
    """The run ended normally on this process (see :meth:`Heartbeat.finished`)."""
    if _heartbeat["current"] is not None:
        _heartbeat["current"].finished()


def in_job() -> bool:
    """Whether this process is one of a multi-process job's (its heartbeat started)."""
    return _heartbeat["current"] is not None


def detection_s() -> float:
    """The longest a dead peer goes unnamed in this job: ``distributed.peer_timeout_s`` and one beat (its last
    beat is seen up to half a beat late, and the silence is checked twice a beat); 0 outside a job."""
    beat = _heartbeat["current"]
    return 0.0 if beat is None else beat.timeout + beat.interval


def end_run() -> None:
    """A multi-process run that ended normally. Process 0 hosts the coordination service, and JAX's
    client aborts a process that is still alive when the service goes (``Terminating process because
    the JAX distributed service detected fatal errors``, signal 6), although its run ended. So the
    others say they are done only as the last act of their exit (:func:`last_word`, after their exit
    handlers), and process 0 says it at once, then waits (at most ``distributed.peer_timeout_s``)
    until every other process has said it, and until those have ended
    (:func:`jaxtrain.runtime.outlive.outlive`). When the others said it here, before their exit
    handlers, process 0 could end first: a 2-process test aborted with -6 that way on 2 cores.
    JAX's own shutdown barrier at exit is skipped: a peer that dies after the run's last save would
    abort the others inside it (``Shutdown barrier has failed``), although nothing was lost."""
    beat = _heartbeat["current"]
    if beat is None:
        return
    if beat.pid != 0:
        beat.ended = True  # its word waits for last_word()
    else:
        beat.finished()
        end = time.monotonic() + beat.timeout
        missing = []
        for p in range(1, beat.n):
            try:
                beat.client.blocking_key_value_get(f"jaxtrain/done/{p}", max(1, int(1000 * (end - time.monotonic()))))
            except Exception:  # noqa: BLE001 - not done in time: said below; the run's work is committed
                missing.append(p)
        if missing:
            print(f"warning: process(es) {', '.join(map(str, missing))} of {beat.n} did not reach the end of the run "
                  f"within distributed.peer_timeout_s={beat.timeout:g} s after this one (their own logs say why)",
                  file=sys.stderr, flush=True)
        outlive.outlive(beat.client, [p for p in range(1, beat.n) if p not in missing])
    from jax._src import api
    atexit.unregister(api.clean_up)  # its distributed.shutdown() is the barrier; the process ends next anyway


def last_word() -> None:
    """The last act of a process other than 0 whose run ended normally (:func:`end_run`), called by
    ``jaxtrain.cli.common.exit_now`` after the exit handlers and the flush, just before ``os._exit``:
    it says it is done, which lets process 0, and the coordination service with it, end."""
    beat = _heartbeat["current"]
    if beat is not None and beat.ended:
        beat.finished()


def leave(code: int) -> None:
    """Ends a multi-process run's process at once with ``code`` (a normal exit would wait in
    ``jax.distributed``'s shutdown barrier for peers that may be stuck in a collective).

    It first tells the others (a key in the coordinator's store): their :class:`Heartbeat` ends them
    with the same code. Process 0 hosts the coordination service, whose end aborts every other
    process, so it waits until the others have left: a heartbeat interval and 5 s for a peer whose
    heartbeat is silent, and up to ``distributed.peer_timeout_s`` (60 s at most) for one still beating
    (on two loaded cores a live peer took longer than 5 s to hear of it, and was aborted), and then
    until the ones that said it have ended (:func:`jaxtrain.runtime.outlive.outlive`).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    from jax._src import distributed as jd  # not jax.process_index(): from a thread it may init a backend
    state = jd.global_state
    client, pid = state.client, state.process_id
    try:
        client.key_value_set(f"jaxtrain/exit/{pid}", str(code), allow_overwrite=True)
    except Exception:  # noqa: BLE001 - leaving anyway
        os._exit(code)
    if pid == 0:
        beat = _heartbeat["current"]
        start, said = time.monotonic(), []
        interval = beat.interval if beat is not None else 5.0
        short = start + 5.0 + interval
        for p in range(1, state.num_processes):
            last_beat = beat.seen.get(p, (None, start))[1] if beat is not None else start
            beating = beat is not None and start - last_beat < 2 * interval
            end = max(short, start + min(beat.timeout, 60.0)) if beating else short
            wait_ms = int(1000 * (end - time.monotonic()))
            if wait_ms <= 0:
                continue
            try:
                client.blocking_key_value_get(f"jaxtrain/exit/{p}", wait_ms)
                said.append(p)
            except Exception:  # noqa: BLE001 - not in time, or the store is gone: leaving anyway
                pass
        outlive.outlive(client, said)  # a peer between its word and its os._exit would be aborted
    os._exit(code)


def after_failure(err: BaseException) -> None:
    """After an unexpected error in a multi-process run: if a peer left (:func:`leave`) or died, end
    the way that asks for, by name (a collective then fails with a connection error; the heartbeat
    decides within ``distributed.peer_timeout_s``). Returns for an error of this process's own."""
    beat = _heartbeat["current"]
    if beat is None:
        return
    from jax.errors import JaxRuntimeError
    deadline = time.monotonic() + (beat.timeout + 2 * beat.interval if isinstance(err, JaxRuntimeError) else 0)
    while True:
        try:
            left = {int(k.rsplit("/", 1)[-1]): int(v) for k, v in beat.client.key_value_dir_get("jaxtrain/exit/")}
        except Exception:  # noqa: BLE001 - the coordinator is gone: the heartbeat reports it
            left = {}
        left.pop(beat.pid, None)
        if left:
            beat._peer_left(*min(left.items()))
        if time.monotonic() >= deadline:
            return
        time.sleep(beat.interval)  # a runtime error: a dead peer's silence ends this process meanwhile


def is_primary() -> bool:
    """Process 0: the one that writes console output, metrics and run files."""
    import jax
    return jax.process_index() == 0


def primary_first(name: str, fn: Callable[[], object], others: Callable[[], object] = lambda: None):
    """Runs ``fn`` on process 0 while the others wait, then ``others`` on them: a named error ``fn``
    raises is raised on every process (same class, same message), so no process goes on into a
    collective alone. Single-process: just ``fn()``."""
    import jax
    if jax.process_count() == 1:
        return fn()
    from jax._src import distributed as jd
    client, key = jd.global_state.client, f"jaxtrain/first/{name}"
    if is_primary():
        try:
            result = fn()
        except JaxtrainError as err:
            client.key_value_set(key, json.dumps({"error": str(err), "cls": type(err).__name__}))
            raise
        client.key_value_set(key, json.dumps({"ok": True}))
        return result
    outcome = json.loads(client.blocking_key_value_get(key, 24 * 3600 * 1000))
    if "error" in outcome:
        raise _same_error(outcome["cls"], outcome["error"])
    return others()


def _same_error(cls_name: str, message: str) -> JaxtrainError:
    """The named error class ``cls_name`` of :mod:`jaxtrain.errors` (else InputError) with ``message``."""
    cls = getattr(errors, cls_name, None)
    ok = isinstance(cls, type) and issubclass(cls, JaxtrainError)
    return (cls if ok else InputError)(message)
