"""MoE step time against the dense model with the same active parameters, on 1 and 8 devices.

    python benchmarks/moe.py [--rounds 2] [--steps 20] [--write-results] [--quick]

The MoE is ``configs/moe_shakespeare.yaml`` (8 experts of d_ff 192, top-2); the dense model is
``configs/shakespeare_char.yaml`` with ``model.d_ff=384`` (2 x 192), both at global batch 16. Each case runs
``benchmarks/step.py`` in its own process (the simulated device count is fixed per process):

  1 device:  dense | MoE dropless | MoE capacity (factor 1.25)
  8 devices: dense (data=8) | MoE dropless, ``ep`` expert=8 | MoE capacity, ``ep`` expert=8

Cases alternate within each round; a case's figure is the median of its rounds' median step
times. Prints a table, and with ``--write-results`` appends rows to RESULTS.md. Measure on a
quiet machine (no tests, no other jobs): 8 simulated devices share the host's cores.
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

from _bench import append_result_rows, commit, hardware

HERE = Path(__file__).resolve().parent
CASES = [  # (name, devices, config, overrides)
    ("dense", 1, "shakespeare_char", ["model.d_ff=384"]),
    ("moe dropless", 1, "moe_shakespeare", []),
    ("moe capacity 1.25", 1, "moe_shakespeare", ["model.routing=capacity"]),
    ("dense data=8", 8, "shakespeare_char", ["model.d_ff=384", "mesh.data=8", "sharding.rules=dp"]),
    ("moe dropless ep expert=8", 8, "moe_shakespeare", ["sharding.rules=ep", "mesh.expert=8"]),
    ("moe capacity 1.25 ep expert=8", 8, "moe_shakespeare", ["sharding.rules=ep", "mesh.expert=8",
                                                             "model.routing=capacity"]),
]
HEADER = ("| date (UTC) | hardware | commit | case | devices | step ms (median) | tokens/s | MFU "
          "| vs dense, same devices |")
INTRO = ("## MoE vs dense (benchmarks/moe.py)\n\nconfigs/moe_shakespeare.yaml (8 experts x d_ff 192, "
         "top-2) against configs/shakespeare_char.yaml with model.d_ff=384: the same active parameters; global "
         "batch 16.")


def run_case(devices: int, config: str, overrides: list[str], steps: int, quick: bool) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    extra = ["train.global_batch=16", *overrides] + (["model.n_layers=1"] if quick else [])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "step.json"
        cmd = [sys.executable, str(HERE / "step.py"), "--config", config, "--steps", str(steps),
               "--warmup", "1" if quick else "3", "--json", str(out), *extra]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--write-results", action="store_true")
    p.add_argument("--quick", action="store_true", help="1 layer, 2 steps, 1 round: checks the plumbing")
    a = p.parse_args(argv)
    rounds, steps = (1, 2) if a.quick else (a.rounds, a.steps)
    medians: dict[str, list[float]] = {c[0]: [] for c in CASES}
    info: dict[str, dict] = {}
    for r in range(rounds):
        for name, devices, config, overrides in CASES:
            res = run_case(devices, config, overrides, steps, a.quick)
            medians[name].append(res["stats"]["median_s"])
            info[name] = res
            print(f"round {r + 1}/{rounds}  {name:32s} {1e3 * res['stats']['median_s']:8.1f} ms/step", flush=True)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    print(f"\n{'case':32s} {'devices':>7s} {'ms/step':>9s} {'tokens/s':>10s} {'MFU':>7s} {'vs dense':>9s}")
    rows = []
    for name, devices, _, _ in CASES:
        ms = 1e3 * statistics.median(medians[name])
        dense = 1e3 * statistics.median(medians["dense" if devices == 1 else "dense data=8"])
        res = info[name]
        tps = res["tokens_per_step"] / (ms / 1e3)
        mfu = f"{100 * res['mfu']:.1f}%" if res.get("mfu") is not None else "n/a"
        print(f"{name:32s} {devices:7d} {ms:9.1f} {tps:10,.0f} {mfu:>7s} {ms / dense:8.2f}x")
        rows.append(f"| {date} | {hardware()} | {commit()} | {name}{' (quick)' if a.quick else ''} | {devices} | "
                    f"{ms:.1f} | {tps:,.0f} | {mfu} | {ms / dense:.2f}x |")
    if a.write_results:
        append_result_rows(HEADER, rows, INTRO)
    return 0


if __name__ == "__main__":
    sys.exit(main())
