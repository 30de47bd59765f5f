"""jaxtrain against the real nanoGPT on its shakespeare-char CPU recipe, whole process, side by side.

nanoGPT (``../shared/peers/nanoGPT``, run as a peer from a temporary copy, never copied into the
project) trains with its own ``train.py``: ``--device=cpu --compile=False``, 4 layers, 4 heads, 128
wide, block 64, batch 12, dropout 0. jaxtrain trains ``configs/shakespeare_char.yaml`` (the same
shapes as a Llama). Both run ``--iters`` iterations as whole processes (imports, data, compile,
training, evaluation, the end), alternately, ``--rounds`` times each; the figure is the median wall
time and the ratio nanoGPT / jaxtrain (> 1: jaxtrain is faster).

    python benchmarks/vs_nanogpt.py [--iters 300 2000] [--rounds 3] [--write-results]
    python benchmarks/vs_nanogpt.py --quick        # 20 iterations, 1 round, tiny evals: that it runs

Needs torch (the CPU wheel: ``pip install 'jaxtrain[bench]'``). Measure on a quiet machine.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _bench import REPO, append_result_row, commit, default_corpus, hardware

PEER = Path(os.environ.get("JAXTRAIN_SHARED", REPO.parent / "shared")) / "peers" / "nanoGPT"
HEADER = ("| date (UTC) | hardware | commit | iterations | nanoGPT s | jaxtrain s | nanoGPT / jaxtrain | "
          "rounds | load |")
INTRO = ("Rows below are appended by `python benchmarks/vs_nanogpt.py --write-results`: whole-process wall "
         "time (median of the rounds, run alternately) of nanoGPT's own `train.py` on its shakespeare-char CPU "
         "recipe and of `jaxtrain.train --config configs/shakespeare_char.yaml`, for the same iterations.")


def prepare_peer(tmp: Path) -> Path:
    """A runnable copy of the peer with the corpus prepared (no download)."""
    peer = tmp / "nanoGPT"
    shutil.copytree(PEER, peer)
    data = peer / "data" / "shakespeare_char"
    shutil.copy(default_corpus(), data / "input.txt")
    subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, capture_output=True, timeout=300)
    return peer


def nanogpt_cmd(iters: int, quick: bool) -> list[str]:
    return [sys.executable, "train.py", "config/train_shakespeare_char.py", "--device=cpu", "--compile=False",
            "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128",
            f"--max_iters={iters}", f"--lr_decay_iters={iters}", "--dropout=0.0", "--out_dir=out",
            *(["--eval_iters=2"] if quick else [])]


def jaxtrain_cmd(iters: int, run_dir: Path, quick: bool) -> list[str]:
    return [sys.executable, "-m", "jaxtrain.train", "--config", "configs/shakespeare_char.yaml",
            f"data.path={default_corpus()}", f"train.steps={iters}", f"run.dir={run_dir}", "run.progress=false",
            *(["train.eval_batches=2", "train.sample_tokens=20"] if quick else [])]


def timed(cmd: list[str], cwd: Path) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=3600)
    seconds = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd[:3])} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, nargs="+", default=[300, 2000])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true",
                   help="20 iterations, 1 round, 2 evaluation batches each, no row written: that it runs")
    p.add_argument("--write-results", action="store_true", help="append a row per --iters to RESULTS.md")
    a = p.parse_args()
    iters_list, rounds = ([20], 1) if a.quick else (a.iters, a.rounds)
    with tempfile.TemporaryDirectory(prefix="vs-nanogpt-") as tmp:
        peer = prepare_peer(Path(tmp))
        for iters in iters_list:
            load0, times = os.getloadavg()[0], {"nanoGPT": [], "jaxtrain": []}
            for r in range(rounds):
                order = ["nanoGPT", "jaxtrain"] if r % 2 == 0 else ["jaxtrain", "nanoGPT"]
                for who in order:
                    if who == "nanoGPT":
                        shutil.rmtree(peer / "out", ignore_errors=True)
                        times[who].append(timed(nanogpt_cmd(iters, a.quick), peer))
                    else:
                        times[who].append(timed(jaxtrain_cmd(iters, Path(tmp) / f"run{iters}_{r}", a.quick), REPO))
                print(f"{iters} iterations, round {r + 1}: nanoGPT {times['nanoGPT'][-1]:.1f} s, "
                      f"jaxtrain {times['jaxtrain'][-1]:.1f} s", flush=True)
            nano, jax_ = statistics.median(times["nanoGPT"]), statistics.median(times["jaxtrain"])
            load = f"{load0:.1f}→{os.getloadavg()[0]:.1f}"
            print(f"{iters} iterations: nanoGPT {nano:.1f} s, jaxtrain {jax_:.1f} s: jaxtrain is "
                  f"{nano / jax_:.2f}x nanoGPT's speed (median of {rounds}; load {load})")
            if a.write_results and not a.quick:
                date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
                append_result_row(HEADER, f"| {date} | {hardware()} | {commit()} | {iters} | {nano:.1f} | {jax_:.1f} "
                                          f"| {nano / jax_:.2f}x | {rounds} | {load} |", INTRO)


if __name__ == "__main__":
    main()
