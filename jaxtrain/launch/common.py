"""What the launch targets share: the command line, config validation, the training command.

``python -m jaxtrain.launch TARGET --config FILE [key=value ...] [flags]``: the target's module
(``gke``, ``vertex``, ``slurm``, ``ray``, ``kubeflow``, ``volcano``) adds its own flags and turns a
:class:`Job` into a spec (``build``), prints it (``render``, for ``--dry-run``) or submits it
(``submit``). The config is loaded and validated here first, so a bad key is ``error: <key>: ...``
(exit 2) before anything is generated or sent.
"""
from __future__ import annotations

import argparse
import importlib
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence, cast

from jaxtrain.errors import LaunchError
from jaxtrain.runtime.job import is_shape_variable

TARGETS = {"gke": "GKE JobSet", "vertex": "Vertex AI CustomJob", "slurm": "SLURM sbatch script",
           "ray": "Ray Train run", "kubeflow": "Kubeflow TrainJob", "volcano": "Volcano Job"}
POD_TARGETS = ("gke", "vertex", "kubeflow", "volcano")  # each node a pod or VM with its own disk
INSTALL_HINT = "pip install 'jaxtrain[launch]'"
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class Job:
    """What every target needs: the validated config and how to start ``jaxtrain.train`` on each process."""

    target: str
    cfg: Any  # the validated jaxtrain.config.Config
    config_path: str  # as the container / cluster sees it
    overrides: list[str]
    nodes: int
    name: str
    env: dict[str, str] = field(default_factory=dict)

    def train_args(self) -> list[str]:
        """The arguments after ``python -m jaxtrain.train``: the config file, then the overrides unchanged."""
        return ["--config", self.config_path, *self.overrides]

    def train_command(self, python: str = "python") -> list[str]:
        """``python -m jaxtrain.train --config FILE key=value ...`` as an argv list."""
        return [python, "-m", "jaxtrain.train", *self.train_args()]

    def local_checkpoints(self) -> Optional[str]:
        """The checkpoint directory when it is on a local disk (a restarted pod or VM loses it), else None."""
        ckpt = self.cfg.checkpoint.dir or f"{self.cfg.run.dir.rstrip('/')}/checkpoints"
        return None if ckpt.startswith(("gs://", "s3://")) else ckpt


class LaunchTarget(Protocol):
    """What a target's module (``jaxtrain/launch/<target>.py``, listed in :data:`TARGETS`) defines:
    ``spec`` is whatever it submits (a manifest dict, a script, a client object)."""

    def add_args(self, parser: argparse.ArgumentParser) -> None:
        """Adds the target's own flags (the common ones are there already)."""

    def build(self, job: Job, args: argparse.Namespace) -> Any:
        """The spec for ``job``; raises LaunchError for a bad flag (before anything is sent)."""

    def notes(self, job: Job, args: argparse.Namespace) -> list[str]:
        """Notes for the user on stderr (e.g. checkpoints on a pod's own disk)."""

    def render(self, spec: Any) -> str:
        """The spec as printed by ``--dry-run``."""

    def submit(self, spec: Any, job: Job, args: argparse.Namespace) -> str:
        """Sends the spec; returns what to print (the job's name or URL). Raises SubmitError."""


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes are a named error (``error: ...``, exit 2) like every jaxtrain command."""

    def error(self, message: str):
        raise LaunchError(f"{message} (see {self.prog} --help)")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int(text, 1)


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int(text, 0)


def _int(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got '{text}'") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    return value


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Flags of every target: config, overrides, process count, name, env, dry run."""
    parser.add_argument("--config", required=True,
                        help="YAML config file (or a name in configs/), validated here before anything is generated")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, passed to every process unchanged")
    parser.add_argument("--container-config", metavar="PATH",
                        help="the config file's path as the job sees it (default: --config as given)")
    parser.add_argument("--nodes", type=positive_int, default=1,
                        help="hosts (GKE pods, Vertex replicas, SLURM nodes, Ray workers, TrainJob nodes, Volcano "
                             "pods) (default: 1)")
    parser.add_argument("--name", help="job name (default: jaxtrain-<config file stem>)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="an environment variable for every process (repeatable)")
    parser.add_argument("--dry-run", action="store_true", help="print what would be submitted; submit nothing")


def add_container_args(parser: argparse.ArgumentParser) -> None:
    """Flags of the container targets (GKE, Vertex): image and accelerators per node."""
    parser.add_argument("--image", required=True, help="container image with jaxtrain installed")
    parser.add_argument("--accelerator", help="accelerator type per node (none: CPU only)")
    parser.add_argument("--accelerator-count", type=positive_int,
                        help="accelerators (GPUs or TPU chips) per node (default 1 with --accelerator)")
    parser.add_argument("--tpu-topology", help="TPU slice topology, e.g. 2x2x2")


def accelerator_count(args: argparse.Namespace) -> int:
    """Accelerators per node: --accelerator-count (only with --accelerator), default 1."""
    if args.accelerator_count is not None and not args.accelerator:
        raise LaunchError("--accelerator-count: needs --accelerator (the accelerator type)")
    return args.accelerator_count or (1 if args.accelerator else 0)


def parse_env(items: Sequence[str]) -> dict[str, str]:
    """``['KEY=VALUE', ...]`` -> dict; a bad item is a LaunchError naming it."""
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not _ENV_KEY.match(key):
            raise LaunchError(f"--env: expected KEY=VALUE with KEY a variable name, got '{item}'")
        env[key] = value
    return env


def check_job(job: Job, processes: int) -> None:
    """Refuses what would break the job once it runs: the job-shape variables given by hand,
    ``distributed.*`` values that contradict the job, and (pods, VMs) a multi-host job whose
    checkpoints would be on each pod's own disk (every save would wait for ever for the others' parts).

    Raises:
      LaunchError: naming the flag or key.
    """
    for key in sorted(k for k in job.env if is_shape_variable(k)):  # the job's shape (jaxtrain.runtime.job)
        raise LaunchError(f"--env: {key} is set for each process by the launcher or the platform; leave it out")
    d = job.cfg.distributed
    for key in ("coordinator_address", "num_processes", "process_id"):
        if getattr(d, key) is not None:
            raise LaunchError(f"distributed.{key}: set for each process by the launcher; leave it unset")
    if processes > 1 and d.mode == "off":
        raise LaunchError(f"distributed.mode: 'off' would make each of the {processes} processes train alone; "
                          f"use auto")
    local = job.local_checkpoints()
    if job.target in POD_TARGETS and job.nodes > 1 and local is not None:
        raise LaunchError(f"checkpoint.dir: '{local}' is on each node's own disk, but the {job.nodes} nodes write "
                          f"one checkpoint together; set checkpoint.dir=gs://BUCKET/PATH (or s3://)")


def check_container_config(target: str, config: str, container_config: Optional[str]) -> None:
    """A pod target's containers start from the image, not from this machine: an absolute ``--config``
    path is this machine's (the image would have to hold the same path by chance), so it is refused
    unless ``--container-config`` says where the image holds the file. A relative path (from the
    image's working directory) and a config name shipped with jaxtrain pass.

    Raises:
      LaunchError: naming ``--config``.
    """
    if target in POD_TARGETS and container_config is None and os.path.isabs(config):
        raise LaunchError(f"--config: {config} is a path on this machine, but the job's containers start from "
                          f"--image; pass --container-config PATH (where the image holds this file), a path "
                          f"relative to the image's working directory, or a config name shipped with jaxtrain "
                          f"(e.g. shakespeare_char)")


def job_devices(target: str, job: Job, args: argparse.Namespace) -> tuple[int, int, str]:
    """(processes, devices per process, platform) of the job the flags ask for: one process per node but
    SLURM's ``--ntasks-per-node``; a CPU process has one device unless ``--env XLA_FLAGS`` (SLURM: or this
    shell's, which sbatch passes on) forces more."""
    processes = job.nodes * getattr(args, "ntasks_per_node", 1)
    per = {"slurm": getattr(args, "gpus_per_task", 0), "ray": getattr(args, "gpus_per_worker", 0)}.get(target)
    kind = "gpu"
    if target in ("gke", "vertex"):
        per = accelerator_count(args)
        kind = "tpu" if (args.accelerator or "").lower().startswith("tpu") else "gpu"
    elif target in ("kubeflow", "volcano"):  # --gpus, or the device plugins' resources by hand (build checked them)
        res = dict(item.partition("=")[::2] for item in getattr(args, "resource", []))
        tpus, gpus = res.get("google.com/tpu", ""), res.get("nvidia.com/gpu", "")
        if tpus.isdigit():
            per, kind = int(tpus), "tpu"
        else:
            per = getattr(args, "gpus", None) or (int(gpus) if gpus.isdigit() else 0)
    if per:
        return processes, per, kind
    flags = job.env.get("XLA_FLAGS", "")
    if target == "slurm" and "XLA_FLAGS" not in job.env:  # sbatch passes the submitting shell's environment on
        flags = os.environ.get("XLA_FLAGS", "")
    forced = re.search(r"--xla_force_host_platform_device_count=(\d+)", flags)
    return processes, int(forced.group(1)) if forced else 1, "cpu"


def check_mesh(job: Job, processes: int, per_process: int, platform: str) -> None:
    """The checks ``jaxtrain.train`` makes once its devices are up, made here for the job's devices, so
    that a mesh that cannot fit is refused before the job waits in a queue: the axis sizes against
    the device count, the batch and model against the axis sizes, and (GPU, CPU: each process is a
    node) ``mesh.across_nodes`` against the process count.

    Raises:
      LaunchError, ConfigError: naming the key, and the job's devices.
    """
    from jaxtrain.config.checks import check_against_mesh
    from jaxtrain.errors import ConfigError
    from jaxtrain.parallel.mesh import resolve_sizes
    cfg, devices = job.cfg, processes * per_process
    what = f"the job has {processes} process{'es' if processes > 1 else ''} x {per_process} {platform.upper()} " \
           f"device{'s' if per_process > 1 else ''} = {devices}"
    across = dict(cfg.mesh.across_nodes or {})
    if across and platform != "tpu" and math.prod(across.values()) != processes:
        raise LaunchError(f"mesh.across_nodes: {across} spans {math.prod(across.values())} nodes, but {what} "
                          f"(each process is a node); the axes across nodes must multiply to {processes}")
    try:
        check_against_mesh(cfg, resolve_sizes(cfg.mesh, devices), platform)
    except ConfigError as err:
        raise type(err)(f"{err} ({what})") from None


def default_name(config: str) -> str:
    """``jaxtrain-<config stem>``, lower case with dashes (a valid Kubernetes name for ordinary stems)."""
    stem = re.sub(r"[^a-z0-9]+", "-", Path(config).stem.lower()).strip("-")
    return f"jaxtrain-{stem}"[:40].rstrip("-")


def require(module: str, target: str, package: str, hint: str = INSTALL_HINT) -> Any:
    """Imports ``module`` of the client library ``package``, or raises LaunchError saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise LaunchError(f"the {target} launcher needs '{package}', which is not installed: {hint}") from None


def connection_reason(err: BaseException) -> str:
    """A short reason for a failed connection: the innermost ``[Errno N] ...`` when there is one."""
    text = str(err)
    found = re.findall(r"\[Errno -?\d+\] [^'\")\]]+", text)
    return found[-1].strip() if found else (text.splitlines() or [type(err).__name__])[0][:200]


def note(message: str) -> None:
    """A note on stderr: it never mixes into the printed spec on stdout."""
    print(f"note: {message}", file=sys.stderr)


def _usage(prog: str) -> str:
    targets = "\n".join(f"  {t:<7} {what}" for t, what in TARGETS.items())
    return (f"usage: {prog} {{{','.join(TARGETS)}}} --config FILE [key=value ...] [flags]\n\n"
            f"Submit a multi-process jaxtrain.train job:\n{targets}\n\n"
            f"`{prog} TARGET --help` lists a target's flags.")


def run(argv: Sequence[str], prog: str) -> int:
    """Parses ``argv`` (target first), validates the config, then prints (--dry-run) or submits the job."""
    if argv and argv[0] in ("-h", "--help"):
        print(_usage(prog))
        return 0
    if not argv or argv[0].startswith("-"):
        raise LaunchError(f"the first argument must be the target: {', '.join(TARGETS)} (see {prog} --help)")
    target, rest = argv[0], list(argv[1:])
    if target not in TARGETS:
        raise LaunchError(f"unknown target '{target}' (choose one of: {', '.join(TARGETS)})")
    module = cast(LaunchTarget, importlib.import_module(f"jaxtrain.launch.{target}"))
    parser = _Parser(prog=f"{prog} {target}", description=f"Submit jaxtrain.train as a {TARGETS[target]}.")
    add_common_args(parser)
    module.add_args(parser)
    args = parser.parse_intermixed_args(rest)
    from jaxtrain.config import load  # imports jax: after the cheap flag checks
    cfg = load(args.config, args.overrides)
    check_container_config(target, args.config, args.container_config)
    job = Job(target=target, cfg=cfg, config_path=args.container_config or args.config,
              overrides=list(args.overrides), nodes=args.nodes, name=args.name or default_name(args.config),
              env=parse_env(args.env))
    spec = module.build(job, args)  # the target's own flag checks first
    processes, per_process, platform = job_devices(target, job, args)
    check_job(job, processes)
    check_mesh(job, processes, per_process, platform)
    more = getattr(module, "check_devices", None)  # a target whose job may run on other device counts too
    if more is not None:
        more(job, args, per_process, platform)
    for message in module.notes(job, args):
        note(message)
    if args.dry_run:
        print(module.render(spec))
        return 0
    print(module.submit(spec, job, args))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m jaxtrain.launch`` / ``jaxtrain-launch``: named errors become exit codes."""
    from jaxtrain.cli.common import cli, prog
    argv = list(sys.argv[1:] if argv is None else argv)
    return cli(lambda: run(argv, prog("jaxtrain.launch")))

