"""``python -m jaxtrain.export``: Hugging Face safetensors out of a run, or into a new one.

    python -m jaxtrain.export RUN_DIR [--step N] --format safetensors OUT_DIR
    python -m jaxtrain.export --import HF_DIR [--config FILE] [key=value ...]

See ``jaxtrain.train.hf``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from jaxtrain.cli.common import cli, prog


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=prog("jaxtrain.export"),
                                     description="Hugging Face safetensors out of a run, or into a new run.")
    parser.add_argument("--import", dest="import_dir", help="HF_DIR to import into run.dir (from the config)")
    parser.add_argument("--config", help="with --import: YAML config or a name in configs/")
    parser.add_argument("--step", type=int, help="checkpoint step to export (default: latest committed)")
    parser.add_argument("--format", default="safetensors", choices=["safetensors"])
    parser.add_argument("args", nargs="*", help="RUN_DIR OUT_DIR (export) or key=value overrides (--import)")
    a = parser.parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    if not a.import_dir and len(a.args) != 2:
        parser.error("export needs RUN_DIR and OUT_DIR")

    def body() -> None:
        from jaxtrain.train import hf
        from jaxtrain.config import load
        if a.import_dir:
            run_dir = hf.import_hf(Path(a.import_dir), load(a.config, a.args))
            print(f"imported {a.import_dir} into {run_dir} (step 0)")
        else:
            out = hf.export(Path(a.args[0]), Path(a.args[1]), a.step)
            print(f"wrote {out / hf.WEIGHTS_FILE} and {out / 'config.json'}")
    return cli(body)


if __name__ == "__main__":
    sys.exit(main())
