"""The ``cpu`` provider's runtime hooks (:class:`jaxtrain.kernels.hooks.RuntimeHooks`): what a
one-device CPU run does beyond its kernels, each step of it measured to pay off on 2-core machines.

- the command line's first imports of the JAX stack without two scans it does not need
  (:mod:`.lean_imports`);
- one-device programs run inline on the calling thread in a single-process run (:mod:`.dispatch`);
- the run's init, train step and evaluation kept across runs as exported StableHLO
  (:mod:`.program_cache`), and a warm start's executables loaded on a thread while it imports
  (:mod:`.prefetch`);
- the peak FLOP/s MFU divides by on a CPU (:mod:`.peak`).

Every module is imported on first use: the command line calls :meth:`CpuHooks.command_start` before
JAX is imported.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from jaxtrain.kernels.hooks import RuntimeHooks


class CpuHooks(RuntimeHooks):
    def lean_imports(self):
        from jaxtrain.kernels.cpu import lean_imports
        return lean_imports.lean()

    def command_start(self) -> None:
        from jaxtrain.kernels.cpu import peak, program_cache
        peak.enable()  # the host's peak, kept a day
        program_cache.enable()  # exported init, train step and evaluation: a warm start traces none

    def before_backend(self, cfg: Any, single_process: bool) -> None:
        if single_process:  # one process: its one-device CPU programs run inline
            from jaxtrain.kernels.cpu import dispatch
            dispatch.run_inline()

    def after_backend(self, cfg: Any) -> None:
        import jax

        from jaxtrain.kernels.cpu import peak, prefetch
        if jax.default_backend() == "cpu":  # measured before the prefetch thread starts: alone, as it must be
            peak.host_peak(getattr(cfg.model, "dtype", "float32"))
        prefetch.start(cfg)  # a warm start's executables load beside the trainer's imports

    def command_end(self) -> None:
        import sys
        for name, undo in (("peak", "disable"), ("program_cache", "disable"), ("prefetch", "stop")):
            module = sys.modules.get(f"jaxtrain.kernels.cpu.{name}")
            if module is not None:  # a main() called in-process: left as it was found
                getattr(module, undo)()

    def peak_flops(self, devices: Sequence[Any], dtype: str, uses: Sequence[str]) -> Optional[tuple[float, str]]:
        if not devices or devices[0].platform != "cpu":
            return None
        from jaxtrain.kernels.cpu import peak
        return peak.host_peak(dtype)

    def compiled(self, setup: Any, name: str, *args: Any) -> Any:
        from jaxtrain.kernels.cpu import program_cache
        if name == "init":
            return program_cache.init(setup)
        if name == "train_step":
            return program_cache.train_step(setup, *args)
        if name == "evaluate":
            return program_cache.evaluate(setup, *args)
        return None

    def runs_inline(self, n_devices: int) -> bool:
        from jaxtrain.kernels.cpu import dispatch
        return dispatch.inline(n_devices)


HOOKS = CpuHooks()
