"""jaxtrain against the real nanoGPT on its shakespeare-char CPU recipe: the same work, side by side.

nanoGPT (``../shared/peers/nanoGPT``, run as a peer from a temporary copy, never copied into the
project) runs exactly its README's CPU line: ``train.py config/train_shakespeare_char.py
--device=cpu --compile=False --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12
--n_layer=4 --n_head=4 --n_embd=128 --max_iters=N --lr_decay_iters=N --dropout=0.0``. jaxtrain runs
``configs/shakespeare_char.yaml`` (the same shapes as a Llama) with the same work:

* evaluation: nanoGPT evaluates both splits, 20 batches each, at iteration 0 and every 250; jaxtrain
  evaluates every 250 steps and at the end, with as many batches in all (``train.eval_batches``);
* checkpoints: nanoGPT saves when the validation loss improves (after its evaluations past 0);
  jaxtrain saves every 250 steps and at the end (``checkpoint.every=250``): as many saves or one more;
* no sample (nanoGPT's ``train.py`` draws none: ``train.sample_tokens=0``);
* a metrics line every iteration (``--log_interval=1``; ``train.log_every=1``), each a host sync.

Both run ``--iters`` iterations as whole processes (imports, data, compile, training, evaluation,
saves, the end), alternately, ``--rounds`` times each. Reported: the median whole-process wall time,
and the median steady time per iteration from each run's own log (nanoGPT's ``time`` of iterations
that did not evaluate; jaxtrain's ``step_time_s``, which leaves evaluations and saves out), with
the CPU model. Ratios are nanoGPT / jaxtrain (> 1: jaxtrain is faster): the ratio of the two
medians, and beside it ("paired") the median of each round's own ratio.

    python benchmarks/vs_nanogpt.py [--iters 300 2000] [--rounds 3] [--write-results]
    python benchmarks/vs_nanogpt.py --quick        # 20 iterations, 1 round: that it runs
    python benchmarks/vs_nanogpt.py --iters 1 --rounds 5   # start-up: nanoGPT's --max_iters=1 (its
        # iteration-0 evaluation, 40 batches) against one step and a 40-batch evaluation; no steady time

Needs torch (the CPU wheel: ``pip install 'jaxtrain[bench]'``). Measure on a quiet machine.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _bench import REPO, append_result_row, commit, default_corpus, hardware

PEER = Path(os.environ.get("JAXTRAIN_SHARED", REPO.parent / "shared")) / "peers" / "nanoGPT"
EVAL_INTERVAL, EVAL_ITERS = 250, 20  # nanoGPT's shakespeare-char config and README CPU line
HEADER = ("| date (UTC) | hardware | commit | iterations | nanoGPT s | jaxtrain s | whole process nanoGPT / jaxtrain "
          "| nanoGPT ms/iter | jaxtrain ms/step | steady nanoGPT / jaxtrain | rounds | load |")
INTRO = ("Rows below are appended by `python benchmarks/vs_nanogpt.py --write-results`: nanoGPT's README CPU line "
         "against `configs/shakespeare_char.yaml` with the same evaluation batches, checkpoints and no sample; whole "
         "process (median of the rounds, run alternately) and the steady time per iteration from each log.")


def prepare_peer(tmp: Path) -> Path:
    """A runnable copy of the peer with the corpus prepared (no download)."""
    peer = tmp / "nanoGPT"
    shutil.copytree(PEER, peer)
    data = peer / "data" / "shakespeare_char"
    shutil.copy(default_corpus(), data / "input.txt")
    subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, capture_output=True, timeout=300)
    return peer


def nanogpt_cmd(iters: int) -> list[str]:
    """Its README's CPU line, with ``iters`` in place of 2000."""
    return [sys.executable, "train.py", "config/train_shakespeare_char.py", "--device=cpu", "--compile=False",
            f"--eval_iters={EVAL_ITERS}", "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4",
            "--n_head=4", "--n_embd=128", f"--max_iters={iters}", f"--lr_decay_iters={iters}", "--dropout=0.0"]


def equal_eval_batches(iters: int) -> int:
    """jaxtrain's batches per evaluation for nanoGPT's forward batches: it evaluates at 0, 250, ...
    (both splits, EVAL_ITERS each); jaxtrain at 250, 500, ... and at the end (once if they coincide)."""
    nano = (iters // EVAL_INTERVAL + 1) * 2 * EVAL_ITERS
    ours = iters // EVAL_INTERVAL + (iters % EVAL_INTERVAL != 0)
    return max(1, round(nano / ours))


def jaxtrain_cmd(iters: int, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "jaxtrain.train", "--config", "configs/shakespeare_char.yaml",
            f"data.path={default_corpus()}", f"train.steps={iters}", f"run.dir={run_dir}", "run.progress=false",
            f"train.eval_every={EVAL_INTERVAL}", f"train.eval_batches={equal_eval_batches(iters)}",
            "train.sample_tokens=0", "train.log_every=1", f"checkpoint.every={EVAL_INTERVAL}"]


def run(cmd: list[str], cwd: Path) -> tuple[float, str]:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=7200)
    seconds = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd[:3])} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return seconds, done.stdout


def median_or_nan(values) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def paired_ratio(nano: list[float], ours: list[float]) -> float:
    """The median of each round's own nanoGPT / jaxtrain ratio (NaN rounds left out). A round's two runs
    ran back to back, so where the machine's speed drifts between rounds (here the same step took 33 to
    66 ms within minutes) this is steadier than the ratio of the two medians."""
    return median_or_nan(n / o for n, o in zip(nano, ours) if n == n and o == o and o > 0)


def shown(x: float, fmt: str = ".1f", suffix: str = "") -> str:
    """``x`` formatted, or ``n/a`` for NaN (no steady iterations)."""
    return "n/a" if x != x else f"{x:{fmt}}{suffix}"


def nanogpt_steady_ms(stdout: str) -> float:
    """Median ``time`` of the iterations that did not evaluate (and not iteration 0, which warms up);
    NaN when there is none (``--iters 1``: a start-up measurement)."""
    times = {int(i): float(t) for i, t in re.findall(r"^iter (\d+): loss [\d.]+, time ([\d.]+)ms", stdout, re.M)}
    return median_or_nan(t for i, t in times.items() if i % EVAL_INTERVAL and i > 1)


def jaxtrain_steady_ms(run_dir: Path) -> float:
    """Median ``step_time_s`` of the logged steps after the first two (compile, warm-up); NaN without."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return 1e3 * median_or_nan(r["step_time_s"] for r in rows if "step_time_s" in r and r["step"] > 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, nargs="+", default=[300, 2000])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="20 iterations, 1 round, no row written: that it runs")
    p.add_argument("--write-results", action="store_true", help="append a row per --iters to RESULTS.md")
    a = p.parse_args()
    iters_list, rounds = ([20], 1) if a.quick else (a.iters, a.rounds)
    with tempfile.TemporaryDirectory(prefix="vs-nanogpt-") as tmp:
        peer = prepare_peer(Path(tmp))
        for iters in iters_list:
            load0 = os.getloadavg()[0]
            wall, steady = {"nanoGPT": [], "jaxtrain": []}, {"nanoGPT": [], "jaxtrain": []}
            for r in range(rounds):
                for who in (["nanoGPT", "jaxtrain"] if r % 2 == 0 else ["jaxtrain", "nanoGPT"]):
                    if who == "nanoGPT":
                        shutil.rmtree(peer / "out-shakespeare-char", ignore_errors=True)
                        seconds, out = run(nanogpt_cmd(iters), peer)
                        steady[who].append(nanogpt_steady_ms(out))
                    else:
                        run_dir = Path(tmp) / f"run{iters}_{r}"
                        seconds, _ = run(jaxtrain_cmd(iters, run_dir), REPO)
                        steady[who].append(jaxtrain_steady_ms(run_dir))
                    wall[who].append(seconds)
                print(f"{iters} iterations, round {r + 1}: nanoGPT {wall['nanoGPT'][-1]:.1f} s "
                      f"({shown(steady['nanoGPT'][-1])} ms/iter), jaxtrain {wall['jaxtrain'][-1]:.1f} s "
                      f"({shown(steady['jaxtrain'][-1])} ms/step)", flush=True)
            (nano, ours), (nano_ms, our_ms) = [tuple(statistics.median(d[w]) for w in ("nanoGPT", "jaxtrain"))
                                               for d in (wall, steady)]
            steady_ratio = nano_ms / our_ms
            paired_whole, paired_steady = (paired_ratio(d["nanoGPT"], d["jaxtrain"]) for d in (wall, steady))
            load = f"{load0:.1f}→{os.getloadavg()[0]:.1f}"
            print(f"{iters} iterations on {hardware()}: whole process nanoGPT {nano:.1f} s, jaxtrain {ours:.1f} s: "
                  f"jaxtrain is {nano / ours:.2f}x nanoGPT's speed; steady {shown(nano_ms)} vs {shown(our_ms)} ms: "
                  f"{shown(steady_ratio, '.2f', 'x')} (median of {rounds}; load {load}); paired rounds: whole "
                  f"{paired_whole:.2f}x, steady {shown(paired_steady, '.2f', 'x')}", flush=True)
            if a.write_results and not a.quick:
                date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
                append_result_row(HEADER, f"| {date} | {hardware()} | {commit()} | {iters} | {nano:.1f} | {ours:.1f} "
                                          f"| {nano / ours:.2f}x (paired {paired_whole:.2f}x) | {shown(nano_ms)} | "
                                          f"{shown(our_ms)} | {shown(steady_ratio, '.2f', 'x')} (paired "
                                          f"{shown(paired_steady, '.2f', 'x')}) | {rounds} | {load} |", INTRO)


if __name__ == "__main__":
    main()
