"""The watched start of a multi-process job: ``jax.distributed`` joined with named timeouts, then
the heartbeat (:mod:`jaxtrain.runtime.heartbeat`). JAX's own timeouts end a process with a C++
abort and a stack trace; here a watchdog says what it waited for and ends the process first."""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Optional

from jaxtrain.errors import InputError
from jaxtrain.runtime import heartbeat, signals
from jaxtrain.runtime.heartbeat import Heartbeat, die, is_primary
from jaxtrain.runtime.job import Plan, detect

log = logging.getLogger("jaxtrain")


def initialize(d, plan: Plan) -> None:
    """``jax.distributed.initialize`` for ``plan`` (gloo collectives on CPU), waiting at most
    ``distributed.init_timeout_s`` for every process to join, with a progress line every 10 s.

    The join runs on a helper thread while the main thread waits, so a SIGTERM/SIGINT meanwhile
    stops the start-up (``jaxtrain.runtime.signals.check_startup``: exit 0, nothing trained). On
    expiry the process prints ``error: distributed.init_timeout_s: ...`` and exits with
    :data:`EXIT_CODE` (JAX's own timeout, set later than ours, would abort with a stack trace).
    """
    import jax
    from jax._src import distributed as jd
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
        signals.check_startup()
        if elapsed >= limit:
            die(f"distributed.init_timeout_s: {who} waited {elapsed:.0f} s for every process to join at {where} "
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
    heartbeat._heartbeat["current"] = Heartbeat(d.peer_timeout_s)
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
