"""``python -m jaxtrain.plan --config X --devices N``: rank meshes x rule sets by compiling them.

For every rule set and every factorization of N devices over the mesh axes that rule set
shards over (the axes its rules name, plus ``data``; other axes stay 1), the planner
  1. checks the config against the mesh (batch and heads divisibility: ConfigError),
  2. resolves every parameter and optimizer-state sharding (ShardingError),
  3. traces the train step on abstract inputs (activation shardings: ShardingError),
  4. AOT-compiles it for N simulated CPU devices: ``jax.jit(step).lower(ShapeDtypeStructs
     with shardings).compile()``. Nothing is allocated or trained.
A candidate whose parameter and optimizer shardings equal an earlier one's (ignoring mesh
axes of size 1) is the same program and is skipped. Each compiled candidate reports per-
device peak, parameter and optimizer bytes (jaxtrain.memory) and bytes per step for each
collective kind (jaxtrain.collectives). Rows are ranked: within the ``--device-memory``
budget first, then fewest collective bytes per step, then lowest peak.

The CLI forces the CPU platform and N host devices before JAX starts its backend (importing
jax does not start it; the first device query does).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import jax

from jaxtrain import collectives, memory, step as steplib
from jaxtrain.config import MESH_AXES, Config, ConfigError, check_against_mesh, load
from jaxtrain.mesh import build_mesh
from jaxtrain.partitioning import Rules, ShardingError
from jaxtrain.tokenizer import DataError

RULE_SETS = ("dp", "zero1", "fsdp", "tp", "fsdp_tp", "sp", "ep")


@dataclass
class Candidate:
    """One (rule set, mesh) pair and what the planner found out about it."""

    rules: str
    mesh: dict[str, int]
    status: str = "pending"  # compiled | rejected | duplicate
    reason: str = ""  # why rejected / which candidate it duplicates
    memory: object = None  # jaxtrain.memory.MemoryReport
    collectives: dict[str, int] = field(default_factory=dict)  # kind -> bytes per device per step
    compile_s: float = 0.0
    fits: Optional[bool] = None  # peak <= --device-memory (None: no budget given)

    @property
    def mesh_str(self) -> str:
        return ",".join(str(self.mesh[a]) for a in MESH_AXES)

    @property
    def comm_bytes(self) -> int:
        return sum(self.collectives.values())


def factorizations(n: int, k: int = len(MESH_AXES)) -> list[tuple[int, ...]]:
    """Ordered k-tuples of positive integers whose product is n: 8, k=2 -> (1,8), (2,4), (4,2), (8,1)."""
    if k == 1:
        return [(n,)]
    return [(d, *rest) for d in range(1, n + 1) if n % d == 0 for rest in factorizations(n // d, k - 1)]


def enumerate_candidates(n: int, rule_sets: Sequence[str]) -> list[Candidate]:
    """Every rule set crossed with the factorizations of n over the axes it uses."""
    out = []
    for name in rule_sets:
        axes = Rules.load(name).mesh_axes() | {"data"}
        free = [a for a in MESH_AXES if a in axes]
        for sizes in factorizations(n, len(free)):
            mesh = dict.fromkeys(MESH_AXES, 1)
            mesh.update(zip(free, sizes))
            out.append(Candidate(name, mesh))
    return out


def _strip(spec, mesh) -> tuple:
    """A PartitionSpec without the mesh axes of size 1 (they do not split anything)."""
    out = []
    for entry in spec:
        axes = entry if isinstance(entry, tuple) else (entry,) if entry else ()
        out.append(tuple(a for a in axes if mesh.shape[a] > 1))
    while out and not out[-1]:
        out.pop()
    return tuple(out)


def evaluate(cand: Candidate, cfg: Config, vocab: int, devices, seen: dict, budget: Optional[int],
             allow_fallback: bool = False) -> Candidate:
    """Runs steps 1-4 of the module docstring for one candidate, filling in its fields."""
    cfg = cfg.model_copy(update={"mesh": cfg.mesh.model_copy(update=cand.mesh)})
    try:
        check_against_mesh(cfg, cand.mesh)
        rules = Rules.load(cand.rules, allow_fallback)
        mesh = build_mesh(cfg.mesh, devices)
        trainer = steplib.build(cfg, mesh, rules, vocab)
    except (ConfigError, ShardingError) as err:
        cand.status, cand.reason = "rejected", str(err)
        return cand
    key = (cand.mesh_str, tuple(_strip(s.spec, mesh) for s in jax.tree_util.tree_leaves(
        trainer.state_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))))
    if key in seen:
        cand.status, cand.reason = "duplicate", f"same shardings as {seen[key]}"
        return cand
    seen[key] = f"{cand.rules} {cand.mesh_str}"
    abstract = jax.eval_shape(trainer.init)
    batch = jax.ShapeDtypeStruct((cfg.train.grad_accum, cfg.micro_batch, cfg.data.seq_len + 1), jax.numpy.int32,
                                 sharding=trainer.batch_sharding)
    t0 = time.perf_counter()
    try:
        compiled = trainer.train_step.lower(abstract, batch).compile()
    except ShardingError as err:
        cand.status, cand.reason = "rejected", str(err)
        return cand
    cand.compile_s = time.perf_counter() - t0
    cand.memory = memory.state_report(abstract, trainer.state_shardings, compiled)
    cand.collectives = collectives.totals(collectives.parse(compiled.as_text()))
    cand.status = "compiled"
    if rules.fallbacks:
        cand.reason = f"replicated {len(rules.fallbacks)} indivisible dims (allow_fallback)"
    if budget is not None:
        cand.fits = cand.memory.compiled["peak"] <= budget
    return cand


def rank(cands: list[Candidate]) -> list[Candidate]:
    done = [c for c in cands if c.status == "compiled"]
    return sorted(done, key=lambda c: (c.fits is False, c.comm_bytes, c.memory.compiled["peak"]))


def table(cands: list[Candidate], budget: Optional[int]) -> str:
    """The ranked table as fixed-width text (bytes in binary units, per device)."""
    short = {"all-gather": "all-gather", "reduce-scatter": "reduce-scat", "all-reduce": "all-reduce",
             "all-to-all": "all-to-all", "collective-permute": "coll-perm"}
    head = ["#", "rules", "mesh d,f,t,s,e", "peak", "params", "optimizer",
            *[short[k] for k in collectives.KINDS], "compile s"]
    rows = []
    for i, c in enumerate(rank(cands), 1):
        m = c.memory
        mark = " OVER" if c.fits is False else ""
        fmt = memory.fmt_bytes
        rows.append([str(i), c.rules, c.mesh_str, fmt(m.compiled["peak"]) + mark, fmt(m.params), fmt(m.opt_state),
                     *[fmt(c.collectives[k]) for k in collectives.KINDS], f"{c.compile_s:.1f}"])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "  ".join(x.rjust(w) if i not in (1, 2) else x.ljust(w)  # noqa: E731
                               for i, (x, w) in enumerate(zip(r, widths)))
    out = [line(head), line(["-" * w for w in widths]), *map(line, rows)]
    if budget is not None:
        out.append(f"OVER: peak above --device-memory {memory.fmt_bytes(budget)}")
    return "\n".join(out)


def plan(cfg: Config, n_devices: int, rule_sets: Sequence[str] = RULE_SETS, budget: Optional[int] = None,
         vocab: Optional[int] = None, allow_fallback: bool = False, log=None) -> list[Candidate]:
    """Evaluates every candidate on the first ``n_devices`` CPU devices; returns all of them.

    Raises:
      ConfigError: fewer than ``n_devices`` CPU devices, or the vocabulary cannot be known.
    """
    devices = jax.devices("cpu")
    if len(devices) < n_devices:
        raise ConfigError(f"--devices: {n_devices} CPU devices requested but this process has {len(devices)} "
                          f"(run python -m jaxtrain.plan in a fresh process)")
    vocab = vocab or model_vocab(cfg)
    seen: dict = {}
    cands = enumerate_candidates(n_devices, rule_sets)
    for c in cands:
        evaluate(c, cfg, vocab, devices[:n_devices], seen, budget, allow_fallback)
        if log and c.status == "compiled":
            log(f"compiled {c.rules:8s} {c.mesh_str} in {c.compile_s:.1f} s")
    return cands


def model_vocab(cfg: Config) -> int:
    """model.vocab_size, or the tokenizer's (char vocabularies are read from data.path)."""
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    from jaxtrain import data as datalib
    return datalib.load_corpus(cfg).tokenizer.vocab_size


def parse_bytes(text: str) -> int:
    """'80GiB' / '80G' / '8.5e10' -> bytes (K, M, G, T are binary: 1024-based)."""
    m = re.fullmatch(r"\s*([\d.eE+]+)\s*([KMGT]?)(i?B)?\s*", text)
    if not m:
        raise ConfigError(f"--device-memory: cannot read '{text}' (examples: 80GiB, 16G, 1e9)")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2) or " "))


def use_cpu_devices(n: int) -> None:
    """Asks for n simulated CPU devices; effective only before JAX initialises its backends."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    jax.config.update("jax_platforms", "cpu")


def cli_args(prog: str, argv: Sequence[str], description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", help="YAML config or a name in configs/ (default: built-in job)")
    parser.add_argument("--devices", type=int, default=None, help="number of devices to plan for")
    parser.add_argument("--rules", help="comma-separated rule sets (default: all shipped ones)")
    parser.add_argument("--device-memory", help="per-device budget, e.g. 80GiB; candidates above are marked")
    parser.add_argument("--allow-fallback", action="store_true",
                        help="replicate indivisible dims (reported) instead of rejecting the candidate")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides (a leading FILE.yaml is the config)")
    args = parser.parse_args(argv)
    if args.overrides and "=" not in args.overrides[0] and args.overrides[0].endswith((".yaml", ".yml")):
        args.config = args.config or args.overrides.pop(0)
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = cli_args("python -m jaxtrain.plan", sys.argv[1:] if argv is None else argv,
                    "Rank mesh shapes x rule sets for a config by AOT-compiling the train step.")
    try:
        if not args.devices or args.devices < 1:
            raise ConfigError("--devices: give the number of devices to plan for, e.g. --devices 8")
        budget = parse_bytes(args.device_memory) if args.device_memory else None
        rule_sets = args.rules.split(",") if args.rules else RULE_SETS
        cfg = load(args.config, args.overrides)
        use_cpu_devices(args.devices)
        from jaxtrain.train import enable_compilation_cache  # the persistent XLA cache

        enable_compilation_cache()
        t0 = time.perf_counter()
        cands = plan(cfg, args.devices, rule_sets, budget, allow_fallback=args.allow_fallback,
                     log=lambda s: print(s, file=sys.stderr, flush=True))
    except (ConfigError, ShardingError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"plan: {args.devices} devices, {len(cands)} candidates, "
          f"{sum(c.status == 'compiled' for c in cands)} compiled in {time.perf_counter() - t0:.0f} s "
          f"(bytes per device; collectives: bytes per step)\n")
    print(table(cands, budget))
    others = [c for c in cands if c.status != "compiled"]
    if others:
        print("\nnot compiled:")
        for c in others:
            print(f"  {c.rules:8s} {c.mesh_str}  {c.status}: {c.reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
