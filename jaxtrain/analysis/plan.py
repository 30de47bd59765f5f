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

With ``--device-memory`` the command line also picks, per mesh, the cheapest (``model.remat``,
``offload.*``) layout that fits, estimated from shapes and confirmed by compiling it
(``jaxtrain.analysis.layouts``); every other layout is listed with why it lost.

Every candidate goes through the same run setup as training (``jaxtrain.train.assembly``).
The command line (:func:`main`) forces the CPU platform and N host devices before
JAX starts its backend (importing jax does not start it; the first device query does).
"""
from __future__ import annotations

import argparse
import math
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import jax

from jaxtrain.analysis import collectives
from jaxtrain.analysis.layouts import Choice, choose_layout, layouts_text
from jaxtrain.cli.common import add_config_args, cli, config_args, enable_compilation_cache, prog, use_cpu_devices
from jaxtrain.config import MESH_AXES, Config
from jaxtrain.errors import ConfigError, ShardingError
from jaxtrain.metrics import memory
from jaxtrain.parallel.pipeline import schedule_of
from jaxtrain.parallel.rules import Rules
from jaxtrain.parallel.rules import rule_sets as shipped_rule_sets
from jaxtrain.train.assembly import setup, vocab_for
from jaxtrain.train.lm import family_of


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
    bubble: float = 0.0  # the pipeline's idle fraction per stage (0 without one)
    est_step_s: Optional[float] = None  # the cost model's step time (--nodes given), see cost()
    cfg: Optional[Config] = None  # the config with this mesh and rule set
    layout: Optional[Choice] = None  # the cheapest layout that fits (choose_layout), None: none fits
    layouts: list = field(default_factory=list)  # every Choice weighed (choose_layout)

    def __post_init__(self):  # axes left out are 1 (e.g. a five-axis mesh written before stage existed)
        unknown = sorted(set(self.mesh) - set(MESH_AXES))
        if unknown:
            raise ValueError(f"Candidate mesh: unknown axes {unknown} (known: {', '.join(MESH_AXES)})")
        self.mesh = {a: self.mesh.get(a, 1) for a in MESH_AXES}

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
    sharding = cfg.sharding.model_copy(update={"rules": cand.rules, "allow_fallback": allow_fallback})
    cfg = cfg.model_copy(update={"mesh": cfg.mesh.model_copy(update=cand.mesh), "sharding": sharding})
    try:
        s = setup(cfg, devices, vocab=vocab)
    except (ConfigError, ShardingError) as err:
        cand.status, cand.reason = "rejected", str(err)
        return cand
    key = (cand.mesh_str, tuple(_strip(x.spec, s.mesh) for x in jax.tree_util.tree_leaves(
        s.fns.state_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))))
    if key in seen:
        cand.status, cand.reason = "duplicate", f"same shardings as {seen[key]}"
        return cand
    seen[key] = f"{cand.rules} {cand.mesh_str}"
    t0 = time.perf_counter()
    try:
        compiled, abstract = s.compile_abstract()
    except ShardingError as err:
        cand.status, cand.reason = "rejected", str(err)
        return cand
    cand.compile_s = time.perf_counter() - t0
    cand.memory = memory.state_report(abstract, s.fns.state_shardings, compiled)
    cand.collectives = collectives.totals(collectives.parse(compiled.as_text()))
    cand.status = "compiled"
    if cand.mesh["stage"] > 1:
        cand.bubble = schedule_of(cfg, cand.mesh["stage"]).bubble
    if s.rules.fallbacks:
        cand.reason = f"replicated {len(s.rules.fallbacks)} indivisible dims (allow_fallback)"
    if budget is not None:
        cand.fits = cand.memory.compiled["device_peak"] <= budget
    cand.cfg = cfg
    return cand


def rank(cands: list[Candidate]) -> list[Candidate]:
    """Within the memory budget first (as configured, or with a layout that fits); then the layout's extra
    seconds; then the cost model's step time when there is one (``--nodes``), else the fewest collective
    bytes; then the lowest peak."""
    done = [c for c in cands if c.status == "compiled"]
    return sorted(done, key=lambda c: (c.fits is False and c.layout is None, c.layout.seconds if c.layout else 0.0,
                                       c.est_step_s if c.est_step_s is not None else 0.0,
                                       c.comm_bytes, c.memory.compiled["device_peak"]))


@dataclass(frozen=True)
class Links:
    """The cost model's machine: ``nodes`` nodes, links within and across them (bytes/s), and the
    per-device compute (FLOP/s). The mesh's outermost axes (``stage``, then ``data``, ``fsdp``, ...:
    ``jaxtrain.parallel.mesh.build_mesh``'s order) are the ones that span nodes."""

    nodes: int
    intra_bps: float
    inter_bps: float
    device_flops: float


# The collectives each axis issues: its bytes go over the links that axis crosses.
AXIS_KINDS = {"stage": ("collective-permute",), "data": ("all-reduce", "reduce-scatter", "all-gather"),
              "fsdp": ("all-reduce", "reduce-scatter", "all-gather"), "expert": ("all-to-all",)}
LAYOUT = ("stage", "data", "fsdp", "tensor", "sequence", "expert")


def cost(cand: Candidate, links: Links, flops_per_step: float) -> float:
    """Seconds per step: compute / (1 - bubble) + each collective kind's bytes over its link (the
    slow one when an axis issuing that kind spans nodes). A model for ranking, not a prediction."""
    n = math.prod(cand.mesh.values())
    across, covered = set(), 1
    for axis in LAYOUT:
        if covered >= links.nodes:
            break
        if cand.mesh[axis] > 1:
            across.add(axis)
            covered *= cand.mesh[axis]
    slow = {k for a in across for k in AXIS_KINDS.get(a, ())}
    comm = sum(b / (links.inter_bps if k in slow else links.intra_bps) for k, b in cand.collectives.items())
    return flops_per_step / (n * links.device_flops) / (1 - cand.bubble) + comm


def table(cands: list[Candidate], budget: Optional[int]) -> str:
    """The ranked table as fixed-width text (bytes in binary units, per device)."""
    short = {"all-gather": "all-gather", "reduce-scatter": "reduce-scat", "all-reduce": "all-reduce",
             "all-to-all": "all-to-all", "collective-permute": "coll-perm"}
    head = ["#", "rules", "mesh d,f,t,s,e,p", "peak", "params", "optimizer",
            *[short[k] for k in collectives.KINDS], "bubble", "est. step", "compile s"]
    rows = []
    for i, c in enumerate(rank(cands), 1):
        m = c.memory
        mark = " OVER" if c.fits is False else ""
        fmt = memory.fmt_bytes
        est = f"{c.est_step_s * 1e3:.3g} ms" if c.est_step_s is not None else "-"
        rows.append([str(i), c.rules, c.mesh_str, fmt(m.compiled["device_peak"]) + mark, fmt(m.params),
                     fmt(m.opt_state),
                     *[fmt(c.collectives[k]) for k in collectives.KINDS], f"{100 * c.bubble:.0f}%", est,
                     f"{c.compile_s:.1f}"])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "  ".join(x.rjust(w) if i not in (1, 2) else x.ljust(w)  # noqa: E731
                               for i, (x, w) in enumerate(zip(r, widths)))
    out = [line(head), line(["-" * w for w in widths]), *map(line, rows)]
    hosts = [f"#{i} {memory.fmt_bytes(c.memory.host)}" for i, c in enumerate(rank(cands), 1) if c.memory.host]
    if hosts:  # the state offload: keeps in host memory (peak, params and optimizer above are device bytes)
        out.append(f"host memory per device (offload): {', '.join(hosts)}")
    if budget is not None:
        out.append(f"OVER: peak above --device-memory {memory.fmt_bytes(budget)}")
    return "\n".join(out)


def plan(cfg: Config, n_devices: int, rule_sets: Optional[Sequence[str]] = None, budget: Optional[int] = None,
         vocab: Optional[int] = None, allow_fallback: bool = False, log=None,
         links: Optional[Links] = None, layouts: bool = False, device_flops: float = 400e12,
         host_bps: float = 50e9) -> list[Candidate]:
    """Evaluates every candidate on the first ``n_devices`` CPU devices; returns all of them.

    ``rule_sets`` defaults to every shipped one (``sharding_rules/*.yaml``). ``layouts`` (with a
    ``budget``): also :func:`choose_layout` for every compiled candidate, at ``device_flops`` FLOP/s and
    ``host_bps`` bytes/s between host and device memory.

    Raises:
      ConfigError: fewer than ``n_devices`` CPU devices, a family that cannot be built from the
        config (``custom``, unknown), or a vocabulary that cannot be known.
    """
    family_of(cfg)  # one error for the config, not the same rejection for every candidate
    devices = jax.devices("cpu")
    if len(devices) < n_devices:
        raise ConfigError(f"--devices: {n_devices} CPU devices requested but this process has {len(devices)} "
                          f"(run python -m jaxtrain.plan in a fresh process)")
    vocab = vocab or vocab_for(cfg)
    seen: dict = {}
    cands = enumerate_candidates(n_devices, rule_sets or shipped_rule_sets())
    for c in cands:
        evaluate(c, cfg, vocab, devices[:n_devices], seen, budget, allow_fallback)
        if log and c.status == "compiled":
            log(f"compiled {c.rules:8s} {c.mesh_str} in {c.compile_s:.1f} s")
        if layouts and budget is not None and c.status == "compiled":
            choose_layout(c, vocab, devices[:n_devices], budget, device_flops, host_bps)
    if links is not None:
        fam = family_of(cfg)
        model_cfg = cfg.model.model_copy(update={"vocab_size": vocab})
        flops_per_step = fam.flops_per_token(model_cfg, cfg.data.seq_len) * cfg.data.seq_len * cfg.train.global_batch
        for c in cands:
            if c.status == "compiled":
                c.est_step_s = cost(c, links, flops_per_step)
    return cands


def parse_bytes(text: str) -> int:
    """'80GiB' / '80G' / '8.5e10' -> bytes (K, M, G, T are binary: 1024-based)."""
    m = re.fullmatch(r"\s*([\d.eE+]+)\s*([KMGT]?)(i?B)?\s*", text)
    try:  # the pattern lets through '1.5.5', '1e', '.', '+' and overflowing exponents
        number = float(m.group(1)) if m else math.nan
        value = number * 1024 ** " KMGT".index(m.group(2) or " ") if m else math.nan
    except (ValueError, OverflowError):
        value = math.nan
    if not (math.isfinite(value) and value >= 1):
        raise ConfigError(f"--device-memory: cannot read '{text}' as a number of bytes >= 1 (examples: 80GiB, 16G, "
                          f"1e9)")
    return int(value)



def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=prog("jaxtrain.plan"),
                                     description="Rank mesh shapes x rule sets for a config by AOT-compiling "
                                                 "the train step.")
    parser.add_argument("--devices", type=int, default=None, help="number of devices to plan for")
    parser.add_argument("--rules", help="comma-separated rule sets (default: every one in sharding_rules/)")
    parser.add_argument("--device-memory", help="per-device budget, e.g. 80GiB; candidates above are marked OVER")
    parser.add_argument("--allow-fallback", action="store_true",
                        help="replicate indivisible dims (reported) instead of rejecting the candidate")
    parser.add_argument("--nodes", type=int, default=None,
                        help="rank by a cost model of this many nodes (the mesh's outer axes span them)")
    parser.add_argument("--intra-node-gbps", type=float, default=450.0, help="GB/s within a node (NVLink-class)")
    parser.add_argument("--inter-node-gbps", type=float, default=25.0, help="GB/s between nodes (200 Gb/s NIC)")
    parser.add_argument("--device-tflops", type=float, default=400.0, help="per-device compute, TFLOP/s")
    parser.add_argument("--host-gbps", type=float, default=50.0,
                        help="GB/s between a device and host memory, for --device-memory's layouts (PCIe 5 x16-class)")
    add_config_args(parser)
    args = config_args(parser, sys.argv[1:] if argv is None else argv)
    return cli(lambda: _plan(args))


def _plan(args: argparse.Namespace) -> int:
    from jaxtrain.config import load
    from jaxtrain.errors import ConfigError
    if not args.devices or args.devices < 1:
        raise ConfigError("--devices: give the number of devices to plan for, e.g. --devices 8")
    budget = parse_bytes(args.device_memory) if args.device_memory is not None else None
    rule_sets = None
    if args.rules is not None:
        rule_sets = list(dict.fromkeys(r.strip() for r in args.rules.split(",") if r.strip()))  # once each
        if not rule_sets:
            raise ConfigError("--rules: no rule set named (e.g. --rules dp,fsdp)")
    for flag in ("intra_node_gbps", "inter_node_gbps", "device_tflops", "host_gbps"):  # the cost model divides by them
        value = getattr(args, flag)
        if not math.isfinite(value) or value <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')}: a rate must be a positive number, got {value}")
    cfg = load(args.config, args.overrides)
    use_cpu_devices(args.devices)
    enable_compilation_cache()  # on over CPU devices too: a plan compiles and never runs what it compiled
    t0 = time.perf_counter()
    links = None
    if args.nodes is not None:
        if args.nodes < 1 or args.devices % args.nodes:
            raise ConfigError(f"--nodes: {args.nodes} nodes do not split --devices {args.devices} evenly")
        links = Links(args.nodes, args.intra_node_gbps * 1e9, args.inter_node_gbps * 1e9, args.device_tflops * 1e12)
    cands = plan(cfg, args.devices, rule_sets, budget, allow_fallback=args.allow_fallback,
                 log=lambda s: print(s, file=sys.stderr, flush=True), links=links, layouts=budget is not None,
                 device_flops=args.device_tflops * 1e12, host_bps=args.host_gbps * 1e9)
    print(f"plan: {args.devices} devices, {len(cands)} candidates, "
          f"{sum(c.status == 'compiled' for c in cands)} compiled in {time.perf_counter() - t0:.0f} s "
          f"(bytes per device; collectives: bytes per step)\n")
    print(table(cands, budget))
    if budget is not None and any(c.layouts for c in cands):
        print("\n" + layouts_text(rank(cands), budget))
    others = [c for c in cands if c.status != "compiled"]
    if others:
        print("\nnot compiled:")
        for c in others:
            print(f"  {c.rules:8s} {c.mesh_str}  {c.status}: {c.reason}")
    compiled = [c for c in cands if c.status == "compiled"]
    if not compiled:  # nothing to rank: the config cannot run on any of them
        sys.stdout.flush()
        raise ConfigError(f"plan: no candidate compiled on {args.devices} devices; each one's reason is above")
    if budget is not None:  # the verdict `plan ... && train` can act on
        fitting = [c for c in compiled if c.fits or c.layout is not None]
        print(f"\nverdict: {len(fitting)} of {len(compiled)} compiled candidates fit --device-memory "
              f"{args.device_memory}" + (f" (best: {rank(fitting)[0].rules} {rank(fitting)[0].mesh_str})" if fitting
                                         else ""))
        if not fitting:
            sys.stdout.flush()
            raise ConfigError(f"--device-memory: no candidate fits {args.device_memory} per device on {args.devices} "
                              f"devices, as configured or with a remat or offload layout; see OVER above")
    return 0


if __name__ == "__main__":
    sys.exit(main())
