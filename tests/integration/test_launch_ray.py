"""``python -m jaxtrain.launch ray``: the run it prints, its errors, the training process's environment,
and real runs on a local Ray cluster started here (tests/helpers/ray_cluster.py, on 127.0.0.2): a
2-worker job trains as one run of 2 processes; a Ray worker killed mid-run restarts the group,
which resumes from the last checkpoint with the uninterrupted run's losses."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import xla_test_flags
from launch_helpers import CONFIG, REPO, launch, launch_cli

from jaxtrain.launch import ray as ray_launcher
from jaxtrain.launch import ray_worker

pytest.importorskip("ray.train.v2.jax")

DRY = ["ray", "--config", CONFIG, "--nodes", "4", "--min-nodes", "2", "--gpus-per-worker", "8", "--chdir", "/shared",
       "--resource", "memory=2e9", "--env", "NCCL_DEBUG=INFO", "--dry-run", "train.steps=10",
       "distributed.device_micro_batch=5"]  # 480 rows on 16, 24 or 32 GPUs: accumulation 6, 4 or 3


def test_dry_run_prints_the_run():
    done = launch_cli(*DRY, "--address", "10.0.0.1:6379", "--max-failures", "5", "--placement", "strict-spread")
    assert (done.returncode, done.stderr) == (0, "")
    assert json.loads(done.stdout) == {
        "address": "10.0.0.1:6379", "name": "jaxtrain-shakespeare-char", "workers": 4, "min_workers": 2,
        "resources_per_worker": {"CPU": 1.0, "GPU": 8, "memory": 2e9}, "placement_strategy": "STRICT_SPREAD",
        "max_failures": 5, "storage_path": None,
        "worker": {"argv": ["--config", CONFIG, "train.steps=10", "distributed.device_micro_batch=5"],
                   "env": {"NCCL_DEBUG": "INFO"}, "chdir": "/shared", "python": None, "coordinator_port": 0}}


@pytest.mark.parametrize("args, message", [
    (["--nodes", "2", "--min-nodes", "3"], "--min-nodes: 3 is more than --nodes 2"),
    (["--resource", "TPU=4"], ("--resource: TPU is not taken here (CPU and GPU have their own flags; for TPU slices "
                               "use the gke target)")),
    (["--resource", "shm=lots"], "--resource: expected NAME=AMOUNT with AMOUNT > 0, got 'shm=lots'"),
    (["--cpus-per-worker", "0"], "--cpus-per-worker: must be a finite number > 0, got 0"),
    (["--cpus-per-worker", "nan"], "--cpus-per-worker: must be a finite number > 0, got nan"),
    (["--cpus-per-worker", "inf"], "--cpus-per-worker: must be a finite number > 0, got inf"),
    (["--resource", "shm=inf"], "--resource: expected NAME=AMOUNT with AMOUNT > 0, got 'shm=inf'"),
    (["--name", "my run"], "--name: 'my run' is not a valid Ray Train run name (letters, digits, '_', '.', '-')"),
    (["--coordinator-port", "70000"], ("argument --coordinator-port: must be a port in 1..65535, got 70000 (or 0: a "
                                       "free one) (see python -m jaxtrain.launch ray --help)")),
    (["--env", "JAXTRAIN_RAY_WORLD_RANK=1"],
     "--env: JAXTRAIN_RAY_WORLD_RANK is set for each process by the launcher or the platform; leave it out"),
    (["--nodes", "2", "distributed.mode=off"],
     "distributed.mode: 'off' would make each of the 2 processes train alone; use auto"),
])
def test_bad_input_is_a_named_error(capsys, args, message):
    code, out, err = launch(capsys, "ray", "--config", CONFIG, "--dry-run", *args)
    assert (code, out, err) == (2, "", f"error: {message}\n")


def test_no_cluster_or_no_ray_is_named(capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code, out, err = launch(capsys, "ray", "--config", CONFIG)
    assert (code, out, err) == (2, "", ("error: --address: no Ray cluster given: pass --address HOST:PORT (or auto, or "
                                        "ray://HOST:10001) or set RAY_ADDRESS\n"))
    no_ray = "import sys; sys.modules['ray'] = None"
    done = launch_cli("ray", "--config", CONFIG, "--address", "127.0.0.2:9", prelude=no_ray)
    assert (done.returncode, done.stderr) == (2, ("error: the ray launcher needs 'ray[train]', which is not installed: "
                                                  "pip install 'jaxtrain[ray]'\n"))


def test_training_process_environment_keeps_only_the_ray_shape():
    inherited = {"PATH": "/bin", "SLURM_PROCID": "3", "SLURM_STEP_NODELIST": "n[1-4]", "JAX_NUM_PROCESSES": "8",
                 "JOB_COMPLETION_INDEX": "2", "VC_WORKER_HOSTS": "a,b", "TPU_WORKER_ID": "0",
                 "JAXTRAIN_NUM_PROCESSES": "5", "CUDA_VISIBLE_DEVICES": "0,1"}
    env = ray_worker.child_env(inherited, {"XLA_FLAGS": "--x"}, "10.0.0.7:41000", 2, 1)
    assert env == {"PATH": "/bin", "TPU_WORKER_ID": "0", "CUDA_VISIBLE_DEVICES": "0,1", "XLA_FLAGS": "--x",
                   "JAXTRAIN_RAY_COORDINATOR_ADDRESS": "10.0.0.7:41000", "JAXTRAIN_RAY_WORLD_SIZE": "2",
                   "JAXTRAIN_RAY_WORLD_RANK": "1"}
    assert ray_worker.coordinator_address("::1", 5) == "[::1]:5"


def test_a_failed_run_ends_with_the_training_process_exit_code():
    spec = {"name": "shk", "max_failures": 2}
    err = RuntimeError("Training failed due to worker errors:\n[Rank 1 Error Snippet]:\nTraceback ...\n"
                       "jaxtrain.launch.ray_worker.TrainingExited: jaxtrain.train exited with code 2 on worker 1 of "
                       "2 (node 10.0.0.3)\n")
    failure = ray_launcher._failure(err, spec)
    assert (str(failure), failure.exit_code) == (
        "Ray Train run 'shk' failed (--max-failures 2): jaxtrain.train exited with code 2 on worker 1 of 2 (node "
        "10.0.0.3)", 2)
    killed = ray_launcher._failure(RuntimeError("jaxtrain.train exited with code -9 on worker 0 of 2 (node x)"), spec)
    assert killed.exit_code == 1  # a signal: no exit code of jaxtrain's own
    other = ray_launcher._failure(RuntimeError("The actor died unexpectedly\nActorDiedError: worker lost"), spec)
    assert (str(other), other.exit_code) == ("Ray Train run 'shk' failed (--max-failures 2): ActorDiedError: worker "
                                             "lost", 1)


def test_a_workers_exit_code_survives_rays_serialization():
    """Ray re-raises a worker's exception in the driver from its serialized form: TrainingExited must rebuild
    with its code (at 5eb7ae3 it rebuilt from the message alone and failed with a TypeError, exit 1)."""
    import pickle
    sent = ray_worker.TrainingExited(2, 1, 2, "10.0.0.3")
    got = pickle.loads(pickle.dumps(sent))
    assert (type(got), str(got), got.code, got.rank, got.size, got.node) == (
        ray_worker.TrainingExited, str(sent), 2, 1, 2, "10.0.0.3")
    assert ray_launcher._failure(got, {"name": "shk", "max_failures": 0}).exit_code == 2


# ---- a real cluster ---------------------------------------------------------------------------------

TRAIN = ["train.steps=32", "train.log_every=1", "train.eval_every=1000", "train.eval_batches=1",
         "train.sample_tokens=0", "checkpoint.every=4", "checkpoint.keep=10", "model.n_layers=1", "run.progress=false",
         "distributed.init_timeout_s=20", "distributed.peer_timeout_s=20"]


@pytest.fixture(scope="module")
def ray_cluster():
    from ray_cluster import RayCluster
    cluster = RayCluster(cpus=4)
    yield cluster
    cluster.stop()


def _command(cluster, tmp_path, corpus: str, name: str) -> list[str]:
    return [sys.executable, "-m", "jaxtrain.launch", "ray", "--address", cluster.address, "--nodes", "2",
            "--max-failures", "2", "--name", name, "--storage-path", str(tmp_path / "ray"), "--chdir", str(REPO),
            "--env", "JAX_PLATFORMS=cpu", "--env", f"XLA_FLAGS={xla_test_flags.with_devices(2)}",
            "--env", f"JAX_COMPILATION_CACHE_DIR={os.environ.get('JAX_COMPILATION_CACHE_DIR', REPO / '.jax_cache')}",
            "--config", "shakespeare_char",  # trained for real: the shipped config's batch, not the dry runs' job
            f"data.path={corpus}", f"run.dir={tmp_path / 'run'}", *TRAIN]


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _start(cluster, tmp_path, corpus, name) -> subprocess.Popen:
    env = {**cluster.env, "RAY_DEDUP_LOGS": "0", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(_command(cluster, tmp_path, corpus, name), cwd=REPO, env=env, text=True,
                            stdout=open(tmp_path / "launch.log", "w"), stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen, tmp_path, timeout: float = 240) -> str:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    out = (tmp_path / "launch.log").read_text(errors="replace")
    assert proc.returncode == 0, out[-6000:]
    return out


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster, tmp_path_factory, corpus_path):
    """2 Ray workers x 2 CPU devices train 32 steps: (launcher output, run dir)."""
    tmp = tmp_path_factory.mktemp("ray-a")
    out = _finish(_start(ray_cluster, tmp, corpus_path, "jt-ray-a"), tmp)
    return out, tmp / "run"


@pytest.mark.servers
@pytest.mark.slow
def test_two_workers_train_as_one_run(uninterrupted):
    out, run_dir = uninterrupted
    assert "Ray Train run 'jt-ray-a' finished (2 workers, " in out
    for rank in (0, 1):
        assert f"jaxtrain.launch ray: worker {rank} of 2 on node 127.0.0.2: coordinator 127.0.0.2:" in out
    assert "distributed: process 0 of 2 joined (Ray worker; coordinator 127.0.0.2:" in out, out[-4000:]
    assert "(4 devices)" in out
    rows = _rows(run_dir)
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 33))  # each once: one run, not two
    assert [r["checkpoint_saved"] for r in rows if "checkpoint_saved" in r] == list(range(4, 33, 4))
    assert (run_dir / "checkpoints" / "32" / "COMMIT.json").is_file()


@pytest.mark.servers
@pytest.mark.slow
def test_a_killed_worker_restarts_the_group_which_resumes(ray_cluster, uninterrupted, tmp_path, corpus_path):
    """SIGKILL to Ray worker 1 (the actor) once step 4 is committed: its training process dies with it, Ray
    Train restarts both workers, the run resumes from the last checkpoint and ends with the losses of the
    uninterrupted run."""
    from ray_cluster import parent_of
    proc = _start(ray_cluster, tmp_path, corpus_path, "jt-ray-b")
    run_dir, end = tmp_path / "run", time.monotonic() + 180
    while not (run_dir / "checkpoints" / "4" / "COMMIT.json").is_file():
        assert proc.poll() is None and time.monotonic() < end, (tmp_path / "launch.log").read_text()[-4000:]
        time.sleep(0.05)
    (trainer,) = ray_cluster.worker_pids(rank=1)
    actor = parent_of(trainer)
    killed_at = max(r["step"] for r in _rows(run_dir) if "loss" in r)
    os.kill(actor, signal.SIGKILL)
    out = _finish(proc, tmp_path)
    assert killed_at < 32, "the run ended before the kill"
    resumed = [int(line.rsplit("/", 1)[1].split()[0]) for line in out.splitlines()
               if f"resumed from {run_dir / 'checkpoints'}/" in line]
    assert len(resumed) == 1 and 4 <= resumed[0] <= killed_at + 4, out[-6000:]
    workers = set(re.findall(r"\(RayTrainWorker pid=(\d+)\)\S* jaxtrain\.launch ray: worker 1 of 2 on node", out))
    assert len(workers) == 2, out[-6000:]  # the group ran twice: a new Ray worker 1
    rows = _rows(run_dir)
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 33))
    reference = {r["step"]: r["loss"] for r in _rows(uninterrupted[1]) if "loss" in r}
    assert all(abs(r["loss"] - reference[r["step"]]) <= 1e-5 for r in rows if "loss" in r)
    assert (run_dir / "checkpoints" / "32" / "COMMIT.json").is_file()


@pytest.mark.servers
@pytest.mark.slow
def test_bad_input_in_training_ends_the_run_with_exit_2_unretried(ray_cluster, tmp_path):
    """The training processes exit 2 (their data.path does not exist on the nodes, which the launcher cannot
    see): the launcher exits 2 at once with an error naming the worker and the code, and Ray Train never
    restarts the group (at 5eb7ae3 it exited 1 with a TypeError, after --max-failures restarts)."""
    proc = _start(ray_cluster, tmp_path, str(tmp_path / "no-such-corpus.txt"), "jt-ray-c")
    try:
        proc.wait(timeout=150)
    finally:
        proc.kill()
    out = (tmp_path / "launch.log").read_text(errors="replace")
    assert proc.returncode == 2, out[-6000:]
    assert out.splitlines()[-1] == (
        "error: Ray Train run 'jt-ray-c' failed: jaxtrain.train exited with code 2 (bad input) on worker 0 of 2 (node "
        "127.0.0.2); not retried: a restart would fail the same way (the worker's output above says why)"), out[-6000:]
    for rank in (0, 1):  # each worker started once, by one Ray worker: no restart (Ray prints each line twice)
        started = re.findall(rf"\(RayTrainWorker pid=(\d+)\)\S* jaxtrain\.launch ray: worker {rank} of 2 on node", out)
        assert len(started) >= 1 and len(set(started)) == 1, out[-6000:]
        assert f"jaxtrain.launch ray: worker {rank} of 2: jaxtrain.train exited with code 2 (bad input): not " \
               f"retried" in out
    assert f"error: data.path: no file matches '{tmp_path / 'no-such-corpus.txt'}'" in out, out[-6000:]
