"""Preemption (SIGTERM to a training subprocess) and a short crash-trial series (SIGKILL).

Every read of and wait for a child has a deadline: on expiry the child is killed and the test fails
with what it printed, so a hung trainer cannot hang the test run. No assertion is on wall time.
"""
import importlib.util
import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("crash_trials", REPO / "benchmarks" / "crash_trials.py")
crash_trials = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(crash_trials)

DEADLINE_S = 240  # generous: compiling on 2 busy cores can take a minute


class Child:
    """A trainer subprocess whose merged stdout/stderr a thread collects, so reads can time out."""

    def __init__(self, cmd, env=None):
        self.proc = subprocess.Popen(cmd, env=env or crash_trials.environment(), cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines, self._new = [], queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            self._new.put(line)
        self._new.put(None)  # EOF

    def output(self) -> str:
        return "".join(self.lines)

    def fail(self, why: str):
        if self.proc.poll() is None:
            self.proc.kill()
            why += "; the child was killed"
        self.proc.wait(timeout=30)
        self._reader.join(timeout=10)
        pytest.fail(f"{why}. Its output:\n{self.output()[-6000:]}")

    def wait_for_line(self, prefix: str, timeout: float = DEADLINE_S) -> str:
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            try:
                line = self._new.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                self.fail(f"the child exited (code {self.proc.wait(timeout=30)}) before printing {prefix!r}")
            if line.startswith(prefix):
                return line
        self.fail(f"no line starting with {prefix!r} within {timeout} s")

    def finish(self, timeout: float = DEADLINE_S) -> str:
        """Waits for the exit and the last output; returns all of it."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.fail(f"still running {timeout} s later")
        self._reader.join(timeout=30)
        return self.output()


def test_sigterm_saves_commits_exits_zero_and_rerun_resumes(tmp_path, corpus_path):
    run_dir, steps = tmp_path / "run", 400
    cmd = crash_trials.command(run_dir, corpus_path, steps) + ["checkpoint.every=1000",
                                                               "checkpoint.grace_period_s=20"]
    child = Child(cmd)
    child.wait_for_line("step      3 |")
    child.proc.send_signal(signal.SIGTERM)
    out = child.finish()
    assert child.proc.returncode == 0, out
    stop = re.search(r"SIGTERM: stopped after step (\d+); checkpoint committed; rerun to resume", out)
    assert stop, out
    n = int(stop.group(1))
    assert 3 <= n < steps and crash_trials.committed(run_dir) == [n]
    first = crash_trials.losses(run_dir)
    assert [s for s, _ in first] == list(range(1, n + 1))

    # The same command resumes (SIGINT this time) and its losses continue the first run's exactly.
    child = Child(cmd)
    child.wait_for_line(f"step {n + 3:>6} |")
    child.proc.send_signal(signal.SIGINT)
    out = child.finish()
    assert child.proc.returncode == 0, out
    assert f"resumed from {run_dir / 'checkpoints'}/{n}\n" in out
    m = int(re.search(r"SIGINT: stopped after step (\d+); checkpoint committed", out).group(1))
    assert crash_trials.committed(run_dir) == [n, m]
    rows = crash_trials.losses(run_dir)
    assert [s for s, _ in rows] == list(range(1, m + 1))  # no step lost or repeated across the stop


def test_sigkill_trials_resume_from_latest_commit(tmp_path, corpus_path):
    summary = crash_trials.run_trials(2, tmp_path, corpus_path, steps=16, seed=3, log=lambda _: None,
                                      timeout=DEADLINE_S)
    assert summary["failures"] == [], json.dumps(summary)
    assert summary["loss_rows_checked"] >= 16 and summary["sigkills"] >= 1


def test_grace_period_expiry_exits_75():
    # The child would sleep 30 s; exit code 75 and the message show the grace period ended it first.
    code = ("import os, signal, time\n"
            "from jaxtrain.runtime.signals import Preemption\n"
            "with Preemption(grace_period_s=0.5):\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(30)  # a save that never commits\n")
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=DEADLINE_S)
    except subprocess.TimeoutExpired as err:  # run() has killed it
        pytest.fail(f"still running after {DEADLINE_S} s:\n{err.stdout or ''}{err.stderr or ''}")
    assert proc.returncode == 75, proc.stderr
    assert proc.stderr.strip() == ("error: checkpoint.grace_period_s=0.5 s passed after SIGTERM before the "
                                   "checkpoint committed; exiting (the latest committed checkpoint is intact)")


def _catches_sigterm(pid: int) -> bool:
    """Whether the process has installed a SIGTERM handler (SigCgt in /proc/PID/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.M).group(1), 16)
    return bool(mask >> (signal.SIGTERM - 1) & 1)


SLOW_DATA = """
import sys, time
from jaxtrain.runtime import signals
signals.during_startup()
from jaxtrain import data
load = data.load
def slow(*args, **kwargs):  # a slow corpus read (a network file system, say)
    print("loading the data", flush=True)
    time.sleep(120)
    return load(*args, **kwargs)
data.load = slow
from jaxtrain.cli.train import main
sys.exit(main(sys.argv[1:]))
"""
NOTHING_TRAINED = ("SIGTERM before the first training step: nothing was trained, so nothing was saved; "
                   "rerun the same command to continue")


def test_sigterm_during_startup_exits_zero_and_a_rerun_starts_cleanly(tmp_path, corpus_path):
    run_dir = tmp_path / "run"
    cmd = crash_trials.command(run_dir, corpus_path, 2)
    # While Python is still importing jax: as soon as the handlers are in.
    child = Child(cmd)
    end = time.monotonic() + DEADLINE_S
    while not _catches_sigterm(child.proc.pid):
        if child.proc.poll() is not None or time.monotonic() > end:
            child.fail("the child never installed a SIGTERM handler")
        time.sleep(0.005)
    child.proc.send_signal(signal.SIGTERM)
    out = child.finish()
    assert child.proc.returncode == 0 and out.strip().endswith(NOTHING_TRAINED), out
    assert crash_trials.committed(run_dir) == [] and not (run_dir / "metrics.jsonl").exists()

    out = Child(cmd).finish()  # the rerun starts cleanly and completes
    assert "step      2 |" in out and crash_trials.committed(run_dir) == [2], out
    config = (run_dir / "config.yaml").read_text()

    # While a resumed run loads its data: it stops at once, and nothing of the run changes.
    script = tmp_path / "slow_data.py"
    script.write_text(SLOW_DATA)
    child = Child([sys.executable, str(script), *cmd[3:-2], "train.steps=4", f"run.dir={run_dir}"])
    child.wait_for_line("loading the data")
    child.proc.send_signal(signal.SIGTERM)
    out = child.finish(timeout=60)  # far less than the 120 s the data would take
    assert child.proc.returncode == 0 and out.strip().endswith(NOTHING_TRAINED), out
    assert crash_trials.committed(run_dir) == [2] and (run_dir / "config.yaml").read_text() == config
    assert [s for s, _ in crash_trials.losses(run_dir)] == [1, 2]


SLOW_END = """
import sys, time
from jaxtrain.train import hooks
from jaxtrain.runtime import signals
signals.during_startup()
end = hooks.Evaluate.on_end
def slow(self, loop, ok):  # the final evaluation takes a while (a large validation set, say)
    print("final evaluation", flush=True)
    time.sleep(3)
    return end(self, loop, ok)
hooks.Evaluate.on_end = slow
from jaxtrain.cli.train import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_signal_after_the_last_step_lets_the_final_save_commit(tmp_path, corpus_path):
    run_dir = tmp_path / "run"
    script = tmp_path / "slow_end.py"
    script.write_text(SLOW_END)
    child = Child([sys.executable, str(script), *crash_trials.command(run_dir, corpus_path, 3)[3:]])
    child.wait_for_line("final evaluation")
    child.proc.send_signal(signal.SIGTERM)
    out = child.finish()
    assert child.proc.returncode == 0 and "Traceback" not in out, out
    assert "SIGTERM after the last step: the run had finished; nothing was lost" in out
    assert 3 in crash_trials.committed(run_dir)  # the final save (committed while the evaluation ran) is kept
