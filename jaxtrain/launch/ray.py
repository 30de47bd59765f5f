"""Ray: a Ray Train run of ``--nodes`` workers, each running ``python -m jaxtrain.train``.

Ray Train's ``JaxTrainer`` (``ray.train.v2.jax``) brings what a multi-host run needs from a Ray
cluster: one worker per host placed together (a placement group, ``--placement``: spread over the
nodes by default), the world rank and size, a failure budget (``--max-failures``: a worker that
dies, or whose training process fails, restarts the whole group, which resumes from jaxtrain's
latest checkpoint; a training process that exits with bad input (2) or divergence (3) ends the run
with that code at once, unretried) and an elastic group (``--min-nodes``: start on as few as that, grow to
``--nodes``; every restart resumes with the batches kept, ``jaxtrain.train.elastic``). Its JAX
backend is switched off (``JaxConfig(use_gpu=False, use_tpu=False)``): it would call
``jax.distributed.initialize`` inside the Ray worker itself, where jaxtrain's own start-up (watched
join, named timeouts, gloo on CPU) cannot run. Each worker instead starts the training process
(``jaxtrain.launch.ray_worker``), worker 0 being the coordinator.

``--dry-run`` prints the run as JSON; submitting connects to the cluster (``--address`` or
``RAY_ADDRESS``) and waits for the run to end, printing the workers' output as Ray forwards it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import time
import uuid
from dataclasses import replace

from jaxtrain.errors import NO_RETRY_EXITS, LaunchError, SubmitError
from jaxtrain.launch import ray_worker
from jaxtrain.launch.common import Job, nonnegative_int, positive_int, require
from jaxtrain.launch.k8s import parse_env_like, port

PLACEMENT = {"spread": "SPREAD", "strict-spread": "STRICT_SPREAD", "pack": "PACK"}
INSTALL = "pip install 'jaxtrain[ray]'"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _port_or_free(text: str) -> int:
    """argparse type: a TCP port, or 0 (a free one)."""
    if text.strip() == "0":
        return 0
    try:
        return port(text)
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(f"{err} (or 0: a free one)") from None


def add_args(parser: argparse.ArgumentParser) -> None:
    """Ray's flags."""
    parser.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                        help="the Ray cluster: its head's HOST:PORT, ray://HOST:10001 (Ray Client) or auto "
                             "(default: $RAY_ADDRESS)")
    parser.add_argument("--min-nodes", type=positive_int,
                        help="elastic: start on as few workers as this and grow to --nodes as nodes come "
                             "(default: --nodes, a fixed group)")
    parser.add_argument("--cpus-per-worker", type=float, default=1.0, help="Ray CPUs per worker (default: 1)")
    parser.add_argument("--gpus-per-worker", type=nonnegative_int, default=0, help="GPUs per worker (default: 0)")
    parser.add_argument("--resource", action="append", default=[], metavar="NAME=AMOUNT",
                        help="another Ray resource per worker (repeatable)")
    parser.add_argument("--placement", choices=sorted(PLACEMENT), default="spread",
                        help="how the workers are placed: spread over the nodes (best effort), strict-spread "
                             "(one per node) or pack (default: spread)")
    parser.add_argument("--max-failures", type=nonnegative_int, default=3,
                        help="group restarts after a failed worker before the run fails (default: 3)")
    parser.add_argument("--storage-path",
                        help="where Ray Train keeps its run state (default: Ray's); checkpoints go to checkpoint.dir")
    parser.add_argument("--coordinator-port", type=_port_or_free, default=0,
                        help="jax.distributed coordinator port on worker 0's node (default: a free one)")
    parser.add_argument("--chdir", default=os.getcwd(),
                        help="working directory of the training processes, on every node (default: here)")
    parser.add_argument("--python", help="the interpreter on the nodes (default: the Ray worker's own)")


def _resources(args: argparse.Namespace) -> dict:
    """Ray resources per worker; a bad or TPU request is a LaunchError naming the flag."""
    if not 0 < args.cpus_per_worker < math.inf:  # NaN and inf passed a plain "<= 0" check
        raise LaunchError(f"--cpus-per-worker: must be a finite number > 0, got {args.cpus_per_worker:g}")
    out: dict = {"CPU": args.cpus_per_worker}
    if args.gpus_per_worker:
        out["GPU"] = args.gpus_per_worker
    for name, amount in parse_env_like("--resource", args.resource).items():
        if name in ("CPU", "GPU", "TPU"):
            raise LaunchError(f"--resource: {name} is not taken here (CPU and GPU have their own flags; for TPU "
                              f"slices use the gke target)")
        try:
            out[name] = float(amount)
            assert 0 < out[name] < math.inf
        except (ValueError, AssertionError):
            raise LaunchError(f"--resource: expected NAME=AMOUNT with AMOUNT > 0, got '{name}={amount}'") from None
    return out


def _storage(path):
    """A local path made absolute (the driver may run elsewhere than here); a URI as given."""
    return os.path.abspath(path) if path and "://" not in path else path


def build(job: Job, args: argparse.Namespace) -> dict:
    """The Ray Train run as a plain dict (what ``--dry-run`` prints as JSON and submission runs)."""
    if args.min_nodes and args.min_nodes > job.nodes:
        raise LaunchError(f"--min-nodes: {args.min_nodes} is more than --nodes {job.nodes}")
    if not _NAME.match(job.name):
        raise LaunchError(f"--name: '{job.name}' is not a valid Ray Train run name (letters, digits, '_', '.', '-')")
    if not args.container_config and os.path.isfile(args.config):
        job.config_path = os.path.abspath(args.config)  # the workers start in --chdir, not here
    return {
        "address": args.address,
        "name": job.name,
        "workers": job.nodes,
        "min_workers": args.min_nodes or job.nodes,
        "resources_per_worker": _resources(args),
        "placement_strategy": PLACEMENT[args.placement],
        "max_failures": args.max_failures,
        "storage_path": _storage(args.storage_path),
        "worker": {"argv": job.train_args(), "env": dict(job.env), "chdir": os.path.abspath(args.chdir),
                   "python": args.python, "coordinator_port": args.coordinator_port},
    }


def check_devices(job: Job, args: argparse.Namespace, per_process: int, platform: str) -> None:
    """An elastic group (``--min-nodes``) may start, and restart, on any worker count from
    ``--min-nodes`` to ``--nodes``: each must take the global batch, as ``--nodes`` itself does
    (:func:`jaxtrain.launch.common.check_mesh`). With ``distributed.elastic`` (and a mesh axis of -1) a
    restart keeps the first count's per-device micro-batch and changes ``train.grad_accum``
    (:mod:`jaxtrain.train.elastic`), so every pair of first and later counts is checked as the
    restarted run would be.

    Raises:
      LaunchError: naming ``--min-nodes``, the worker counts and the key that cannot hold.
    """
    low = args.min_nodes or job.nodes
    if low == job.nodes:
        return
    from jaxtrain.config import MESH_AXES, from_dict
    from jaxtrain.errors import ConfigError
    from jaxtrain.launch.common import check_mesh
    from jaxtrain.parallel.mesh import resolve_sizes
    from jaxtrain.train.elastic import batch_devices, grad_accum_for
    span = f"--min-nodes: the group may start or restart on any of {low}..{job.nodes} workers"
    cfg, counts = job.cfg, range(low, job.nodes + 1)
    elastic = cfg.distributed.elastic and any(getattr(cfg.mesh, a) == -1 for a in MESH_AXES)
    for first in counts:
        try:
            check_mesh(job, first, per_process, platform)  # as the first run on that count sees it
        except (ConfigError, LaunchError) as err:
            if not (elastic and cfg.distributed.device_micro_batch):  # else the accumulation adapts at once
                raise LaunchError(f"{span}, but on {first}: {err}") from None
        if not elastic:
            continue
        per_device = cfg.distributed.device_micro_batch or cfg.micro_batch // batch_devices(
            resolve_sizes(cfg.mesh, first * per_process))
        for later in counts:
            try:
                tree = cfg.to_dict()
                tree["train"]["grad_accum"] = grad_accum_for(
                    cfg.train.global_batch, per_device, batch_devices(resolve_sizes(cfg.mesh, later * per_process)))
                check_mesh(replace(job, cfg=from_dict(tree)), later, per_process, platform)
            except (ConfigError, LaunchError) as err:
                raise LaunchError(f"{span}, but a group started on {first} and restarted on {later} cannot keep "
                                  f"its batch: {err}") from None


def notes(job: Job, args: argparse.Namespace) -> list[str]:
    """Nothing to warn about: a checkpoint directory the nodes do not share is refused by jaxtrain at start."""
    return []


def render(spec: dict) -> str:
    """The run as JSON."""
    return json.dumps(spec, indent=2)


def _trainer(spec: dict, board: str):
    """Ray Train's JaxTrainer for ``spec``, with its JAX backend off (the workers start jaxtrain
    themselves); its workers post an exit no restart can fix to the :class:`ray_worker.ExitBoard` ``board``."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.v2.jax import JaxConfig, JaxTrainer
    workers = spec["workers"] if spec["min_workers"] == spec["workers"] else (spec["min_workers"], spec["workers"])
    scaling = ScalingConfig(num_workers=workers, resources_per_worker=spec["resources_per_worker"],
                            use_gpu="GPU" in spec["resources_per_worker"],
                            placement_strategy=spec["placement_strategy"])
    run = RunConfig(name=spec["name"], storage_path=spec["storage_path"],
                    failure_config=FailureConfig(max_failures=spec["max_failures"]))
    return JaxTrainer(ray_worker.run, train_loop_config={**spec["worker"], "board": board},
                      jax_config=JaxConfig(use_gpu=False, use_tpu=False), scaling_config=scaling, run_config=run)


def _failure(err: BaseException, spec: dict) -> SubmitError:
    """A SubmitError for a failed run, with the training process's exit code when a worker reported one."""
    text = str(err)
    found = re.search(r"jaxtrain\.train exited with code (-?\d+) on worker (\d+) of (\d+) \(node [^)]*\)", text)
    reason = found.group(0) if found else (text.strip().splitlines() or [type(err).__name__])[-1][:300]
    failure = SubmitError(f"Ray Train run '{spec['name']}' failed (--max-failures {spec['max_failures']}): {reason}")
    if found and int(found.group(1)) > 0:
        failure.exit_code = int(found.group(1))  # the job's own exit code, as jaxtrain.train would end
    return failure


def _not_retried(code: int, rank: int, size: int, node: str, spec: dict) -> SubmitError:
    """The launcher's error for a worker whose training ended with an exit no restart can fix."""
    failure = SubmitError(f"Ray Train run '{spec['name']}' failed: jaxtrain.train exited with code {code} "
                          f"({NO_RETRY_EXITS[code]}) on worker {rank} of {size} (node {node}); not retried: a "
                          f"restart would fail the same way (the worker's output above says why)")
    failure.exit_code = code
    return failure


def submit(spec: dict, job: Job, args: argparse.Namespace) -> str:
    """Runs the Ray Train run on the cluster and waits for it; returns the line to print.

    Raises:
      LaunchError: no cluster address, or Ray not installed.
      SubmitError: the cluster is unreachable, the run failed after its restarts (exit code: the
        training process's, when one reported it), or a worker's training ended with an exit no
        restart can fix (bad input 2, divergence 3: that code, at once, without a restart).
    """
    if not spec["address"]:
        raise LaunchError("--address: no Ray cluster given: pass --address HOST:PORT (or auto, or ray://HOST:10001) "
                          "or set RAY_ADDRESS")
    ray = require("ray", "ray", "ray[train]", INSTALL)
    require("ray.train.v2.jax", "ray", "ray[train]", INSTALL)
    try:
        ray.init(address=spec["address"], log_to_driver=True)
    except (ConnectionError, RuntimeError, ValueError) as err:
        raise SubmitError(f"cannot reach the Ray cluster at {spec['address']}: {str(err).splitlines()[0]}") from None
    t0 = time.monotonic()
    error, final = None, None
    try:
        name = f"exits-{spec['name']}-{uuid.uuid4().hex[:8]}"  # one per submission: two may share a run name
        board = ray.remote(num_cpus=0)(ray_worker.ExitBoard).options(
            name=name, namespace=ray_worker.BOARD_NAMESPACE).remote()
        try:
            _trainer(spec, name).fit()  # raises the run's error (TrainingFailedError) once the restarts are spent
        except Exception as err:  # noqa: BLE001 - Ray Train's errors, whatever their class in this Ray version
            error = err
        final = ray.get(board.lowest.remote(), timeout=60)
    finally:
        ray.shutdown()
    if final is not None:
        raise _not_retried(*final, spec)
    if error is not None:
        raise _failure(error, spec)
    workers = spec["workers"] if spec["min_workers"] == spec["workers"] else \
        f"{spec['min_workers']}-{spec['workers']}"
    return f"Ray Train run '{spec['name']}' finished ({workers} workers, {time.monotonic() - t0:.0f} s)"
