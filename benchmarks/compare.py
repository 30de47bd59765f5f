"""jaxtrain vs PyTorch eager vs ``torch.compile``, same config, same machine, in alternation.

``python benchmarks/compare.py [--quick] [--write-results]``

For each config (default: the shakespeare recipe and the ~25M decoder at seq
256) it starts one worker process per implementation (``step.py --serve``,
``torch_reference.py --serve --mode eager|compile``), lets each compile and
warm up, then runs rounds A B C, A B C, ... (``--rounds``, at least 3): in
each round every worker times ``--steps`` steps while the others sleep, and
measures the matmul peak just before and after. Ratios are taken per round
(paired, so that a machine that slows down between rounds slows both sides)
and summarised by their median. Prints a table, writes JSON (``--json``) and,
with ``--write-results``, appends one dated row per config to
benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _bench import REPO, STEP_TABLE_HEADER, append_result_row, commit, hardware, stats, write_json

HERE = Path(__file__).resolve().parent
CONFIGS = {  # name -> (config, overrides, timed steps per round)
    "shakespeare": ("shakespeare_char", [], 20),
    "llama_25m": ("llama_25m", [], 8),
}
IMPLS = {
    "jaxtrain": [str(HERE / "step.py")],
    "torch-eager": [str(HERE / "torch_reference.py"), "--mode", "eager"],
    "torch-compile": [str(HERE / "torch_reference.py"), "--mode", "compile"],
}


class Worker:
    def __init__(self, name: str, config: str, overrides: list[str], warmup: int):
        self.name = name
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
        env.pop("XLA_FLAGS", None)  # one CPU device: what a user of this machine runs
        cmd = [sys.executable, *IMPLS[name], "--config", config, "--serve", "--warmup", str(warmup), *overrides]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     cwd=REPO)
        self.ready = self._read()["ready"]

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"{self.name} worker exited with {self.proc.wait()} before answering")

    def run(self, n: int) -> dict:
        self.proc.stdin.write(f"run {n}\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)


def compare(label: str, config: str, overrides: list[str], impls: list[str], rounds: int, steps: int,
            warmup: int) -> dict:
    load0 = os.getloadavg()[0]
    workers = []
    try:
        for name in impls:  # one at a time: compiles must not overlap
            t = time.perf_counter()
            workers.append(Worker(name, config, overrides, warmup))
            print(f"[{label}] {name} ready in {time.perf_counter() - t:.0f} s", flush=True)
        per_round = []
        for r in range(rounds):
            row = {}
            for w in workers:
                time.sleep(0.5)  # let the previous worker's threads go idle
                res = w.run(steps)
                tps = w.ready["tokens_per_step"] / statistics.median(res["times"])
                row[w.name] = {"times": res["times"], "tokens_per_sec": tps, "matmul_peak": res["matmul_peak"],
                               "loss": res["loss"]}
            per_round.append(row)
            print(f"[{label}] round {r + 1}/{rounds}: " +
                  ", ".join(f"{k} {v['tokens_per_sec']:,.0f} tok/s" for k, v in row.items()), flush=True)
    finally:
        for w in workers:
            w.close()
    out = {"label": label, "config": config, "overrides": overrides, "rounds": rounds, "steps_per_round": steps,
           "load_avg_1m": [load0, os.getloadavg()[0]], "impls": {}, "per_round": per_round}
    for w in workers:
        times = [t for row in per_round for t in row[w.name]["times"]]
        s = stats(times)
        out["impls"][w.name] = {**w.ready, "stats": s, "tokens_per_sec": w.ready["tokens_per_step"] / s["median_s"]}
    if "jaxtrain" in out["impls"]:
        fpt = out["impls"]["jaxtrain"]["flops_per_token"]
        # Achieved FLOP/s over the best jax matmul measured in the same round.
        fracs = [row["jaxtrain"]["tokens_per_sec"] * fpt / max(row["jaxtrain"]["matmul_peak"]) for row in per_round]
        out["fraction_of_matmul_peak"] = statistics.median(fracs)
        out["matmul_peak_gflops"] = statistics.median(max(row["jaxtrain"]["matmul_peak"]) for row in per_round) / 1e9
        for other in (n for n in out["impls"] if n != "jaxtrain"):
            ratios = [row["jaxtrain"]["tokens_per_sec"] / row[other]["tokens_per_sec"] for row in per_round]
            out[f"ratio_vs_{other}"] = statistics.median(ratios)
            out[f"ratio_vs_{other}_per_round"] = ratios
    return out



def results_row(res: dict, quick: bool) -> str:
    im = res["impls"]

    def tps(name):
        return f"{im[name]['tokens_per_sec']:,.0f}" if name in im else "-"

    def ratio(name):
        return f"{res[f'ratio_vs_{name}']:.2f}x" if f"ratio_vs_{name}" in res else "-"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    frac = f"{100 * res['fraction_of_matmul_peak']:.0f}% of {res['matmul_peak_gflops']:.0f}" \
        if "fraction_of_matmul_peak" in res else "-"
    cfg = res["config"] + (" " + " ".join(res["overrides"]) if res["overrides"] else "")
    note = f"{res['rounds']}x{res['steps_per_round']} steps{' (quick)' if quick else ''}; load " + \
        "→".join(f"{x:.1f}" for x in res["load_avg_1m"])
    return (f"| {date} | {hardware()} | {commit()} | {cfg} | {tps('jaxtrain')} | {tps('torch-eager')} | "
            f"{tps('torch-compile')} | {ratio('torch-eager')} | {ratio('torch-compile')} | {frac} | "
            f"{im.get('jaxtrain', {}).get('compile_s', 0):.1f} | {note} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="timed steps per round (default: per config)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="3 rounds of 3 steps, 1 warm-up: checks the plumbing")
    p.add_argument("--json", default=str(HERE / "out" / "compare.json"))
    p.add_argument("--write-results", action="store_true", help="append rows to benchmarks/RESULTS.md")
    p.add_argument("overrides", nargs="*", help="key=value overrides applied to every config")
    args = p.parse_args(argv)
    if args.rounds < 3:
        p.error("--rounds must be at least 3")
    if args.quick:
        args.steps, args.warmup = 3, 1
    results = []
    for label in args.configs:
        config, overrides, steps = CONFIGS[label]
        results.append(compare(label, config, [*overrides, *args.overrides], args.impls, args.rounds,
                               args.steps or steps, args.warmup))
    print("\n| config | impl | tokens/s (median) | step p10-p90 ms | compile s |")
    print("|---|---|---|---|---|")
    for res in results:
        for name, r in res["impls"].items():
            s = r["stats"]
            print(f"| {res['label']} | {name} | {r['tokens_per_sec']:,.0f} | {s['p10_s'] * 1e3:.1f}-"
                  f"{s['p90_s'] * 1e3:.1f} | {r['compile_s']:.1f} |")
    print()
    for res in results:
        parts = [f"{k[9:]} {v:.2f}x" for k, v in res.items() if k.startswith("ratio_vs_") and not k.endswith("round")]
        frac = res.get("fraction_of_matmul_peak")
        print(f"{res['label']}: jaxtrain / " + ", ".join(parts) +
              (f"; jaxtrain at {100 * frac:.0f}% of the {res['matmul_peak_gflops']:.0f} GFLOP/s matmul peak"
               if frac is not None else "") + f" (load {res['load_avg_1m'][0]:.1f})")
    write_json(args.json, {"hardware": hardware(), "commit": commit(), "results": results})
    if args.write_results:
        for res in results:
            append_result_row(STEP_TABLE_HEADER, results_row(res, args.quick))
        print(f"appended {len(results)} rows to {HERE / 'RESULTS.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
