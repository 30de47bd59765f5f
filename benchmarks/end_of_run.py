"""Runs that must finish: one process on 8 simulated devices, 3 steps and the default 100 evaluation
batches, N times each for ring attention (``sharding.rules=sp``) and expert parallelism (MoE,
``sharding.rules=ep``). Before the evaluation became one program, 6 of 8 such runs aborted at their
end (XLA:CPU's rendezvous timeout, exit 134).

    python benchmarks/end_of_run.py [--runs 20] [--quick]

Prints one line per run (exit code, wall seconds, the validation loss) and, per case, how many of
the runs finished with exit 0; exit status 1 unless every run did.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CASES = {
    "ring-sp": ["--config", "configs/shakespeare_char.yaml", "model.attention=ring", "sharding.rules=sp",
                "mesh.sequence=4", "mesh.data=2"],
    "moe-ep": ["--config", "configs/moe_shakespeare.yaml", "sharding.rules=ep", "mesh.expert=8"],
}


def run_once(case: str, data: str, workdir: Path, eval_batches: int) -> tuple[int, float, str]:
    """(exit code, wall seconds, the last line that names the validation loss or the error)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    run_dir = Path(tempfile.mkdtemp(prefix=f"{case}-", dir=workdir))
    cmd = [sys.executable, "-m", "jaxtrain.train", *CASES[case], f"data.path={data}", f"run.dir={run_dir}",
           "train.steps=3", f"train.eval_batches={eval_batches}", "run.progress=false"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    said = re.findall(r"^(validation loss .*|error: .*|.*Termination timeout.*)$", out, re.M)
    return proc.returncode, time.monotonic() - t0, said[-1] if said else out[-300:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="runs per case")
    parser.add_argument("--quick", action="store_true", help="one run per case, 4 evaluation batches")
    parser.add_argument("--data", default=str(Path(os.environ.get("JAXTRAIN_SHARED", REPO.parent / "shared"))
                                              / "data" / "tinyshakespeare.txt"))
    args = parser.parse_args()
    runs, eval_batches = (1, 4) if args.quick else (args.runs, 100)
    workdir = Path(tempfile.mkdtemp(prefix="end_of_run_"))
    finished = {}
    for case in CASES:
        ok = 0
        for i in range(runs):
            code, seconds, said = run_once(case, args.data, workdir, eval_batches)
            ok += code == 0
            print(f"{case} run {i + 1:>2}: exit {code} in {seconds:.1f} s | {said}", flush=True)
        finished[case] = ok
        print(f"{case}: {ok} of {runs} runs finished with exit 0 ({eval_batches} evaluation batches)", flush=True)
    return 0 if all(n == runs for n in finished.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
