"""Real multi-process training runs on 127.0.0.1: N ``python -m jaxtrain.train`` processes, each with
its own simulated CPU devices, joined by ``jax.distributed`` through the ``JAXTRAIN_*`` environment
(what the GKE launcher sets). Every wait has a deadline; on expiry the processes are killed and the
test fails with what they printed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import portpicker
import pytest
import xla_test_flags

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 300


def environment(devices: int, extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXTRAIN_", "SLURM_", "CLUSTER_SPEC"))}
    env["XLA_FLAGS"] = xla_test_flags.with_devices(devices)
    env["JAX_PLATFORMS"] = "cpu"
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(REPO / ".jax_cache"))
    env["JAXTRAIN_PROGRAM_CACHE_DIR"] = os.environ.get("JAXTRAIN_PROGRAM_CACHE_DIR", str(REPO / ".program_cache"))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


class Job:
    """``processes`` trainers of one job (``devices`` CPU devices each); output goes to files."""

    def __init__(self, processes: int, devices: int, args: list[str], extra_env: dict | None = None,
                 log_dir: Path | None = None, only: list[int] | None = None, per_process: dict | None = None,
                 entry: tuple[str, ...] = ("-m", "jaxtrain.train")):
        """``only``: start just these process ids (the others never come). ``per_process``: ``{id: (extra
        args, extra env)}`` for some of them. ``entry``: how the interpreter starts the trainer."""
        self.port = portpicker.pick_unused_port()
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="jaxtrain-job-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs, self.logs = [], []
        for i in (range(processes) if only is None else only):
            env = environment(devices, {"JAXTRAIN_COORDINATOR_ADDRESS": f"127.0.0.1:{self.port}",
                                        "JAXTRAIN_NUM_PROCESSES": str(processes), "JAXTRAIN_PROCESS_ID": str(i),
                                        **(extra_env or {})})
            more_args, more_env = (per_process or {}).get(i, ([], {}))
            env.update(more_env)
            log = open(self.log_dir / f"process{i}.log", "w")
            self.logs.append(log)
            self.procs.append(subprocess.Popen([sys.executable, *entry, *args, *more_args], env=env,
                                               cwd=REPO,
                                               stdout=log, stderr=subprocess.STDOUT))

    def output(self, i: int) -> str:
        return (self.log_dir / f"process{i}.log").read_text()

    def wait_for(self, text: str, process: int = 0, timeout: float = DEADLINE_S) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if text in self.output(process):
                return
            if all(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.2)
        self.fail(f"process {process} never printed {text!r}")

    def wait(self, timeout: float = DEADLINE_S) -> list[int]:
        end = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(timeout=max(1.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.fail(f"not every process ended within {timeout} s")
        for log in self.logs:
            log.close()
        return [p.returncode for p in self.procs]

    def fail(self, why: str) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait(timeout=30)
        tails = "\n".join(f"--- process {i} ---\n{self.output(i)[-4000:]}" for i in range(len(self.procs)))
        pytest.fail(f"{why}. Output:\n{tails}")


def run(processes: int, devices: int, args: list[str], timeout: float = DEADLINE_S, **kw) -> Job:
    """Runs a job to the end; fails the test unless every process exits 0."""
    job = Job(processes, devices, args, **kw)
    codes = job.wait(timeout)
    if any(codes):
        job.fail(f"exit codes {codes}")
    return job


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows(run_dir) if "loss" in r}
