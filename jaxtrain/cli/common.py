"""What every command line shares: config arguments, the error wrapper, the compile cache, logging."""
from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import traceback
from typing import Any, Callable, Optional, Sequence

from jaxtrain.errors import JaxtrainError

# No jax import at module level: ``jaxtrain.cli.train`` installs its signal handlers before jax loads.


def exit_now(code: int) -> None:
    """Ends a finished command-line process with ``code`` and without the interpreter's finalization.

    Tearing down jax/XLA's objects and libraries after a run took ~1.2 s (a one-step shakespeare run
    is 14 s in all). The exit handlers (``atexit``: jax.distributed's shutdown, logging, the
    sinks') run first and the output is flushed, so only the destructors are skipped. Only for a
    process's entry point (``python -m jaxtrain.train``), never for a ``main()`` called in-process.
    """
    import atexit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    if "jaxtrain.runtime.heartbeat" in sys.modules:  # a multi-process run's: process 0 may end once it is said
        sys.modules["jaxtrain.runtime.heartbeat"].last_word()
    os._exit(code)


def cli(body: Callable[[], Optional[int]]) -> int:
    """Runs ``body``; a named error (:class:`jaxtrain.errors.JaxtrainError`) is printed as
    ``error: <message>`` on stderr and becomes its exit code (2 for bad input). Returns the exit code.

    An error with ``hard_exit`` (a checkpoint save stuck past its timeout) ends the process at once:
    a normal exit would wait for ever on the stuck writer thread. A SIGTERM/SIGINT during a training
    run's start-up (``jaxtrain.runtime.signals.StartupInterrupted``) is exit 0: nothing was trained.
    """
    from jaxtrain.errors import StartupInterrupted
    try:
        return body() or 0
    except StartupInterrupted as stop:
        from jaxtrain.runtime.signals import report_startup_stop
        code = report_startup_stop(stop)
        if _multiprocess():  # the others are told, and stop too (they would wait for this one for ever)
            from jaxtrain.runtime import heartbeat
            heartbeat.leave(code)
        return code
    except JaxtrainError as err:
        print(f"error: {err}", file=sys.stderr)
        # Many processes: a normal exit would wait in jax.distributed's shutdown barrier for peers that
        # may be stuck in a collective; the others' heartbeat sees this one go and stops them too.
        if _multiprocess():
            from jaxtrain.runtime import heartbeat
            heartbeat.leave(err.exit_code)
        if getattr(err, "hard_exit", False):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(err.exit_code)
        return err.exit_code
    except KeyboardInterrupt as err:  # a second SIGINT (the first asks the loop to stop and save)
        if _multiprocess():
            from jaxtrain.runtime import heartbeat
            heartbeat.after_failure(err)
            print("interrupted (a second SIGINT): stopping every process at once; committed checkpoints are "
                  "intact", file=sys.stderr)
            heartbeat.leave(130)
        print("interrupted (a second SIGINT): stopped at once; committed checkpoints are intact", file=sys.stderr)
        return 130
    except BaseException as err:
        if _multiprocess() and not isinstance(err, SystemExit):
            # Many processes: never a normal exit (it would wait in jax.distributed's shutdown barrier
            # while the others wait in a collective); a collective that failed because a peer is gone
            # is reported by name, not as a traceback.
            from jaxtrain.runtime import heartbeat
            heartbeat.after_failure(err)
            traceback.print_exc()
            heartbeat.leave(1)
        raise


def _multiprocess() -> bool:
    """This process has joined a multi-process run (``jaxtrain.runtime.join``)."""
    module = sys.modules.get("jaxtrain.runtime.heartbeat")
    return module is not None and module.joined()


def prog(module: str) -> str:
    """The command's name in usage lines: ``jaxtrain-train`` as a console script, else ``python -m <module>``."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name.startswith("jaxtrain-") else f"python -m {module}"


def add_config_args(parser: argparse.ArgumentParser, default: str = "the built-in default job") -> None:
    """``--config FILE`` (or a leading positional FILE.yaml) and dotted ``key=value`` overrides."""
    parser.add_argument("--config", help=f"YAML config file or a name in configs/ (default: {default})")
    parser.add_argument("overrides", nargs="*", help="key=value overrides (a leading FILE.yaml is the config)")


def config_args(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """Parses ``argv``; overrides may come before or after ``--config`` (MaxText-style positional file too)."""
    args = parser.parse_intermixed_args(argv)
    if args.overrides and "=" not in args.overrides[0] and args.overrides[0].endswith((".yaml", ".yml")):
        if args.config:
            parser.error("give the config file once: positional or --config")
        args.config = args.overrides.pop(0)
    return args


def start_backend() -> None:
    """Starts JAX's backend (``jax.devices()``) so that an environment it cannot start is bad input.

    Raises:
      InputError: ``JAX_PLATFORMS`` names a platform JAX cannot start here (no such plugin or
        device), with JAX's reason.
    """
    import jax

    from jaxtrain.errors import InputError
    try:
        jax.devices()
    except (RuntimeError, AssertionError) as err:  # JAX asserts when its backend failed to start before
        asked = os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms
        reason = str(err) or "none of those platforms has a device here"  # e.g. cuda without an NVIDIA GPU
        hint = "" if "JAX_PLATFORMS" in reason else " (unset JAX_PLATFORMS to let JAX choose)"
        raise InputError(f"JAX_PLATFORMS={asked!r}: JAX could not start it: {reason}{hint}" if asked
                         else f"JAX could not start a backend: {reason}") from None


def enable_compilation_cache(devices: Optional[Sequence[Any]] = None) -> bool:
    """JAX's persistent compilation cache (``JAX_COMPILATION_CACHE_DIR`` or ~/.cache/jaxtrain/xla), for
    every program: JAX's default keeps only those that took a second to compile, and a run's small
    ones (the initialisation, the evaluation, the sample) cost a second of start-up together.

    Off (JAX's cache disabled, whatever the environment says) when ``devices``, those the programs
    will run on, are several CPU devices: XLA:CPU gives the collectives of a program it compiles one
    shared communicator resource, which keeps them in program order on every device, but gives each
    collective a resource of its own when it loads the program from the cache
    (``CreateResourceFromProto`` in XLA's thunk serialization). Two independent collectives of a
    loaded program can then start in different orders on different devices and wait for each other
    until XLA's rendezvous aborts the process (40 s, exit 134). Measured on jax 0.10.2: the pipelined
    Mixtral of ``tests/integration/test_pipeline.py`` (stage 2 x expert 4 on 8 CPU devices) aborted
    on each of 3 runs from a warm cache, and passed from a cold one. Returns whether the cache is on.
    """
    import jax
    if devices is not None and len(devices) > 1 and devices[0].platform == "cpu":
        jax.config.update("jax_enable_compilation_cache", False)
        jax.config.update("jax_compilation_cache_dir", None)  # also where JAX_COMPILATION_CACHE_DIR set one
        return False
    from pathlib import Path

    from jaxtrain.runtime.env import cache_folder_usable
    folder = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    what = f"JAX_COMPILATION_CACHE_DIR={folder}" if folder else "JAX's compilation cache"
    folder = folder or os.path.expanduser("~/.cache/jaxtrain/xla")
    if not cache_folder_usable(Path(folder), what):  # JAX would warn on every entry and compile anyway
        jax.config.update("jax_enable_compilation_cache", False)
        jax.config.update("jax_compilation_cache_dir", None)
        return False
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return True


def log_to_console() -> None:
    """Shows the library's INFO lines (e.g. which attention ``model.attention=auto`` picked) on stderr,
    once each and plainly, whatever handlers other libraries put on the root logger."""
    log = logging.getLogger("jaxtrain")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.INFO)


def use_cpu_devices(n: int) -> None:
    """Asks for n simulated CPU devices; effective only before JAX initialises its backends."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    import jax
    jax.config.update("jax_platforms", "cpu")
