"""``python -m jaxtrain.launch gke``: every generated JobSet is valid against the upstream JobSet CRD's
schema (shared/k8s/), its values follow jaxtrain's env contract, and submission sends exactly the
dry-run manifest to a local stand-in for the API server."""
from __future__ import annotations

import copy

import pytest
import yaml
from launch_helpers import POD_CONFIG, SHARED, StubServer, crd_validators, launch, launch_cli, schema_errors

jsonschema = pytest.importorskip("jsonschema")

CRD = SHARED / "k8s" / "jobset.x-k8s.io_jobsets.yaml"
NAME = "jaxtrain-shakespeare-char"
COORDINATOR = f"{NAME}-workers-0-0.{NAME}:8476"
JOBSET_ENV = [{"name": f"JOBSET_{var}", "valueFrom": {"fieldRef": {
    "fieldPath": f"metadata.annotations['jobset.sigs.k8s.io/{key}']"}}}
    for var, key in (("JOB_GLOBAL_INDEX", "job-global-index"), ("GLOBAL_REPLICAS", "global-replicas"))]

VARIANTS = {
    "gpu": ["--nodes", "2", "--accelerator", "nvidia-h100-80gb", "--accelerator-count", "8"],
    "tpu": ["--nodes", "2", "--accelerator", "tpu-v5p-slice", "--accelerator-count", "4", "--tpu-topology", "2x2x2"],
    "cpu": ["--nodes", "3"],
}


@pytest.fixture(scope="module")
def validators():
    """(plain, strict) validators of the v1alpha2 JobSet schema from the upstream CRD."""
    return crd_validators(CRD.name, "jobset.x-k8s.io", "jobsets", "v1alpha2")


_errors = schema_errors


def _dry_run(capsys, *args):
    code, out, err = launch(capsys, "gke", "--config", POD_CONFIG, "--image", "us-docker.pkg.dev/p/r/jaxtrain:1",
                            "--dry-run", *args)
    assert code == 0, err
    return yaml.safe_load(out), err


def _pod(manifest):
    return manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_manifest_is_a_valid_jobset(capsys, validators, variant):
    manifest, _ = _dry_run(capsys, *VARIANTS[variant], "train.steps=10", "checkpoint.dir=gs://bucket/ck")
    plain, strict = validators
    assert _errors(plain, manifest) == []
    assert _errors(strict, manifest) == []  # no field the API server would drop

    nodes = int(VARIANTS[variant][1])
    assert manifest["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and manifest["kind"] == "JobSet"
    assert manifest["metadata"]["name"] == NAME and manifest["metadata"]["namespace"] == "default"
    spec = manifest["spec"]
    assert spec["failurePolicy"] == {"maxRestarts": 3}
    assert spec["network"] == {"enableDNSHostnames": True, "subdomain": NAME}
    (rjob,) = spec["replicatedJobs"]
    assert rjob["replicas"] == 1
    job = rjob["template"]["spec"]
    assert (job["completionMode"], job["completions"], job["parallelism"], job["backoffLimit"]) == \
        ("Indexed", nodes, nodes, 0)
    # The coordinator is pod 0 under the host name the CRD documents:
    # <jobSet.name>-<replicatedJob.name>-<job-index>-<pod-index>.<subdomain>
    assert COORDINATOR == f"{NAME}-{rjob['name']}-0-0.{spec['network']['subdomain']}:8476"
    pod = _pod(manifest)
    assert pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    assert container["image"] == "us-docker.pkg.dev/p/r/jaxtrain:1"
    assert container["command"] + container["args"] == [
        "python", "-m", "jaxtrain.train", "--config", POD_CONFIG, "train.steps=10", "checkpoint.dir=gs://bucket/ck"]
    assert container["env"] == [{"name": "JAXTRAIN_COORDINATOR_ADDRESS", "value": COORDINATOR},
                                {"name": "JAXTRAIN_NUM_PROCESSES", "value": str(nodes)}, *JOBSET_ENV,
                                {"name": "JOBSET_PODS_PER_JOB", "value": str(nodes)}]
    assert container["ports"] == [{"name": "coordinator", "containerPort": 8476}]
    if variant == "gpu":
        assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
        assert container["resources"] == {"limits": {"nvidia.com/gpu": 8}, "requests": {"nvidia.com/gpu": 8}}
        assert "annotations" not in manifest["metadata"]
    elif variant == "tpu":
        assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                                       "cloud.google.com/gke-tpu-topology": "2x2x2"}
        assert container["resources"] == {"limits": {"google.com/tpu": 4}, "requests": {"google.com/tpu": 4}}
        assert manifest["metadata"]["annotations"] == {
            "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
    else:
        assert "nodeSelector" not in pod and "resources" not in container


BROKEN = {
    # (mutation, which validator must catch it)
    "restart strategy not in the enum": (lambda m: m["spec"]["failurePolicy"].update(restartStrategy="Restart"),
                                         "plain"),
    "negative replicas": (lambda m: m["spec"]["replicatedJobs"][0].update(replicas=-1), "plain"),
    "replicas not a number": (lambda m: m["spec"]["replicatedJobs"][0].update(replicas="one"), "plain"),
    "container without a name": (lambda m: _pod(m)["containers"][0].pop("name"), "plain"),
    "enableDNSHostnames not a bool": (lambda m: m["spec"]["network"].update(enableDNSHostnames="yes"), "plain"),
    "misspelled field": (lambda m: m["spec"]["replicatedJobs"][0]["template"]["spec"].update(completion=2),
                         "strict"),
    "misspelled env key": (lambda m: _pod(m)["containers"][0]["env"][0].update(valu="x"),
                                                "strict"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_manifest_fails_validation(capsys, validators, case):
    """The schema check can fail: each deliberate mistake is caught."""
    manifest, _ = _dry_run(capsys, *VARIANTS["gpu"], "checkpoint.dir=gs://bucket/ck")
    mutate, which = BROKEN[case]
    broken = copy.deepcopy(manifest)
    mutate(broken)
    plain, strict = validators
    assert _errors(strict, broken), case
    if which == "plain":
        assert _errors(plain, broken), case


def test_env_flag_and_overrides(capsys):
    manifest, _ = _dry_run(capsys, "--nodes", "2", "--env", "XLA_FLAGS=--xla_dump_to=/tmp/x", "--namespace", "ml",
                           "--max-restarts", "7", "--name", "shk", "--coordinator-port", "1234", "--container-config",
                           "/app/shk.yaml", "train.sample_prompt=to be", "checkpoint.dir=gs://b/ck")
    (container,) = _pod(manifest)["containers"]
    assert container["env"] == [
        {"name": "JAXTRAIN_COORDINATOR_ADDRESS", "value": "shk-workers-0-0.shk:1234"},
        {"name": "JAXTRAIN_NUM_PROCESSES", "value": "2"}, *JOBSET_ENV,
        {"name": "JOBSET_PODS_PER_JOB", "value": "2"}, {"name": "XLA_FLAGS", "value": "--xla_dump_to=/tmp/x"}]
    assert container["args"] == ["--config", "/app/shk.yaml", "train.sample_prompt=to be", "checkpoint.dir=gs://b/ck"]
    assert manifest["metadata"]["namespace"] == "ml" and manifest["spec"]["failurePolicy"]["maxRestarts"] == 7
    assert _pod(manifest)["terminationGracePeriodSeconds"] == 60  # checkpoint.grace_period_s 30 + 30


def _pod_env(container: dict, job_index: int, jobs: int, completion_index: int) -> dict:
    """The environment one pod of the JobSet sees: the values, the annotations the JobSet controller
    sets (resolved like the downward API), and the index Kubernetes sets in an Indexed Job's pods."""
    annotations = {"jobset.sigs.k8s.io/job-global-index": str(job_index),
                   "jobset.sigs.k8s.io/global-replicas": str(jobs)}
    env = {"JOB_COMPLETION_INDEX": str(completion_index)}
    for entry in container["env"]:
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        else:
            path = entry["valueFrom"]["fieldRef"]["fieldPath"]
            env[entry["name"]] = annotations[path.split("['")[1].rstrip("']")]
    return env


def test_every_pod_gets_its_own_process_id(capsys):
    """Resolve each pod's environment as Kubernetes would and detect: ids 0..n-1, one coordinator, one
    count; the same JobSet given 2 replicas (the count set to match) numbers its 6 pods 0..5, not [0, 1, 2] twice."""
    from jaxtrain.config.schema import DistributedConfig
    from jaxtrain.runtime.job import detect
    manifest, _ = _dry_run(capsys, "--nodes", "3", "checkpoint.dir=gs://b/c")
    (container,) = _pod(manifest)["containers"]
    plans = [detect(DistributedConfig(), _pod_env(container, 0, 1, i)) for i in range(3)]
    assert [(p.coordinator, p.num_processes, p.process_id) for p in plans] == [(COORDINATOR, 3, i) for i in range(3)]
    for entry in container["env"]:
        if entry["name"] == "JAXTRAIN_NUM_PROCESSES":
            entry["value"] = "6"
    ids = [detect(DistributedConfig(), _pod_env(container, j, 2, i)).process_id for j in (0, 1) for i in range(3)]
    assert ids == [0, 1, 2, 3, 4, 5]


def test_local_checkpoint_dir_is_noted_on_stderr(capsys):
    manifest, err = _dry_run(capsys, "checkpoint.dir=/data/ck")
    assert err == ("note: checkpoint.dir is local to the pod (/data/ck): after a preemption the JobSet restarts on "
                   "fresh disks and training starts again from step 0; set checkpoint.dir=gs://BUCKET/PATH to resume "
                   "instead\n")
    assert manifest["kind"] == "JobSet"  # stdout is still pure YAML
    _, err = _dry_run(capsys, "checkpoint.dir=gs://b/ck")
    assert err == ""


@pytest.mark.parametrize("args, message", [
    (["--accelerator", "tpu-v5p-slice", "--accelerator-count", "4"],
     "--tpu-topology: required with --accelerator tpu-v5p-slice (e.g. 2x2x2)"),
    (["--nodes", "2", "--accelerator", "tpu-v5p-slice", "--accelerator-count", "4", "--tpu-topology", "2x2x4"],
     "--tpu-topology: 2x2x4 has 16 chips, but --nodes 2 x --accelerator-count 4 = 8"),
    (["--accelerator", "tpu-v5p-slice", "--tpu-topology", "2by2"], "--tpu-topology: expected AxB or AxBxC, got '2by2'"),
    (["--accelerator", "NVIDIA_H100_80GB"],
     ("--accelerator: expected a GKE accelerator label, nvidia-... (GPU, e.g. nvidia-h100-80gb) or tpu... "
      "(TPU, e.g. tpu-v5p-slice), got 'NVIDIA_H100_80GB'")),
    (["--accelerator", "nvidia-l4", "--tpu-topology", "2x2"],
     "--tpu-topology: only for a TPU --accelerator (e.g. tpu-v5p-slice)"),
    (["--accelerator-count", "2"], "--accelerator-count: needs --accelerator (the accelerator type)"),
    (["--name", "Shakespeare_1"], ("--name: 'Shakespeare_1' is not a valid JobSet name (lower-case letters, digits "
                                   "and '-', starting with a letter and ending with a letter or digit)")),
    (["--namespace", "ML"], "--namespace: 'ML' is not a valid namespace name"),
    (["--max-restarts", "-1"], ("argument --max-restarts: must be >= 0, got -1 (see python -m jaxtrain.launch gke "
                                "--help)")),
    (["--coordinator-port", "70000"], ("argument --coordinator-port: must be a port in 1..65535, got 70000 "
                                       "(see python -m jaxtrain.launch gke --help)")),
    (["--env", "1X=2"], "--env: expected KEY=VALUE with KEY a variable name, got '1X=2'"),
    (["train.stepz=3"], "unknown config key 'train.stepz'; did you mean 'train.steps'?"),
    (["train.steps=0"], "train.steps: must be > 0, got 0"),
    (["--env", "JAXTRAIN_NUM_PROCESSES=5"],
     "--env: JAXTRAIN_NUM_PROCESSES is set for each process by the launcher or the platform; leave it out"),
    (["distributed.num_processes=3"],
     "distributed.num_processes: set for each process by the launcher; leave it unset"),
    (["--nodes", "2", "checkpoint.dir=gs://b/c", "distributed.mode=off"],
     "distributed.mode: 'off' would make each of the 2 processes train alone; use auto"),
    (["--nodes", "2"], ("checkpoint.dir: 'runs/shakespeare_char/checkpoints' is on each node's own disk, but the 2 "
                        "nodes write one checkpoint together; set checkpoint.dir=gs://BUCKET/PATH (or s3://)")),
])
def test_bad_input_is_a_named_error(capsys, args, message):
    code, out, err = launch(capsys, "gke", "--config", POD_CONFIG, "--image", "img", "--dry-run", *args)
    assert (code, out, err) == (2, "", f"error: {message}\n")


def test_pod_name_limit_counts_the_last_pod(capsys):
    ok = "a" * 51  # a-...-workers-0-9 is 63 characters: allowed
    code, _, err = launch(capsys, "gke", "--config", POD_CONFIG, "--image", "img", "--dry-run", "--nodes", "10",
                          "--name", ok, "checkpoint.dir=gs://b/c")
    assert code == 0, err
    code, _, err = launch(capsys, "gke", "--config", POD_CONFIG, "--image", "img", "--dry-run", "--nodes", "11",
                          "--name", ok)
    assert code == 2 and "'" + ok + "-workers-0-10' has 64 characters (at most 63)" in err


def test_cli_dry_run_and_bad_input_exit_codes():
    """Through a real `python -m jaxtrain.launch` process: YAML on stdout (exit 0); bad input exit 2."""
    done = launch_cli("gke", "--config", POD_CONFIG, "--image", "img", "--nodes", "2", "--dry-run", "train.steps=5",
                      "checkpoint.dir=gs://b/c")
    assert done.returncode == 0, done.stderr
    manifest = yaml.safe_load(done.stdout)
    assert manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["completions"] == 2
    assert _pod(manifest)["containers"][0]["args"] == ["--config", POD_CONFIG, "train.steps=5", "checkpoint.dir=gs://b/c"]
    done = launch_cli("gke", "--image", "img", "--dry-run")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == ("error: the following arguments are required: --config "
                           "(see python -m jaxtrain.launch gke --help)\n")
    done = launch_cli("kubernetes", "--config", POD_CONFIG)
    assert (done.returncode, done.stderr) == (2, ("error: unknown target 'kubernetes' (choose one of: gke, vertex, "
                                                  "slurm, ray, kubeflow, volcano)\n"))


def test_submit_posts_the_dry_run_manifest(capsys):
    args = ["gke", "--config", POD_CONFIG, "--image", "img", *VARIANTS["tpu"], "--namespace", "team-a",
            "checkpoint.dir=gs://b/c"]
    code, out, err = launch(capsys, *args, "--dry-run")
    assert code == 0, err
    expected = yaml.safe_load(out)
    with StubServer() as api:
        code, out, err = launch(capsys, *args, "--k8s-host", api.url)
    assert (code, err) == (0, "")
    assert out == (f"submitted JobSet team-a/{NAME} (2 pods); follow it with: kubectl get jobset {NAME} "
                   f"-n team-a\n")
    (req,) = api.requests
    assert (req.method, req.path) == ("POST", "/apis/jobset.x-k8s.io/v1alpha2/namespaces/team-a/jobsets")
    assert req.query == {"fieldValidation": ["Strict"]}
    assert req.json() == expected


def test_submit_failure_is_a_short_named_error(capsys, monkeypatch):
    def conflict(req):
        return 409, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "AlreadyExists",
                     "message": f'jobsets.jobset.x-k8s.io "{NAME}" already exists', "code": 409}
    with StubServer(conflict) as api:
        monkeypatch.setenv("JAXTRAIN_K8S_HOST", api.url)  # the environment instead of --k8s-host
        code, out, err = launch(capsys, "gke", "--config", POD_CONFIG, "--image", "img", "checkpoint.dir=gs://b/c")
    assert len(api.requests) == 1
    assert (code, out) == (1, "")
    assert err == (f"error: the Kubernetes API refused JobSet default/{NAME}: HTTP 409 Conflict: "
                   f'jobsets.jobset.x-k8s.io "{NAME}" already exists (delete it with `kubectl delete jobset '
                   f"{NAME} -n default` or pass --name)\n")
    with StubServer(lambda req: (500, {"message": "etcd unavailable"})) as api:
        code, out, err = launch(capsys, "gke", "--config", POD_CONFIG, "--image", "img", "checkpoint.dir=gs://b/c",
                                "--k8s-host", api.url)
    assert (code, err) == (1, (f"error: the Kubernetes API refused JobSet default/{NAME}: HTTP 500 Internal Server "
                               f"Error: etcd unavailable\n"))


def test_bad_config_submits_nothing(capsys):
    with StubServer() as api:
        code, _, err = launch(capsys, "gke", "--config", POD_CONFIG, "--image", "img", "--k8s-host", api.url,
                              "optimizer.lr=-1")
    assert (code, err) == (2, "error: optimizer.lr: must be > 0, got -1.0\n")
    assert api.requests == []


def test_missing_kubernetes_library_is_named():
    """Without the kubernetes package: submission says how to install it (exit 2); --dry-run needs no client."""
    no_k8s = "import sys; sys.modules['kubernetes'] = None"
    done = launch_cli("gke", "--config", POD_CONFIG, "--image", "img", "--k8s-host", "http://127.0.0.1:9",
                      "checkpoint.dir=gs://b/c", prelude=no_k8s)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == ("error: the gke launcher needs 'kubernetes', which is not installed: "
                           "pip install 'jaxtrain[launch]'\n")
    done = launch_cli("gke", "--config", POD_CONFIG, "--image", "img", "--dry-run", "checkpoint.dir=gs://b/c",
                      prelude=no_k8s)
    assert done.returncode == 0, done.stderr
    assert yaml.safe_load(done.stdout)["kind"] == "JobSet"
