"""``python -m jaxtrain.launch volcano``: every generated Job is valid against the upstream Volcano Job CRD
(shared/k8s/), each of its pods (given what Volcano's svc and env plugins set) finds the coordinator and
its own process id, and submission sends exactly the dry-run manifest to a local stand-in for the API."""
from __future__ import annotations

import copy

import pytest
import yaml
from launch_helpers import POD_CONFIG, StubServer, crd_validators, launch, schema_errors

from jaxtrain.config.schema import DistributedConfig
from jaxtrain.runtime.job import Plan, detect

pytest.importorskip("jsonschema")

NAME = "jaxtrain-shakespeare-char"
BASE = ["volcano", "--config", POD_CONFIG, "--image", "us-docker.pkg.dev/p/r/jaxtrain:1"]
VARIANTS = {
    "gpu": ["--nodes", "2", "--gpus", "8", "--node-selector", "cloud.google.com/gke-accelerator=nvidia-h100-80gb"],
    "tpu": ["--nodes", "2", "--resource", "google.com/tpu=4", "--node-selector",
            "cloud.google.com/gke-tpu-topology=2x2x2", "--queue", "research", "--priority-class", "high"],
    "cpu": ["--nodes", "3", "--resource", "cpu=8", "--resource", "memory=32Gi"],
}


@pytest.fixture(scope="module")
def validators():
    return crd_validators("batch.volcano.sh_jobs.yaml", "batch.volcano.sh", "jobs", "v1alpha1")


def _dry_run(capsys, *args):
    code, out, err = launch(capsys, *BASE, "--dry-run", *args)
    assert code == 0, err
    return yaml.safe_load(out), err


def _container(manifest):
    (task,) = manifest["spec"]["tasks"]
    (container,) = task["template"]["spec"]["containers"]
    return container


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_manifest_is_a_valid_volcano_job(capsys, validators, variant):
    manifest, err = _dry_run(capsys, *VARIANTS[variant], "train.steps=10", "checkpoint.dir=gs://bucket/ck")
    plain, strict = validators
    assert schema_errors(plain, manifest) == [] and schema_errors(strict, manifest) == []
    assert err == ""
    nodes = int(VARIANTS[variant][1])
    assert (manifest["apiVersion"], manifest["kind"]) == ("batch.volcano.sh/v1alpha1", "Job")
    spec = manifest["spec"]
    assert (spec["schedulerName"], spec["minAvailable"], spec["maxRetry"]) == ("volcano", nodes, 3)
    assert spec["queue"] == ("research" if variant == "tpu" else "default")
    assert spec["plugins"] == {"svc": [], "env": []}
    assert spec["policies"] == [{"exitCode": 2, "action": "TerminateJob"}, {"exitCode": 3, "action": "TerminateJob"},
                                {"event": "PodEvicted", "action": "RestartJob"},
                                {"event": "PodFailed", "action": "RestartJob"},
                                {"event": "TaskCompleted", "action": "CompleteJob"}]
    (task,) = spec["tasks"]
    assert (task["name"], task["replicas"], task["minAvailable"]) == ("worker", nodes, nodes)
    pod = task["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["terminationGracePeriodSeconds"] == 60
    container = _container(manifest)
    assert container["command"] + container["args"] == [
        "python", "-m", "jaxtrain.train", "--config", POD_CONFIG, "train.steps=10", "checkpoint.dir=gs://bucket/ck"]
    assert container["env"] == [{"name": "JAX_COORDINATOR_PORT", "value": "8476"}]
    assert container["ports"] == [{"name": "coordinator", "containerPort": 8476}]
    limits = {"gpu": {"nvidia.com/gpu": 8}, "tpu": {"google.com/tpu": 4}, "cpu": {"cpu": 8, "memory": "32Gi"}}[variant]
    assert container["resources"] == {"limits": limits, "requests": limits}
    if variant == "tpu":
        assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-topology": "2x2x2"}
        assert pod["priorityClassName"] == "high"


def test_every_pod_finds_the_coordinator_and_its_id(capsys):
    """Each pod's environment as Volcano builds it (svc: host names and count, env: the task index;
    the pod's host name <job>-worker-<i>), then detection: one coordinator, one count, ids 0..n-1."""
    manifest, _ = _dry_run(capsys, "--nodes", "3", "--coordinator-port", "9000", "checkpoint.dir=gs://b/c")
    hosts = ",".join(f"{NAME}-worker-{i}.{NAME}" for i in range(3))
    ours = {e["name"]: e["value"] for e in _container(manifest)["env"]}
    plans = [detect(DistributedConfig(), {**ours, "VC_WORKER_HOSTS": hosts, "VC_WORKER_NUM": "3",
                                          "VC_TASK_INDEX": str(i), "VK_TASK_INDEX": str(i),
                                          "HOSTNAME": f"{NAME}-worker-{i}"}) for i in range(3)]
    assert plans == [Plan("Volcano Job", f"{NAME}-worker-0.{NAME}:9000", 3, i) for i in range(3)]


BROKEN = {
    "policy event not in the enum": lambda m: m["spec"]["policies"].append({"event": "PodCrashed"}),
    "replicas not a number": lambda m: m["spec"]["tasks"][0].update(replicas="two"),
    "plugins not lists": lambda m: m["spec"]["plugins"].update(svc="yes"),
    "misspelled field": lambda m: m["spec"].update(minAvailible=2),
    "container without a name": lambda m: _container(m).pop("name"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_manifest_fails_validation(capsys, validators, case):
    """The schema check can fail: each deliberate mistake is caught (a misspelling by the strict check)."""
    manifest, _ = _dry_run(capsys, *VARIANTS["gpu"], "checkpoint.dir=gs://bucket/ck")
    broken = copy.deepcopy(manifest)
    BROKEN[case](broken)
    assert schema_errors(validators[1], broken), case


@pytest.mark.parametrize("args, message", [
    (["--resource", "google.com/tpu"], "--resource: expected KEY=VALUE, got 'google.com/tpu'"),
    (["--resource", "cpu=lots"], "--resource: expected NAME=QUANTITY such as google.com/tpu=4 or memory=64Gi, got "
                                 "'cpu=lots'"),
    (["--node-selector", "bad key=x"],
     "--node-selector: expected LABEL=VALUE with a Kubernetes label, got 'bad key=x'"),
    (["--queue", "Research"], "--queue: 'Research' is not a valid Volcano queue name"),
    (["--name", "Shk"], ("--name: 'Shk' is not a valid Volcano Job name (lower-case letters, digits and '-', starting "
                         "with a letter and ending with a letter or digit)")),
    (["--nodes", "2"], ("checkpoint.dir: 'runs/shakespeare_char/checkpoints' is on each node's own disk, but the 2 "
                        "nodes write one checkpoint together; set checkpoint.dir=gs://BUCKET/PATH (or s3://)")),
    (["--env", "VC_TASK_INDEX=0"],
     "--env: VC_TASK_INDEX is set for each process by the launcher or the platform; leave it out"),
])
def test_bad_input_is_a_named_error(capsys, args, message):
    code, out, err = launch(capsys, *BASE, "--dry-run", *args)
    assert (code, out, err) == (2, "", f"error: {message}\n")


def test_local_checkpoint_dir_is_noted_for_one_node(capsys):
    _, err = _dry_run(capsys, "checkpoint.dir=/data/ck")
    assert err == ("note: checkpoint.dir is local to the pod (/data/ck): a restarted pod starts on a fresh disk and "
                   "training starts again from step 0; set checkpoint.dir=gs://BUCKET/PATH (or s3://) to resume "
                   "instead\n")


def test_submit_posts_the_dry_run_manifest(capsys):
    args = [*BASE, *VARIANTS["tpu"], "--namespace", "team-a", "checkpoint.dir=gs://b/c"]
    code, out, err = launch(capsys, *args, "--dry-run")
    assert code == 0, err
    expected = yaml.safe_load(out)
    with StubServer() as api:
        code, out, err = launch(capsys, *args, "--k8s-host", api.url)
    assert (code, err) == (0, "")
    assert out == (f"submitted Volcano Job team-a/{NAME} (2 pods, queue research); follow it with: kubectl get vcjob "
                   f"{NAME} -n team-a\n")
    (req,) = api.requests
    assert (req.method, req.path) == ("POST", "/apis/batch.volcano.sh/v1alpha1/namespaces/team-a/jobs")
    assert req.query == {"fieldValidation": ["Strict"]}
    assert req.json() == expected


def test_submit_failure_is_a_short_named_error(capsys):
    not_found = {"kind": "Status", "status": "Failure", "message": "the server could not find the requested resource",
                 "reason": "NotFound", "code": 404}
    with StubServer(lambda req: (404, not_found)) as api:
        code, out, err = launch(capsys, *BASE, "--k8s-host", api.url, "checkpoint.dir=gs://b/c")
    assert (code, out) == (1, "")
    assert err == (f"error: the Kubernetes API refused Job default/{NAME}: HTTP 404 Not Found: the server could not "
                   f"find the requested resource (is Volcano installed in the cluster?)\n")


def test_the_device_plugins_resources_count_as_the_jobs_devices(capsys):
    """--resource google.com/tpu=4 on 2 pods is 8 TPU devices, which a micro-batch of 12 cannot split."""
    code, out, err = launch(capsys, *BASE, "--dry-run", *VARIANTS["tpu"], "checkpoint.dir=gs://b/c",
                            "train.global_batch=12")
    assert (code, out) == (2, "")
    assert err == ("error: train.global_batch: micro-batch 12 (global_batch 12 / grad_accum 1) is not divisible by "
                   "data*fsdp*expert = 8*1*1 = 8 (the job has 2 processes x 4 TPU devices = 8)\n")
