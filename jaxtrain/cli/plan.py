"""``python -m jaxtrain.plan --config X --devices N``: rank meshes x rule sets by compiling them.

See ``jaxtrain.analysis.plan`` for what is compared and how the table is ranked.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Optional, Sequence

from jaxtrain.cli.common import add_config_args, cli, config_args, enable_compilation_cache, prog, use_cpu_devices


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=prog("jaxtrain.plan"),
                                     description="Rank mesh shapes x rule sets for a config by AOT-compiling "
                                                 "the train step.")
    parser.add_argument("--devices", type=int, default=None, help="number of devices to plan for")
    parser.add_argument("--rules", help="comma-separated rule sets (default: every one in sharding_rules/)")
    parser.add_argument("--device-memory", help="per-device budget, e.g. 80GiB; candidates above are marked OVER")
    parser.add_argument("--allow-fallback", action="store_true",
                        help="replicate indivisible dims (reported) instead of rejecting the candidate")
    add_config_args(parser)
    args = config_args(parser, sys.argv[1:] if argv is None else argv)
    return cli(lambda: _plan(args))


def _plan(args: argparse.Namespace) -> int:
    from jaxtrain.analysis import plan
    from jaxtrain.config import load
    from jaxtrain.errors import ConfigError
    if not args.devices or args.devices < 1:
        raise ConfigError("--devices: give the number of devices to plan for, e.g. --devices 8")
    budget = plan.parse_bytes(args.device_memory) if args.device_memory else None
    rule_sets = None
    if args.rules is not None:
        rule_sets = list(dict.fromkeys(r.strip() for r in args.rules.split(",") if r.strip()))  # once each
        if not rule_sets:
            raise ConfigError("--rules: no rule set named (e.g. --rules dp,fsdp)")
    cfg = load(args.config, args.overrides)
    use_cpu_devices(args.devices)
    enable_compilation_cache()
    t0 = time.perf_counter()
    cands = plan.plan(cfg, args.devices, rule_sets, budget, allow_fallback=args.allow_fallback,
                      log=lambda s: print(s, file=sys.stderr, flush=True))
    print(f"plan: {args.devices} devices, {len(cands)} candidates, "
          f"{sum(c.status == 'compiled' for c in cands)} compiled in {time.perf_counter() - t0:.0f} s "
          f"(bytes per device; collectives: bytes per step)\n")
    print(plan.table(cands, budget))
    others = [c for c in cands if c.status != "compiled"]
    if others:
        print("\nnot compiled:")
        for c in others:
            print(f"  {c.rules:8s} {c.mesh_str}  {c.status}: {c.reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
