"""``python -m jaxtrain.launch vertex``: the CustomJob (chief pool, then workers), its dry-run JSON, and
submission through the real ``aiplatform_v1`` REST client to a local stand-in for the API."""
from __future__ import annotations

import json

import pytest
from launch_helpers import POD_CONFIG, StubServer, launch, launch_cli

aip = pytest.importorskip("google.cloud.aiplatform_v1")

BASE = ["vertex", "--config", POD_CONFIG, "--image", "us-docker.pkg.dev/p/r/jaxtrain:1", "--project", "my-proj",
        "--region", "europe-west4", "--machine-type", "a3-highgpu-8g"]
GPU = ["--accelerator", "NVIDIA_H100_80GB", "--accelerator-count", "8"]
JOB_NAME = "projects/my-proj/locations/europe-west4/customJobs/4242"


def _pool(replicas: str, accelerator_type) -> dict:
    return {
        "machineSpec": {"machineType": "a3-highgpu-8g", "acceleratorType": accelerator_type, "acceleratorCount": 8},
        "replicaCount": replicas,  # int64: a string in proto JSON
        "containerSpec": {"imageUri": "us-docker.pkg.dev/p/r/jaxtrain:1",
                          "command": ["python", "-m", "jaxtrain.train"],
                          "args": ["--config", POD_CONFIG, "train.steps=10", "checkpoint.dir=gs://b/ck"],
                          "env": [{"name": "NCCL_DEBUG", "value": "INFO"}]},
    }


def _expected(accelerator_type) -> dict:
    return {"displayName": "jaxtrain-shakespeare-char",
            "jobSpec": {"workerPoolSpecs": [_pool("1", accelerator_type), _pool("3", accelerator_type)],
                        "scheduling": {"restartJobOnWorkerRestart": True}}}


ARGS = [*BASE, *GPU, "--nodes", "4", "--env", "NCCL_DEBUG=INFO", "train.steps=10", "checkpoint.dir=gs://b/ck"]


def test_cli_dry_run_prints_the_custom_job_json():
    """A real `python -m jaxtrain.launch vertex --dry-run` process: chief pool (1) then workers (nodes - 1)."""
    done = launch_cli(*ARGS, "--dry-run")
    assert (done.returncode, done.stderr) == (0, "")
    assert json.loads(done.stdout) == _expected("NVIDIA_H100_80GB")
    job = aip.CustomJob.from_json(done.stdout)  # the library reads it back: field names are its own
    assert [p.replica_count for p in job.job_spec.worker_pool_specs] == [1, 3]


def test_single_node_has_only_the_chief_pool_and_a_tpu_topology(capsys):
    code, out, err = launch(capsys, *BASE[:-2], "--machine-type", "ct5lp-hightpu-4t", "--accelerator",
                            "TPU_V5_LITEPOD", "--accelerator-count", "4", "--tpu-topology", "2x2", "--dry-run",
                            "checkpoint.dir=gs://b/ck")
    assert (code, err) == (0, "")
    (pool,) = json.loads(out)["jobSpec"]["workerPoolSpecs"]
    assert pool["replicaCount"] == "1"
    assert pool["machineSpec"] == {"machineType": "ct5lp-hightpu-4t", "acceleratorType": "TPU_V5_LITEPOD",
                                   "acceleratorCount": 4, "tpuTopology": "2x2"}
    assert "env" not in pool["containerSpec"]


def test_cpu_only_job_and_local_checkpoint_note(capsys):
    code, out, err = launch(capsys, *BASE, "--nodes", "2", "--dry-run", "--name", "shk run", "--service-account",
                            "trainer@my-proj.iam.gserviceaccount.com")
    assert (code, err) == (2, "error: checkpoint.dir: 'runs/shakespeare_char/checkpoints' is on each node's own disk, "
                              "but the 2 nodes write one checkpoint together; set checkpoint.dir=gs://BUCKET/PATH "
                              "(or s3://)\n")  # two replicas would each wait for ever for the other's part
    code, out, err = launch(capsys, *BASE, "--nodes", "1", "--dry-run", "--name", "shk run", "--service-account",
                            "trainer@my-proj.iam.gserviceaccount.com")
    assert code == 0
    assert err == ("note: checkpoint.dir is local to each replica (runs/shakespeare_char/checkpoints): a restarted "
                   "job starts again from step 0; set checkpoint.dir=gs://BUCKET/PATH to resume instead\n")
    job = json.loads(out)
    assert job["displayName"] == "shk run"
    assert job["jobSpec"]["serviceAccount"] == "trainer@my-proj.iam.gserviceaccount.com"
    assert [p["machineSpec"] for p in job["jobSpec"]["workerPoolSpecs"]] == [{"machineType": "a3-highgpu-8g"}]


@pytest.mark.parametrize("args, message", [
    (["--accelerator", "nvidia-h100-80gb"], "--accelerator: unknown Vertex AI accelerator 'nvidia-h100-80gb' (known: "
     + ", ".join(a.name for a in aip.AcceleratorType if a.name != "ACCELERATOR_TYPE_UNSPECIFIED") + ")"),
    (["--accelerator", "NVIDIA_L4", "--tpu-topology", "2x2"],
     "--tpu-topology: only for a TPU --accelerator (e.g. TPU_V5_LITEPOD)"),
    (["--accelerator-count", "2"], "--accelerator-count: needs --accelerator (the accelerator type)"),
    (["--region", "Europe West"], "--region: expected a region such as us-central1, got 'Europe West'"),
    (["--name", "x" * 129], "--name: a Vertex AI display name has 1 to 128 characters, got 129"),
    (["--nodes", "two"], ("argument --nodes: expected an integer, got 'two' (see python -m jaxtrain.launch vertex "
                          "--help)")),
    (["model.n_head=4"], "unknown config key 'model.n_head'; did you mean 'model.n_heads'?"),
    (["--env", "CLUSTER_SPEC={}"],
     "--env: CLUSTER_SPEC is set for each process by the launcher or the platform; leave it out"),
])
def test_bad_input_is_a_named_error(capsys, args, message):
    code, out, err = launch(capsys, *BASE, "--dry-run", *args)
    assert (code, out, err) == (2, "", f"error: {message}\n")


def test_cli_missing_project_exits_2():
    done = launch_cli("vertex", "--config", POD_CONFIG, "--image", "img", "--machine-type", "n1-standard-8",
                      "--dry-run")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == ("error: the following arguments are required: --project "
                           "(see python -m jaxtrain.launch vertex --help)\n")


def test_submit_posts_the_custom_job(capsys):
    code, dry, _ = launch(capsys, *ARGS, "--dry-run")
    assert code == 0
    with StubServer(lambda req: (200, {"name": JOB_NAME, "displayName": "jaxtrain-shakespeare-char"})) as api:
        code, out, err = launch(capsys, *ARGS, "--vertex-endpoint", api.url)
    assert (code, err) == (0, "")
    assert out == (f"submitted CustomJob {JOB_NAME} (4 replicas); follow it with: gcloud ai custom-jobs describe "
                   f"{JOB_NAME}\n")
    (req,) = api.requests
    assert (req.method, req.path) == ("POST", "/v1/projects/my-proj/locations/europe-west4/customJobs")
    assert "Authorization" not in req.headers  # anonymous over plain http
    # The REST transport sends enums as numbers (and asks for them back the same way).
    assert req.query == {"$alt": ["json;enum-encoding=int"]}
    assert req.json() == _expected(aip.AcceleratorType.NVIDIA_H100_80GB.value)
    assert aip.CustomJob.from_json(req.body) == aip.CustomJob.from_json(dry)


def test_submit_failure_is_a_short_named_error(capsys):
    def denied(req):
        return 403, {"error": {"code": 403, "message": "Permission 'aiplatform.customJobs.create' denied",
                               "status": "PERMISSION_DENIED"}}
    with StubServer(denied) as api:
        code, out, err = launch(capsys, *ARGS, "--vertex-endpoint", api.url)
    assert len(api.requests) == 1
    assert (code, out) == (1, "")
    assert err == ("error: Vertex AI refused CustomJob 'jaxtrain-shakespeare-char' in "
                   "projects/my-proj/locations/europe-west4: HTTP 403 PERMISSION_DENIED: Permission "
                   "'aiplatform.customJobs.create' denied\n")


def test_unreachable_endpoint_is_a_named_error(capsys):
    import portpicker
    url = f"http://127.0.0.1:{portpicker.pick_unused_port()}"  # nothing listens there
    code, out, err = launch(capsys, *ARGS, "--vertex-endpoint", url)
    assert (code, out, err) == (1, "", f"error: cannot reach Vertex AI at {url}: [Errno 111] Connection refused\n")


def test_bad_config_submits_nothing(capsys):
    with StubServer() as api:
        code, _, err = launch(capsys, *ARGS, "--vertex-endpoint", api.url, "train.global_batch=10",
                              "train.grad_accum=3")
    assert (code, err) == (2, "error: train.global_batch: 10 is not divisible by train.grad_accum=3\n")
    assert api.requests == []


def test_missing_aiplatform_library_is_named():
    done = launch_cli(*ARGS, "--dry-run", prelude="import sys; sys.modules['google.cloud.aiplatform_v1'] = None")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == ("error: the vertex launcher needs 'google-cloud-aiplatform', which is not installed: "
                           "pip install 'jaxtrain[launch]'\n")
