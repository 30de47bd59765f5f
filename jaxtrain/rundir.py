"""A run directory that describes itself: resolved config, package versions, metrics."""
from __future__ import annotations

import fcntl
import json
import os
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


# Keys whose change makes a checkpoint unloadable (parameter shapes, dtypes, layout).
STATE_KEYS = ("model.vocab_size", "model.d_model", "model.n_layers", "model.n_heads", "model.n_kv_heads",
              "model.d_ff", "model.tie_embeddings", "model.param_dtype", "model.scan_layers")
# Keys whose change on resume is allowed but means the data stream or LR schedule differs.
STREAM_KEYS = ("data.path", "data.tokenizer", "data.mode", "data.seed", "data.seq_len", "train.global_batch",
               "train.seed")


def prepare(cfg: Config, write_config: bool = True) -> Path:
    """Creates ``run.dir`` and writes ``versions.json`` (and ``config.yaml`` unless told not to).

    Raises:
      ConfigError: ``run.dir`` is a file, cannot be created or written, or is a non-empty
        directory that is not a jaxtrain run directory (so a user's files are never overwritten).
    """
    run_dir = Path(cfg.run.dir).expanduser()
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run.dir: '{run_dir}' exists and is not a directory")
    if run_dir.is_dir() and any(run_dir.iterdir()) and not (run_dir / "versions.json").exists():
        raise ConfigError(f"run.dir: '{run_dir}' is not empty and is not a jaxtrain run directory "
                          f"(no versions.json); choose a new or empty directory")
    versions = {"python": sys.version.split()[0], "platform": platform.platform()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "versions.json").write_text(json.dumps(versions, indent=2) + "\n")
    except OSError as err:
        raise ConfigError(f"run.dir: cannot write to '{run_dir}': {err.strerror}") from None
    if write_config:
        write_config_file(cfg, run_dir)
    return run_dir


def write_config_file(cfg: Config, run_dir: Path) -> None:
    """Writes the resolved config as ``config.yaml`` (atomically: a crash leaves the old one)."""
    tmp = run_dir / "config.yaml.tmp"
    tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    os.replace(tmp, run_dir / "config.yaml")


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key != "mixture":
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def resume_changes(cfg: Config, run_dir: Path) -> tuple[list[str], list[str]]:
    """Compares ``cfg`` with the run directory's ``config.yaml`` before a resume.

    Returns:
      (shape_keys, notes): one line per changed key that fixes parameter shapes
      ("model.d_model: checkpoint has 128, config has 64"), used to explain a failed
      restore; and one line per changed data-stream key or LR horizon (allowed, but
      worth saying).

    Raises:
      ConfigError: the saved config.yaml is not valid YAML.
    """
    path = run_dir / "config.yaml"
    if not path.exists():
        return [], []
    try:
        saved = _flat(yaml.safe_load(path.read_text()) or {})
    except yaml.YAMLError as err:
        raise ConfigError(f"run.dir: {path} is not valid YAML: {err}") from None
    new = _flat(cfg.to_dict())
    changed = [k for k in new if k in saved and saved[k] != new[k]]
    shape_keys = [f"{k}: checkpoint has {saved[k]!r}, config has {new[k]!r}" for k in changed if k in STATE_KEYS]
    notes = [f"{k} changed from {saved[k]!r} to {new[k]!r}" for k in changed if k in STREAM_KEYS]
    old_horizon = saved.get("optimizer.decay_steps") or saved.get("train.steps")
    if old_horizon and old_horizon != cfg.decay_steps:
        notes.append(f"the LR schedule now decays over {cfg.decay_steps} steps (was {old_horizon}); "
                     f"set optimizer.decay_steps={old_horizon} to keep the old schedule")
    return shape_keys, notes


class RunLock:
    """An exclusive ``flock`` on ``RUN_DIR/.lock`` so two runs never share a run directory.

    Only process 0 takes it (other hosts of the same run share the directory).
    Raises ConfigError if another process holds it.
    """

    def __init__(self, run_dir: Path, enabled: bool = True):
        self._file = None
        if not enabled:
            return
        self._file = open(run_dir / ".lock", "a+")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "unknown"
            self._file.close()
            raise ConfigError(f"run.dir: '{run_dir}' is in use by another training process (pid {holder})") from None
        self._file.seek(0)
        self._file.truncate()
        self._file.write(str(os.getpid()))
        self._file.flush()

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None


class MetricsWriter:
    """Appends one JSON object per line to ``RUN_DIR/metrics.jsonl`` (flushed per row)."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a")

    def drop_after(self, step: int) -> None:
        """Removes rows past ``step`` (left by a run that died after its last checkpoint), so a
        resumed run's rows are not duplicated. Rewrites the file atomically."""
        self._file.close()
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        keep = [ln for ln in lines if ln.strip() and _step_of(ln) <= step]
        if len(keep) != len(lines):
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(ln + "\n" for ln in keep))
            os.replace(tmp, self.path)
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


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return 0


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
