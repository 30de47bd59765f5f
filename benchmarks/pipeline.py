"""Pipeline parallelism on 8 simulated CPU devices: step time and compiled peak memory per device for
stage = 1, 2, 4 and microbatches = 4, 8, 16, for each schedule, at one global batch.

    python benchmarks/pipeline.py [--steps 6] [--write-results] [--quick]

The model is configs/shakespeare_char.yaml (4 layers, d_model 128) at global batch 32 and
sequence length 64; the stages split the 8 devices with ``data`` (stage=2: data=4). On a CPU the
8 simulated devices share the host's cores, so a step's time is the work of every stage summed:
a pipeline's idle slots (the bubble) are work the SPMD program still does, masked. The measured
bubble is 1 - (the stage=1 step time at the same microbatch count) / (this step time), against the
schedule's formula. Prints a table; ``--write-results`` appends rows to RESULTS.md. Measure on a
quiet machine.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
from _bench import append_result_row, commit, default_corpus, hardware  # noqa: E402

from jaxtrain import config as cfglib  # noqa: E402
from jaxtrain.errors import ConfigError  # noqa: E402
from jaxtrain.parallel.pipeline import schedule_of  # noqa: E402
from jaxtrain.train import setup  # noqa: E402

HEADER = ("| date (UTC) | hardware | commit | schedule | stage x data | microbatches | step ms (median) "
          "| peak MiB/device | bubble measured | bubble formula |")
INTRO = ("## Pipeline schedules (benchmarks/pipeline.py)\n\nconfigs/shakespeare_char.yaml (4 layers), global "
         "batch 32, 8 simulated CPU devices (stage x data = 8). The measured bubble is 1 - (stage=1 step "
         "time) / (pipelined step time) at the same microbatch count; on CPU every stage's masked work "
         "is done, so it is the SPMD program's idle work, which a GPU would spend waiting.")


def measure(overrides: list[str], steps: int) -> tuple[float, float]:
    """(median seconds per step, compiled peak bytes per device) of the train step under ``overrides``."""
    cfg = cfglib.load("shakespeare_char", [f"data.path={default_corpus()}", "train.global_batch=32", *overrides])
    s = setup(cfg, jax.devices(), load_data=True)
    state = jax.block_until_ready(s.fns.init())  # as the trainer: init done before the first step
    batches = s.data.iterator(s.fns.batch_sharding)
    batch = next(batches)
    step = s.fns.train_step.lower(state, batch).compile()
    m = step.memory_analysis()
    peak = m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    times = []
    for i in range(steps + 2):  # two warm-up steps
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics["loss"])
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), peak


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--write-results", action="store_true")
    p.add_argument("--quick", action="store_true", help="stage 1 and 2, 4 microbatches, 2 steps: the plumbing")
    a = p.parse_args(argv)
    stages, micro, steps = ((1, 2), (4,), 2) if a.quick else ((1, 2, 4), (4, 8, 16), a.steps)
    schedules = ("gpipe",) if a.quick else ("gpipe", "circular", "1f1b")
    rows = []
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    print(f"{'schedule':9s} {'stage x data':>12s} {'micro':>5s} {'ms/step':>8s} {'peak MiB':>9s} "
          f"{'bubble':>7s} {'formula':>8s}", flush=True)
    base, _ = measure(["mesh.stage=1", "mesh.data=8"], steps)  # no pipeline: microbatches play no part
    for m in micro:
        for schedule in schedules:
            for s in stages[1:]:
                if schedule == "circular" and m < s:
                    continue
                extra = [f"mesh.stage={s}", f"mesh.data={8 // s}", f"pipeline.microbatches={m}",
                         f"pipeline.schedule={schedule}"]
                if schedule == "circular":
                    extra.append(f"pipeline.repeats={4 // s}")
                try:
                    t, peak = measure(extra, steps)
                except ConfigError as err:  # e.g. 16 microbatches of 2 sequences cannot split over data=4
                    print(f"{schedule:9s} {f'{s} x {8 // s}':>12s} {m:5d} skipped: {err}", flush=True)
                    continue
                sched = schedule_of(cfglib.load(None, extra), s)
                measured = 1 - base / t
                print(f"{schedule:9s} {f'{s} x {8 // s}':>12s} {m:5d} {1e3 * t:8.1f} {peak / 2**20:9.1f} "
                      f"{100 * measured:6.1f}% {100 * sched.bubble:7.1f}%", flush=True)
                rows.append(f"| {date} | {hardware()} | {commit()} | {schedule} | {s} x {8 // s} | {m} | "
                            f"{1e3 * t:.1f} | {peak / 2**20:.1f} | {100 * measured:.1f}% | {100 * sched.bubble:.1f}% |")
    print(f"stage=1 x data=8 (no pipeline): {1e3 * base:.1f} ms/step", flush=True)
    if a.write_results:
        for row in rows:
            append_result_row(HEADER, row, INTRO)
    return 0


if __name__ == "__main__":
    sys.exit(main())
