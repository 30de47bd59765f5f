"""``python -m jaxtrain.explain --config X [--devices N] [key=value ...]``: one mesh + rule set in detail.

See ``jaxtrain.analysis.explain`` for what the report holds.
"""
from __future__ import annotations

import argparse
import math
import sys
from typing import Optional, Sequence

from jaxtrain.cli.common import add_config_args, cli, config_args, enable_compilation_cache, prog, use_cpu_devices


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
    from jaxtrain.analysis.explain import explain
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
    enable_compilation_cache()
    import jax
    devices = jax.devices("cpu")
    if len(devices) < n:
        raise ConfigError(f"--devices: {n} CPU devices requested but this process has {len(devices)}")
    print(explain(cfg, devices[:n], budget=budget))
    return 0


if __name__ == "__main__":
    sys.exit(main())
