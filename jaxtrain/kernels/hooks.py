"""Kernel providers' runtime hooks: what a provider does in a run beyond its kernels (a program cache,
a prefetch of compiled programs, the host's peak FLOP/s), called by the command line and the trainer at
fixed points. A provider offers them as its ``hooks`` attribute (:class:`RuntimeHooks`); nothing here
names a provider.
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional, Sequence

from jaxtrain.kernels import registry


class RuntimeHooks:
    """A provider's part in a run beyond its kernels, every method optional (this base does nothing).
    The command line and the trainer call each provider's hooks through :func:`hooks`; a hook decides
    itself whether it applies (the backend, the process and device count).

    - ``lean_imports()``: a context manager around the command line's first imports of the JAX stack.
    - ``command_start()``: a command line starts (before JAX is imported; InputError for a bad
      environment variable).
    - ``before_backend(cfg, single_process)``: the config is read, JAX's backend not yet started.
    - ``after_backend(cfg)``: the backend is up; the trainer not yet imported.
    - ``command_end()``: a command line returns (undo what the others set for this process).
    - ``peak_flops(devices, dtype, uses)``: ``(FLOP/s of one host, what it is)`` or None: the peak MFU
      divides by where no table knows the chip (``uses``: the implementations the run's plan chose).
    - ``compiled(setup, name, *args)``: a compiled program ('init', 'train_step', 'evaluate') for the
      run's setup, or None (the trainer compiles it as usual).
    - ``runs_inline(n_devices)``: whether a program over ``n_devices`` runs on the thread calling it.
    """

    def lean_imports(self):
        return contextlib.nullcontext()

    def command_start(self) -> None:
        pass

    def before_backend(self, cfg: Any, single_process: bool) -> None:
        pass

    def after_backend(self, cfg: Any) -> None:
        pass

    def command_end(self) -> None:
        pass

    def peak_flops(self, devices: Sequence[Any], dtype: str, uses: Sequence[str]) -> Optional[tuple[float, str]]:
        return None

    def compiled(self, setup: Any, name: str, *args: Any) -> Any:
        return None

    def runs_inline(self, n_devices: int) -> bool:
        return False


def hooks(plugins: bool = True) -> list[Any]:
    """Every provider's runtime hooks (:class:`RuntimeHooks`), in registration order (``plugins``: also the
    entry points' providers; the command line's start-up hooks, before JAX starts, call the built-in and
    registered ones only)."""
    return [p.hooks for p in registry.providers(plugins).values() if getattr(p, "hooks", None) is not None]


@contextlib.contextmanager
def lean_imports(hook_list: Sequence[Any]):
    """Every hook's ``lean_imports`` context at once (the command line's imports of the JAX stack)."""
    with contextlib.ExitStack() as stack:
        for h in hook_list:
            stack.enter_context(h.lean_imports())
        yield


def compiled(setup: Any, name: str, *args: Any) -> Any:
    """A provider's compiled program ``name`` for the run (``RuntimeHooks.compiled``), or None."""
    for h in hooks():
        program = h.compiled(setup, name, *args)
        if program is not None:
            return program
    return None


def runs_inline(n_devices: int) -> bool:
    """Whether a program over ``n_devices`` devices runs on the thread that calls it (a provider says so)."""
    return any(h.runs_inline(n_devices) for h in hooks())


def peak_flops(devices: Sequence[Any], dtype: str, uses: Sequence[str] = ()) -> Optional[tuple[float, str]]:
    """A provider's peak FLOP/s of one host of ``devices`` and where it came from, or None."""
    for h in hooks():
        found = h.peak_flops(devices, dtype, uses)
        if found is not None:
            return found
    return None
