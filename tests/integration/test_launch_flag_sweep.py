"""Every numeric launcher flag of every target given 0, a negative, a non-number, NaN, infinity or a
fraction: a valid value prints the job, every other is one ``error:`` line naming the flag, exit 2,
before anything is generated. The flags are found from the targets' own parsers, so a flag added
later is swept too. Also the quantities of ``--resource`` and the node counts a global batch cannot
take (``--nodes``, and every count from ``ray --min-nodes`` up)."""
from __future__ import annotations

import argparse
import importlib

import pytest
from launch_helpers import CONFIG, POD_CONFIG, launch

from jaxtrain.launch import common
from jaxtrain.launch.common import TARGETS

REQUIRED = {"gke": ["--image", "img"],
            "vertex": ["--image", "img", "--project", "p", "--machine-type", "n1-standard-4"],
            "slurm": [], "ray": [], "kubeflow": ["--image", "img"], "volcano": ["--image", "img"]}
VALUES = ["0", "-1", "abc", "nan", "inf", "1.5"]


def _numeric_flags(target: str) -> list[tuple[str, object]]:
    parser = argparse.ArgumentParser()
    common.add_common_args(parser)
    importlib.import_module(f"jaxtrain.launch.{target}").add_args(parser)
    return [(a.option_strings[0], a.type) for a in parser._actions
            if a.option_strings and a.type is not None and a.type is not str]


def _valid(kind, value: str) -> bool:
    """Whether the flag's type takes ``value`` as a meaningful setting."""
    if kind in (common.positive_int,):
        return False  # none of VALUES is an integer >= 1
    if kind is common.nonnegative_int or getattr(kind, "__name__", "") == "_port_or_free":
        return value == "0"  # 0 restarts, 0 GPUs, port 0 = a free one
    if kind is float:  # --cpus-per-worker: a finite number > 0
        return value == "1.5"
    return False  # ports: 1..65535


CASES = [(t, flag, kind, v) for t in TARGETS for flag, kind in _numeric_flags(t) for v in VALUES]


def test_the_sweep_covers_every_targets_numeric_flags():
    found = {(t, flag) for t, flag, _, _ in CASES}
    assert {("gke", "--coordinator-port"), ("ray", "--min-nodes"), ("ray", "--cpus-per-worker"),
            ("slurm", "--cpus-per-task"), ("volcano", "--max-restarts"), ("kubeflow", "--gpus"),
            ("vertex", "--accelerator-count")} <= found
    assert len({flag for _, flag in found}) >= 12 and all(len(VALUES) == sum(
        1 for c in CASES if c[:2] == key) for key in found)


@pytest.mark.parametrize("target, flag, kind, value", CASES, ids=[f"{c[0]}{c[1]}={c[3]}" for c in CASES])
def test_numeric_flag(capsys, target, flag, kind, value):
    extra = ["--accelerator", "nvidia-tesla-a100"] if flag == "--accelerator-count" else []
    if flag == "--min-nodes":
        extra = ["--nodes", "4"]
    code, out, err = launch(capsys, target, "--config", POD_CONFIG, "--dry-run", *REQUIRED[target], *extra, flag, value)
    if _valid(kind, value):
        assert code == 0 and out and "error" not in err
        return
    assert (code, out) == (2, ""), err
    assert err.count("\n") == 1 and err.startswith("error: ") and flag in err, err


@pytest.mark.parametrize("target, args, message", [
    ("slurm", ["--time", "-1"], "--time: expected MINUTES, HH:MM:SS or D-HH:MM:SS, got '-1'"),
    ("slurm", ["--time", "nan"], "--time: expected MINUTES, HH:MM:SS or D-HH:MM:SS, got 'nan'"),
    ("gke", ["--accelerator", "tpu-v5-lite-podslice", "--tpu-topology", "0x0"],
     "--tpu-topology: expected AxB or AxBxC, got '0x0'"),
    ("kubeflow", ["--resource", "memory=0"],
     "--resource: memory must be more than 0, got '0' (leave out what a pod does not need)"),
    ("volcano", ["--resource", "nvidia.com/gpu=-2"],
     "--resource: nvidia.com/gpu must be more than 0, got '-2' (leave out what a pod does not need)"),
    ("kubeflow", ["--resource", "cpu=nan"],
     "--resource: expected NAME=QUANTITY such as google.com/tpu=4 or memory=64Gi, got 'cpu=nan'"),
    ("volcano", ["--gpus", "4", "--resource", "nvidia.com/gpu=2"],
     "--resource: nvidia.com/gpu=2 and --gpus 4 both set the GPUs per node; give one"),
    ("kubeflow", ["--resource", "google.com/tpu=0.5"],
     "--resource: google.com/tpu is a device plugin's resource, counted in whole units; got '0.5'"),
    ("gke", ["--coordinator-port", "-1"], ("argument --coordinator-port: must be a port in 1..65535, got -1 (see "
                                           "python -m jaxtrain.launch gke --help)")),
    ("ray", ["--resource", "memory=0"], "--resource: expected NAME=AMOUNT with AMOUNT > 0, got 'memory=0'"),
    ("ray", ["--resource", "memory=-inf"], "--resource: expected NAME=AMOUNT with AMOUNT > 0, got 'memory=-inf'"),
])
def test_numeric_values_of_other_flags(capsys, target, args, message):
    code, out, err = launch(capsys, target, "--config", POD_CONFIG, "--dry-run", *REQUIRED[target], *args)
    assert (code, out, err) == (2, "", f"error: {message}\n")


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_a_node_count_the_global_batch_cannot_take(capsys, target):
    shared = [] if target in ("slurm", "ray") else ["checkpoint.dir=gs://bucket/run"]  # pods: no shared disk
    code, out, err = launch(capsys, target, "--config", POD_CONFIG, "--dry-run", *REQUIRED[target], "--nodes", "7",
                            "--env", "XLA_FLAGS=", *shared)  # one CPU device per process (slurm: not this shell's)
    assert (code, out) == (2, "")
    assert err == ("error: train.global_batch: micro-batch 480 (global_batch 480 / grad_accum 1) is not divisible by "
                   "data*fsdp*expert = 7*1*1 = 7 (the job has 7 processes x 1 CPU device = 7)\n")


@pytest.mark.parametrize("overrides, message", [
    (["train.global_batch=8", "distributed.elastic=false"], (
        "--min-nodes: the group may start or restart on any of 2..4 workers, but on 3: train.global_batch: micro-batch "
        "8 (global_batch 8 / grad_accum 1) is not divisible by data*fsdp*expert = 3*1*1 = 3 (the job has 3 processes "
        "x 1 CPU device = 3)")),
    (["train.global_batch=12"], (
        "--min-nodes: the group may start or restart on any of 2..4 workers, but a group started on 2 and restarted "
        "on 3 cannot keep its batch: train.grad_accum: elastic resume: train.global_batch=12 is not a whole number of "
        "micro-batches of 18 sequences (distributed.device_micro_batch=6 on each of 3 batch devices, "
        "data*fsdp*expert), so no gradient accumulation keeps both; resume on a device count for which it is, set "
        "distributed.device_micro_batch to a size that divides, or set distributed.elastic=false to keep "
        "train.grad_accum instead")),
])
def test_ray_min_nodes_counts_the_global_batch_cannot_take(capsys, overrides, message):
    """At 5eb7ae3 only --nodes was checked: an elastic group that shrank to 3 workers failed at its restart."""
    code, out, err = launch(capsys, "ray", "--config", CONFIG, "--dry-run", "--nodes", "4", "--min-nodes", "2",
                            *overrides)
    assert (code, out, err) == (2, "", f"error: {message}\n")


@pytest.mark.parametrize("overrides", [["train.global_batch=12", "distributed.device_micro_batch=1"],
                                       ["train.global_batch=12", "distributed.elastic=false"]])
def test_ray_min_nodes_counts_that_all_take_the_batch(capsys, overrides):
    code, out, err = launch(capsys, "ray", "--config", CONFIG, "--dry-run", "--nodes", "4", "--min-nodes", "2",
                            *overrides)
    assert (code, err) == (0, "") and '"min_workers": 2' in out



@pytest.mark.parametrize("target", sorted(common.POD_TARGETS))
def test_a_pod_target_refuses_this_machines_absolute_config_path(capsys, target):
    """At 5eb7ae3 the manifest carried the absolute path, which the image does not hold (the pods failed)."""
    code, out, err = launch(capsys, target, "--config", CONFIG, "--dry-run", *REQUIRED[target])
    assert (code, out, err) == (2, "", (
        f"error: --config: {CONFIG} is a path on this machine, but the job's containers start from --image; pass "
        f"--container-config PATH (where the image holds this file), a path relative to the image's working "
        f"directory, or a config name shipped with jaxtrain (e.g. shakespeare_char)\n"))
    code, out, _ = launch(capsys, target, "--config", CONFIG, "--container-config", "/app/shk.yaml", "--dry-run",
                          *REQUIRED[target])
    assert code == 0 and "/app/shk.yaml" in out and CONFIG not in out
