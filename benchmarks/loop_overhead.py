"""What the training loop adds to the bare step: the trainer's logged step time against step.py's.

The trainer (``python -m jaxtrain.train``, a whole process, no evaluation, checkpoint or sample
inside the timed steps) logs ``step_time_s``, the mean wall time per step of each row of
``--log-every`` steps; its figure is the mean over all rows but the first (which holds the
compile's first step). ``benchmarks/step.py`` times the bare compiled step on batches already on
the device, each step synchronised; its figure is the mean over ``--steps`` steps. The two run
alternately, ``--rounds`` times each; the ratio trainer / bare is the median of the per-round ratios
(1.00: the loop costs nothing).

    python benchmarks/loop_overhead.py [--config configs/shakespeare_char.yaml] [--steps 300] [--rounds 3]
                                       [--write-results]
    python benchmarks/loop_overhead.py --quick     # 20 steps, 1 round, no row written: that it runs

Measure on a quiet machine.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _bench import REPO, append_result_row, commit, default_corpus, hardware

HEADER = ("| date (UTC) | hardware | commit | config | steps | trainer ms/step | bare step ms | trainer / bare | "
          "rounds | load |")
INTRO = ("Rows below are appended by `python benchmarks/loop_overhead.py --write-results`: the trainer's "
         "logged `step_time_s` (mean over its rows after the first) against `benchmarks/step.py`'s bare "
         "compiled step (mean), same config, run alternately; the ratio is the median of the per-round ratios.")


def trainer_ms(config: str, steps: int, log_every: int, run_dir: Path) -> float:
    """Mean step time (ms) the trainer logged, weighting each row by its steps, the first row left out."""
    cmd = [sys.executable, "-m", "jaxtrain.train", "--config", config, f"data.path={default_corpus()}",
           f"train.steps={steps}", f"train.log_every={log_every}", f"train.eval_every={steps + 1}",
           f"checkpoint.every={steps + 1}", "train.sample_tokens=0", "train.eval_batches=1",
           f"run.dir={run_dir}", "run.progress=false"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise SystemExit(f"the trainer failed ({done.returncode}):\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "step_time_s" in r]
    weighted = [(r["step_time_s"], r["step"] - prev["step"]) for prev, r in zip(train, train[1:])]
    return 1e3 * sum(t * n for t, n in weighted) / sum(n for _, n in weighted)


def bare_ms(config: str, steps: int, out: Path) -> float:
    cmd = [sys.executable, str(REPO / "benchmarks" / "step.py"), "--config", config, "--steps", str(steps),
           "--warmup", "5", "--json", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise SystemExit(f"step.py failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return 1e3 * json.loads(out.read_text())["stats"]["mean_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/shakespeare_char.yaml")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="20 steps, 1 round, no row written: that it runs")
    p.add_argument("--write-results", action="store_true", help="append a row to RESULTS.md")
    a = p.parse_args()
    steps, rounds = (20, 1) if a.quick else (a.steps, a.rounds)
    log_every = max(steps // 6, 2)
    load0, ratios, loop, bare = os.getloadavg()[0], [], [], []
    with tempfile.TemporaryDirectory(prefix="loop-overhead-") as tmp:
        for r in range(rounds):
            run = {"trainer": lambda: trainer_ms(a.config, steps, log_every, Path(tmp) / f"run{r}"),
                   "bare": lambda: bare_ms(a.config, steps - log_every, Path(tmp) / f"step{r}.json")}
            got = {who: run[who]() for who in (["trainer", "bare"] if r % 2 == 0 else ["bare", "trainer"])}
            loop.append(got["trainer"])
            bare.append(got["bare"])
            ratios.append(got["trainer"] / got["bare"])
            print(f"round {r + 1}: trainer {got['trainer']:.1f} ms/step, bare step {got['bare']:.1f} ms: "
                  f"{ratios[-1]:.3f}x", flush=True)
    ratio, load = statistics.median(ratios), f"{load0:.1f}→{os.getloadavg()[0]:.1f}"
    print(f"{a.config}: the trainer's step is {ratio:.3f}x the bare step ({(ratio - 1) * 100:+.1f}%; median of "
          f"{rounds} rounds; load {load})")
    if a.write_results and not a.quick:
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
        append_result_row(HEADER, f"| {date} | {hardware()} | {commit()} | {a.config} | {steps} | "
                                  f"{statistics.median(loop):.1f} | {statistics.median(bare):.1f} | {ratio:.3f}x | "
                                  f"{rounds} | {load} |", INTRO)


if __name__ == "__main__":
    main()
