"""Crash trials across processes, checkpoints on a real S3 server: SIGKILL one process or all of a
2-process job at random moments (start-up, restore, training, async saves and their uploads), resume,
and check that nothing committed was lost and no partial step was ever restored.

    python benchmarks/crash_trials_multi.py --kills 50 [--processes 2] [--devices 4] [--seed 0]

It starts its own ``moto_server`` on 127.0.0.1. One uninterrupted reference job gives the loss at
every step. Then each trial starts (or resumes) the same job in one run directory (checkpoints
``s3://ckpts/<series>``, saved every 2 steps), kills one random process or every process after a
random delay, waits for the survivors to stop by themselves (``distributed.peer_timeout_s``: a
survivor still running 90 s after a kill is a failure: a hang), reads which steps are committed on
S3, and checks that the next start resumes from exactly the latest committed step. When a job
completes, a new series starts in a fresh prefix. At the end every loss row process 0 wrote must equal
the reference at its step, bit for bit. Prints one line per trial and a JSON summary; exit 1 on a
failure.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("crash_trials", REPO / "benchmarks" / "crash_trials.py")
crash_trials = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(crash_trials)

BUCKET = "ckpts"
INIT_TIMEOUT_S = 30  # distributed.init_timeout_s: a survivor of a kill before the join waits this long
SURVIVOR_LIMIT_S = INIT_TIMEOUT_S + 60.0  # a process still running this long after a kill is hung


def start_s3(workdir: Path) -> tuple[subprocess.Popen, str]:
    """A moto_server on a free loopback port with bucket ``ckpts``: (process, endpoint URL)."""
    import portpicker
    port = portpicker.pick_unused_port()
    exe = Path(sys.executable).parent / "moto_server"
    log = open(workdir / "moto.log", "w")
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    import s3fs
    end = time.monotonic() + 30
    while True:
        try:
            s3fs.S3FileSystem(endpoint_url=endpoint).mkdir(BUCKET)
            return proc, endpoint
        except Exception:  # noqa: BLE001 - not up yet
            if time.monotonic() > end or proc.poll() is not None:
                proc.kill()
                raise RuntimeError(f"moto_server did not start on port {port}") from None
            time.sleep(0.3)


def committed_s3(endpoint: str, prefix: str) -> list[int]:
    """Steps under ``s3://ckpts/<prefix>`` with a valid commit marker (read directly)."""
    import s3fs
    fs = s3fs.S3FileSystem(endpoint_url=endpoint, use_listings_cache=False, skip_instance_cache=True)
    out = []
    try:
        names = [p.rsplit("/", 1)[-1] for p in fs.ls(f"{BUCKET}/{prefix}", refresh=True)]
    except FileNotFoundError:
        return []
    for name in names:
        if name.isdigit():
            try:
                if json.loads(fs.cat(f"{BUCKET}/{prefix}/{name}/COMMIT.json")).get("step") == int(name):
                    out.append(int(name))
            except (OSError, ValueError):
                pass
    return sorted(out)


class Job:
    """One start of the job: ``processes`` trainers joined through the JAXTRAIN_* environment."""

    def __init__(self, run_dir: Path, prefix: str, args: argparse.Namespace, endpoint: str, data: str):
        import portpicker
        port = portpicker.pick_unused_port()
        cmd = [*crash_trials.command(run_dir, data, args.steps), "mesh.data=-1",
            f"checkpoint.dir=s3://{BUCKET}/{prefix}", f"checkpoint.s3_endpoint={endpoint}",
            "distributed.peer_timeout_s=10", f"distributed.init_timeout_s={INIT_TIMEOUT_S}",
            "checkpoint.grace_period_s=20"]
        self.procs, self.lines = [], []
        for i in range(args.processes):
            env = crash_trials.environment()
            env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices}",
                       JAXTRAIN_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                       JAXTRAIN_NUM_PROCESSES=str(args.processes), JAXTRAIN_PROCESS_ID=str(i))
            proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
            lines: list[str] = []
            threading.Thread(target=lambda p=proc, out=lines: out.extend(p.stdout), daemon=True).start()
            self.procs.append(proc)
            self.lines.append(lines)

    def phase(self, restorable: bool) -> str:
        """Where process 0 is, from what it has printed: what a kill now lands in (before saves are
        told apart by what they leave behind, see :func:`landed`)."""
        text = "".join(self.lines[0])
        if "compiled train step" in text:
            return "training"
        if "joined" not in text:
            return "before the join"
        if restorable and "resumed from" not in text:
            return "restore"
        return "start-up"

    def wait(self, timeout: float) -> bool:
        """Whether every process ended within ``timeout`` seconds (the rest are killed)."""
        end = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in self.procs:
                    q.kill()
                for q in self.procs:
                    q.wait()
                return False
        time.sleep(0.2)  # let the readers drain
        return True

    def output(self, i: int = 0) -> str:
        return "".join(self.lines[i])


def unfinished(endpoint: str, prefix: str, run_dir: Path) -> bool:
    """Whether a save was under way: a step on S3 without its commit marker, or staged files left."""
    import s3fs
    fs = s3fs.S3FileSystem(endpoint_url=endpoint, use_listings_cache=False, skip_instance_cache=True)
    try:
        names = [p.rsplit("/", 1)[-1] for p in fs.ls(f"{BUCKET}/{prefix}", refresh=True)]
    except FileNotFoundError:
        names = []
    done = {str(s) for s in committed_s3(endpoint, prefix)}
    on_s3 = [n for n in names if n[0].isdigit() and n not in done]
    staged = run_dir / "checkpoints_staging"
    return bool(on_s3) or (staged.is_dir() and any(p.name[0].isdigit() for p in staged.iterdir()))


def trial(job: Job, rng: random.Random, window: float, restorable: bool) -> dict:
    """Kills one random process or all of them after a random delay; returns what happened."""
    mode = rng.choice(["one", "one", "all"])
    delay = rng.uniform(1.0, window)
    time.sleep(delay)
    if all(p.poll() is not None for p in job.procs):
        return {"killed": [], "phase": "finished first", "delay": delay}
    victims = [rng.randrange(len(job.procs))] if mode == "one" else list(range(len(job.procs)))
    phase = job.phase(restorable)
    for i in victims:
        if job.procs[i].poll() is None:
            job.procs[i].send_signal(signal.SIGKILL)
    return {"killed": victims, "phase": phase, "delay": delay}


def run(args: argparse.Namespace) -> dict:
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="crash_multi_"))
    server, endpoint = start_s3(workdir)
    rng = random.Random(args.seed)
    try:
        t0 = time.monotonic()
        ref = Job(workdir / "reference", "reference", args, endpoint, args.data)
        if not ref.wait(900) or any(p.returncode for p in ref.procs):
            raise RuntimeError(f"the reference job failed:\n{ref.output()[-3000:]}")
        reference = dict(crash_trials.losses(workdir / "reference"))
        window = time.monotonic() - t0
        print(f"reference: {args.steps} steps, 2-process job of {window:.0f} s", flush=True)
        failures, kills, phases, series, rows_checked, n = [], 0, {}, 0, 0, 0
        run_dir = workdir / f"series{series}"
        while kills < args.kills or committed_s3(endpoint, f"series{series}")[-1:] != [args.steps]:
            final = kills >= args.kills
            expected = committed_s3(endpoint, f"series{series}")
            if expected[-1:] == [args.steps]:  # done: check it, start a fresh series
                rows_checked += _check_rows(run_dir, reference, failures)
                series += 1
                run_dir, expected = workdir / f"series{series}", []
            job = Job(run_dir, f"series{series}", args, endpoint, args.data)
            what = ({"killed": [], "phase": "ran to completion", "delay": 0.0} if final
                    else trial(job, rng, window, bool(expected)))
            ended = job.wait(SURVIVOR_LIMIT_S if what["killed"] else 900)
            if what["killed"] and what["phase"] == "training" and unfinished(endpoint, f"series{series}", run_dir):
                what["phase"] = "training, a save or upload under way"
            codes = [p.returncode for p in job.procs]
            resumed = re.search(r"resumed from \S+/(\d+)", job.output())
            got = int(resumed.group(1)) if resumed else None
            want = expected[-1] if expected else None
            status = "ok"
            if not ended:
                status = f"FAIL: a process was still running {SURVIVOR_LIMIT_S:.0f} s after the kill (hung)"
            elif resumed is None and want is not None and "compiled train step" in job.output():
                status = f"FAIL: trained without restoring; latest committed was {want}"
            elif resumed is not None and got != want:
                status = f"FAIL: resumed from {got}, latest committed was {want}"
            elif not what["killed"] and any(codes):
                status = f"FAIL: exit codes {codes}: {job.output()[-800:]}"
            # A survivor ends 5 (our heartbeat: a peer stopped answering), or -6 when process 0 died: JAX's
            # coordination client aborts at once, saying "another task died" (it offers no hook to do better).
            survivors = [c for i, c in enumerate(codes) if i not in what["killed"]]
            allowed = (0, 5, -6) if 0 in what["killed"] else (0, 5)
            if what["killed"] and ended and any(c not in allowed for c in survivors):
                status = f"FAIL: a survivor ended with {survivors} (expected one of {allowed})"
            for i in range(len(job.procs)):  # kept for a look at what happened
                (workdir / f"trial{n}.process{i}.log").write_text(job.output(i))
            if status != "ok":
                failures.append(f"trial {n}: {status}")
            if what["killed"]:
                kills += len(what["killed"])
                phases[what["phase"]] = phases.get(what["phase"], 0) + 1
            did = (f"SIGKILL {what['killed']} at {what['delay']:.1f} s ({what['phase']})" if what["killed"]
                   else what["phase"])
            print(f"trial {n:>3}: {did}; resumed from {got}; exit codes {codes}; committed now "
                  f"{committed_s3(endpoint, f'series{series}')} | {status}", flush=True)
            n += 1
        rows_checked += _check_rows(run_dir, reference, failures)
        summary = {"kills": kills, "trials": n, "kills_by_phase": phases, "completed_series": series + 1,
                   "loss_rows_checked": rows_checked, "bad_resumes": len(failures), "failures": failures}
        print(json.dumps(summary), flush=True)
        return summary
    finally:
        server.terminate()
        server.wait(timeout=10)


def _check_rows(run_dir: Path, reference: dict, failures: list) -> int:
    """Every loss row of a series must equal the reference at its step, bit for bit."""
    rows = crash_trials.losses(run_dir)
    bad = [(s, v, reference[s]) for s, v in rows if v != reference[s]]
    if bad:
        failures.append(f"{run_dir.name}: {len(bad)} loss rows differ from the reference, e.g. {bad[:3]}")
    return len(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=50, help="processes to SIGKILL in all")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices", type=int, default=4, help="simulated CPU devices per process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--data", default=str(Path(os.environ.get("JAXTRAIN_SHARED", REPO.parent / "shared"))
                                              / "data" / "tinyshakespeare.txt"))
    return 1 if run(parser.parse_args())["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
