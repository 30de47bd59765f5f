"""``python -m jaxtrain.export``: Hugging Face safetensors out of a run, or into a new one.

    python -m jaxtrain.export RUN_DIR [--step N] [--max-shard-size 5GB] --format safetensors OUT_DIR
    python -m jaxtrain.export --import HF_DIR [--config FILE] [key=value ...]
    python -m jaxtrain.export RUN_DIR --register NAME [--alias candidate] [--ready-timeout-s 300]   # MLflow

See ``jaxtrain.interop.hf`` and ``jaxtrain.interop.registry``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from jaxtrain.cli.common import cli, prog, start_backend


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=prog("jaxtrain.export"),
                                     description="Hugging Face safetensors out of a run, or into a new run.")
    parser.add_argument("--import", dest="import_dir", help="HF_DIR to import into run.dir (from the config)")
    parser.add_argument("--config", help="with --import: YAML config or a name in configs/")
    parser.add_argument("--step", type=int, help="checkpoint step to export (default: latest committed)")
    parser.add_argument("--format", default="safetensors", choices=["safetensors"])
    parser.add_argument("--max-shard-size", help="export: weights above this size are written as HF shards "
                                                 "(model-00001-of-0000N.safetensors + index); bytes or e.g. "
                                                 "5GB, 500MB, 2GiB (default 5GB)")
    parser.add_argument("--register", metavar="NAME", help="register the export as a new version of this MLflow "
                                                           "model (OUT_DIR is then optional)")
    parser.add_argument("--alias", help="with --register: point this alias (e.g. candidate) at the new version")
    parser.add_argument("--tracking-uri", help="with --register: the MLflow server (default: the run's "
                                               "metrics.mlflow_tracking_uri, else $MLFLOW_TRACKING_URI)")
    parser.add_argument("--ready-timeout-s", type=float, default=None,
                        help="with --register: seconds to wait for the new version to be READY before failing "
                             "(exit 1, alias not moved; default 300)")
    parser.add_argument("args", nargs="*", help="RUN_DIR OUT_DIR (export) or key=value overrides (--import)")
    a = parser.parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    if not a.import_dir and not (len(a.args) == 2 or (a.register and len(a.args) == 1)):
        parser.error("export needs RUN_DIR and OUT_DIR (or RUN_DIR --register NAME)")
    if a.alias and not a.register:
        parser.error("--alias goes with --register")
    if a.ready_timeout_s is not None and (not a.register or a.ready_timeout_s < 0):
        parser.error("--ready-timeout-s goes with --register and is >= 0")
    if a.max_shard_size is not None and (a.import_dir or len(a.args) != 2):
        parser.error("--max-shard-size goes with an export to OUT_DIR")

    def body() -> None:
        start_backend()
        from jaxtrain.interop import hf
        if a.import_dir:
            cfg, notes = hf.import_config(Path(a.import_dir), a.config, a.args)
            run_dir = hf.import_hf(Path(a.import_dir), cfg, notes=notes)  # adds the tensors' notes
            for note in notes:  # a warning (a stored value not read) is printed as one
                print(note if note.startswith("warning: ") else f"note: {note}", file=sys.stderr)
            print(f"imported {a.import_dir} into {run_dir} (step 0)")
            return
        if len(a.args) == 2:
            out = hf.export(Path(a.args[0]), Path(a.args[1]), a.step,
                            a.max_shard_size or hf.DEFAULT_MAX_SHARD_SIZE)
            if (out / hf.INDEX_FILE).is_file():
                index = json.loads((out / hf.INDEX_FILE).read_text())
                shards = len(set(index["weight_map"].values()))
                print(f"wrote {shards} shards, {out / hf.INDEX_FILE} and {out / hf.CONFIG_FILE}")
            else:
                print(f"wrote {out / hf.WEIGHTS_FILE} and {out / hf.CONFIG_FILE}")
        if a.register:
            from jaxtrain.interop.registry import READY_TIMEOUT_S, register
            timeout = READY_TIMEOUT_S if a.ready_timeout_s is None else a.ready_timeout_s
            v = register(Path(a.args[0]), a.register, a.alias, a.step, a.tracking_uri, timeout)
            alias = f", alias '{a.alias}'" if a.alias else ""
            print(f"registered {a.register} version {v.version} (step {v.tags['jaxtrain.step']}{alias})")
            files = json.loads(v.tags["jaxtrain.files_sha256"])
            print(f"READY; sha256 of its {len(files)} files read back from the registry match the export")
    return cli(body)


if __name__ == "__main__":
    sys.exit(main())
