"""How a process learns the job's shape: how many processes, which one it is, where the coordinator is.

One table (:data:`SOURCES`) lists every way, in precedence order, first match wins (:func:`detect`);
the launchers (``jaxtrain.launch``) set the variables named here, so detection and launchers
share one source of truth:

==================  =======================================================================
source              variables
==================  =======================================================================
config keys         ``distributed.coordinator_address``, ``.num_processes``, ``.process_id``
                    (each overrides the same value from the environment)
jaxtrain / GKE      :data:`COORDINATOR_VAR`, :data:`NUM_PROCESSES_VAR`, and :data:`PROCESS_ID_VAR`
                    or an Indexed Job's :data:`JOB_INDEX_VAR` (what ``jaxtrain.launch gke`` sets)
Vertex AI           :data:`VERTEX_SPEC_VAR` (the chief pool ``workerpool0`` is process 0, its first
                    host the coordinator; the workers of ``workerpool1`` follow)
SLURM               a step with several tasks (``srun``): :data:`SLURM_STEP_VARS`; JAX's own
                    cluster detection reads the rest
TPU pod             :data:`TPU_VARS`: JAX's own detection
==================  =======================================================================
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional

from jaxtrain.errors import InputError

COORDINATOR_VAR = "JAXTRAIN_COORDINATOR_ADDRESS"
NUM_PROCESSES_VAR = "JAXTRAIN_NUM_PROCESSES"
PROCESS_ID_VAR = "JAXTRAIN_PROCESS_ID"
JOB_INDEX_VAR = "JOB_COMPLETION_INDEX"  # a Kubernetes Indexed Job's (a JobSet's) pod index
VERTEX_SPEC_VAR = "CLUSTER_SPEC"
SLURM_STEP_VARS = ("SLURM_STEP_NODELIST", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
TPU_VARS = ("TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS")


@dataclass(frozen=True)
class Source:
    """One way a process learns the job's shape (a row of the module docstring's table)."""

    name: str
    variables: tuple[str, ...]


SOURCES = (
    Source("distributed.* config keys", ()),
    Source("JAXTRAIN_* environment", (COORDINATOR_VAR, NUM_PROCESSES_VAR, PROCESS_ID_VAR, JOB_INDEX_VAR)),
    Source("Vertex AI CLUSTER_SPEC", (VERTEX_SPEC_VAR,)),
    Source("SLURM (srun)", SLURM_STEP_VARS),
    Source("TPU pod", TPU_VARS),
)
LAUNCHER_VARS = tuple(v for s in SOURCES[1:3] for v in s.variables)  # set by jaxtrain.launch, never by users
_ADDRESS = re.compile(r"^\[?[A-Za-z0-9_.:-]+\]?:(\d{1,5})$")


@dataclass(frozen=True)
class Plan:
    """How this process joins the job. ``coordinator`` etc. None: JAX's own detection fills them in."""

    source: str  # where the shape came from, for the log line
    coordinator: Optional[str] = None
    num_processes: Optional[int] = None
    process_id: Optional[int] = None


def _int(name: str, value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise InputError(f"{name}: expected an integer, got {value!r}") from None


def _vertex(spec_text: str) -> tuple[str, int, int]:
    """(coordinator, processes, this process) from Vertex AI's ``CLUSTER_SPEC`` JSON."""
    try:
        spec = json.loads(spec_text)
        cluster, task = spec["cluster"], spec["task"]
        pools = [cluster[k] for k in sorted(cluster) if k.startswith("workerpool")]
        order = sorted(k for k in cluster if k.startswith("workerpool"))
        offset = sum(len(cluster[k]) for k in order[:order.index(task["type"])])
        return pools[0][0], sum(len(p) for p in pools), offset + int(task["index"])
    except (ValueError, KeyError, IndexError, TypeError) as err:
        raise InputError(f"CLUSTER_SPEC: not a Vertex AI cluster spec ({type(err).__name__}: {err})") from None


def detect(d, env: Mapping[str, str] = os.environ) -> Optional[Plan]:
    """This process's :class:`Plan`, or None for a single-process run.

    Args:
      d: the ``distributed`` config section (:class:`jaxtrain.config.schema.DistributedConfig`).

    Raises:
      InputError: a malformed value (naming the key or environment variable), or a process id
        outside ``[0, num_processes)``.
    """
    if d.mode == "off":
        return None
    coord, num, pid, source = None, None, None, ""
    if env.get(COORDINATOR_VAR) or env.get(NUM_PROCESSES_VAR):
        coord, source = env.get(COORDINATOR_VAR), SOURCES[1].name
        num = _int(NUM_PROCESSES_VAR, env.get(NUM_PROCESSES_VAR))
        pid_var = PROCESS_ID_VAR if PROCESS_ID_VAR in env else JOB_INDEX_VAR
        pid = _int(pid_var, env.get(pid_var)) if pid_var in env else None
    elif env.get(VERTEX_SPEC_VAR):
        (coord, num, pid), source = _vertex(env[VERTEX_SPEC_VAR]), SOURCES[2].name
    if d.coordinator_address or d.num_processes or d.process_id is not None:
        source = SOURCES[0].name
    coord = d.coordinator_address or coord
    num = d.num_processes if d.num_processes is not None else num
    pid = d.process_id if d.process_id is not None else pid
    if source:
        for key, value in (("coordinator_address", coord), ("num_processes", num), ("process_id", pid)):
            if value is None:
                raise InputError(f"distributed.{key}: not set (the job's other values came from {source})")
        port = _ADDRESS.match(coord)
        if not port or not 1 <= int(port.group(1)) <= 65535:
            raise InputError(f"distributed.coordinator_address: expected host:port (port 1..65535), got {coord!r}")
        if num < 1 or not 0 <= pid < num:
            raise InputError(f"distributed.process_id: {pid} is not in [0, {num}) "
                             f"(distributed.num_processes={num}; from {source})")
        return Plan(source, coord, num, pid) if num > 1 or d.mode == "on" else None
    slurm_tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
    if env.get("SLURM_STEP_NODELIST") and slurm_tasks and _int("SLURM_STEP_NUM_TASKS", slurm_tasks) > 1:
        return Plan(SOURCES[3].name)
    if "," in env.get("TPU_WORKER_HOSTNAMES", "") or env.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return Plan(SOURCES[4].name)
    return Plan("jax.distributed auto-detection") if d.mode == "on" else None
