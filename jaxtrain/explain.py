"""``python -m jaxtrain.explain --config X [--devices N] [key=value ...]``: one candidate, in detail.

Prints, for the config's own mesh and rule set (``mesh.*``, ``sharding.rules``):
  * per parameter: shape, logical axes, PartitionSpec, the optimizer-state PartitionSpec
    when it differs (zero1), and bytes per device;
  * the per-device memory report (jaxtrain.memory);
  * the collectives of the compiled train step (jaxtrain.collectives): kind, result
    shape, executions per step, bytes per step, and the JAX operation they came from.
Like ``jaxtrain.plan`` it compiles on simulated CPU devices from abstract inputs only.
"""
from __future__ import annotations

import math
import re
import sys
from typing import Optional, Sequence

import jax
from flax import nnx

from jaxtrain import collectives, memory, step as steplib
from jaxtrain.config import MESH_AXES, Config, ConfigError, check_against_mesh, load
from jaxtrain.mesh import build_mesh, describe, resolve_sizes
from jaxtrain.partitioning import Rules, ShardingError, path_str
from jaxtrain.plan import cli_args, model_vocab, use_cpu_devices
from jaxtrain.tokenizer import DataError


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


def explain(cfg: Config, devices, vocab: Optional[int] = None, top: int = 25) -> str:
    """The report as text. Raises ConfigError / ShardingError like training would."""
    check_against_mesh(cfg, resolve_sizes(cfg.mesh, len(devices)))
    rules = Rules.load(cfg.sharding.rules, cfg.sharding.allow_fallback)
    mesh = build_mesh(cfg.mesh, devices)
    vocab = vocab or model_vocab(cfg)
    trainer = steplib.build(cfg, mesh, rules, vocab)
    abstract = jax.eval_shape(trainer.init)
    batch = jax.ShapeDtypeStruct((cfg.train.grad_accum, cfg.micro_batch, cfg.data.seq_len + 1), jax.numpy.int32,
                                 sharding=trainer.batch_sharding)
    compiled = trainer.train_step.lower(abstract, batch).compile()

    abstract_model = nnx.eval_shape(lambda: steplib.Llama(steplib.llama_config(cfg, vocab), nnx.Rngs(0)))
    axes = {path_str(p): tuple(v.get_metadata()["axes"])
            for p, v in nnx.to_flat_state(nnx.state(abstract_model, nnx.Param))}
    mu = trainer.state_shardings["opt_state"][1][0].mu  # AdamW first moment: the optimizer's layout
    opt_specs = {path_str(p): s.spec for p, s in jax.tree_util.tree_flatten_with_path(
        mu, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))[0]}
    rows = []
    for p, x in jax.tree_util.tree_flatten_with_path(abstract["params"])[0]:
        name = path_str(p)
        spec = _spec(x.sharding.spec, x.ndim)
        ospec = _spec(opt_specs[name], x.ndim)
        rows.append([name, "x".join(map(str, x.shape)), "(" + ", ".join(map(str, axes[name])) + ")", spec,
                     "" if ospec == spec else ospec, memory.fmt_bytes(memory.shard_bytes(x))])
    out = [f"mesh {describe(mesh)} | rules {rules.name} | batch {_spec(trainer.batch_sharding.spec, 3)} "
           f"[accum, micro, T+1]", "",
           _fmt_table(["parameter", "shape", "logical axes", "PartitionSpec", "optimizer state", "bytes/device"],
                      rows, right={5}), ""]
    out.append(memory.state_report(abstract, trainer.state_shardings, compiled).summary())
    if rules.fallbacks:
        out += ["", "replicated by sharding.allow_fallback:", *[f"  {f}" for f in rules.fallbacks]]
    found = sorted(collectives.parse(compiled.as_text()), key=lambda c: -c.bytes * c.count)
    total = collectives.totals(found)
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = cli_args("python -m jaxtrain.explain", sys.argv[1:] if argv is None else argv,
                    "Per-parameter shardings and the collectives of one mesh + rule set (the config's).")
    try:
        overrides = list(args.overrides)
        if args.rules:
            overrides.append(f"sharding.rules={args.rules}")
        if args.allow_fallback:
            overrides.append("sharding.allow_fallback=true")
        cfg = load(args.config, overrides)
        sizes = [getattr(cfg.mesh, a) for a in MESH_AXES]
        n = args.devices or (math.prod(sizes) if -1 not in sizes else 8)
        use_cpu_devices(n)
        devices = jax.devices("cpu")
        if len(devices) < n:
            raise ConfigError(f"--devices: {n} CPU devices requested but this process has {len(devices)}")
        print(explain(cfg, devices[:n]))
    except (ConfigError, ShardingError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
