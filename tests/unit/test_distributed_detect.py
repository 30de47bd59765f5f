"""How a process learns the job's shape (jaxtrain.runtime.job.detect): one test per row of the table of
sources (config keys, JAXTRAIN_*, a Ray worker, Kubeflow's JAX_*, Volcano, JobSet / Indexed Job,
Vertex AI, SLURM, TPU) and one per conflict between them; exact errors."""
import json

import pytest

from jaxtrain.config.schema import DistributedConfig
from jaxtrain.errors import InputError
from jaxtrain.runtime import job
from jaxtrain.runtime.job import Plan, detect

VERTEX = {"cluster": {"workerpool0": ["chief-0:2222"], "workerpool1": ["w-0:2222", "w-1:2222", "w-2:2222"]},
          "task": {"type": "workerpool1", "index": 2}}
SLURM = {"SLURM_JOB_ID": "4100", "SLURM_STEP_NODELIST": "node[03-04,07]", "SLURM_STEP_NUM_TASKS": "2",
         "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
VOLCANO = {"VC_TASK_INDEX": "1", "VK_TASK_INDEX": "1", "VC_WORKER_HOSTS": "shk-worker-0.shk,shk-worker-1.shk",
           "VC_WORKER_NUM": "2"}
CONFLICT_TAIL = ("; the processes would wait for peers that never come. Remove the one that does not describe "
                 "this job (or set distributed.mode=off to train as one process)")
JAXTRAIN = "JAXTRAIN_* environment"


def _error(env, **cfg) -> str:
    with pytest.raises(InputError) as err:
        detect(DistributedConfig(**cfg), env)
    return str(err.value)


def test_single_process_without_any_hint():
    assert detect(DistributedConfig(), {}) is None
    assert detect(DistributedConfig(mode="off"), {"JAXTRAIN_NUM_PROCESSES": "4", **SLURM}) is None


def test_row_config_keys():
    d = DistributedConfig(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=1)
    assert detect(d, {}) == Plan("distributed.* config keys", "10.0.0.1:1234", 2, 1)
    assert detect(DistributedConfig(coordinator_address="h:1", num_processes=1, process_id=0), {}) is None
    assert detect(DistributedConfig(mode="on", coordinator_address="h:1", num_processes=1, process_id=0),
                  {}) == Plan("distributed.* config keys", "h:1", 1, 0)


def test_row_jaxtrain_environment():
    env = {"JAXTRAIN_COORDINATOR_ADDRESS": "a:1", "JAXTRAIN_NUM_PROCESSES": "2", "JAXTRAIN_PROCESS_ID": "1"}
    assert detect(DistributedConfig(), env) == Plan(JAXTRAIN, "a:1", 2, 1)
    # config keys fill in what the environment lacks, and may repeat what it says
    env.pop("JAXTRAIN_PROCESS_ID")
    assert detect(DistributedConfig(process_id=0, num_processes=2), env) == Plan(
        f"distributed.* config keys + {JAXTRAIN}", "a:1", 2, 0)


def test_row_ray_worker():
    env = {"JAXTRAIN_RAY_COORDINATOR_ADDRESS": "10.1.2.3:40001", "JAXTRAIN_RAY_WORLD_SIZE": "4",
           "JAXTRAIN_RAY_WORLD_RANK": "3"}
    assert detect(DistributedConfig(), env) == Plan("Ray worker", "10.1.2.3:40001", 4, 3)


def test_row_kubeflow_trainjob():
    env = {"JAX_COORDINATOR_ADDRESS": "shk-node-0-0.shk:6666", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1",
           "JOB_COMPLETION_INDEX": "1"}  # a TrainJob's pods are an Indexed Job's too: the same index
    assert detect(DistributedConfig(), env) == Plan("Kubeflow TrainJob + JobSet / Indexed Job",
                                                    "shk-node-0-0.shk:6666", 2, 1)


def test_row_volcano_job():
    assert detect(DistributedConfig(), VOLCANO) == Plan("Volcano Job", "shk-worker-0.shk:8476", 2, 1)
    older = {k: v for k, v in VOLCANO.items() if k != "VC_TASK_INDEX"}  # Volcano before VC_*: VK_TASK_INDEX
    assert detect(DistributedConfig(), {**older, "JAX_COORDINATOR_PORT": "1234"}) == Plan(
        "Volcano Job", "shk-worker-0.shk:1234", 2, 1)
    two_tasks = {**VOLCANO, "VC_TB_HOSTS": "shk-tb-0.shk", "VC_TB_NUM": "1", "HOSTNAME": "shk-worker-1"}
    assert detect(DistributedConfig(), two_tasks).num_processes == 2  # the task this pod is in
    assert _error({**two_tasks, "HOSTNAME": "elsewhere"}) == (
        "VC_TASK_INDEX: a Volcano Job of several tasks, and this pod's host name 'elsewhere' is in 0 of their "
        "VC_<TASK>_HOSTS lists; run jaxtrain as one task")
    assert detect(DistributedConfig(), {"VC_TASK_INDEX": "3"}) is None  # an index alone: no job of several


def test_row_jobset_gives_unique_ids_over_replicated_jobs_and_replicas():
    """2 Jobs (two replicated jobs of 1 replica, or one of 2) x 2 pods: ids 0..3, not [0, 1, 0, 1]."""
    base = {"JAXTRAIN_COORDINATOR_ADDRESS": "shk-workers-0-0.shk:8476", "JAXTRAIN_NUM_PROCESSES": "4",
            "JOBSET_GLOBAL_REPLICAS": "2", "JOBSET_PODS_PER_JOB": "2"}
    ids = [detect(DistributedConfig(), {**base, "JOBSET_JOB_GLOBAL_INDEX": str(j), "JOB_COMPLETION_INDEX": str(p)})
           for j in (0, 1) for p in (0, 1)]
    assert [plan.process_id for plan in ids] == [0, 1, 2, 3]
    assert ids[3] == Plan(f"{JAXTRAIN} + JobSet / Indexed Job", "shk-workers-0-0.shk:8476", 4, 3)
    indexed = {"JAXTRAIN_COORDINATOR_ADDRESS": "h:1", "JAXTRAIN_NUM_PROCESSES": "3", "JOB_COMPLETION_INDEX": "2"}
    assert detect(DistributedConfig(), indexed).process_id == 2  # a plain Indexed Job: its completion index
    assert detect(DistributedConfig(), {"JOB_COMPLETION_INDEX": "5"}) is None  # a sweep's pods train alone


def test_row_vertex_counts_only_the_pools_that_run_jaxtrain():
    plan = detect(DistributedConfig(), {"CLUSTER_SPEC": json.dumps(VERTEX)})
    assert plan == Plan("Vertex AI CLUSTER_SPEC", "chief-0:2222", 4, 3)
    chief = {**VERTEX, "task": {"type": "workerpool0", "index": 0}}
    assert detect(DistributedConfig(), {"CLUSTER_SPEC": json.dumps(chief)}).process_id == 0
    # a reduction-server pool (2) and an evaluator pool (3) do not join: 4 processes, not 7
    cluster = {**VERTEX["cluster"], "workerpool2": ["rs-0:2222", "rs-1:2222"], "workerpool3": ["ev-0:2222"]}
    assert detect(DistributedConfig(), {"CLUSTER_SPEC": json.dumps({**VERTEX, "cluster": cluster})}) == plan
    server = {"cluster": cluster, "task": {"type": "workerpool2", "index": 0}}
    assert _error({"CLUSTER_SPEC": json.dumps(server)}) == (
        "CLUSTER_SPEC: this process is in workerpool2, but jaxtrain runs in workerpool0 and workerpool1 (the primary "
        "and the workers); give the workerpool2 pool its own container")
    single = {"cluster": {"workerpool0": ["c-0:2222"]}, "task": {"type": "workerpool0", "index": 0}}
    assert detect(DistributedConfig(), {"CLUSTER_SPEC": json.dumps(single)}) is None


def test_row_slurm_step():
    # JAX's port for a SLURM job: 61440 + job id % 4096
    assert detect(DistributedConfig(), SLURM) == Plan("SLURM (srun)", "node03:61444", 2, 1)
    assert detect(DistributedConfig(), {**SLURM, "SLURM_STEP_NODELIST": "gpu7,node[01-02]"}).coordinator == \
        "gpu7:61444"
    assert detect(DistributedConfig(), {**SLURM, "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1",
                                        "SLURM_PROCID": "0"}) is None
    assert job.first_slurm_host("rack[2-3]-n[08,09]") == "rack2-n08"


def test_slurm_allocation_without_srun_is_named():
    alloc = {"SLURM_JOB_ID": "88", "SLURM_NTASKS": "8", "SLURM_JOB_NUM_NODES": "2"}
    assert _error(alloc) == (
        "SLURM_NTASKS: SLURM job 88 has 8 tasks on 2 nodes, but this process is not in a job step: started "
        "without srun, it would train alone. Start it with `srun python -m jaxtrain.train ...` (python -m "
        "jaxtrain.launch slurm does), or set distributed.mode=off to train as one process")
    assert detect(DistributedConfig(mode="off"), alloc) is None
    assert detect(DistributedConfig(), {"SLURM_JOB_ID": "88", "SLURM_NTASKS": "1"}) is None  # one task: fine


def test_row_tpu_pod_is_checked_then_left_to_jax():
    env = {"TPU_WORKER_HOSTNAMES": "t0,t1", "TPU_WORKER_ID": "1"}
    assert detect(DistributedConfig(), env) == Plan("TPU pod")
    multislice = {"TPU_WORKER_HOSTNAMES": "t0,t1", "TPU_WORKER_ID": "1", "MEGASCALE_COORDINATOR_ADDRESS": "t0:8080",
                  "MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "1"}
    gke = {"JAXTRAIN_COORDINATOR_ADDRESS": "t0.svc:8476", "JAXTRAIN_NUM_PROCESSES": "4", "JAXTRAIN_PROCESS_ID": "3"}
    assert detect(DistributedConfig(), {**multislice, **gke}) == Plan(f"{JAXTRAIN} + TPU pod", "t0.svc:8476", 4, 3)
    assert detect(DistributedConfig(), {"TPU_WORKER_HOSTNAMES": "t0"}) is None  # one host


def test_mode_on_with_nothing_to_go_on_is_named(monkeypatch):
    assert _error({}, mode="on") == (
        "distributed.mode: 'on', but nothing describes the job: no distributed.* keys and no variables of any "
        "source (JAXTRAIN_*, Kubeflow's JAX_*, Volcano, JobSet, Vertex AI, SLURM, TPU, a Ray worker); set "
        "distributed.coordinator_address, num_processes and process_id, or use auto")
    assert _error({"JOB_COMPLETION_INDEX": "1"}, mode="on") == (
        "distributed.coordinator_address: not set (the job's other values came from JobSet / Indexed Job)")
    monkeypatch.setattr(job, "_tpu_vm", lambda: True)  # a TPU VM: JAX asks the metadata server
    assert detect(DistributedConfig(mode="on"), {}) == Plan("TPU VM (JAX's own detection)")


@pytest.mark.parametrize("env, cfg, message", [
    ({"JAX_COORDINATOR_ADDRESS": "node03:1234", "JAX_NUM_PROCESSES": "3", "JAX_PROCESS_ID": "1", **SLURM}, {},
     "distributed.num_processes: two descriptions of this job disagree: JAX_NUM_PROCESSES=3 (Kubeflow TrainJob) "
     "but SLURM_STEP_NUM_TASKS=2 (SLURM (srun))"),
    (SLURM, {"coordinator_address": "login1:1234"},
     "distributed.coordinator_address: two descriptions of this job disagree: "
     "distributed.coordinator_address=login1:1234 (distributed.* config keys) but "
     "SLURM_STEP_NODELIST=node[03-04,07] (first host node03) (SLURM (srun))"),
    ({"JAXTRAIN_COORDINATOR_ADDRESS": "a:1", "JAXTRAIN_NUM_PROCESSES": "2", "JAXTRAIN_PROCESS_ID": "1"},
     {"process_id": 0},
     "distributed.process_id: two descriptions of this job disagree: distributed.process_id=0 (distributed.* "
     "config keys) but JAXTRAIN_PROCESS_ID=1 (JAXTRAIN_* environment)"),
    ({"JAXTRAIN_COORDINATOR_ADDRESS": "a:1", "JAXTRAIN_NUM_PROCESSES": "4", "JAXTRAIN_PROCESS_ID": "1",
      "JOB_COMPLETION_INDEX": "1", "JOBSET_JOB_GLOBAL_INDEX": "1", "JOBSET_GLOBAL_REPLICAS": "2",
      "JOBSET_PODS_PER_JOB": "2"}, {},  # a JobSet whose pods were given their Job's index as the process id
     "distributed.process_id: two descriptions of this job disagree: JAXTRAIN_PROCESS_ID=1 (JAXTRAIN_* "
     "environment) but JOBSET_JOB_GLOBAL_INDEX=1 x JOBSET_PODS_PER_JOB=2 + JOB_COMPLETION_INDEX=1 "
     "(JobSet / Indexed Job)"),
    ({"JAXTRAIN_RAY_COORDINATOR_ADDRESS": "10.0.0.5:4000", "JAXTRAIN_RAY_WORLD_SIZE": "2",
      "JAXTRAIN_RAY_WORLD_RANK": "0", **VOLCANO}, {},
     "distributed.process_id: two descriptions of this job disagree: JAXTRAIN_RAY_WORLD_RANK=0 (Ray worker) but "
     "VC_TASK_INDEX=1 (Volcano Job)"),
    ({"JAX_COORDINATOR_ADDRESS": "a:1", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "1",
      "CLUSTER_SPEC": json.dumps(VERTEX)}, {},
     "distributed.coordinator_address: two descriptions of this job disagree: JAX_COORDINATOR_ADDRESS=a:1 "
     "(Kubeflow TrainJob) but CLUSTER_SPEC workerpool0[0]=chief-0:2222 (Vertex AI CLUSTER_SPEC)"),
    ({"JAXTRAIN_COORDINATOR_ADDRESS": "t0:8476", "JAXTRAIN_NUM_PROCESSES": "2", "JAXTRAIN_PROCESS_ID": "0",
      "TPU_WORKER_HOSTNAMES": "t0,t1,t2,t3", "TPU_WORKER_ID": "0"}, {},
     "distributed.num_processes: two descriptions of this job disagree: JAXTRAIN_NUM_PROCESSES=2 (JAXTRAIN_* "
     "environment) but TPU_WORKER_HOSTNAMES (4 hosts) x 1 slices (TPU pod)"),
])
def test_sources_that_disagree_are_named_before_any_wait(env, cfg, message):
    assert _error(env, **cfg) == message + CONFLICT_TAIL


def test_sources_that_agree_join_and_a_stated_port_wins():
    env = {**SLURM, "JAXTRAIN_COORDINATOR_ADDRESS": "node03.cluster:5000", "JAXTRAIN_NUM_PROCESSES": "2"}
    assert detect(DistributedConfig(), env) == Plan(f"{JAXTRAIN} + SLURM (srun)", "node03.cluster:5000", 2, 1)
    assert job.same_host("node03", "node03.cluster.local") and not job.same_host("node03", "node04")
    assert job.same_host("localhost", "127.0.0.1") and not job.same_host("10.0.0.1", "10.0.0.2")


@pytest.mark.parametrize("env, cfg, message", [
    ({"JAXTRAIN_NUM_PROCESSES": "abc"}, {}, "JAXTRAIN_NUM_PROCESSES: expected an integer, got 'abc'"),
    ({"JAXTRAIN_COORDINATOR_ADDRESS": "h:1", "JAXTRAIN_NUM_PROCESSES": "2"}, {},
     "distributed.process_id: not set (the job's other values came from JAXTRAIN_* environment)"),
    ({"JAXTRAIN_COORDINATOR_ADDRESS": "host", "JAXTRAIN_NUM_PROCESSES": "2", "JAXTRAIN_PROCESS_ID": "0"}, {},
     "distributed.coordinator_address: expected host:port (port 1..65535), got 'host'"),
    ({"JAXTRAIN_COORDINATOR_ADDRESS": "h:1", "JAXTRAIN_NUM_PROCESSES": "2", "JAXTRAIN_PROCESS_ID": "2"}, {},
     "distributed.process_id: 2 is not in [0, 2) (distributed.num_processes=2; from JAXTRAIN_* environment)"),
    ({"JAXTRAIN_COORDINATOR_ADDRESS": "h:99999", "JAXTRAIN_NUM_PROCESSES": "2", "JAXTRAIN_PROCESS_ID": "0"}, {},
     "distributed.coordinator_address: expected host:port (port 1..65535), got 'h:99999'"),
    ({"CLUSTER_SPEC": "{not json"}, {}, "CLUSTER_SPEC: not a Vertex AI cluster spec (JSONDecodeError: "),
    ({**SLURM, "SLURM_STEP_NODELIST": "node[01-02"}, {}, "SLURM_STEP_NODELIST: not a SLURM node list: 'node[01-02'"),
    ({}, {"num_processes": 2, "process_id": 0},
     "distributed.coordinator_address: not set (the job's other values came from distributed.* config keys)"),
])
def test_bad_values_are_named(env, cfg, message):
    assert _error(env, **cfg).startswith(message)


def test_shape_variables_are_reserved():
    assert all(job.is_shape_variable(v) for v in ("JAX_PROCESS_ID", "VC_TASK_INDEX", "VC_WORKER_HOSTS", "VC_PS_NUM",
                                                  "JOBSET_PODS_PER_JOB", "SLURM_PROCID", "CLUSTER_SPEC"))
    assert not any(job.is_shape_variable(v) for v in ("XLA_FLAGS", "JAX_COORDINATOR_PORT", "SLURM_CPUS_PER_TASK"))


@pytest.mark.parametrize("override, message", [
    ("distributed.init_timeout_s=0", "distributed.init_timeout_s: must be > 0, got 0"),
    ("distributed.peer_timeout_s=-5", "distributed.peer_timeout_s: must be > 0, got -5"),
    ("distributed.stop_check_every=0", "distributed.stop_check_every: must be > 0, got 0"),
    ("distributed.process_id=-1", "distributed.process_id: must be >= 0, got -1"),
    ("distributed.device_micro_batch=0", "distributed.device_micro_batch: must be > 0, got 0"),
    ("distributed.mode=sometimes", "distributed.mode: "),
])
def test_distributed_keys_are_checked_with_the_config(override, message):
    from jaxtrain.config import load
    from jaxtrain.errors import ConfigError
    with pytest.raises(ConfigError) as err:
        load(None, [override])
    assert str(err.value).startswith(message), str(err.value)
