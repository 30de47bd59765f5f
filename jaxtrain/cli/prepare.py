"""``python -m jaxtrain.data.prepare [--config FILE] [key=value ...] --out DIR`` (``jaxtrain-prepare``):
tokenize ``data.path`` once into a token cache (:mod:`jaxtrain.data.prepare`)."""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from jaxtrain.cli.common import cli, prog
from jaxtrain.data.prepare import check_out, prepare


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=prog("jaxtrain.data.prepare"),
                                     description="Tokenize data.path once into an ArrayRecord token cache.")
    parser.add_argument("--config", help="YAML config file or a name in configs/ (its data section is used)")
    parser.add_argument("--out", required=True, help="output directory (local, gs:// or s3://)")
    parser.add_argument("--docs-per-shard", type=int, default=100_000)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. data.path=corpus/*.jsonl")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    def body() -> None:
        from jaxtrain.config import load
        from jaxtrain.config.paths import REMOTE, normalize
        out = normalize("--out", args.out, REMOTE)
        check_out(out)  # before any tokenizing
        # The mode does not matter to a cache; packed lets BOS/EOS options validate.
        cfg = load(args.config, ["data.mode=packed", *args.overrides])
        meta = prepare(cfg, out, args.docs_per_shard, not args.no_progress)
        rate = meta["tokens"] / max(meta["seconds"], 1e-9)
        skipped = meta["stats"]["skipped_empty"] + meta["stats"]["skipped_short"]
        print(f"wrote {args.out}: {meta['documents']} documents, {meta['tokens']} tokens in "
              f"{len(meta['shards'])} shard(s), {rate:,.0f} tokens/s; skipped {skipped}, invalid UTF-8 replaced "
              f"in {meta['stats']['invalid_utf8']}")
    return cli(body)
