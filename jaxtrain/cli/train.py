"""``python -m jaxtrain.train [--config FILE | FILE] [key=value ...]``: train, checkpoint, resume.

With no arguments it runs the built-in default job (a small Llama trained byte-level on
this interpreter's standard library). Rerunning a command with the same ``run.dir``
resumes from the latest committed checkpoint. Exit codes: 0 done (or stopped cleanly by
SIGTERM/SIGINT, also during start-up), 2 bad input (config, data, path, a corrupt checkpoint),
3 the run diverged (non-finite steps or validation loss), 4 a checkpoint save stuck past
``checkpoint.save_timeout_s``, 5 a multi-process job whose processes did not all join within
``distributed.init_timeout_s`` or one of which stopped answering (``distributed.peer_timeout_s``),
75 preemption grace expired.
"""
from __future__ import annotations

import argparse
import gc
import sys
from typing import Optional, Sequence

from jaxtrain.cli.common import (
    add_config_args,
    cli,
    config_args,
    enable_compilation_cache,
    log_to_console,
    prog,
    start_backend,
)
from jaxtrain.metrics import peak_cache
from jaxtrain.runtime import cpu_dispatch, imports, signals, xla_flags


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog("jaxtrain.train"),
        description="Train a model. Overrides are dotted key=value pairs, e.g. train.steps=100 mesh.fsdp=8.")
    add_config_args(parser)
    return config_args(parser, argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    signals.during_startup()  # first: a preemption notice may come while jax still imports
    # Automatic garbage collection is off from here, as in the loop (train.hooks.GarbageCollection,
    # torchtitan disables it at its trainer's start too): imports and tracing make millions of
    # long-lived objects, and the full collections they set off took ~0.1-0.3 s of a 4 s start.
    # train.gc_every=0 turns it back on once the config is read; a main() called in-process
    # leaves the collector and the peak cache as it found them.
    collecting = gc.isenabled()
    gc.disable()
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)

        def body() -> None:
            # Before JAX starts its backend (XLA reads XLA_FLAGS then); a bad opt-out value is exit 2.
            xla_flags.apply_gpu_defaults()  # nothing on a machine without CUDA
            xla_flags.apply_cpu_defaults()  # XLA:CPU's own dot kernels, not YNNPACK's (see xla_flags)
            peak_cache.enable()  # the CPU matmul peak MFU divides by, measured once a day per host
            log_to_console()
            with imports.lean():  # the JAX stack without two import-time scans a command needs not
                from jaxtrain.config import load
                from jaxtrain.runtime import heartbeat, join
                from jaxtrain.train import prefetch, program_cache
            program_cache.enable()  # exported init, train step and evaluation: a warm start traces none
            signals.check_startup()
            with imports.lean():  # the model family's module, and with it Flax, is imported here
                cfg = load(args.config, args.overrides)
            if not cfg.train.gc_every and collecting:
                gc.enable()
            if join.start(cfg.distributed) is None:  # before anything touches a device
                cpu_dispatch.run_inline()  # one process: its one-device CPU programs run inline
            start_backend()
            import jax
            enable_compilation_cache(jax.devices())  # not over several CPU devices: see its docstring
            prefetch.start(cfg)  # a warm start's executables load beside the trainer's imports
            with imports.lean():
                from jaxtrain.train import fit
            signals.check_startup()
            fit(cfg)
            heartbeat.end_run()
        return cli(body)
    finally:
        peak_cache.disable()
        if "jaxtrain.train.program_cache" in sys.modules:  # a main() called in-process: as it found it
            sys.modules["jaxtrain.train.program_cache"].disable()
        if "jaxtrain.train.prefetch" in sys.modules:
            sys.modules["jaxtrain.train.prefetch"].stop()
        if collecting:
            gc.enable()


if __name__ == "__main__":
    sys.exit(main())
