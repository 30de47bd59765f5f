"""The benchmark scripts run (``--quick``) and print their figures; speed itself is never asserted here."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_quick(script: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device, as a user runs them
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--quick"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def rounded_ratio(ratio: float, num: float, den: float, unit: float, ratio_unit: float = 0.01) -> bool:
    """Whether ``ratio`` (printed to ``ratio_unit``) can be num/den of the unrounded values behind ``num`` and
    ``den`` (each printed to ``unit``): a fixed tolerance failed on CI when a 2.3 s run's rounding alone was 2%."""
    h, r = unit / 2, ratio_unit / 2
    return (num - h) / (den + h) - r <= ratio <= (num + h) / (den - h) + r


@pytest.mark.slow  # over ~20 s on 2 cores (CI's durations)
def test_loop_overhead_compares_the_trainers_logged_step_with_the_bare_step():
    out = run_quick("loop_overhead.py")
    ratio = re.search(r"the trainer's step is ([0-9.]+)x the bare step", out)
    trainer, bare = map(float, re.search(r"trainer ([0-9.]+) ms/step, bare step ([0-9.]+) ms", out).groups())
    # (the times are printed to 0.1 ms, the ratio to 0.001 from the unrounded ones)
    assert ratio and trainer > 0 and bare > 0 and rounded_ratio(float(ratio.group(1)), trainer, bare, 0.1, 0.001), out


def test_vs_nanogpt_runs_the_real_nanogpt_and_jaxtrain():
    pytest.importorskip("torch")
    out = run_quick("vs_nanogpt.py")
    m = re.search(r"20 iterations on (.+): whole process nanoGPT ([0-9.]+) s, jaxtrain ([0-9.]+) s: jaxtrain is "
                  r"([0-9.]+)x nanoGPT's speed; steady ([0-9.]+) vs ([0-9.]+) ms: ([0-9.]+)x", out)
    assert m, out
    nano, ours, ratio, nano_ms, our_ms, steady = map(float, m.groups()[1:])
    assert m.group(1) and nano > 0 and ours > 0 and nano_ms > 0 and our_ms > 0  # the CPU model is named
    assert rounded_ratio(ratio, nano, ours, 0.1), out  # seconds printed to 0.1 s
    assert rounded_ratio(steady, nano_ms, our_ms, 0.1), out  # ms printed to 0.1 ms
    paired = re.search(r"paired rounds: whole ([0-9.]+)x, steady ([0-9.]+)x", out)  # one round: the same ratios
    assert paired and (float(paired.group(1)), float(paired.group(2))) == (
        pytest.approx(ratio, abs=0.011), pytest.approx(steady, abs=0.011)), out


def test_moe_kernels_prints_each_case_against_the_dense_swiglu():
    out = run_quick("moe_kernels.py")
    table = out.split("max rel. diff\n", 1)[1]
    rows = {line[:20].strip(): tuple(map(float, line[20:].replace("x", "").split()[:2]))
            for line in table.splitlines() if line.strip()}
    assert list(rows) == ["dense 2-D", "dense cpu_fused", "per-expert 2-D", "batched [E, M/E]", "dropless windows",
                          "dropless blocks", "ragged_dot", "dropless cpu_fused"], out
    diffs = {line[:20].strip(): line.split()[-1] for line in table.splitlines() if line.strip()}
    assert all(d == "-" if n.startswith("dense") else float(d) < 1e-5 for n, d in diffs.items()), out  # float32 sums
    dense = rows["dense 2-D"][0]
    for ms, ratio in rows.values():  # times printed to 0.01 ms, ratios to 0.01
        assert ms > 0 and rounded_ratio(ratio, ms, dense, 0.01), out
