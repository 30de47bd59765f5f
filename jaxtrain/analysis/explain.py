"""``python -m jaxtrain.explain --config X [--devices N] [key=value ...]``: one candidate, in detail.

Prints, for the config's own mesh and rule set (``mesh.*``, ``sharding.rules``):
  * per parameter: shape, logical axes, PartitionSpec, the optimizer-state PartitionSpec
    when it differs (zero1), and bytes per device;
  * the per-device memory report (jaxtrain.memory): device and host bytes apart, from the memory
    model and, where XLA separates them, from the compiled program; what ``offload:`` moves to host;
  * the collectives of the compiled train step (jaxtrain.collectives): kind, result
    shape, executions per step, bytes per step, and the JAX operation they came from.
Like ``jaxtrain.plan`` it goes through the run setup of training (``jaxtrain.train.assembly``)
and compiles on simulated CPU devices from abstract inputs only.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from jaxtrain.analysis import collectives
from jaxtrain.cli.common import add_config_args, cli, config_args, enable_compilation_cache, prog, use_cpu_devices
from jaxtrain.config import Config
from jaxtrain.metrics import memory
from jaxtrain.parallel import offload
from jaxtrain.parallel.mesh import describe
from jaxtrain.parallel.pipeline import schedule_of
from jaxtrain.parallel.rules import path_str
from jaxtrain.train.assembly import setup


def _spec(spec, ndim: int) -> str:
    entries = list(spec) + [None] * (ndim - len(spec))
    return "(" + ", ".join("+".join(e) if isinstance(e, tuple) else str(e) for e in entries) + ")"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def _short_op(name: str, width: int = 72) -> str:
    """'jit(step_fn)/while/body/closed_call/jvp()/dot_general' -> 'jvp()/dot_general'."""
    return _clip(re.sub(r"^jit\([^)]*\)/(while/body/(closed_call/)?)?", "", name) or "-", width)


def _fmt_table(head: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "  ".join(x.rjust(w) if i in right else x.ljust(w)  # noqa: E731
                               for i, (x, w) in enumerate(zip(r, widths))).rstrip()
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, rows)])


def explain(cfg: Config, devices, vocab: Optional[int] = None, top: int = 25,
            budget: Optional[int] = None) -> str:
    """The report as text (``budget``: per-device bytes the compiled peak is compared with).

    Raises ConfigError / ShardingError / DataError like training would.
    """
    s = setup(cfg, devices, vocab=vocab)
    compiled, abstract = s.compile_abstract()
    axes = {path_str(p): a for p, a in jax.tree_util.tree_flatten_with_path(
        s.fns.param_axes, is_leaf=lambda x: isinstance(x, tuple))[0]}
    mu = s.fns.state_shardings["opt_state"][1][0].mu  # AdamW first moment: the optimizer's layout
    opt_specs = {path_str(p): sh.spec for p, sh in jax.tree_util.tree_flatten_with_path(
        mu, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))[0]}
    rows = []
    for p, x in jax.tree_util.tree_flatten_with_path(abstract["params"])[0]:
        name = path_str(p)
        spec = _spec(x.sharding.spec, x.ndim)
        ospec = _spec(opt_specs[name], x.ndim)
        rows.append([name, "x".join(map(str, x.shape)), "(" + ", ".join(map(str, axes[name])) + ")", spec,
                     "" if ospec == spec else ospec, memory.fmt_bytes(memory.shard_bytes(x))])
    out = [f"mesh {describe(s.mesh)} | rules {s.rules.name} | model {s.model_spec.name} | batch "
           f"{_spec(s.fns.batch_sharding.spec, 2)} [accum, micro, ...]", "",
           _fmt_table(["parameter", "shape", "logical axes", "PartitionSpec", "optimizer state", "bytes/device"],
                      rows, right={5}), ""]
    report = memory.state_report(abstract, s.fns.state_shardings, compiled)
    out.append(report.summary())
    out.append(offload_summary(s, report))
    if budget is not None:
        fits = "within" if report.compiled["device_peak"] <= budget else "OVER"
        out.append(f"device peak {memory.fmt_bytes(report.compiled['device_peak'])}: {fits} --device-memory "
                   f"{memory.fmt_bytes(budget)}")
    if s.rules.fallbacks:
        out += ["", "replicated by sharding.allow_fallback:", *[f"  {f}" for f in s.rules.fallbacks]]
    found = sorted(collectives.parse(compiled.as_text()), key=lambda c: -c.bytes * c.count)
    total = collectives.totals(found)
    if s.mesh.shape["stage"] > 1:
        out += ["", pipeline_summary(s, total["collective-permute"])]
    out += ["", "collectives per step (bytes per device): " +
            ", ".join(f"{k} {memory.fmt_bytes(v)}" for k, v in total.items())]
    if found:
        crow = [[c.kind, _clip(re.sub(r"\{[^}]*\}", "", c.shape), 48), str(c.count),
                 memory.fmt_bytes(c.bytes * c.count),
                 _short_op(c.op_name)] for c in found[:top]]
        out += ["", _fmt_table(["kind", "result", "x/step", "bytes/step", "from"], crow, right={2, 3})]
        if len(found) > top:
            out.append(f"... {len(found) - top} more")
    return "\n".join(out)



def offload_summary(s, report: memory.MemoryReport) -> str:
    """One line: what ``offload:`` keeps in host memory, per device (state: the memory model; activations:
    the forward's offloaded residuals per micro-batch, an estimate from shapes)."""
    o = s.cfg.offload
    acts = ""
    if o.activations:
        micro = {k: jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for k, x in s.abstract_batch().items()}
        split = s.mesh.shape["data"] * s.mesh.shape["fsdp"] * s.mesh.shape["expert"]
        _, host = memory.activation_bytes(s.model_spec, micro, lambda: offload.active(offload.Plan.from_config(s.cfg)),
                                          split)
        acts = f" ({memory.fmt_bytes(host)} per micro-batch per device, estimate)"
    return (f"offload: optimizer {o.optimizer}, params {o.params}, activations {list(o.activations) or '-'}{acts}; "
            f"state in host memory {memory.fmt_bytes(report.host)} per device")


def pipeline_summary(s, permute_bytes: int) -> str:
    """The pipeline in a few lines: schedule, bubble (formula), loop iterations, the activations a
    stage keeps for its microbatches in flight (an estimate from shapes: stage inputs of
    [micro-batch / M, length, embed]), and the stage-to-stage bytes of the compiled step."""
    cfg, sched = s.cfg, schedule_of(s.cfg, s.mesh.shape["stage"])
    S, M, R = sched.stages, sched.microbatches, sched.repeats
    per_stage = s.model_config.n_layers // (S * R)
    batch_div = s.mesh.shape["data"] * s.mesh.shape["fsdp"] * s.mesh.shape["expert"]
    one = (cfg.micro_batch // M // batch_div) * cfg.data.seq_len * s.model_config.d_model * \
        jnp.dtype(s.model_config.dtype).itemsize
    if sched.schedule == "1f1b":
        kept, how = (2 * S - 1) * one, f"1f1b keeps at most 2S-1 = {2 * S - 1} stage inputs"
    else:
        n = sched.iterations * per_stage
        kept, how = n * one, f"{sched.schedule} keeps every iteration's layer inputs: {n}"
    return (f"pipeline: {S} stages x {M} microbatches ({sched.schedule}"
            f"{f', {R} repeats' if R > 1 else ''}), {sched.iterations} loop iterations; bubble "
            f"{100 * sched.bubble:.1f}% = {sched.bubble_formula}\n"
            f"  activations in flight per stage (estimate): {memory.fmt_bytes(kept)} ({how} of "
            f"{memory.fmt_bytes(one)}); stage-to-stage (collective-permute) {memory.fmt_bytes(permute_bytes)} "
            f"per step")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=prog("jaxtrain.explain"),
                                     description="Per-parameter shardings, memory and the collectives of one "
                                                 "mesh + rule set (the config's).")
    parser.add_argument("--devices", type=int, default=None,
                        help="simulated CPU devices (default: the product of the mesh sizes, or 8)")
    parser.add_argument("--rules", help="the rule set (one name in sharding_rules/, or a YAML path); "
                                        "same as sharding.rules=NAME")
    parser.add_argument("--device-memory", help="per-device budget, e.g. 80GiB: says whether the peak fits")
    parser.add_argument("--allow-fallback", action="store_true", help="same as sharding.allow_fallback=true")
    add_config_args(parser)
    args = config_args(parser, sys.argv[1:] if argv is None else argv)
    return cli(lambda: _explain(args))


def _explain(args: argparse.Namespace) -> int:
    from jaxtrain.analysis.plan import parse_bytes
    from jaxtrain.config import MESH_AXES, load
    from jaxtrain.errors import ConfigError
    overrides = list(args.overrides)
    if args.rules:
        if "," in args.rules:
            raise ConfigError(f"--rules: explain shows one rule set, got '{args.rules}' "
                              f"(compare several with python -m jaxtrain.plan --rules {args.rules})")
        overrides.append(f"sharding.rules={args.rules}")
    if args.allow_fallback:
        overrides.append("sharding.allow_fallback=true")
    budget = parse_bytes(args.device_memory) if args.device_memory else None
    cfg = load(args.config, overrides)
    sizes = [getattr(cfg.mesh, a) for a in MESH_AXES]
    n = args.devices or (math.prod(sizes) if -1 not in sizes else 8)
    use_cpu_devices(n)
    enable_compilation_cache()  # on over CPU devices too: nothing compiled here runs
    import jax
    devices = jax.devices("cpu")
    if len(devices) < n:
        raise ConfigError(f"--devices: {n} CPU devices requested but this process has {len(devices)}")
    print(explain(cfg, devices[:n], budget=budget))
    return 0


if __name__ == "__main__":
    sys.exit(main())
