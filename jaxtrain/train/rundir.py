"""A run directory that describes itself: resolved config, package versions, a lock, resume notes.

Metric rows are written by the sinks (``jaxtrain.metrics.sinks``), checkpoints by
``jaxtrain.checkpoint``.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator, Optional

import yaml

from jaxtrain.config import Config
from jaxtrain.config.loading import yaml_error
from jaxtrain.errors import ConfigError

PACKAGES = ("jaxtrain", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "tensorstore",
            "numpy", "pydantic")

# Keys whose change on resume is allowed but means the data stream or LR schedule differs.
STREAM_KEYS = ("data.path", "data.tokenizer", "data.mode", "data.seed", "data.seq_len", "train.global_batch",
               "train.seed")


@contextlib.contextmanager
def opened(cfg: Config, new: bool = False, lock: bool = True) -> Iterator[Path]:
    """Creates (or reopens) ``run.dir``, locks it (:class:`RunLock`) and only then writes ``versions.json``,
    so a directory in use by another run is never written to. Yields the path; unlocks on exit.

    Args:
      new: the directory must not exist or be empty (an import starts a new run).
      lock: take the lock (process 0 of a multi-process run; the others share the directory).

    Raises:
      ConfigError: ``run.dir`` is a file, cannot be created or written, is in use, is not empty when
        ``new``, or is a non-empty directory that is not a jaxtrain run directory (so a user's files
        are never overwritten).
    """
    from jaxtrain.runtime import heartbeat
    run_dir = Path(cfg.run.dir).expanduser()
    # Many processes: process 0 checks, creates, locks and writes it; an error there is every process's.
    held = heartbeat.primary_first("run_dir", lambda: _open(run_dir, new, lock))
    try:
        yield run_dir
    finally:
        if held is not None:
            held.release()


def _open(run_dir: Path, new: bool, lock: bool) -> "RunLock":
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run.dir: '{run_dir}' exists and is not a directory")
    if run_dir.is_dir() and any(run_dir.iterdir()):
        if new:
            raise ConfigError(f"run.dir: '{run_dir}' is not empty; give a new or empty directory")
        if not (run_dir / "versions.json").exists():
            raise ConfigError(f"run.dir: '{run_dir}' is not empty and is not a jaxtrain run directory "
                              f"(no versions.json); choose a new or empty directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"run.dir: cannot create '{run_dir}': {err.strerror}") from None
    held = RunLock(run_dir, enabled=lock)
    try:
        _write_versions(run_dir)
    except BaseException:
        held.release()
        raise
    return held


def _write_versions(run_dir: Path) -> None:
    versions = {"python": sys.version.split()[0], "platform": platform.platform()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    try:
        (run_dir / "versions.json").write_text(json.dumps(versions, indent=2) + "\n")
    except OSError as err:
        raise ConfigError(f"run.dir: cannot write to '{run_dir}': {err.strerror}") from None


def write_config_file(cfg: Config, run_dir: Path) -> None:
    """Writes the resolved config as ``config.yaml`` (atomically: a crash leaves the old one)."""
    tmp = run_dir / "config.yaml.tmp"
    tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    os.replace(tmp, run_dir / "config.yaml")


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key not in ("mixture", "extra_rules"):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def resume_changes(cfg: Config, run_dir: Path, vocab: Optional[int] = None) -> tuple[list[str], list[str]]:
    """Compares ``cfg`` with the run directory's ``config.yaml`` before a resume.

    A key written two ways that mean the same (``model.vocab_size`` 0, "from the tokenizer", against
    the tokenizer's ``vocab``; ``model.max_positions`` None against ``data.seq_len``, as an HF import
    records them) is not a change.

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
        raise ConfigError(yaml_error(f"run.dir: {path}", err)) from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"run.dir: {path} is not UTF-8 text (byte {err.start}: {err.reason})") from None
    new = _flat(cfg.to_dict())
    same_new, same_saved = _resolved(new, vocab), _resolved(saved, vocab)
    changed = [k for k in new if k in saved and same_saved[k] != same_new[k]]
    if saved.get("model.family", "llama") != cfg.model.family:  # every model key means something else now
        changed.insert(0, "model.family")
        saved.setdefault("model.family", "llama")
    # The model keys that fix parameter shapes, dtypes or layout (all model keys if the family says none).
    layout = {f"model.{k}" for k in cfg.model.layout_keys} or {k for k in new if k.startswith("model.")}
    layout.add("model.family")
    shape_keys = [f"{k}: checkpoint has {saved[k]!r}, config has {new[k]!r}" for k in changed if k in layout]
    notes = [f"{k} changed from {_shown(k, saved, same_saved)} to {_shown(k, new, same_new)}{_keep(k, saved, new)}"
             for k in changed if k in STREAM_KEYS or (k.startswith("optimizer.") and k != "optimizer.decay_steps")
             or (k.startswith("model.") and k not in layout)]  # e.g. top_k, dtype, remat: allowed, but said
    old_horizon = saved.get("optimizer.decay_steps") or saved.get("train.steps")
    if old_horizon and old_horizon != cfg.decay_steps:
        keep = (f"; set optimizer.decay_steps={old_horizon} to keep the old schedule"
                if old_horizon > cfg.optimizer.warmup_steps else "")
        notes.append(f"the LR schedule now decays over {cfg.decay_steps} steps (was {old_horizon}){keep}")
    return shape_keys, notes


def check_data_position(cfg: Config, run_dir: Path) -> None:
    """A checkpoint's data position was reached with the saved ``train.global_batch``: resuming it with
    another would skip or repeat training data (a resume 16 -> 32 skipped rows 64-127 of the data order).

    Raises:
      ConfigError: naming both batch sizes and what to do.
    """
    path = run_dir / "config.yaml"
    saved = (yaml.safe_load(path.read_text()) or {}).get("train", {}).get("global_batch") if path.is_file() else None
    if saved is not None and saved != cfg.train.global_batch:
        raise ConfigError(f"train.global_batch: {cfg.train.global_batch}, but the checkpoint's data position was "
                          f"reached with {saved} sequences a step; resuming with another batch would skip or "
                          f"repeat training data. Resume with train.global_batch={saved}, or start a new run.dir")


_UNSET_MEANS = {"model.vocab_size": "the tokenizer's", "model.max_positions": "data.seq_len"}


def _shown(key: str, flat: dict[str, Any], resolved: dict[str, Any]) -> str:
    """A value as a note shows it: an unset model key with what it stands for ('None (data.seq_len: 32)')."""
    if key in _UNSET_MEANS and flat[key] != resolved[key] and resolved[key] is not None:
        return f"{flat[key]!r} ({_UNSET_MEANS[key]}: {resolved[key]!r})"
    return repr(flat[key])


def _keep(key: str, saved: dict[str, Any], new: dict[str, Any]) -> str:
    """For a key set before and unset now (an HF import's max_positions), how to keep the old value."""
    if key in _UNSET_MEANS and new[key] in (None, 0) and saved[key] not in (None, 0):
        return f"; set {key}={saved[key]} to keep it"
    return ""


def _resolved(flat: dict[str, Any], vocab: Optional[int]) -> dict[str, Any]:
    """``flat`` with the model keys' "unset" values replaced by what they stand for."""
    out = dict(flat)
    if vocab and out.get("model.vocab_size") == 0:
        out["model.vocab_size"] = vocab
    if "model.max_positions" in out and out["model.max_positions"] is None:
        out["model.max_positions"] = out.get("data.seq_len")
    return out


def _last_step(metrics: Path) -> int:
    """The highest ``step`` of the rows in ``metrics`` (0: none, or no file; unreadable lines count 0)."""
    from jaxtrain.metrics.sinks import step_of
    return max(map(step_of, metrics.read_bytes().splitlines()), default=0) if metrics.is_file() else 0


def _same_place(a: Any, b: Any, run_dir: Path) -> bool:
    """Whether two ``checkpoint.dir`` values (None: ``RUN_DIR/checkpoints``) name the same place."""
    def norm(v):
        v = str(v or run_dir / "checkpoints")
        return v.rstrip("/") if "://" in v else str(Path(v).expanduser().resolve())
    return norm(a) == norm(b)


def fresh_start_notes(cfg: Config, run_dir: Path) -> list[str]:
    """Before a run starts at step 0 in a run directory that may hold an earlier one.

    Returns one note when metrics.jsonl has rows of an earlier attempt (dropped: those steps are
    trained again), none for a new directory.

    Raises:
      ConfigError: the directory holds a run whose checkpoints were in another ``checkpoint.dir``
        (a changed or mistyped one would start it over and drop its metrics); its metrics and
        config.yaml are left as they were.
    """
    last = _last_step(run_dir / "metrics.jsonl")
    saved_path = run_dir / "config.yaml"
    if not last:
        return []
    try:
        saved = yaml.safe_load(saved_path.read_text()) if saved_path.is_file() else None
    except (yaml.YAMLError, UnicodeDecodeError):
        saved = None  # resume_changes names a damaged config.yaml when there is a checkpoint to resume
    saved_dir = ((saved or {}).get("checkpoint") or {}).get("dir") if isinstance(saved, dict) else None
    if isinstance(saved, dict) and not _same_place(saved_dir, cfg.checkpoint.dir, run_dir):
        where = cfg.checkpoint.dir or f"{run_dir / 'checkpoints'} (the default)"
        was = saved_dir or f"{run_dir / 'checkpoints'} (the default)"
        raise ConfigError(f"checkpoint.dir: {where} holds no checkpoint, but run.dir {run_dir} holds a run to step "
                          f"{last} whose checkpoints were in {was}: starting it over would drop its metrics. To "
                          f"resume, set checkpoint.dir back; to start a new run, use a new run.dir. Its "
                          f"metrics.jsonl and config.yaml are left as they were")
    return [f"no checkpoint to resume: starting at step 0 (metrics.jsonl's rows to step {last}, of an earlier "
            f"attempt, are dropped)"]


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
