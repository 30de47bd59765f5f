"""What the multi-process stop agreement costs per step (``distributed.stop_check_every``).

Runs the shakespeare config as 2 local processes x 4 simulated CPU devices (one 8-device mesh,
``jax.distributed`` over gloo on 127.0.0.1), alternately with the agreement every step and with it
effectively off (``stop_check_every`` larger than the run), ``--rounds`` times each, and prints the
median logged ``step_time_s`` of each setting (ms/step, steady rows only) and their difference.

    python benchmarks/stop_agreement.py [--steps 60] [--rounds 2]

Measure on a quiet machine: the processes share its cores.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from _bench import REPO, with_corpus

sys.path.insert(0, str(REPO / "tests"))
import multiproc  # noqa: E402  (the tests' local multi-process launcher)

SETTINGS = {"every step": "distributed.stop_check_every=1", "off": "distributed.stop_check_every=1000000"}


def one_run(setting: str, steps: int, tmp: Path) -> list[float]:
    run_dir = tmp / f"run_{len(list(tmp.iterdir()))}"
    args = ["--config", "configs/shakespeare_char.yaml", *with_corpus([]), f"run.dir={run_dir}",
            f"train.steps={steps}", "train.log_every=5", f"train.eval_every={steps}", "train.eval_batches=1",
            "train.sample_tokens=0", "checkpoint.enabled=false", "run.progress=false",
            "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", SETTINGS[setting]]
    multiproc.run(2, 4, args, timeout=900)
    rows = [r for r in multiproc.rows(run_dir) if "step_time_s" in r]
    return [r["step_time_s"] for r in rows[2:]]  # past the compile and the first gloo connections


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    a = parser.parse_args()
    times: dict[str, list[float]] = {k: [] for k in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for setting in (SETTINGS if r % 2 == 0 else reversed(list(SETTINGS))):
                times[setting] += one_run(setting, a.steps, Path(tmp))
                print(f"round {r + 1}: {setting}: median {1e3 * statistics.median(times[setting]):.1f} ms/step",
                      flush=True)
    on, off = (statistics.median(times[k]) for k in SETTINGS)
    print(f"stop agreement every step: {1e3 * on:.1f} ms/step; off: {1e3 * off:.1f} ms/step; "
          f"cost {1e3 * (on - off):+.2f} ms/step ({100 * (on - off) / off:+.1f}%), "
          f"2 processes x 4 CPU devices, {len(times['off'])} rows per setting")


if __name__ == "__main__":
    main()
