"""Crash trials: SIGKILL the trainer at random moments, resume, and check nothing was lost or corrupted.

    python benchmarks/crash_trials.py --trials 50 [--seed 0] [--slow-checksum 0.3] [--workdir DIR] [--data FILE]

One uninterrupted reference run gives the loss at every step. Then each trial
starts (or resumes) the same command in one run directory, kills it with
SIGKILL at a random moment (most within two steps after a random step's log
line; saves happen every 2 steps, so many kills land during an async save),
reads which steps are committed, and checks that the
next start resumes from exactly the latest committed step. When a run
completes, the directory is reset. At the end every loss row written by every
process must equal the reference loss at that step, bit for bit. Prints one
line per trial and a summary; exit code 1 on any failure.

``--slow-checksum S`` makes every file checksum of the trainer (after a save, and before a
restore) sleep S seconds first and print when it starts and ends, as a large checkpoint would
take, so that many kills land during the integrity check; the summary counts them.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SMALL = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
         "data.tokenizer=byte", "data.seq_len=32", "train.global_batch=8", "train.log_every=1",
         "train.eval_every=1000", "train.eval_batches=2", "train.sample_tokens=8", "optimizer.warmup_steps=5",
         "run.progress=false", "mesh.data=1", "checkpoint.every=2", "checkpoint.keep=2"]


STEP_LINE = re.compile(r"step +(\d+) \|")  # the trainer's per-step log line


SLOW_CHECKSUM = """
import sys, time
from jaxtrain.checkpoint import integrity
manifest = integrity.local_manifest
def slow(root):
    print(f"checksumming {{root}}", flush=True)
    time.sleep({seconds})
    out = manifest(root)
    print("checksummed", flush=True)
    return out
integrity.local_manifest = slow
from jaxtrain.cli.train import main
sys.exit(main(sys.argv[1:]))
"""


def command(run_dir: Path, data: str, steps: int, slow_checksum: float = 0.0) -> list[str]:
    args = [*SMALL, f"data.path={data}", f"train.steps={steps}", f"run.dir={run_dir}"]
    if slow_checksum:
        return [sys.executable, "-c", SLOW_CHECKSUM.format(seconds=slow_checksum), *args]
    return [sys.executable, "-m", "jaxtrain.train", *args]


def in_checksum(out: str) -> bool:
    """Whether the output ends inside a checksum (started, not finished): where a kill landed."""
    return out.rfind("checksumming ") > out.rfind("checksummed")


def environment() -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    env["JAX_PLATFORMS"] = "cpu"
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(REPO / ".jax_cache"))
    return env


def committed(run_dir: Path) -> list[int]:
    """Steps with a valid commit marker (read directly: the same rule as jaxtrain.checkpoint)."""
    out = []
    ck = run_dir / "checkpoints"
    for p in ck.iterdir() if ck.is_dir() else []:
        if p.name.isdigit():
            try:
                if json.loads((p / "COMMIT.json").read_text()).get("step") == int(p.name):
                    out.append(int(p.name))
            except (OSError, ValueError):
                pass
    return sorted(out)


def uncommitted(run_dir: Path) -> list[str]:
    ck = run_dir / "checkpoints"
    return sorted(p.name for p in ck.iterdir() if p.name[0].isdigit() and not (
        p.name.isdigit() and int(p.name) in committed(run_dir))) if ck.is_dir() else []


def losses(run_dir: Path) -> list[tuple[int, float]]:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def _kill_after(proc: subprocess.Popen, delay: float) -> None:
    try:
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)


def run_trials(trials: int, workdir: Path, data: str, steps: int = 40, seed: int = 0,
               log=print, timeout: float | None = None, slow_checksum: float = 0.0) -> dict:
    """Runs the trials; returns a summary dict (``failures`` lists what went wrong).

    ``timeout``: seconds any one trainer process may run; one that runs longer is killed and
    RuntimeError is raised with its output (so a hung trainer cannot hang a test run).
    """
    rng = random.Random(seed)
    env = environment()
    ref_dir = workdir / "reference"
    t0 = time.monotonic()
    try:
        ref = subprocess.run(command(ref_dir, data, steps, slow_checksum), env=env, cwd=REPO, capture_output=True,
                             text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:  # run() has killed it
        out = f"{err.stdout or ''}{err.stderr or ''}"[-3000:]
        raise RuntimeError(f"reference run still running after {timeout} s:\n{out}") from None
    ref_time = time.monotonic() - t0
    if ref.returncode:
        raise RuntimeError(f"reference run failed:\n{ref.stderr[-3000:]}")
    reference = dict(losses(ref_dir))
    assert sorted(reference) == list(range(1, steps + 1)), sorted(reference)

    run_dir, failures, during_save, completed_runs, kills, rows_checked = workdir / "trial", [], 0, 0, 0, 0
    during_checksum = 0

    def check_rows() -> int:
        """Every loss row of the series (all processes) must equal the reference at its step."""
        rows = losses(run_dir)
        bad = [(s, v, reference[s]) for s, v in rows if v != reference[s]]
        if bad:
            failures.append(f"{len(bad)} loss rows differ from the reference, e.g. {bad[:3]}")
        return len(rows)

    rows = [json.loads(line) for line in (ref_dir / "metrics.jsonl").read_text().splitlines()]
    logged_at = {r["step"]: r["time"] for r in rows if "loss" in r}  # when the reference logged each step
    window = logged_at[steps] - logged_at[1]
    log(f"reference: {steps} steps in {ref_time:.1f} s, {window:.1f} s of it training (and saving)")
    for trial in range(trials + 1):
        last = trial == trials  # the final start runs to completion
        expected = committed(run_dir)
        if expected and expected[-1] == steps:  # finished earlier: check it, start a fresh series
            rows_checked += check_rows()
            shutil.rmtree(run_dir)
            completed_runs += 1
            expected = []
        proc = subprocess.Popen(command(run_dir, data, steps, slow_checksum), env=env, cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        # Most kills are aimed at a step the run has not yet logged, so they land before it ends
        # however fast this machine is today (a delay measured from the reference run did not).
        lines, reached = [], threading.Event()
        first = min(expected[-1] + 1 if expected else 1, steps - 1)  # the first step this start logs
        target = rng.randint(first, steps - 1)

        def read():
            try:
                for line in proc.stdout:
                    lines.append(line)
                    logged = STEP_LINE.match(line)
                    if logged and int(logged.group(1)) >= target:
                        reached.set()
            finally:
                reached.set()  # the process ended (or closed its output) first
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        if last:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                reader.join(timeout=10)
                raise RuntimeError(f"final run still running after {timeout} s:\n{''.join(lines)[-3000:]}") from None
        elif rng.random() < 0.2:  # some kills during start-up, restore or compile
            delay = rng.uniform(0.5, 4.0)
            when = f"{delay:.1f} s after start"
            _kill_after(proc, delay)
        else:  # most during training, where every other step starts an async save
            reached.wait()
            # At most half the time the reference took from this step to its last one: a later
            # start may run faster (warm caches), and a kill must still land before the end.
            delay = rng.uniform(0.0, 0.5 * (logged_at[steps] - logged_at[target]))
            when = f"{delay * 1000:.0f} ms after step {target}"
            _kill_after(proc, delay)
        proc.wait()
        reader.join()
        out = "".join(lines)
        killed = proc.returncode == -signal.SIGKILL
        resumed = re.search(r"resumed from \S+/(\d+)", out)
        got = int(resumed.group(1)) if resumed else None
        want = expected[-1] if expected else None
        if resumed is None and "compiled train step" not in out and killed:
            got = want  # killed before it got as far as the restore: nothing to check
        status = "ok"
        if got != want:
            status = f"FAIL: resumed from {got}, latest committed was {want}"
        elif not killed and proc.returncode != 0:
            status = f"FAIL: exit code {proc.returncode}: {out[-500:]}"
        leftovers = uncommitted(run_dir)
        during_save += bool(killed and leftovers)
        during_checksum += bool(killed and in_checksum(out))
        kills += killed
        if status != "ok":
            failures.append(f"trial {trial}: {status}")
        log(f"trial {trial:>2}: {'SIGKILL ' + when if killed else 'ran to completion'}; "
            f"resumed from {want}; committed now {committed(run_dir)}; "
            f"uncommitted left {leftovers or '-'}"
            f"{' (killed while checksumming)' if killed and in_checksum(out) else ''}"
            f" | {status}")
    rows_checked += check_rows()
    if committed(run_dir)[-1:] != [steps]:
        failures.append(f"the final run did not complete: committed {committed(run_dir)}")
    summary = {"trials": trials, "sigkills": kills, "killed_during_save": during_save,
               "killed_during_checksum": during_checksum,
               "completed_series": completed_runs,
               "loss_rows_checked": rows_checked, "failures": failures}
    log(json.dumps(summary))
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slow-checksum", type=float, default=0.0,
                        help="seconds every file checksum sleeps first (kills then land in the integrity check)")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--data", default=str(Path(os.environ.get("JAXTRAIN_SHARED", REPO.parent / "shared"))
                                              / "data" / "tinyshakespeare.txt"))
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="crash_trials_"))
    summary = run_trials(args.trials, workdir, args.data, args.steps, args.seed,
                         slow_checksum=args.slow_checksum)
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
