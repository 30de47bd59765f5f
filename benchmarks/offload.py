"""Host-memory offload: step time and device / host bytes per device with and without each kind of offload.

    python benchmarks/offload.py [--config X] [--variants none,optimizer,params,activations,all] [--rounds 3]
                                 [--steps 10] [--warmup 2] [--quick] [--json F] [--write-results] [key=value ...]

Each variant is the config's train step with one ``offload:`` setting (docs/memory.md), timed on real
batches (benchmarks/step.py's JaxBench: the trainer's own setup and data pipeline). The variants
alternate within each of ``--rounds`` rounds (each built afresh, one at a time, so that a machine that
slows down slows them all): a variant's time is the median over rounds of its median step, and its
ratio to ``none`` the median of the per-round ratios. The variants:
  none         nothing offloaded;
  optimizer    offload.optimizer=host (the moments, and float32 masters of low-precision params);
  params       offload.params=host (the stacked layers fetched one per scan iteration);
  activations  offload.activations = every name the model tags;
  all          the three together.
Parameter and activation offload need ``model.scan_layers=true`` and a recomputing ``model.remat``: the
config gets both (remat full) unless it has them. Device and host bytes come from the memory model (the state's
shardings and memory kinds; the offloaded activations estimated from shapes) and from the compiled step
(``device_peak``: XLA's figures where it separates host memory, else the peak minus the model's host bytes:
on XLA:CPU the transfers lower to nothing and the step times show only the bookkeeping). ``--write-results``
appends rows to benchmarks/RESULTS.md; measure on a quiet machine.
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys

import jax
from _bench import append_result_row, commit, hardware, print_table, stats, write_json
from step import JaxBench, as_the_trainer_runs

from jaxtrain.metrics import memory
from jaxtrain.parallel import offload
from jaxtrain.train import setup

VARIANTS = ("none", "optimizer", "params", "activations", "all")
HEADER = ("| date (UTC) | hardware | commit | config | variant | step ms (median) | vs none | device peak MiB "
          "| host state MiB | host activations MiB |")
INTRO = ("## Host-memory offload (benchmarks/offload.py)\n\nThe same train step with nothing, the optimizer state, "
         "the parameters, the named activations, or all three in pinned_host memory. Device peak: the compiled "
         "step's (on XLA:CPU its peak minus the memory model's host bytes); host: the memory model's.")


def overrides_for(variant: str, names: list[str]) -> list[str]:
    """The ``offload.*`` overrides of one variant (``names``: the activations the model tags)."""
    acts = f"offload.activations=[{','.join(names)}]"
    return {"none": [], "optimizer": ["offload.optimizer=host"], "params": ["offload.params=host"],
            "activations": [acts], "all": ["offload.optimizer=host", "offload.params=host", acts]}[variant]


def measure(config: str, overrides: list[str], steps: int, warmup: int) -> dict:
    """Median step time and the memory figures (bytes per device) of one variant."""
    b = JaxBench(config, overrides, n_batches=2)
    shardings = jax.tree_util.tree_map(lambda x: x.sharding, b.state)
    rep = memory.state_report(b.state, shardings, b.compiled)
    acts_host = 0
    if b.cfg.offload.activations:
        s = setup(b.cfg, jax.devices())
        micro = {k: jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for k, x in s.abstract_batch().items()}
        split = s.mesh.shape["data"] * s.mesh.shape["fsdp"] * s.mesh.shape["expert"]
        _, acts_host = memory.activation_bytes(s.model_spec, micro,
                                               lambda: offload.active(offload.Plan.from_config(b.cfg)), split)
    b.run(warmup)
    st = stats(b.run(steps))
    dev = jax.devices()[0]
    in_use = (dev.memory_stats() or {}).get("peak_bytes_in_use") if hasattr(dev, "memory_stats") else None
    return {"overrides": overrides, "stats": st, "device_peak": rep.compiled["device_peak"],
            "peak": rep.compiled["peak"], "host_source": rep.compiled["host_source"], "device_state": rep.state,
            "host_state": rep.host, "host_activations": acts_host, "peak_bytes_in_use": in_use,
            "final_loss": b.last_loss, "compile_s": b.compile_s}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="shakespeare_char")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="rounds of alternated variants")
    p.add_argument("--quick", action="store_true", help="2 layers, 2 steps: the plumbing")
    p.add_argument("--json", default=None)
    p.add_argument("--write-results", action="store_true")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    as_the_trainer_runs()  # flags and dispatch as python -m jaxtrain.train sets them
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    base = [*_layers_scanned(a.config, a.overrides), *a.overrides]
    steps, warmup, rounds = (2, 1, 1) if a.quick else (a.steps, a.warmup, a.rounds)
    if a.quick:
        base = ["model.n_layers=2", "train.global_batch=8", *base]
    names = sorted(offload.model_names(*_spec_and_micro(a.config, base)))
    out, medians = run_rounds(lambda v: measure(a.config, [*base, *overrides_for(v, names)], steps, warmup),
                              variants, rounds)
    ratios = {v: statistics.median(m / n for m, n in zip(medians[v], medians["none"])) if "none" in out else None
              for v in variants}
    mib = lambda n: f"{n / 2**20:,.1f} MiB" if n is not None else "n/a"  # noqa: E731
    rows = []
    for v, r in out.items():
        t = statistics.median(medians[v])
        vs = f" ({ratios[v]:.2f}x none)" if ratios[v] is not None else ""
        rows.append((v, f"{1e3 * t:.1f} ms/step{vs} | device peak {mib(r['device_peak'])} (compiled; host from the "
                        f"{r['host_source']}) | device state {mib(r['device_state'])} | host state "
                        f"{mib(r['host_state'])}, activations {mib(r['host_activations'])} (estimate)"))
    print_table(f"offload: {a.config} {' '.join(base)} on {jax.devices()[0].device_kind} x{len(jax.devices())}",
                rows)
    write_json(a.json, {"config": a.config, "overrides": base, "jax": jax.__version__, "rounds": rounds,
                        "round_medians_s": medians, "vs_none": ratios, "variants": out})
    if a.write_results:
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
        for v, r in out.items():
            t = statistics.median(medians[v])
            vs = f"{ratios[v]:.2f}x" if ratios[v] is not None else "-"
            append_result_row(HEADER, f"| {date} | {hardware()}; {jax.devices()[0].device_kind} | {commit()} | "
                                      f"{a.config} {' '.join(base)} | {v} | {1e3 * t:.1f} | "
                                      f"{vs} | {r['device_peak'] / 2**20:.1f} | "
                                      f"{r['host_state'] / 2**20:.1f} | {r['host_activations'] / 2**20:.1f} |", INTRO)
    return 0


def run_rounds(measure_one, variants: list[str], rounds: int) -> tuple[dict, dict]:
    """``measure_one(variant)`` for every variant in turn, ``rounds`` times: (the first round's result per
    variant, which holds the memory figures; every round's median step seconds per variant)."""
    out: dict[str, dict] = {}
    medians: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(rounds):
        for v in variants:
            res = measure_one(v)
            medians[v].append(res["stats"]["median_s"])
            out.setdefault(v, res)
            print(f"round {r + 1}/{rounds}  {v:12s} {1e3 * res['stats']['median_s']:8.1f} ms/step", flush=True)
    return out, medians


def _layers_scanned(config: str, overrides: list[str]) -> list[str]:
    """``model.scan_layers=true`` and ``model.remat=full`` where the config lacks them (parameter and
    activation offload need both); nothing where it has them (e.g. llama_1b_h200's save_matmuls)."""
    from _bench import with_corpus

    from jaxtrain import config as cfglib
    model = cfglib.load(config, with_corpus(overrides)).model
    return ([] if getattr(model, "scan_layers", True) else ["model.scan_layers=true"]) + \
        (["model.remat=full"] if getattr(model, "remat", None) == "none" else [])


def _spec_and_micro(config: str, overrides: list[str]):
    """(model spec, one abstract micro-batch) of ``config``: for the names its model tags."""
    from _bench import with_corpus

    from jaxtrain import config as cfglib
    s = setup(cfglib.load(config, with_corpus(overrides)), jax.devices()[:1], vocab=256)
    return s.model_spec, {k: jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for k, x in s.abstract_batch().items()}


if __name__ == "__main__":
    sys.exit(main())
