"""How a process learns the job's shape (jaxtrain.runtime.job.detect): config keys, the
JAXTRAIN_* / Indexed Job environment, Vertex AI's CLUSTER_SPEC, SLURM and TPU pods; exact errors."""
import json

import pytest

from jaxtrain.config.schema import DistributedConfig
from jaxtrain.errors import InputError
from jaxtrain.runtime.job import Plan, detect

VERTEX = {"cluster": {"workerpool0": ["chief-0:2222"], "workerpool1": ["w-0:2222", "w-1:2222", "w-2:2222"]},
          "task": {"type": "workerpool1", "index": 2}}


def test_single_process_without_any_hint():
    assert detect(DistributedConfig(), {}) is None
    assert detect(DistributedConfig(mode="off"), {"JAXTRAIN_NUM_PROCESSES": "4"}) is None


def test_gke_environment_with_the_indexed_job_completion_index():
    env = {"JAXTRAIN_COORDINATOR_ADDRESS": "run-workers-0-0.run:8476", "JAXTRAIN_NUM_PROCESSES": "4",
           "JOB_COMPLETION_INDEX": "3"}
    assert detect(DistributedConfig(), env) == Plan("JAXTRAIN_* environment", "run-workers-0-0.run:8476", 4, 3)
    assert detect(DistributedConfig(), {**env, "JAXTRAIN_PROCESS_ID": "1"}).process_id == 1


def test_vertex_cluster_spec_orders_the_chief_then_the_workers():
    plan = detect(DistributedConfig(), {"CLUSTER_SPEC": json.dumps(VERTEX)})
    assert plan == Plan("Vertex AI CLUSTER_SPEC", "chief-0:2222", 4, 3)
    chief = {**VERTEX, "task": {"type": "workerpool0", "index": 0}}
    assert detect(DistributedConfig(), {"CLUSTER_SPEC": json.dumps(chief)}).process_id == 0


def test_config_keys_override_the_environment():
    env = {"JAXTRAIN_COORDINATOR_ADDRESS": "a:1", "JAXTRAIN_NUM_PROCESSES": "2", "JAXTRAIN_PROCESS_ID": "1"}
    plan = detect(DistributedConfig(coordinator_address="10.0.0.1:1234", process_id=0), env)
    assert plan == Plan("distributed.* config keys", "10.0.0.1:1234", 2, 0)
    assert detect(DistributedConfig(coordinator_address="h:1", num_processes=1, process_id=0), {}) is None
    assert detect(DistributedConfig(mode="on", coordinator_address="h:1", num_processes=1, process_id=0),
                  {}) == Plan("distributed.* config keys", "h:1", 1, 0)


def test_slurm_steps_and_tpu_pods_use_jax_detection():
    assert detect(DistributedConfig(), {"SLURM_STEP_NODELIST": "vm", "SLURM_STEP_NUM_TASKS": "2"}) == Plan(
        "SLURM (srun)")
    assert detect(DistributedConfig(), {"SLURM_STEP_NODELIST": "vm", "SLURM_STEP_NUM_TASKS": "1"}) is None
    assert detect(DistributedConfig(), {"SLURM_NTASKS": "8"}) is None  # sbatch without srun: no step
    assert detect(DistributedConfig(), {"TPU_WORKER_HOSTNAMES": "t0,t1"}) == Plan("TPU pod")
    assert detect(DistributedConfig(mode="on"), {}) == Plan("jax.distributed auto-detection")


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
    ({}, {"num_processes": 2, "process_id": 0},
     "distributed.coordinator_address: not set (the job's other values came from distributed.* config keys)"),
])
def test_bad_values_are_named(env, cfg, message):
    with pytest.raises(InputError) as err:
        detect(DistributedConfig(**cfg), env)
    assert str(err.value).startswith(message), str(err.value)


@pytest.mark.parametrize("override, message", [
    ("distributed.init_timeout_s=0", "distributed.init_timeout_s: must be > 0, got 0"),
    ("distributed.peer_timeout_s=-5", "distributed.peer_timeout_s: must be > 0, got -5"),
    ("distributed.stop_check_every=0", "distributed.stop_check_every: must be > 0, got 0"),
    ("distributed.process_id=-1", "distributed.process_id: must be >= 0, got -1"),
    ("distributed.mode=sometimes", "distributed.mode: "),
])
def test_distributed_keys_are_checked_with_the_config(override, message):
    from jaxtrain.config import load
    from jaxtrain.errors import ConfigError
    with pytest.raises(ConfigError) as err:
        load(None, [override])
    assert str(err.value).startswith(message), str(err.value)
