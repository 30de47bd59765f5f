"""Multi-process start-up: which processes form the job, ``jax.distributed`` with named timeouts,
and a heartbeat that ends every process when one dies.

Where the job's shape comes from, first match wins (:func:`detect`):

1. the ``distributed.*`` config keys (each overrides the same value from the environment);
2. ``JAXTRAIN_COORDINATOR_ADDRESS`` + ``JAXTRAIN_NUM_PROCESSES`` + ``JAXTRAIN_PROCESS_ID`` (or an
   Indexed Job's ``JOB_COMPLETION_INDEX``): what ``jaxtrain.launch gke`` puts in the JobSet;
3. Vertex AI's ``CLUSTER_SPEC`` (the chief pool ``workerpool0`` is process 0, its first host the
   coordinator; the workers of ``workerpool1`` follow);
4. a SLURM step with several tasks (``srun``) or a multi-host TPU slice: JAX's own cluster detection.

JAX's own timeouts end a process with a C++ abort and a stack trace; here a watchdog thread says
what it waited for and ends the process first, with :data:`EXIT_CODE`.
"""
from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from jaxtrain.errors import InputError, JaxtrainError

EXIT_CODE = 5  # a peer did not join in time, or stopped answering
_ADDRESS = re.compile(r"^\[?[A-Za-z0-9_.:-]+\]?:(\d{1,5})$")
log = logging.getLogger("jaxtrain")


@dataclass(frozen=True)
class Plan:
    """How this process joins the job. ``coordinator`` etc. None: JAX's own detection fills them in."""

    source: str  # where the shape came from, for the log line
    coordinator: Optional[str] = None
    num_processes: Optional[int] = None
    process_id: Optional[int] = None


def _int(name: str, value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise InputError(f"{name}: expected an integer, got {value!r}") from None


def _vertex(spec_text: str) -> tuple[str, int, int]:
    """(coordinator, processes, this process) from Vertex AI's ``CLUSTER_SPEC`` JSON."""
    try:
        spec = json.loads(spec_text)
        cluster, task = spec["cluster"], spec["task"]
        pools = [cluster[k] for k in sorted(cluster) if k.startswith("workerpool")]
        order = sorted(k for k in cluster if k.startswith("workerpool"))
        offset = sum(len(cluster[k]) for k in order[:order.index(task["type"])])
        return pools[0][0], sum(len(p) for p in pools), offset + int(task["index"])
    except (ValueError, KeyError, IndexError, TypeError) as err:
        raise InputError(f"CLUSTER_SPEC: not a Vertex AI cluster spec ({type(err).__name__}: {err})") from None


def detect(d, env: Mapping[str, str] = os.environ) -> Optional[Plan]:
    """This process's :class:`Plan`, or None for a single-process run.

    Args:
      d: the ``distributed`` config section (:class:`jaxtrain.config.schema.DistributedConfig`).

    Raises:
      InputError: a malformed value (naming the key or environment variable), or a process id
        outside ``[0, num_processes)``.
    """
    if d.mode == "off":
        return None
    coord, num, pid, source = None, None, None, ""
    if env.get("JAXTRAIN_COORDINATOR_ADDRESS") or env.get("JAXTRAIN_NUM_PROCESSES"):
        coord, source = env.get("JAXTRAIN_COORDINATOR_ADDRESS"), "JAXTRAIN_* environment"
        num = _int("JAXTRAIN_NUM_PROCESSES", env.get("JAXTRAIN_NUM_PROCESSES"))
        pid_var = "JAXTRAIN_PROCESS_ID" if "JAXTRAIN_PROCESS_ID" in env else "JOB_COMPLETION_INDEX"
        pid = _int(pid_var, env.get(pid_var)) if pid_var in env else None
    elif env.get("CLUSTER_SPEC"):
        (coord, num, pid), source = _vertex(env["CLUSTER_SPEC"]), "Vertex AI CLUSTER_SPEC"
    if d.coordinator_address or d.num_processes or d.process_id is not None:
        source = "distributed.* config keys"
    coord = d.coordinator_address or coord
    num = d.num_processes if d.num_processes is not None else num
    pid = d.process_id if d.process_id is not None else pid
    if source:
        for key, value in (("coordinator_address", coord), ("num_processes", num), ("process_id", pid)):
            if value is None:
                raise InputError(f"distributed.{key}: not set (the job's other values came from {source})")
        port = _ADDRESS.match(coord)
        if not port or not 1 <= int(port.group(1)) <= 65535:
            raise InputError(f"distributed.coordinator_address: expected host:port (port 1..65535), got {coord!r}")
        if num < 1 or not 0 <= pid < num:
            raise InputError(f"distributed.process_id: {pid} is not in [0, {num}) "
                             f"(distributed.num_processes={num}; from {source})")
        return Plan(source, coord, num, pid) if num > 1 or d.mode == "on" else None
    slurm_tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
    if env.get("SLURM_STEP_NODELIST") and slurm_tasks and _int("SLURM_STEP_NUM_TASKS", slurm_tasks) > 1:
        return Plan("SLURM (srun)")
    if "," in env.get("TPU_WORKER_HOSTNAMES", "") or env.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return Plan("TPU pod")
    return Plan("jax.distributed auto-detection") if d.mode == "on" else None


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


def _die(message: str, code: int = EXIT_CODE) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    if _heartbeat["current"] is not None:  # joined: tell the others
        leave(code)
    os._exit(code)


def initialize(d, plan: Plan) -> None:
    """``jax.distributed.initialize`` for ``plan`` (gloo collectives on CPU), waiting at most
    ``distributed.init_timeout_s`` for every process to join, with a progress line every 10 s.

    The join runs on a helper thread while the main thread waits, so a SIGTERM/SIGINT meanwhile
    stops the start-up (``jaxtrain.train.preempt.check_startup``: exit 0, nothing trained). On
    expiry the process prints ``error: distributed.init_timeout_s: ...`` and exits with
    :data:`EXIT_CODE` (JAX's own timeout, set later than ours, would abort with a stack trace).
    """
    import jax
    from jax._src import distributed as jd
    from jaxtrain.train import preempt
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX's preemption notifier replaces Python's SIGTERM handler; jaxtrain agrees on stops itself.
    jax.config.update("jax_enable_preemption_service", False)
    who = (f"process {plan.process_id} of {plan.num_processes}" if plan.num_processes else "this process")
    where = plan.coordinator or "the coordinator JAX detects"
    limit, margin = d.init_timeout_s, 60  # JAX's own limits stay behind ours, so ours report first
    outcome: dict = {}

    def join() -> None:
        try:
            jax.distributed.initialize(plan.coordinator, plan.num_processes, plan.process_id,
                                       initialization_timeout=int(limit) + margin,
                                       heartbeat_timeout_seconds=int(d.peer_timeout_s) + margin)
        except BaseException as err:  # noqa: BLE001 - re-raised on the main thread
            outcome["error"] = err

    joining = threading.Thread(target=join, name="jaxtrain-join", daemon=True)
    t0, reported = time.monotonic(), 0
    joining.start()
    while joining.is_alive():
        joining.join(0.2)  # the main thread runs Python between waits: signal handlers fire
        elapsed = time.monotonic() - t0
        preempt.check_startup()
        if elapsed >= limit:
            _die(f"distributed.init_timeout_s: {who} waited {elapsed:.0f} s for every process to join at {where} "
                 f"({plan.source}); start all {plan.num_processes or ''} processes with the same coordinator "
                 f"address and distinct process ids, check that it is reachable, or raise "
                 f"distributed.init_timeout_s")
        if elapsed >= reported + 10:
            reported += 10
            log.info(f"distributed: {who} waiting for the others at {where} ({reported} s of "
                     f"distributed.init_timeout_s={limit:g})")
    if "error" in outcome:
        raise outcome["error"]
    log.info(f"distributed: process {jax.process_index()} of {jax.process_count()} joined ({plan.source}; "
             f"coordinator {jd.global_state.coordinator_address}; "
             f"{jax.local_device_count()} local of {jax.device_count()} devices)")


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
        self.timeout, self.count, self.stop = peer_timeout_s, 0, threading.Event()
        self.seen: dict[int, tuple[str, float]] = {}
        self.failing_since: Optional[float] = None
        self.interval = max(0.5, min(5.0, peer_timeout_s / 6))
        self.thread = _every(self.interval, self.stop, self._tick, "jaxtrain-heartbeat")

    def _tick(self, elapsed: float) -> bool:
        now = time.monotonic()
        try:
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
                _die(f"distributed.peer_timeout_s: the coordinator (process 0) has not answered for "
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
                _die(f"distributed.peer_timeout_s: process {p} of {self.n} sent no heartbeat for "
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
        _die(f"process {p} of {self.n} ended with exit code {code} (its own log says why); stopping process "
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


def start(d) -> Optional[Plan]:
    """Detects the job (:func:`detect`); for several processes, initializes ``jax.distributed`` and
    starts the :class:`Heartbeat`. Call before anything touches a device. Returns the plan or None.

    Raises:
      InputError: a malformed job description, or the job formed with another number of processes
        than this one was told.
    """
    plan = detect(d)
    if plan is None:
        return None
    initialize(d, plan)
    _heartbeat["current"] = Heartbeat(d.peer_timeout_s)
    import jax
    if plan.num_processes is not None and jax.process_count() != plan.num_processes:  # joined: the others hear
        raise InputError(f"distributed.num_processes: this process was told {plan.num_processes} ({plan.source}) "
                         f"but the job formed with {jax.process_count()} (process 0's value); give every process "
                         f"the same number")
    if not is_primary():  # one voice: process 0 prints; the others only their warnings and errors
        log.setLevel(logging.WARNING)
        sys.stdout.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)  # also what native code (gloo) prints to stdout
        os.close(devnull)
    return plan


def joined() -> bool:
    """This process is part of a multi-process run (joined, with its :class:`Heartbeat` running)."""
    return _heartbeat["current"] is not None


def finished() -> None:
    """The run ended normally on this process (see :meth:`Heartbeat.finished`)."""
    if _heartbeat["current"] is not None:
        _heartbeat["current"].finished()


def leave(code: int) -> None:
    """Ends a multi-process run's process at once with ``code`` (a normal exit would wait in
    ``jax.distributed``'s shutdown barrier for peers that may be stuck in a collective).

    It first tells the others (a key in the coordinator's store): their :class:`Heartbeat` ends them
    with the same code. Process 0 hosts the coordination service, whose end aborts every other
    process, so it waits (a heartbeat interval and 5 s at most) until the others have left.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    from jax._src import distributed as jd  # not jax.process_index(): from a thread it may init a backend
    state = jd.global_state
    client, pid = state.client, state.process_id
    try:
        client.key_value_set(f"jaxtrain/exit/{pid}", str(code), allow_overwrite=True)
        if pid == 0:
            beat = _heartbeat["current"]
            end = time.monotonic() + 5.0 + (beat.interval if beat is not None else 5.0)
            for p in range(1, state.num_processes):
                wait_ms = int(1000 * (end - time.monotonic()))
                if wait_ms <= 0:
                    break
                client.blocking_key_value_get(f"jaxtrain/exit/{p}", wait_ms)
    except Exception:  # noqa: BLE001 - leaving anyway
        pass
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
    from jaxtrain import errors
    from jaxtrain.errors import ConfigError
    from jaxtrain.errors import CheckpointError
    known = {c.__name__: c for c in (ConfigError, CheckpointError, errors.InputError, JaxtrainError)}
    return known.get(cls_name, InputError)(message)
