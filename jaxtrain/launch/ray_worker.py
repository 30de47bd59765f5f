"""The worker side of ``python -m jaxtrain.launch ray``: what each Ray Train worker runs.

:func:`run` (Ray Train's ``train_loop_per_worker``) learns its rank and the group's size from Ray
Train, takes the coordinator address that worker 0 publishes (its node's IP and a free port,
``broadcast_from_rank_zero``), and starts ``python -m jaxtrain.train`` as a child process with
the Ray worker variables of ``jaxtrain.runtime.job`` (:data:`~jaxtrain.runtime.job.RAY_VARS`). The
job-shape variables the Ray node itself inherited (a SLURM step, a JobSet pod, ...) are left out:
for this job Ray's numbering is the one that holds.

A child, not ``jaxtrain.train`` inside the Ray worker: the training process needs the main thread
for its signal handlers, its own ``XLA_FLAGS`` before jax is imported, and its own stdout (every
process but 0 silences its own). The child dies with the worker (``PR_SET_PDEATHSIG``, set by
``python -m jaxtrain.launch.ray_worker PARENT_PID COMMAND...`` before it execs the command), so a
worker group that Ray Train tears down never leaves a training process behind holding the run
directory while the next group starts.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from typing import Mapping

from jaxtrain.errors import NO_RETRY_EXITS
from jaxtrain.runtime.job import RAY_VARS, TPU_VARS, is_shape_variable

PR_SET_PDEATHSIG = 1  # linux/prctl.h
BOARD_NAMESPACE = "jaxtrain"  # the Ray namespace of the launcher's ExitBoard actor


class TrainingExited(RuntimeError):
    """``jaxtrain.train`` on one worker ended with a non-zero exit code: Ray Train restarts the group
    (``--max-failures``), and the launcher reports the code."""

    def __init__(self, code: int, rank: int, size: int, node: str):
        super().__init__(f"jaxtrain.train exited with code {code} on worker {rank} of {size} (node {node})")
        self.code, self.rank, self.size, self.node = code, rank, size, node

    def __reduce__(self):
        # Ray sends a worker's exception to the driver serialized; the default rebuilds it from the
        # message alone (BaseException.args), which this __init__ cannot take: the driver then failed
        # with a TypeError and lost the training's exit code.
        return type(self), (self.code, self.rank, self.size, self.node)


class ExitBoard:
    """Where the workers post an exit no restart can fix (:data:`jaxtrain.errors.NO_RETRY_EXITS`: bad
    input, divergence), for the launcher to read: a Ray actor that the launcher starts, named per
    submission. Ray Train retries every worker error up to ``--max-failures`` and lets nobody
    choose, so such a worker ends its Ray Train function normally (nothing to retry) and posts its
    code here instead; the launcher then ends with that code."""

    def __init__(self):
        self.exits: dict[int, tuple[int, int, int, str]] = {}

    def post(self, code: int, rank: int, size: int, node: str) -> None:
        self.exits.setdefault(rank, (code, rank, size, node))

    def lowest(self):
        """(code, rank, size, node) of the lowest worker rank that posted, or None."""
        return self.exits[min(self.exits)] if self.exits else None


def child_env(base: Mapping[str, str], extra: Mapping[str, str], coordinator: str, size: int,
              rank: int) -> dict[str, str]:
    """The training process's environment: ``base`` without other job-shape variables (a TPU host's
    own are kept: they describe the hardware), then ``--env``, then the Ray worker variables."""
    env = {k: v for k, v in base.items() if not is_shape_variable(k) or k in TPU_VARS}
    env.update(extra)
    env.update(zip(RAY_VARS, (coordinator, str(size), str(rank))))
    return env


def coordinator_address(ip: str, port: int) -> str:
    """``ip:port`` for the coordinator on this node; port 0: one that is free now."""
    if not port:
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
            port = s.getsockname()[1]
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def run(config: dict) -> None:
    """Ray Train's ``train_loop_per_worker``: one ``jaxtrain.train`` process for this worker.

    Args:
      config: the ``worker`` part of the launcher's spec: ``argv`` (after ``python -m
        jaxtrain.train``), ``env``, ``chdir``, ``python`` (None: this worker's interpreter),
        ``coordinator_port`` (0: a free one on worker 0's node) and ``board`` (the name of the
        launcher's :class:`ExitBoard`, where an exit no restart can fix is posted instead of raised).

    Raises:
      TrainingExited: the training process ended with a non-zero exit code (or a signal: -N) that a
        restart may fix.
      RuntimeError: ``chdir`` is not a directory on this node.
    """
    import ray
    import ray.train
    from ray.train.collective import broadcast_from_rank_zero
    ctx = ray.train.get_context()
    rank, size = ctx.get_world_rank(), ctx.get_world_size()
    ip = ray.util.get_node_ip_address()
    coordinator = broadcast_from_rank_zero(coordinator_address(ip, config["coordinator_port"]) if rank == 0 else None)
    if not os.path.isdir(config["chdir"]):
        raise RuntimeError(f"worker {rank} of {size}: --chdir {config['chdir']} is not a directory on node {ip}")
    python = config["python"] or sys.executable
    command = [python, "-m", "jaxtrain.train", *config["argv"]]
    print(f"jaxtrain.launch ray: worker {rank} of {size} on node {ip}: coordinator {coordinator}", flush=True)
    child = subprocess.Popen([sys.executable, "-m", __name__, str(os.getpid()), *command], cwd=config["chdir"],
                             env=child_env(os.environ, config["env"], coordinator, size, rank))
    code = child.wait()
    if code in NO_RETRY_EXITS and config.get("board"):
        board = ray.get_actor(config["board"], namespace=BOARD_NAMESPACE)
        ray.get(board.post.remote(code, rank, size, ip), timeout=60)
        print(f"jaxtrain.launch ray: worker {rank} of {size}: jaxtrain.train exited with code {code} "
              f"({NO_RETRY_EXITS[code]}): not retried", flush=True)
        return  # a raise would make Ray Train restart the group, which would fail the same way
    if code:
        raise TrainingExited(code, rank, size, ip)


def exec_dying_with_parent(parent: int, command: list[str]) -> None:
    """Asks the kernel to SIGKILL this process when its parent ``parent`` dies, then execs
    ``command`` (the setting survives exec). Exits 1 at once if the parent is already gone."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the prctl: the signal will never come
        sys.exit(1)
    os.execvp(command[0], command)


if __name__ == "__main__":
    exec_dying_with_parent(int(sys.argv[1]), sys.argv[2:])
