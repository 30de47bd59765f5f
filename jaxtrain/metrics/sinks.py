"""Metric sinks: where rows of scalars go (``metrics.sinks``).

A row is a step and a dict of values: a train row (``loss``, ``lr``, ``grad_norm``,
``<unit>_per_sec``, ``step_time_s``, ``mfu``, ...), an eval row (``val_loss``, ...) or a
checkpoint row (``checkpoint_saved`` / ``checkpoint_failed``). A sink implements
:class:`Sink`; :data:`SINKS` names the ones ``metrics.sinks`` can choose.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Protocol

from jaxtrain.config import Config
from jaxtrain.metrics.console import Reporter

TRAIN_KEYS = ("loss", "lr", "grad_norm", "step_time_s", "mfu", "nonfinite_steps")


class Sink(Protocol):
    def write(self, step: int, values: dict[str, Any]) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class JsonlSink:
    """Appends one JSON object per row to ``RUN_DIR/metrics.jsonl`` (``time``, ``step``, values; flushed)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / "metrics.jsonl"
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

    def write(self, step: int, values: dict[str, Any]) -> None:
        row = {"time": round(time.time(), 3), "step": step, **{k: _plain(v) for k, v in values.items()}}
        self._file.write(json.dumps(row) + "\n")

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class ConsoleSink:
    """One console line per train or eval row, and a red line for a failed checkpoint save."""

    def __init__(self, reporter: Reporter, unit: str = "tokens"):
        self.out, self.unit = reporter, unit

    def write(self, step: int, values: dict[str, Any]) -> None:
        rate = f"{self.unit}_per_sec"
        if "loss" in values and rate in values:
            mfu = f"{100 * values['mfu']:.1f}%" if values.get("mfu") is not None else "n/a"
            extra = "".join(f" | {k} {_num(v)}" for k, v in values.items() if k not in (*TRAIN_KEYS, rate))
            self.out.info(f"step {step:>6} | loss {values['loss']:.4f} | lr {values['lr']:.2e} | grad_norm "
                          f"{values['grad_norm']:.3f} | {values[rate]:,.0f} {self.unit}/s | "
                          f"{values['step_time_s'] * 1e3:.1f} ms/step | MFU {mfu}{extra}")
        elif "val_loss" in values:
            self.out.info(f"step {step:>6} | " + " | ".join(f"{k} {_num(v)}" for k, v in values.items()))
        elif "checkpoint_failed" in values:
            self.out.info(f"[red]checkpoint save at step {step} failed: {values['checkpoint_failed']}; "
                          f"latest committed step: {values.get('latest_committed')}")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


# metrics.sinks name -> (cfg, run_dir, reporter, unit) -> Sink
SINKS: dict[str, Callable[..., Sink]] = {
    "console": lambda cfg, run_dir, reporter, unit: ConsoleSink(reporter, unit),
    "jsonl": lambda cfg, run_dir, reporter, unit: JsonlSink(run_dir),
}


class Sinks:
    """The configured sinks as one: every row goes to each, and is flushed."""

    def __init__(self, cfg: Config, run_dir: Path, reporter: Reporter, unit: str):
        self.sinks = {name: SINKS[name](cfg, run_dir, reporter, unit) for name in cfg.metrics.sinks}

    def write(self, step: int, values: dict[str, Any]) -> None:
        for sink in self.sinks.values():
            sink.write(step, values)
            sink.flush()

    def drop_after(self, step: int) -> None:
        for sink in self.sinks.values():
            if hasattr(sink, "drop_after"):
                sink.drop_after(step)

    def close(self) -> None:
        for sink in self.sinks.values():
            sink.close()


def _num(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


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
    """Every row of ``RUN_DIR/metrics.jsonl``."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
