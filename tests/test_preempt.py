"""Preemption (SIGTERM to a training subprocess) and a short crash-trial series (SIGKILL)."""
import importlib.util
import json
import re
import signal
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("crash_trials", REPO / "benchmarks" / "crash_trials.py")
crash_trials = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(crash_trials)


def test_sigterm_saves_commits_exits_zero_and_rerun_resumes(tmp_path, corpus_path):
    run_dir, steps = tmp_path / "run", 400
    cmd = crash_trials.command(run_dir, corpus_path, steps) + ["checkpoint.every=1000",
                                                               "checkpoint.grace_period_s=20"]
    proc = subprocess.Popen(cmd, env=crash_trials.environment(), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step      3 |"):
            break
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    rest, _ = proc.communicate(timeout=60)
    out = "".join(lines) + rest
    assert proc.returncode == 0, out
    assert time.monotonic() - t0 < 20
    stop = re.search(r"SIGTERM: stopped after step (\d+); checkpoint committed; rerun to resume", out)
    assert stop, out
    n = int(stop.group(1))
    assert 3 <= n < steps and crash_trials.committed(run_dir) == [n]
    first = crash_trials.losses(run_dir)
    assert [s for s, _ in first] == list(range(1, n + 1))

    # The same command resumes (SIGINT this time) and its losses continue the first run's exactly.
    proc = subprocess.Popen(cmd, env=crash_trials.environment(), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(f"step {n + 3:>6} |"):
            break
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=60)
    out = "".join(lines) + rest
    assert proc.returncode == 0, out
    assert f"resumed from {run_dir / 'checkpoints'}/{n}\n" in out
    m = int(re.search(r"SIGINT: stopped after step (\d+); checkpoint committed", out).group(1))
    assert crash_trials.committed(run_dir) == [n, m]
    rows = crash_trials.losses(run_dir)
    assert [s for s, _ in rows] == list(range(1, m + 1))  # no step lost or repeated across the stop


def test_sigkill_trials_resume_from_latest_commit(tmp_path, corpus_path):
    summary = crash_trials.run_trials(2, tmp_path, corpus_path, steps=16, seed=3, log=lambda _: None)
    assert summary["failures"] == [], json.dumps(summary)
    assert summary["loss_rows_checked"] >= 16 and summary["sigkills"] >= 1


def test_grace_period_expiry_exits_75():
    code = ("import os, signal, time\n"
            "from jaxtrain.train.preempt import Preemption\n"
            "with Preemption(grace_period_s=0.5):\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(30)  # a save that never commits\n")
    import sys
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 75
    assert time.monotonic() - t0 < 20
    assert proc.stderr.strip() == ("error: checkpoint.grace_period_s=0.5 s passed after SIGTERM before the "
                                   "checkpoint committed; exiting (the latest committed checkpoint is intact)")
