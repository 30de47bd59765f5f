"""One-device CPU programs run on the thread that dispatches them, for a single-process run (a hook of the
``cpu`` kernel provider, :mod:`.hooks`).

JAX dispatches every program asynchronously by default: the call returns at once and a runtime
thread executes it. On a CPU that thread competes with XLA's own compute threads for the same
cores, and the train loop keeps several steps in flight between two metrics rows. Measured on a
2-core AMD EPYC (``configs/shakespeare_char.yaml``, one device, 8 alternated rounds of 30 steps in
one process), steps queued behind each other took a median 1.10x as long as steps run one at a
time; with JAX's ``jax_cpu_enable_async_dispatch=False`` (each one-device program runs inline on
the calling thread) queued and one-at-a-time steps took the same time. In whole runs of 300 steps
with ``train.log_every=100`` the median ``step_time_s`` went from 42.3 / 39.9 / 49.4 ms to 37.6 /
38.6 / 36.6 ms (3 alternated rounds); with ``train.log_every=1`` (one sync a step) it was unchanged.

JAX applies the option to one-device computations only: a program over a mesh of several devices
stays asynchronous, so its devices still run concurrently. The hang watchdog
(``jaxtrain.runtime.watchdog``) watches from its own thread, so a stuck program still ends by name.
"""
from __future__ import annotations

import os

from jaxtrain.runtime.env import switch

OPT_OUT = "JAXTRAIN_CPU_ASYNC_DISPATCH"  # "1": keep JAX's asynchronous dispatch


def run_inline(env: os._Environ | dict = os.environ) -> bool:
    """Turns JAX's asynchronous CPU dispatch off unless ``JAXTRAIN_CPU_ASYNC_DISPATCH=1``. Call it
    before JAX starts its backend (the CPU client reads the option once, when it is created), and
    only for a single-process run. Returns whether it did.

    Raises:
      InputError: ``JAXTRAIN_CPU_ASYNC_DISPATCH`` is set to something other than ``0`` or ``1``.
    """
    if switch(OPT_OUT, False, "JAX's asynchronous CPU dispatch", "inline, the default for a single-process run", env):
        return False
    import jax
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    return True


def inline(n_devices: int) -> bool:
    """Whether a program over ``n_devices`` devices runs inline on the calling thread here: asynchronous
    CPU dispatch off (:func:`run_inline`), a CPU backend, one process and one device."""
    import jax
    return (not jax.config.read("jax_cpu_enable_async_dispatch") and n_devices == 1 and jax.process_count() == 1
            and jax.default_backend() == "cpu")
