"""Time jaxtrain's compiled train step: ``python benchmarks/step.py --config X [key=value ...]``.

Prints a table and writes JSON (``--json``): median and spread of the step time
over ``--steps`` steps after ``--warmup`` steps, tokens/s, FLOPs/token, MFU,
compile time, peak host memory (RSS) and device memory, and the matmul peak
measured in this same process before and after the timed steps (on CPU the
throughput swings within minutes, so only a same-run peak is meaningful).

The batches are real ones from the config's data pipeline, put on the devices
before timing; each step is synchronised so every step has its own time.
``--compile-only`` reports the compile time alone (e.g. 4 vs 32 layers, with
and without ``model.scan_layers=true``). ``--abstract`` validates the config and
lowers and compiles the full-size step from shapes alone (no parameters are
allocated): the CPU smoke check of configs meant for an accelerator.
``--write-results`` appends a row to benchmarks/RESULTS.md. ``--serve`` is
compare.py's worker mode.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import jax  # noqa: E402
from _bench import (
    HERE_RESULTS,
    STEP_TABLE_HEADER,
    append_result_row,
    commit,
    fmt,
    hardware,
    peak_host_rss_bytes,
    print_table,
    serve,
    stats,
    with_corpus,
    write_json,
)

from jaxtrain import config as cfglib  # noqa: E402
from jaxtrain.kernels import hooks as provider_hooks  # noqa: E402
from jaxtrain.kernels.cpu.peak import xla_matmul_peak  # noqa: E402
from jaxtrain.metrics import flops  # noqa: E402
from jaxtrain.runtime import host_memory, xla_flags  # noqa: E402
from jaxtrain.train import setup  # noqa: E402
from jaxtrain.train.step import count_params  # noqa: E402


def matmul_peak(dtype: str) -> float:
    """Measured matmul FLOP/s now: 2048^3 on CPU, 8192^3 on accelerators (best of 5)."""
    n = 2048 if jax.devices()[0].platform == "cpu" else 8192
    return xla_matmul_peak(n=n, dtype=dtype) if n == 2048 else _accel_matmul(n, dtype)


def _accel_matmul(n: int, dtype: str) -> float:
    # Random operands: a matmul on constant data runs faster than on real data (13% on an H200 here).
    a = jax.random.normal(jax.random.key(0), (n, n), jax.numpy.dtype(dtype))
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * n ** 3 / best


def as_the_trainer_runs() -> None:
    """The process settings ``python -m jaxtrain.train`` makes before JAX starts, so that the step
    timed here is the step the trainer runs: XLA's GPU and CPU default flags (``JAXTRAIN_XLA_GPU_FLAGS=0``,
    ``JAXTRAIN_XLA_CPU_FLAGS=0``: none), and the kernel providers' settings for a single process before
    the backend starts (the ``cpu`` provider: one-device CPU programs run inline;
    ``JAXTRAIN_CPU_ASYNC_DISPATCH=1``: asynchronously). The last matters beyond the dispatch: a program
    run on JAX's runtime thread gets its temporaries from a glibc thread arena, which cannot hold more
    than 64 MiB, so larger ones are mapped and faulted in afresh on every step (the 25M step's ~1 GiB:
    2.65-2.82 s a step against 2.24-2.33 s inline, 2-core AMD EPYC)."""
    xla_flags.apply_gpu_defaults()
    xla_flags.apply_cpu_defaults()
    for hook in provider_hooks.hooks(plugins=False):
        hook.before_backend(None, True)


class JaxBench:
    """Builds, compiles and times the train step of one config on all local devices."""

    def __init__(self, config: str | None, overrides: list[str], n_batches: int = 8):
        self.cfg = cfg = cfglib.load(config, with_corpus(overrides))
        if cfg.run.reuse_host_memory:  # the same process settings as the trainer (jaxtrain.train.trainer)
            host_memory.reuse_freed_memory()
        s = setup(cfg, jax.devices(), load_data=True)  # the trainer's own setup, checks and data pipeline
        it = s.data.iterator(s.fns.batch_sharding)  # batch dicts on the mesh
        self.batches = [next(it) for _ in range(n_batches)]
        self.state = s.fns.init()
        t0 = time.perf_counter()
        self.compiled = s.fns.train_step.lower(self.state, self.batches[0]).compile()
        self.compile_s = time.perf_counter() - t0
        self.fpt = s.model_spec.flops_per_unit
        self.tokens_per_step = cfg.train.global_batch * s.model_spec.units_per_example
        self.n_params = count_params(self.state["params"])
        self.i = 0
        self.last_loss = None

    def run(self, n: int) -> list[float]:
        times = []
        for _ in range(n):
            batch = self.batches[self.i % len(self.batches)]
            self.i += 1
            t = time.perf_counter()
            self.state, m = self.compiled(self.state, batch)
            loss = float(m["loss"])  # sync: each step gets its own time
            times.append(time.perf_counter() - t)
            self.last_loss = loss
        return times

    def memory(self) -> dict:
        dev = jax.devices()[0]
        stats_ = dev.memory_stats() if hasattr(dev, "memory_stats") else None
        mem = self.compiled.memory_analysis()
        return {"host_peak_rss_bytes": peak_host_rss_bytes(),
                "device_peak_bytes": (stats_ or {}).get("peak_bytes_in_use"),
                "compiled_temp_bytes": getattr(mem, "temp_size_in_bytes", None),
                "compiled_argument_bytes": getattr(mem, "argument_size_in_bytes", None)}


def abstract_compile(config: str | None, overrides: list[str]) -> dict:
    """Validates ``config`` and compiles its train step from ShapeDtypeStructs (nothing allocated)."""
    cfg = cfglib.load(config, with_corpus(overrides))
    s = setup(cfg, jax.devices())
    t0 = time.perf_counter()
    compiled, state = s.compile_abstract()
    mem = compiled.memory_analysis()
    return {"config": config, "n_params": count_params(state["params"]),
            "flops_per_token": s.model_spec.flops_per_unit, "compile_s": time.perf_counter() - t0,
            "compiled_temp_bytes": getattr(mem, "temp_size_in_bytes", None)}


def results_row(info: dict) -> str:
    """One RESULTS.md row (the table of compare.py; the torch columns empty)."""
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    cfg = info["config"] + (" " + " ".join(info["overrides"]) if info["overrides"] else "")
    mfu = f"MFU {100 * info['mfu']:.1f}% ({info['peak_source']})" if info["mfu"] is not None else "MFU n/a"
    return (f"| {date} | {hardware()}; {info['device']} x{info['n_devices']} | {commit()} | {cfg} | "
            f"{info['tokens_per_sec']:,.0f} | - | - | - | - | {mfu} | {info['compile_s']:.1f} | "
            f"step.py, {info['stats']['steps']} steps, {info['dtype']}, jax {info['jax']}"
            f"{', GPU XLA flags' if info.get('gpu_flags') else ''}"
            f"{', XLA_FLAGS=' + info['users_xla_flags'] if info.get('users_xla_flags') else ''} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="shakespeare_char")
    p.add_argument("--steps", type=int, default=20, help="timed steps (after warm-up)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--abstract", action="store_true", help="validate and compile from shapes only, then exit")
    p.add_argument("--write-results", action="store_true", help="append a row to benchmarks/RESULTS.md")
    p.add_argument("--serve", action="store_true", help="worker mode for compare.py")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    users_xla_flags = os.environ.get("XLA_FLAGS", "").strip()  # before the trainer's defaults join them
    as_the_trainer_runs()

    if args.abstract:
        info = abstract_compile(args.config, args.overrides)
        print_table(f"jaxtrain abstract compile: {args.config} {' '.join(args.overrides)}", [
            ("params", f"{info['n_params'] / 1e9:.3f}B, {info['flops_per_token'] / 1e9:.2f} GFLOP/token"),
            ("compile", fmt(info["compile_s"], " s", digits=1)),
            ("compiled temp", fmt(info["compiled_temp_bytes"], " GiB", 2 ** 30, 2))])
        write_json(args.json, info)
        return 0
    t_start = time.perf_counter()
    b = JaxBench(args.config, args.overrides)
    cfg = b.cfg
    dev = jax.devices()[0]
    peak_src = flops.total_peak_flops(cfg, jax.devices(), calibrate=False)
    info = {"impl": "jaxtrain", "config": args.config, "overrides": args.overrides, "device": dev.device_kind,
            "gpu_flags": dev.platform == "gpu" and "latency_hiding" in os.environ.get("XLA_FLAGS", ""),
            "platform": dev.platform, "n_devices": len(jax.devices()), "dtype": cfg.model.dtype,
            "n_params": int(b.n_params), "flops_per_token": b.fpt, "tokens_per_step": b.tokens_per_step,
            "compile_s": b.compile_s, "scan_layers": getattr(cfg.model, "scan_layers", False),
            "remat": getattr(cfg.model, "remat", "none"), "jax": jax.__version__,
            "users_xla_flags": users_xla_flags}
    if args.compile_only:
        print_table("jaxtrain compile", [("config", f"{args.config} {' '.join(args.overrides)}"),
                                         ("layers", str(cfg.model.n_layers)),
                                         ("compile", fmt(b.compile_s, " s", digits=2))])
        write_json(args.json, info)
        return 0
    if args.serve:
        b.run(args.warmup)

        def run_steps(n: int) -> dict:
            before = matmul_peak(cfg.model.dtype)
            times = b.run(n)
            return {"times": times, "matmul_peak": [before, matmul_peak(cfg.model.dtype)], "loss": b.last_loss}
        serve(info, run_steps)
        return 0

    peaks = [matmul_peak(cfg.model.dtype)]
    b.run(args.warmup)
    times = b.run(args.steps)
    peaks.append(matmul_peak(cfg.model.dtype))
    s = stats(times)
    tps = b.tokens_per_step / s["median_s"]
    measured = max(peaks)
    if dev.platform == "cpu" and cfg.train.peak_tflops is None:
        peak, src = measured, "best matmul measured in this run"
    else:
        peak, src = peak_src

    info.update(stats=s, tokens_per_sec=tps, matmul_peak_samples=peaks, matmul_peak=measured,
                fraction_of_matmul_peak=tps * b.fpt / measured, mfu=flops.mfu(tps, b.fpt, peak), peak_source=src,
                final_loss=b.last_loss, memory=b.memory(), wall_s=time.perf_counter() - t_start)
    mem = info["memory"]
    print_table(f"jaxtrain step: {args.config} {' '.join(args.overrides)}", [
        ("device", f"{dev.device_kind} x{len(jax.devices())} ({cfg.model.dtype})"),
        ("params", f"{b.n_params / 1e6:.2f}M, {b.fpt / 1e6:.1f} MFLOP/token"),
        ("compile", fmt(b.compile_s, " s", digits=2)),
        ("step time (median)", f"{s['median_s'] * 1e3:.1f} ms over {s['steps']} steps "
                               f"(p10 {s['p10_s'] * 1e3:.1f}, p90 {s['p90_s'] * 1e3:.1f}, spread {s['spread']:.1%})"),
        ("tokens/s", f"{tps:,.0f}"),
        ("achieved", fmt(tps * b.fpt, " GFLOP/s", 1e9)),
        ("matmul peak (this run)", " / ".join(fmt(x, "", 1e9) for x in peaks) + " GFLOP/s (before / after)"),
        ("MFU", fmt(info["mfu"] and 100 * info["mfu"], "%") + f" ({info['peak_source']})"),
        ("host peak RSS", fmt(mem["host_peak_rss_bytes"], " MiB", 2 ** 20)),
        ("device peak", fmt(mem["device_peak_bytes"], " MiB", 2 ** 20)),
        ("compiled temp", fmt(mem["compiled_temp_bytes"], " MiB", 2 ** 20)),
    ])
    write_json(args.json, info)
    if args.write_results:
        append_result_row(STEP_TABLE_HEADER, results_row(info))  # compare.py's table, torch columns empty
        print(f"appended a row to {HERE_RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
