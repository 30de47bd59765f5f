"""``python -m jaxtrain.launch kubeflow``: every generated TrainJob is valid against the upstream Kubeflow
Trainer CRD (shared/k8s/), refers to the jax-distributed runtime and patches the replicated job that
runtime has; each node (given the JAX_* variables the runtime's JAX plugin sets) joins as its own
process; submission sends exactly the dry-run manifest to a local stand-in for the API."""
from __future__ import annotations

import copy
import re

import pytest
import yaml
from launch_helpers import POD_CONFIG, SHARED, StubServer, crd_validators, launch, schema_errors

from jaxtrain.config.schema import DistributedConfig
from jaxtrain.runtime.job import Plan, detect

pytest.importorskip("jsonschema")

NAME = "jaxtrain-shakespeare-char"
BASE = ["kubeflow", "--config", POD_CONFIG, "--image", "us-docker.pkg.dev/p/r/jaxtrain:1"]
GPU = ["--nodes", "2", "--gpus", "8", "--node-selector", "cloud.google.com/gke-accelerator=nvidia-h100-80gb",
       "--env", "NCCL_DEBUG=INFO"]


@pytest.fixture(scope="module")
def validators():
    return crd_validators("trainer.kubeflow.org_trainjobs.yaml", "trainer.kubeflow.org", "trainjobs", "v1alpha1")


def _dry_run(capsys, *args):
    code, out, err = launch(capsys, *BASE, "--dry-run", *args)
    assert code == 0, err
    return yaml.safe_load(out), err


def _cel_name_rules(manifest) -> list[str]:
    """The CRD's two CEL rules on the name (a JSON-schema validator does not run CEL)."""
    name = manifest["metadata"]["name"]
    return [msg for ok, msg in ((re.match(r"^[a-z]([-a-z0-9]*[a-z0-9])?$", name), "RFC 1035"),
                                (len(name) <= 63, "63 characters")) if not ok]


def test_manifest_is_a_valid_trainjob_on_the_jax_runtime(capsys, validators):
    manifest, err = _dry_run(capsys, *GPU, "train.steps=10", "checkpoint.dir=gs://bucket/ck")
    plain, strict = validators
    assert schema_errors(plain, manifest) == [] and schema_errors(strict, manifest) == []
    assert _cel_name_rules(manifest) == [] and err == ""
    assert (manifest["apiVersion"], manifest["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    spec = manifest["spec"]
    assert spec["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                  "name": "jax-distributed"}
    assert spec["trainer"] == {
        "image": "us-docker.pkg.dev/p/r/jaxtrain:1", "command": ["python", "-m", "jaxtrain.train"],
        "args": ["--config", POD_CONFIG, "train.steps=10", "checkpoint.dir=gs://bucket/ck"], "numNodes": 2,
        "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
        "resourcesPerNode": {"limits": {"nvidia.com/gpu": 8}, "requests": {"nvidia.com/gpu": 8}}}
    (patch,) = spec["runtimePatches"]
    assert patch["manager"] == "jaxtrain.launch"
    (job,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert job["template"]["spec"]["template"]["spec"] == {
        "terminationGracePeriodSeconds": 60, "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}}
    # the patch names the replicated job the upstream runtime has, and that runtime sets JAX_* (mlPolicy.jax)
    runtime = yaml.safe_load((SHARED / "k8s" / "kubeflow-runtime-jax-distributed.yaml").read_text())
    assert runtime["metadata"]["name"] == spec["runtimeRef"]["name"] and "jax" in runtime["spec"]["mlPolicy"]
    assert [j["name"] for j in runtime["spec"]["template"]["spec"]["replicatedJobs"]] == [job["name"]]


def test_cpu_trainjob_has_no_resources_or_env(capsys, validators):
    manifest, _ = _dry_run(capsys, "--nodes", "3", "--runtime", "jax-cpu", "checkpoint.dir=gs://b/c")
    assert schema_errors(validators[1], manifest) == []
    assert manifest["spec"]["runtimeRef"]["name"] == "jax-cpu"
    assert set(manifest["spec"]["trainer"]) == {"image", "command", "args", "numNodes"}


def test_every_node_joins_with_the_jax_plugin_variables():
    """Kubeflow's JAX plugin sets JAX_* in each node's container (its pods are an Indexed Job's too)."""
    coordinator = f"{NAME}-node-0-0.{NAME}:6666"
    plans = [detect(DistributedConfig(), {"JAX_COORDINATOR_ADDRESS": coordinator, "JAX_NUM_PROCESSES": "2",
                                          "JAX_PROCESS_ID": str(i), "JOB_COMPLETION_INDEX": str(i)}) for i in (0, 1)]
    assert plans == [Plan("Kubeflow TrainJob + JobSet / Indexed Job", coordinator, 2, i) for i in (0, 1)]


BROKEN = {
    "runtimeRef without a name": lambda m: m["spec"]["runtimeRef"].pop("name"),
    "negative numNodes": lambda m: m["spec"]["trainer"].update(numNodes=-1),
    "a patch without its manager": lambda m: m["spec"]["runtimePatches"][0].pop("manager"),
    "a quantity that is not one": lambda m: m["spec"]["trainer"]["resourcesPerNode"]["limits"].update(cpu="lots"),
    "misspelled field": lambda m: m["spec"]["trainer"].update(numNode=2),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_manifest_fails_validation(capsys, validators, case):
    manifest, _ = _dry_run(capsys, *GPU, "checkpoint.dir=gs://bucket/ck")
    broken = copy.deepcopy(manifest)
    BROKEN[case](broken)
    assert schema_errors(validators[1], broken), case


@pytest.mark.parametrize("args, message", [
    (["--runtime", "JAX"], "--runtime: 'JAX' is not a valid ClusterTrainingRuntime name"),
    (["--gpus", "0"], "argument --gpus: must be >= 1, got 0 (see python -m jaxtrain.launch kubeflow --help)"),
    (["--name", "a" * 60, "checkpoint.dir=gs://b/c"],
     f"--name: '{'a' * 60}' is too long: pod host name '{'a' * 60}-node-0-0' has 69 characters (at most 63)"),
    (["--env", "JAX_PROCESS_ID=0"],
     "--env: JAX_PROCESS_ID is set for each process by the launcher or the platform; leave it out"),
    (["--nodes", "2", "distributed.process_id=0"],
     "distributed.process_id: set for each process by the launcher; leave it unset"),
])
def test_bad_input_is_a_named_error(capsys, args, message):
    code, out, err = launch(capsys, *BASE, "--dry-run", *args)
    assert (code, out, err) == (2, "", f"error: {message}\n")


def test_submit_posts_the_dry_run_manifest(capsys):
    args = [*BASE, *GPU, "--namespace", "ml", "checkpoint.dir=gs://b/c"]
    code, out, err = launch(capsys, *args, "--dry-run")
    assert code == 0, err
    expected = yaml.safe_load(out)
    with StubServer() as api:
        code, out, err = launch(capsys, *args, "--k8s-host", api.url)
    assert (code, err) == (0, "")
    assert out == (f"submitted TrainJob ml/{NAME} (2 nodes, runtime jax-distributed); follow it with: kubectl get "
                   f"trainjob {NAME} -n ml\n")
    (req,) = api.requests
    assert (req.method, req.path) == ("POST", "/apis/trainer.kubeflow.org/v1alpha1/namespaces/ml/trainjobs")
    assert req.query == {"fieldValidation": ["Strict"]}
    assert req.json() == expected


def test_submit_failure_is_a_short_named_error(capsys):
    invalid = {"kind": "Status", "status": "Failure", "reason": "Invalid", "code": 422,
               "message": 'TrainJob.trainer.kubeflow.org "x" is invalid: spec.runtimeRef: Not found: "jax-distributed"'}
    with StubServer(lambda req: (422, invalid)) as api:
        code, out, err = launch(capsys, *BASE, "--k8s-host", api.url, "checkpoint.dir=gs://b/c")
    assert (code, out) == (1, "")
    assert err == (f"error: the Kubernetes API refused TrainJob default/{NAME}: HTTP 422 Unprocessable Entity: "
                   f"{invalid['message']}\n")
