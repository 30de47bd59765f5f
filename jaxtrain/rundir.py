"""A run directory that describes itself: resolved config, package versions, metrics."""
from __future__ import annotations

import json
import platform
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from jaxtrain.config import Config, ConfigError

PACKAGES = ("jaxtrain", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "tensorstore",
            "numpy", "pydantic")


def prepare(cfg: Config) -> Path:
    """Creates ``run.dir`` and writes ``config.yaml`` and ``versions.json``.

    Raises:
      ConfigError: ``run.dir`` exists and is a file, or cannot be created.
    """
    run_dir = Path(cfg.run.dir).expanduser()
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run.dir: '{run_dir}' exists and is not a directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"run.dir: cannot create '{run_dir}': {err.strerror}") from None
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    versions = {"python": sys.version.split()[0], "platform": platform.platform()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    (run_dir / "versions.json").write_text(json.dumps(versions, indent=2) + "\n")
    return run_dir


class MetricsWriter:
    """Appends one JSON object per line to ``RUN_DIR/metrics.jsonl`` (flushed per row)."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a")

    def write(self, row: dict[str, Any]) -> None:
        row = {"time": round(time.time(), 3), **{k: _plain(v) for k, v in row.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float):
        return round(value, 6) if abs(value) >= 1e-3 else float(f"{value:.6g}")
    return value


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
