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
    exit_now,
    log_to_console,
    prog,
    start_backend,
)
from jaxtrain.kernels import hooks as provider_hooks
from jaxtrain.runtime import signals, xla_flags


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog("jaxtrain.train"),
        description="Train a model. Overrides are dotted key=value pairs, e.g. train.steps=100 mesh.fsdp=8.")
    add_config_args(parser)
    return config_args(parser, argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the command line; returns its exit code. A process of a multi-process job does not return: it
    ends here with the code (:func:`jaxtrain.cli.common.exit_now`), as ``python -m jaxtrain.train`` does,
    so a wrapper's ``sys.exit(main())`` ends the job as one (the interpreter's own finalization tore down
    process 0's coordination service under its live client: SIGABRT after a committed run)."""
    signals.during_startup()  # first: a preemption notice may come while jax still imports
    # Automatic garbage collection is off from here, as in the loop (train.hooks.GarbageCollection,
    # torchtitan disables it at its trainer's start too): imports and tracing make millions of
    # long-lived objects, and the full collections they set off took ~0.1-0.3 s of a 4 s start.
    # train.gc_every=0 turns it back on once the config is read; a main() called in-process
    # leaves the collector and the providers' hooks as it found them.
    collecting = gc.isenabled()
    gc.disable()
    hooks = provider_hooks.hooks(plugins=False)  # the kernel providers' start-up hooks (before JAX is imported)
    code: Optional[int] = None
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)

        def body() -> None:
            # Before JAX starts its backend (XLA reads XLA_FLAGS then); a bad opt-out value is exit 2.
            xla_flags.apply_gpu_defaults()  # nothing on a machine without CUDA
            xla_flags.apply_cpu_defaults()  # XLA:CPU's own dot kernels, not YNNPACK's (see xla_flags)
            for hook in hooks:
                hook.command_start()
            log_to_console()
            with provider_hooks.lean_imports(hooks):  # the JAX stack as lean as the providers make it
                from jaxtrain.config import load
                from jaxtrain.runtime import heartbeat, join
            signals.check_startup()
            with provider_hooks.lean_imports(hooks):  # the model family's module, and with it Flax, is imported here
                cfg = load(args.config, args.overrides)
            if not cfg.train.gc_every and collecting:
                gc.enable()
            single = join.start(cfg.distributed) is None  # before anything touches a device
            for hook in hooks:
                hook.before_backend(cfg, single)
            start_backend()
            import jax
            enable_compilation_cache(jax.devices())  # not over several CPU devices: see its docstring
            for hook in provider_hooks.hooks():  # the installed plugins' too, now that the backend is up
                hook.after_backend(cfg)
            with provider_hooks.lean_imports(hooks):
                from jaxtrain.train import fit
            signals.check_startup()
            fit(cfg)
            heartbeat.end_run()
        code = cli(body)
        return code
    finally:
        for hook in hooks:
            hook.command_end()
        if collecting:
            gc.enable()
        heartbeat = sys.modules.get("jaxtrain.runtime.heartbeat")
        if code is not None and heartbeat is not None and heartbeat.in_job():
            exit_now(code)


if __name__ == "__main__":
    sys.exit(main())
