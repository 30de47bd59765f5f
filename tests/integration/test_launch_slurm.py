"""``python -m jaxtrain.launch slurm``: the sbatch script, its errors, and real jobs on a single-node SLURM
cluster started from Debian's packages (tests/slurm_cluster.py): the mechanics alone (2 tasks under
srun form one jax.distributed run), then jaxtrain.train as one run of 2 processes."""
from __future__ import annotations

import json
import re
import sys
import time

import pytest
import xla_test_flags
from launch_helpers import CONFIG, REPO, launch, launch_cli
from slurm_cluster import slurm_cluster  # noqa: F401  (the fixture)

EXPECTED_SCRIPT = """\
#!/bin/bash
#SBATCH --job-name=shk
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-task=h100:1
#SBATCH --time=0-02:00:00
#SBATCH --output=logs/%j.out
#SBATCH --chdir=/scratch/me
#SBATCH --account=ml
# Written by `python -m jaxtrain.launch slurm`. srun starts every task of the step: JAX's own
# SLURM detection (jax.distributed.initialize()) then forms one run of all of them.
set -eu
export NCCL_DEBUG=INFO
export GREETING='hello world'
srun --kill-on-bad-exit=1 python3 -m jaxtrain.train --config /scratch/me/shk.yaml train.steps=10 \
'train.sample_prompt=to be'
"""


def test_cli_dry_run_prints_the_script():
    done = launch_cli("slurm", "--config", CONFIG, "--container-config", "/scratch/me/shk.yaml", "--name", "shk",
                      "--nodes", "2", "--ntasks-per-node", "4", "--gpus-per-task", "1", "--gpu-type", "h100",
                      "--time", "0-02:00:00", "--output", "logs/%j.out", "--chdir", "/scratch/me", "--python",
                      "python3", "--sbatch-arg=--account=ml", "--env", "NCCL_DEBUG=INFO", "--env",
                      "GREETING=hello world", "train.steps=10", "train.sample_prompt=to be", "--dry-run")
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == EXPECTED_SCRIPT.replace(" \\\n", " ")


def test_cpu_script_has_no_gpu_line(capsys, tmp_path):
    code, out, err = launch(capsys, "slurm", "--config", CONFIG, "--chdir", str(tmp_path), "--dry-run")
    assert (code, err) == (0, "")  # a shared filesystem: no note about local checkpoints
    assert [line for line in out.splitlines() if line.startswith("#SBATCH")] == [
        "#SBATCH --job-name=jaxtrain-shakespeare-char", "#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1",
        "#SBATCH --output=jaxtrain-%j.out", f"#SBATCH --chdir={tmp_path}"]
    assert out.splitlines()[-1] == f"srun --kill-on-bad-exit=1 python -m jaxtrain.train --config {CONFIG}"


GPUS = ["--nodes", "2", "--ntasks-per-node", "4", "--gpus-per-task", "1"]
JOB = "(the job has 8 processes x 1 GPU device = 8)"


@pytest.mark.parametrize("flags, error", [
    ([*GPUS, "mesh.data=2", "mesh.fsdp=2"], "mesh: the axis sizes multiply to 4 but there are 8 devices (data=2, "
     f"fsdp=2, tensor=1, sequence=1, expert=1, stage=1) {JOB}"),
    ([*GPUS, "train.global_batch=12"], "train.global_batch: micro-batch 12 (global_batch 12 / grad_accum 1) is not "
     f"divisible by data*fsdp*expert = 8*1*1 = 8 {JOB}"),
    ([*GPUS, "mesh.across_nodes={data: 2}"], "mesh.across_nodes: {'data': 2} spans 2 nodes, but the job has 8 "
     "processes x 1 GPU device = 8 (each process is a node); the axes across nodes must multiply to 8"),
    (["--nodes", "2", "--env", "XLA_FLAGS=--xla_force_host_platform_device_count=4", "mesh.data=-1",
      "mesh.tensor=3"], "mesh.data: cannot fill -1: 8 devices are not divisible by the product 3 of the other axes "
     "(data=-1, fsdp=1, tensor=3, sequence=1, expert=1, stage=1) (the job has 2 processes x 4 CPU devices = 8)"),
    (["--nodes", "2", "mesh.data=-1", "mesh.tensor=3"],  # this shell's XLA_FLAGS, which sbatch passes on
     "mesh.data: cannot fill -1: 16 devices are not divisible by the product 3 of the other axes "
     "(data=-1, fsdp=1, tensor=3, sequence=1, expert=1, stage=1) (the job has 2 processes x 8 CPU devices = 16)"),
])
def test_a_mesh_the_job_cannot_hold_is_refused_before_the_script(capsys, monkeypatch, tmp_path, flags, error):
    """The checks jaxtrain.train makes once its devices are up, made for the job's devices: such a job
    would otherwise wait in the queue only to fail at its start."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # this shell's, as sbatch passes it
    code, out, err = launch(capsys, "slurm", "--config", CONFIG, "--chdir", str(tmp_path), "--dry-run", *flags)
    assert (code, out, err) == (2, "", f"error: {error}\n")


def test_relative_config_file_becomes_absolute(capsys, monkeypatch, tmp_path):
    """The job starts in --chdir: a relative config file is passed by its absolute path (a shared filesystem)."""
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("XLA_FLAGS")  # the tests' 8 host devices, which sbatch would pass on: batch 12 cannot split
    code, out, _ = launch(capsys, "slurm", "--config", "configs/shakespeare_char.yaml", "--chdir", str(tmp_path),
                          "--dry-run", "train.steps=3")
    assert code == 0
    assert out.splitlines()[-1] == (f"srun --kill-on-bad-exit=1 python -m jaxtrain.train --config "
                                    f"{REPO}/configs/shakespeare_char.yaml train.steps=3")


@pytest.mark.parametrize("args, message", [
    (["--time", "2h"], "--time: expected MINUTES, HH:MM:SS or D-HH:MM:SS, got '2h'"),
    (["--gpu-type", "a100"], "--gpu-type: needs --gpus-per-task"),
    (["--partition", "gpu #1"], ("--partition: 'gpu #1' contains spaces, quotes or '#', which an #SBATCH line cannot "
                                 "carry")),
    (["--name", "my job"], "--name: 'my job' is not a valid SLURM job name (no spaces, quotes or '#')"),
    (["--sbatch-arg", "account=ml"], ("--sbatch-arg: expected an sbatch option such as --account=abc, got "
                                      "'account=ml'")),
    (["--ntasks-per-node", "0"], ("argument --ntasks-per-node: must be >= 1, got 0 (see python -m jaxtrain.launch "
                                  "slurm --help)")),
    (["--env", "A"], "--env: expected KEY=VALUE with KEY a variable name, got 'A'"),
    (["data.seq_len=-4"], "data.seq_len: must be > 0, got -4"),
])
def test_bad_input_is_a_named_error(capsys, args, message):
    code, out, err = launch(capsys, "slurm", "--config", CONFIG, "--dry-run", *args)
    assert (code, out, err) == (2, "", f"error: {message}\n")


def test_cli_bad_config_exits_2_and_submits_nothing(tmp_path):
    done = launch_cli("slurm", "--config", str(tmp_path / "missing.yaml"), env={"PATH": "/nonexistent"})
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith(f"error: --config: '{tmp_path / 'missing.yaml'}' is no such file, and no name in ")


def test_no_sbatch_is_a_named_error(capsys, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    code, out, err = launch(capsys, "slurm", "--config", CONFIG)
    assert (code, out) == (2, "")
    assert err == ("error: sbatch not found on PATH: run the slurm launcher on a SLURM login node "
                   "(or print the script with --dry-run)\n")


# ---- a real cluster ---------------------------------------------------------------------------------

MECHANICS = """\
#!/bin/bash
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --output={out}
export JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2
srun --kill-on-bad-exit=1 {python} -c "import jax; jax.config.update('jax_cpu_collectives_implementation', 'gloo'); \
jax.distributed.initialize(); print('process', jax.process_index(), 'of', jax.process_count(), 'devices', \
jax.device_count())"
"""


def test_srun_tasks_form_one_jax_run(slurm_cluster, tmp_path):  # noqa: F811
    """The cluster itself: two srun tasks detect SLURM and form one 2-process, 4-device JAX run."""
    out = tmp_path / "mechanics.out"
    done = slurm_cluster.run("sbatch", "--parsable", stdin=MECHANICS.format(out=out, python=sys.executable))
    assert done.returncode == 0, done.stderr
    state = slurm_cluster.wait_job(done.stdout.strip().split(";")[0], timeout_s=60)
    log = out.read_text() if out.exists() else ""
    assert state == "COMPLETED", f"{state}\n{log}\n{slurm_cluster.logs()}"
    assert sorted(line for line in log.splitlines() if line.startswith("process")) == [
        "process 0 of 2 devices 4", "process 1 of 2 devices 4"]


NO_SRUN = """\
#!/bin/bash
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --output={out}
export JAX_PLATFORMS=cpu
{python} -m jaxtrain.train --config {config} train.steps=1
"""


def test_a_batch_script_without_srun_is_a_named_error(slurm_cluster, tmp_path):  # noqa: F811
    """An allocation of 2 tasks whose script starts python itself (no job step): refused by name, exit 2,
    instead of one process training alone."""
    out = tmp_path / "no-srun.out"
    done = slurm_cluster.run("sbatch", "--parsable", stdin=NO_SRUN.format(out=out, python=sys.executable,
                                                                        config=CONFIG))
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip().split(";")[0]
    state = slurm_cluster.wait_job(job_id, timeout_s=60)
    log = out.read_text() if out.exists() else ""
    assert state == "FAILED", f"{state}\n{log}"
    assert (f"error: SLURM_NTASKS: SLURM job {job_id} has 2 tasks on 1 nodes, but this process is not in a job step: "
            f"started without srun, it would train alone.") in log, log


def test_bad_partition_is_a_named_submit_error(slurm_cluster, capsys, monkeypatch):  # noqa: F811
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))
    code, out, err = launch(capsys, "slurm", "--config", CONFIG, "--partition", "nope")
    assert (code, out) == (1, "")
    assert err == ("error: sbatch failed (exit 1): sbatch: error: Batch job submission failed: Invalid partition "
                   "name specified\n")


TRAIN = ["train.steps=4", "train.log_every=1", "train.eval_every=4", "train.eval_batches=1", "train.sample_tokens=0",
         "checkpoint.every=4", "model.n_layers=1", "run.progress=false"]


@pytest.mark.slow  # over ~20 s on 2 cores (CI's durations)
def test_launched_job_trains_as_one_run_of_two_processes(slurm_cluster, capsys, monkeypatch, tmp_path,  # noqa: F811
                                                         corpus_path):
    """`jaxtrain.launch slurm` submits jaxtrain.train on 2 tasks of one node (2 CPU devices each): one run
    of 2 processes, 4 devices; every metrics row once; a committed checkpoint at step 4."""
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))
    run_dir = tmp_path / "run"
    code, out, err = launch(
        capsys, "slurm", "--config", CONFIG, "--nodes", "1", "--ntasks-per-node", "2",
        "--python", sys.executable, "--chdir", str(tmp_path), "--output", "job-%j.out", "--time", "5",
        "--name", "jt-launch", "--env", "JAX_PLATFORMS=cpu",
        "--env", f"XLA_FLAGS={xla_test_flags.with_devices(2)}",
        f"data.path={corpus_path}", f"run.dir={run_dir}", *TRAIN)
    assert (code, err) == (0, ""), err
    match = re.fullmatch(r"submitted SLURM job (\d+) \(1 nodes x 2 tasks\); log: (\S+)\n", out)
    assert match, out
    job_id, log_path = match.groups()
    assert log_path == str(tmp_path / f"job-{job_id}.out")
    start = time.monotonic()
    state = slurm_cluster.wait_job(job_id, timeout_s=150)
    took = time.monotonic() - start
    log = (tmp_path / f"job-{job_id}.out").read_text(errors="replace") if (tmp_path / f"job-{job_id}.out").exists() \
        else "(no log)"
    assert state == "COMPLETED", f"job {state} after {took:.0f} s\n{log}\n{slurm_cluster.logs()}"

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in rows if "loss" in r]
    assert train_steps == [1, 2, 3, 4], log  # each step once: one run, not two runs writing side by side
    assert [r["step"] for r in rows if "val_loss" in r] == [4]
    assert (run_dir / "checkpoints" / "4" / "COMMIT.json").is_file()
    # 2 tasks x 2 local devices: only one run of both processes sees 4 devices.
    assert re.search(r"^mesh .*\(4 devices\)", log, re.M), log
    assert not re.search(r"\((1|2) devices\)", log), log
    for rank in (0, 1):  # each task reports joining as its own process of the 2
        assert re.search(rf"\bprocess {rank} of 2\b", log), log
