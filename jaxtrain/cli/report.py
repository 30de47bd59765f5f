"""``python -m jaxtrain.report RUN_DIR [RUN_DIR ...] -o FILE.png``: plots of runs, overlaid.

See ``jaxtrain.analysis.report``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from jaxtrain.cli.common import cli, prog


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=prog("jaxtrain.report"),
                                     description="Loss, learning rate, gradient norm, throughput and MFU of "
                                                 "one or more runs, overlaid, as a PNG.")
    parser.add_argument("run_dirs", nargs="+", help="run directories (each with config.yaml and metrics.jsonl)")
    parser.add_argument("-o", "--out", required=True, help="the PNG to write")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    def body() -> None:
        from jaxtrain.analysis.report import write
        print(f"wrote {write([Path(p) for p in args.run_dirs], Path(args.out))}")
    return cli(body)


if __name__ == "__main__":
    sys.exit(main())
