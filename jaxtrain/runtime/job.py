"""How a process learns the job's shape: how many processes, which one it is, where the coordinator is.

One table (:data:`SOURCES`) lists every way, in precedence order. Every source present in the
environment is read, and they must agree: two that disagree (``JAX_NUM_PROCESSES=3`` beside a
SLURM step of 2 tasks) are an :class:`InputError` (exit 2) before any wait, never a hang until
``distributed.init_timeout_s``. Where they agree, the first source with a value gives it. The
launchers (``jaxtrain.launch``) set the variables named here:

=========================  ==============================================================================
source                     variables (what each gives: C coordinator, N processes, P process id)
=========================  ==============================================================================
config keys                ``distributed.coordinator_address`` (C), ``.num_processes`` (N), ``.process_id`` (P)
JAXTRAIN_*                 :data:`COORDINATOR_VAR`, :data:`NUM_PROCESSES_VAR`, :data:`PROCESS_ID_VAR`
                           (``jaxtrain.launch gke`` sets C and N; by hand all three)
Ray worker                 :data:`RAY_VARS` (C, N, P: what ``jaxtrain.launch ray``'s workers set)
Kubeflow TrainJob          :data:`KUBEFLOW_VARS` (C, N, P: Kubeflow Trainer's JAX plugin)
Volcano Job                P from ``VC_TASK_INDEX`` (or the older ``VK_TASK_INDEX``; the ``env`` plugin);
                           N and C (task 0's host) from ``VC_<TASK>_HOSTS``/``_NUM`` (the ``svc`` plugin)
JobSet / Indexed Job       P = ``JOBSET_JOB_GLOBAL_INDEX`` x ``JOBSET_PODS_PER_JOB`` + ``JOB_COMPLETION_INDEX``,
                           N = ``JOBSET_GLOBAL_REPLICAS`` x ``JOBSET_PODS_PER_JOB`` (a plain Indexed Job: P alone)
Vertex AI                  ``CLUSTER_SPEC``: the pools that run jaxtrain, ``workerpool0`` (process 0, the
                           coordinator) then ``workerpool1``; reduction-server and evaluator pools not counted
SLURM (srun)               a step: ``SLURM_STEP_NODELIST`` (C: its first host), ``SLURM_STEP_NUM_TASKS``
                           (N), ``SLURM_PROCID`` (P); the port as JAX picks it
TPU pod                    ``TPU_WORKER_HOSTNAMES``, ``TPU_WORKER_ID``, ``MEGASCALE_*``: checked here,
                           given to JAX's own detection
=========================  ==============================================================================

A coordinator's port that is only a default (SLURM's, Volcano's, a TPU pod's) may be overridden by
a source that states one; its host may not.
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Union

from jaxtrain.errors import InputError

COORDINATOR_VAR = "JAXTRAIN_COORDINATOR_ADDRESS"
NUM_PROCESSES_VAR = "JAXTRAIN_NUM_PROCESSES"
PROCESS_ID_VAR = "JAXTRAIN_PROCESS_ID"
RAY_VARS = ("JAXTRAIN_RAY_COORDINATOR_ADDRESS", "JAXTRAIN_RAY_WORLD_SIZE", "JAXTRAIN_RAY_WORLD_RANK")
KUBEFLOW_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
VOLCANO_INDEX_VARS = ("VC_TASK_INDEX", "VK_TASK_INDEX")
JOB_INDEX_VAR = "JOB_COMPLETION_INDEX"  # set by Kubernetes in every pod of an Indexed Job
JOBSET_VARS = ("JOBSET_JOB_GLOBAL_INDEX", "JOBSET_GLOBAL_REPLICAS", "JOBSET_PODS_PER_JOB")
VERTEX_SPEC_VAR = "CLUSTER_SPEC"
SLURM_STEP_VARS = ("SLURM_STEP_NODELIST", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_JOB_ID")
TPU_VARS = ("TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES", "TPU_WORKER_ID", "MEGASCALE_COORDINATOR_ADDRESS",
            "MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID")
DEFAULT_PORT = 8476  # jaxtrain's coordinator port on GKE and Volcano
TPU_PORT = 8482  # JAX's on a TPU pod
PORT_VAR = "JAX_COORDINATOR_PORT"  # JAX's own override of a detected coordinator's port
VERTEX_POOLS = ("workerpool0", "workerpool1")  # primary, workers; not 2 (reduction server) or 3 (evaluators)
_VOLCANO_HOSTS = re.compile(r"^VC_([A-Z0-9_]+)_HOSTS$")
_ADDRESS = re.compile(r"^\[?[A-Za-z0-9_.:-]+\]?:(\d{1,5})$")
FIELDS = {"coordinator": "coordinator_address", "num_processes": "num_processes", "process_id": "process_id"}


@dataclass(frozen=True)
class Value:
    """One value a source gives, and where it came from (``why``, e.g. ``JAX_NUM_PROCESSES=3``)."""

    value: Union[str, int]
    why: str
    exact: bool = True  # a coordinator whose port was stated (False: a default port another source may set)


Reading = dict  # {"coordinator" | "num_processes" | "process_id": Value}


@dataclass(frozen=True)
class Source:
    """One way a process learns the job's shape (a row of the module docstring's table).

    ``read(distributed_config, env)`` returns what the source says ({} when absent). A source whose
    ``jax_detects`` is True is only checked against the others: JAX's own detection reads it."""

    name: str
    variables: tuple[str, ...]
    read: Callable[..., Reading]
    jax_detects: bool = False


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


def _triple(env: Mapping[str, str], names: tuple[str, str, str]) -> Reading:
    """Coordinator, count and id from three variables (those present)."""
    out: Reading = {}
    for field, name in zip(FIELDS, names):
        if env.get(name, "") != "":
            value = env[name] if field == "coordinator" else _int(name, env[name])
            out[field] = Value(value, f"{name}={env[name]}")
    return out


def _config(d, env) -> Reading:
    out: Reading = {}
    for field, key in FIELDS.items():
        value = getattr(d, key)
        if value is not None and value != "":
            out[field] = Value(value, f"distributed.{key}={value}")
    return out


def _port(env: Mapping[str, str], default: int = DEFAULT_PORT) -> int:
    return _int(PORT_VAR, env[PORT_VAR]) if env.get(PORT_VAR) else default


def _volcano(d, env) -> Reading:
    """Volcano: the task index (``env`` plugin), the hosts of the task this pod is in (``svc`` plugin)."""
    out: Reading = {}
    index = [(n, _int(n, env[n])) for n in VOLCANO_INDEX_VARS if env.get(n, "") != ""]
    if index:
        out["process_id"] = Value(index[0][1], f"{index[0][0]}={env[index[0][0]]}")
    tasks = {m.group(1): env[k].split(",") for k in sorted(env) if (m := _VOLCANO_HOSTS.match(k)) and env[k]}
    if len(tasks) > 1:  # several tasks: the one holding this pod (its host name is <job>-<task>-<index>)
        mine = env.get("HOSTNAME", "")
        tasks = {t: h for t, h in tasks.items() if any(x.split(".")[0] == mine for x in h)}
        if len(tasks) != 1:
            raise InputError(f"VC_TASK_INDEX: a Volcano Job of several tasks, and this pod's host name "
                             f"{mine!r} is in {len(tasks)} of their VC_<TASK>_HOSTS lists; run jaxtrain as one task")
    for task, hosts in tasks.items():
        count = env.get(f"VC_{task}_NUM") or str(len(hosts))
        out["num_processes"] = Value(_int(f"VC_{task}_NUM", count), f"VC_{task}_NUM={count}")
        out["coordinator"] = Value(f"{hosts[0]}:{_port(env)}", f"VC_{task}_HOSTS={hosts[0]},...", exact=False)
    return out


def _jobset(d, env) -> Reading:
    """A JobSet's pods: a global index over every Job of every replicated job; an Indexed Job's: its index."""
    if env.get(JOB_INDEX_VAR, "") == "":
        return {}
    pod = _int(JOB_INDEX_VAR, env[JOB_INDEX_VAR])
    if not all(env.get(n) for n in JOBSET_VARS):
        return {"process_id": Value(pod, f"{JOB_INDEX_VAR}={pod}")}
    job, jobs, per_job = (_int(n, env[n]) for n in JOBSET_VARS)
    why = f"JOBSET_JOB_GLOBAL_INDEX={job} x JOBSET_PODS_PER_JOB={per_job} + {JOB_INDEX_VAR}={pod}"
    return {"process_id": Value(job * per_job + pod, why),
            "num_processes": Value(jobs * per_job, f"JOBSET_GLOBAL_REPLICAS={jobs} x JOBSET_PODS_PER_JOB={per_job}")}


def _vertex(d, env) -> Reading:
    """Vertex AI's ``CLUSTER_SPEC``: the jaxtrain pools (``VERTEX_POOLS``) in order; process 0 coordinates."""
    if not env.get(VERTEX_SPEC_VAR):
        return {}
    try:
        spec = json.loads(env[VERTEX_SPEC_VAR])
        cluster, task = spec["cluster"], spec["task"]
        pools = [p for p in VERTEX_POOLS if cluster.get(p)]
        kind, index = task["type"], int(task["index"])
        first, count = cluster[pools[0]][0], sum(len(cluster[p]) for p in pools)
    except (ValueError, KeyError, IndexError, TypeError) as err:
        raise InputError(f"CLUSTER_SPEC: not a Vertex AI cluster spec ({type(err).__name__}: {err})") from None
    if kind not in pools:
        raise InputError(f"CLUSTER_SPEC: this process is in {kind}, but jaxtrain runs in {' and '.join(VERTEX_POOLS)} "
                         f"(the primary and the workers); give the {kind} pool its own container")
    offset = sum(len(cluster[p]) for p in pools[:pools.index(kind)])
    sizes = "+".join(str(len(cluster[p])) for p in pools)
    return {"coordinator": Value(first, f"CLUSTER_SPEC {pools[0]}[0]={first}"),
            "num_processes": Value(count, f"CLUSTER_SPEC {'+'.join(pools)}={sizes}"),
            "process_id": Value(offset + index, f"CLUSTER_SPEC task {kind}[{index}]")}


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``node[01-04,07],gpu1`` -> ``node01``. Raises ValueError."""
    out, i = [], 0
    while i < len(nodelist) and nodelist[i] != ",":
        if nodelist[i] == "[":
            end = nodelist.index("]", i)
            out.append(re.split(r"[-,]", nodelist[i + 1:end])[0])
            i = end + 1
        else:
            out.append(nodelist[i])
            i += 1
    if not out:
        raise ValueError("empty")
    return "".join(out)


def _slurm(d, env) -> Reading:
    """A SLURM step (``srun``): its tasks, this task's rank, its first host at JAX's port for the job."""
    nodes = env.get("SLURM_STEP_NODELIST", "")
    tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
    if not nodes or not tasks:
        return {}
    try:
        host = first_slurm_host(nodes)
    except ValueError:
        raise InputError(f"SLURM_STEP_NODELIST: not a SLURM node list: {nodes!r}") from None
    name = "SLURM_STEP_NUM_TASKS" if env.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
    out = {"num_processes": Value(_int(name, tasks), f"{name}={tasks}")}
    if env.get("SLURM_PROCID", "") != "":
        out["process_id"] = Value(_int("SLURM_PROCID", env["SLURM_PROCID"]), f"SLURM_PROCID={env['SLURM_PROCID']}")
    if env.get("SLURM_JOB_ID") or env.get(PORT_VAR):
        # JAX's choice for a SLURM job: 61440 + job id mod 4096 (unless JAX_COORDINATOR_PORT says otherwise)
        port = _port(env) if env.get(PORT_VAR) else 61440 + _int("SLURM_JOB_ID", env["SLURM_JOB_ID"]) % 4096
        out["coordinator"] = Value(f"{host}:{port}", f"SLURM_STEP_NODELIST={nodes} (first host {host})", exact=False)
    return out


def _tpu(d, env) -> Reading:
    """A multi-host TPU slice (or several, ``MEGASCALE_*``) as JAX's own detection reads it."""
    hosts = [h for h in (env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES") or "").split(",") if h]
    coordinator = env.get("MEGASCALE_COORDINATOR_ADDRESS") or (hosts[0] if len(hosts) > 1 else "")
    if not coordinator:
        return {}
    slices = _int("MEGASCALE_NUM_SLICES", env.get("MEGASCALE_NUM_SLICES") or 1)
    host = coordinator.split(":")[0] if coordinator.count(":") == 1 else coordinator
    out = {"coordinator": Value(f"{host}:{_port(env, TPU_PORT)}", f"TPU coordinator host {host}", exact=False)}
    if hosts:
        why = f"TPU_WORKER_HOSTNAMES ({len(hosts)} hosts) x {slices} slices"
        out["num_processes"] = Value(len(hosts) * slices, why)
        if env.get("TPU_WORKER_ID", "") != "":
            slice_id = _int("MEGASCALE_SLICE_ID", env.get("MEGASCALE_SLICE_ID") or 0)
            pid = slice_id * len(hosts) + _int("TPU_WORKER_ID", env["TPU_WORKER_ID"])
            out["process_id"] = Value(pid, f"TPU_WORKER_ID={env['TPU_WORKER_ID']} in slice {slice_id}")
    return out


SOURCES = (
    Source("distributed.* config keys", (), _config),
    Source("JAXTRAIN_* environment", (COORDINATOR_VAR, NUM_PROCESSES_VAR, PROCESS_ID_VAR),
           lambda d, env: _triple(env, (COORDINATOR_VAR, NUM_PROCESSES_VAR, PROCESS_ID_VAR))),
    Source("Ray worker", RAY_VARS, lambda d, env: _triple(env, RAY_VARS)),
    Source("Kubeflow TrainJob", KUBEFLOW_VARS, lambda d, env: _triple(env, KUBEFLOW_VARS)),
    Source("Volcano Job", VOLCANO_INDEX_VARS, _volcano),
    Source("JobSet / Indexed Job", (JOB_INDEX_VAR, *JOBSET_VARS), _jobset),
    Source("Vertex AI CLUSTER_SPEC", (VERTEX_SPEC_VAR,), _vertex),
    Source("SLURM (srun)", SLURM_STEP_VARS, _slurm),
    Source("TPU pod", TPU_VARS, _tpu, jax_detects=True),
)
SHAPE_VARS = tuple(v for s in SOURCES for v in s.variables)


def is_shape_variable(name: str) -> bool:
    """True for a variable some source reads (the launchers and platforms set these, never ``--env``)."""
    return name in SHAPE_VARS or bool(re.match(r"^VC_[A-Z0-9_]+_(HOSTS|NUM)$", name))


def _split(address: str) -> tuple[str, str]:
    host, _, port = address.rpartition(":")
    return host.strip("[]").lower(), port


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def same_host(a: str, b: str) -> bool:
    """Whether two host names (or addresses) name one host: equal, the same first DNS label
    (``node01`` and ``node01.cluster``), or a name resolving to the other's address. A name that
    does not resolve here counts as the same host (unknown is not a contradiction)."""
    if a == b:
        return True
    if _is_ip(a) and _is_ip(b):
        return False
    if not _is_ip(a) and not _is_ip(b):
        return a.split(".")[0] == b.split(".")[0]
    ip, name = (a, b) if _is_ip(a) else (b, a)
    try:
        return ip in {info[4][0] for info in socket.getaddrinfo(name, None)}
    except OSError:
        return True


def _agree(field: str, a: Value, b: Value) -> bool:
    if field != "coordinator":
        return a.value == b.value
    (host_a, port_a), (host_b, port_b) = _split(str(a.value)), _split(str(b.value))
    return same_host(host_a, host_b) and (not (a.exact and b.exact) or port_a == port_b)


def _merge(readings: list) -> dict:
    """``{field: (source, Value)}``: the first source's value per field (a stated port before a default).

    Raises:
      InputError: two sources give different values for one field, naming both.
    """
    chosen: dict = {}
    for src, reading in readings:
        for field, value in reading.items():
            if field not in chosen:
                chosen[field] = (src, value)
                continue
            first_src, first = chosen[field]
            if not _agree(field, first, value):
                raise InputError(
                    f"distributed.{FIELDS[field]}: two descriptions of this job disagree: {first.why} "
                    f"({first_src.name}) but {value.why} ({src.name}); the processes would wait for peers that "
                    f"never come. Remove the one that does not describe this job (or set distributed.mode=off "
                    f"to train as one process)")
            if field == "coordinator" and value.exact and not first.exact:
                chosen[field] = (src, value)  # the stated port wins over a default one
    return chosen


def _refuse_slurm_allocation(env: Mapping[str, str]) -> None:
    """A SLURM allocation of several tasks with no step: started without ``srun``, it would train alone."""
    tasks = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS")
    nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    if not env.get("SLURM_JOB_ID") or env.get("SLURM_STEP_NODELIST"):
        return
    if (tasks and _int("SLURM_NTASKS", tasks) > 1) or (nodes and _int("SLURM_JOB_NUM_NODES", nodes) > 1):
        raise InputError(f"SLURM_NTASKS: SLURM job {env['SLURM_JOB_ID']} has {tasks or '?'} tasks on {nodes or '?'} "
                         f"nodes, but this process is not in a job step: started without srun, it would train "
                         f"alone. Start it with `srun python -m jaxtrain.train ...` (python -m jaxtrain.launch slurm "
                         f"does), or set distributed.mode=off to train as one process")


def _tpu_vm() -> bool:
    """This machine has TPU chips (a TPU VM, whose slice JAX learns from the metadata server)."""
    try:
        from jax._src import hardware_utils
        return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
    except Exception:  # noqa: BLE001 - a private API: without it, no TPU VM
        return False


def detect(d, env: Mapping[str, str] = os.environ) -> Optional[Plan]:
    """This process's :class:`Plan`, or None for a single-process run.

    Args:
      d: the ``distributed`` config section (:class:`jaxtrain.config.schema.DistributedConfig`).

    Raises:
      InputError: a malformed value (naming the key or variable), two sources that disagree, a
        value missing when the others are given, a process id outside ``[0, num_processes)``, a
        SLURM allocation of several tasks entered without ``srun``, or ``distributed.mode=on``
        with nothing describing the job.
    """
    if d.mode == "off":
        return None
    readings = [(s, r) for s in SOURCES if (r := s.read(d, env))]
    chosen = _merge(readings)
    if not {"coordinator", "num_processes"} & chosen.keys():
        _refuse_slurm_allocation(env)
        if d.mode != "on":
            return None  # a process id alone (an Indexed Job's pods, a sweep) is not a multi-process job
        if not chosen:
            if _tpu_vm():
                return Plan("TPU VM (JAX's own detection)")
            raise InputError("distributed.mode: 'on', but nothing describes the job: no distributed.* keys and no "
                             "variables of any source (JAXTRAIN_*, Kubeflow's JAX_*, Volcano, JobSet, Vertex AI, "
                             "SLURM, TPU, a Ray worker); set distributed.coordinator_address, num_processes and "
                             "process_id, or use auto")
    return _plan(d, readings, chosen)


def _plan(d, readings: list, chosen: dict) -> Optional[Plan]:
    """The Plan of the merged values (None for one process), after checking that none is missing or out
    of range. Raises InputError naming the key."""
    explicit = [s for s, _ in readings if not s.jax_detects]
    source = " + ".join(s.name for s, _ in readings)
    if explicit:
        for field, key in FIELDS.items():
            if field not in chosen:
                raise InputError(f"distributed.{key}: not set (the job's other values came from {explicit[0].name})")
    values = {f: v.value for f, (_, v) in chosen.items()}
    coord, num, pid = values.get("coordinator"), values.get("num_processes"), values.get("process_id")
    port = _ADDRESS.match(str(coord)) if coord is not None else None
    if coord is not None and (not port or not 1 <= int(port.group(1)) <= 65535):
        raise InputError(f"distributed.coordinator_address: expected host:port (port 1..65535), got {coord!r}")
    if num is not None and (num < 1 or (pid is not None and not 0 <= pid < num)):
        raise InputError(f"distributed.process_id: {pid} is not in [0, {num}) (distributed.num_processes={num}; "
                         f"from {source})")
    if num == 1 and d.mode != "on":
        return None
    # A value only a TPU pod gave is left to JAX's own detection, which reads the same variables.
    given = {f: v.value for f, (s, v) in chosen.items() if not s.jax_detects}
    return Plan(source, given.get("coordinator"), given.get("num_processes"), given.get("process_id"))
