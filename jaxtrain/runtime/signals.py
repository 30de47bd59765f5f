"""Preemption: SIGTERM/SIGINT ask the train loop to stop after the current step.

The handler only sets a flag; the loop finishes the step it is on, saves a
checkpoint, waits for it to commit and returns, so the process exits 0. A
watchdog started by the first signal ends the process (exit code
:data:`GRACE_EXPIRED_EXIT`) if that has not happened within the grace
period, so a scheduler's SIGKILL never lands on a half-written save that we
believed would finish. A second SIGINT (Ctrl-C twice) raises
KeyboardInterrupt at once. Committed checkpoints are never affected: an
interrupted save has no commit marker and is ignored on restart.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Callable, Optional

from jaxtrain.errors import GRACE_EXIT, StartupInterrupted
from jaxtrain.runtime import heartbeat

GRACE_EXPIRED_EXIT = GRACE_EXIT  # 75, EX_TEMPFAIL: the job may be retried


class _Wakeup:
    """Hears SIGTERM/SIGINT even while the main thread is blocked in native code (a device program
    that never finishes, a collective whose peers never arrive), where Python's own handler would
    not run until that call returns: Python's C-level handler writes each signal's number into a
    wakeup pipe (:func:`signal.set_wakeup_fd`), and a daemon thread reads it and calls the newest
    registered callback. One pipe and thread per process; the previous wakeup fd (an event loop's)
    is put back when the last user leaves. Main thread only (where handlers are installed)."""

    def __init__(self):
        self.users: list = []
        self.read_fd = self.write_fd = self.previous = None
        self.lock = threading.Lock()

    def push(self, callback: Callable[[int], None]) -> bool:
        if threading.current_thread() is not threading.main_thread():
            return False
        with self.lock:
            if self.read_fd is None:
                self.read_fd, self.write_fd = os.pipe()
                os.set_blocking(self.write_fd, False)
                threading.Thread(target=self._run, name="jaxtrain-signal-listener", daemon=True).start()
            if not self.users:
                self.previous = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
            self.users.append(callback)
        return True

    def pop(self, callback: Callable[[int], None]) -> None:
        with self.lock:
            if callback not in self.users:
                return
            self.users.remove(callback)
            if not self.users and threading.current_thread() is threading.main_thread():
                signal.set_wakeup_fd(self.previous)

    def _run(self) -> None:
        while True:
            data = os.read(self.read_fd, 64)
            with self.lock:
                callback = self.users[-1] if self.users else None
            for signum in data:
                if callback is not None and signum in (signal.SIGTERM, signal.SIGINT):
                    callback(signum)


_wakeup = _Wakeup()


class Preemption:
    """Context manager installing the handlers (main thread only; elsewhere it never fires).

    Args:
      grace_period_s: from the first signal to exit :data:`GRACE_EXPIRED_EXIT` unless
        :meth:`finished` (or the context's end) comes first.
      waiting_for: says what the process waits for now (e.g. the hang watchdog's
        ``waiting_for``), for the message when the grace period expires.
    """

    def __init__(self, grace_period_s: float = 30.0, signals=(signal.SIGTERM, signal.SIGINT),
                 waiting_for: Optional[Callable[[], str]] = None):
        self.grace_period_s = grace_period_s
        self.signals = tuple(signals)
        self.waiting_for = waiting_for or (lambda: "")
        self.signum: Optional[int] = None
        self.received_at: Optional[float] = None
        self._previous: dict = {}
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._sigints = 0  # handled by Python's handler (on the main thread)

    def __enter__(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
            _wakeup.push(self._arm)
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        _wakeup.pop(self._arm)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            self._sigints += 1
            if self._sigints > 1:  # Ctrl-C twice
                raise KeyboardInterrupt
        self._arm(signum)

    def _arm(self, signum: int) -> None:
        """The first signal: remember it and start the grace timer (from either thread; once)."""
        with self._lock:
            if self.signum is not None:
                return
            self.signum, self.received_at = signum, time.monotonic()
        threading.Thread(target=self._watchdog, name="jaxtrain-preempt-watchdog", daemon=True).start()

    def _watchdog(self) -> None:
        if self._done.wait(self.grace_period_s):
            return
        waiting = self.waiting_for()
        waiting = f"; it was waiting for {waiting}" if waiting else ""
        print(f"error: checkpoint.grace_period_s={self.grace_period_s:g} s passed after "
              f"{signal.Signals(self.signum).name} before the checkpoint committed{waiting}; exiting "
              f"(the latest committed checkpoint is intact)", file=sys.stderr, flush=True)
        sys.stdout.flush()
        if heartbeat.joined():  # the other processes end the same way
            heartbeat.leave(GRACE_EXPIRED_EXIT)
        os._exit(GRACE_EXPIRED_EXIT)

    @property
    def requested(self) -> bool:
        """True once a signal arrived in this process (many processes agree through
        :class:`jaxtrain.runtime.agreement.StopAgreement`)."""
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def finished(self) -> None:
        """The save committed: stop the watchdog."""
        self._done.set()


STARTUP_EXIT_AFTER_S = 3.0  # a phase that runs on (compiling, a large read) is not waited for longer
_startup: dict = {"armed": False, "signum": None, "over": threading.Event(), "lock": threading.Lock()}


def report_startup_stop(stop: StartupInterrupted) -> int:
    """Says that nothing was trained (stderr) and returns the exit code: 0, a clean stop."""
    print(f"{stop.name} before the first training step: nothing was trained, so nothing was saved; "
          f"rerun the same command to continue", file=sys.stderr, flush=True)
    return 0


def during_startup() -> None:
    """Installs the start-up handlers (main thread only), first thing in the command line.

    Until the train loop installs its own (:class:`Preemption`, then :func:`startup_over`), a
    SIGTERM/SIGINT only records itself; the start-up stops at its next phase boundary
    (:func:`check_startup`: after the imports, the config, the data, the restore), or, if a phase
    (a compile, a long read) runs on for :data:`STARTUP_EXIT_AFTER_S`, the process exits 0 from a
    watchdog: nothing has been trained or saved, and what start-up writes survives a kill.
    """
    if threading.current_thread() is threading.main_thread():
        _startup["armed"] = True  # first: a signal right after signal.signal() must find it armed
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _on_startup_signal)
        _wakeup.push(_startup_arm)  # also heard while a native call (an import, a join) blocks


def check_startup() -> None:
    """A phase boundary of the start-up: raises StartupInterrupted if a signal has arrived."""
    if _startup["armed"] and _startup["signum"] is not None:
        _startup["armed"] = False
        _startup["over"].set()
        _wakeup.pop(_startup_arm)
        raise StartupInterrupted(_startup["signum"])


def startup_over() -> None:
    """The loop handles signals now (:class:`Preemption`). One that came in between still stops the
    run before its first step (raises StartupInterrupted)."""
    check_startup()
    _startup["armed"] = False
    _startup["over"].set()
    _wakeup.pop(_startup_arm)


def _on_startup_signal(signum, frame) -> None:
    if not _startup["armed"]:  # after the loop: what the default handler's status says, but unwinding
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)
    _startup_arm(signum)


def _startup_arm(signum: int) -> None:
    """The first signal of the start-up (from the handler or the wakeup thread; once)."""
    with _startup["lock"]:
        if not _startup["armed"] or _startup["signum"] is not None:
            return
        _startup["signum"] = signum
    threading.Thread(target=_exit_if_still_starting, args=(signum,), name="jaxtrain-startup-stop",
                     daemon=True).start()


def _exit_if_still_starting(signum: int) -> None:
    if not _startup["over"].wait(STARTUP_EXIT_AFTER_S):
        code = report_startup_stop(StartupInterrupted(signum))
        if heartbeat.joined():  # a multi-process run: its peers are told
            heartbeat.leave(code)
        os._exit(code)
