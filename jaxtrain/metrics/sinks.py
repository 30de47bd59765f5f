"""Metric sinks: where rows of scalars go (``metrics.sinks``), written by process 0 only.

A row is a step and a dict of values: a train row (``loss``, ``lr``, ``grad_norm``,
``<unit>_per_sec``, ``step_time_s``, ``mfu``, ...), an eval row (``val_loss``, ...,
``eval_time_s``) or a checkpoint row (``checkpoint_saved`` / ``checkpoint_failed``). A sink
implements :class:`Sink`; :data:`SINKS` maps the names ``metrics.sinks`` can choose to
their constructors (the external ones, TensorBoard, MLflow and W&B, are in
``jaxtrain.metrics.external``). A sink that fails (a server down, a full disk) is reported
once and dropped: it never stops training.
"""
from __future__ import annotations

import importlib.util
import json
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from jaxtrain.config import Config
from jaxtrain.errors import ConfigError
from jaxtrain.metrics.console import Reporter
from jaxtrain.metrics.external import tracking_uri

TRAIN_KEYS = ("loss", "lr", "grad_norm", "step_time_s", "mfu", "nonfinite_steps", "data_wait_s",
              "checkpoint_block_s", "compile_s")


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
        resumed run's rows are not duplicated, and a last row cut short by a crash (the next row
        would be appended to it). Rewrites the file atomically."""
        self._file.close()
        lines, torn = _complete_lines(self.path.read_bytes() if self.path.exists() else b"")
        keep = [ln for ln in lines if ln.strip() and step_of(ln) <= step]
        if torn or len(keep) != len(lines):
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_bytes(b"".join(ln + b"\n" for ln in keep))
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
            self.out.line(f"step {step:>6} | loss {values['loss']:.4f} | lr {values['lr']:.2e} | grad_norm "
                          f"{values['grad_norm']:.3f} | {values[rate]:,.0f} {self.unit}/s | "
                          f"{values['step_time_s'] * 1e3:.1f} ms/step | MFU {mfu}{extra}")
        elif "val_loss" in values:
            self.out.line(f"step {step:>6} | " + " | ".join(f"{k} {_num(v)}" for k, v in values.items()
                                                           if k != "eval_time_s"))
        elif "checkpoint_failed" in values:
            self.out.info(f"[red]checkpoint save at step {step} failed: {values['checkpoint_failed']}; "
                          f"latest committed step: {values.get('latest_committed')}")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class Background:
    """Runs a sink on a thread of its own (made there too), so a slow or absent server never stalls
    the loop. A failure is kept in ``error`` and the sink is not called again."""

    def __init__(self, make: Callable[[], Sink], name: str):
        self.error: Optional[BaseException] = None
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, args=(make,), name=f"jaxtrain-sink-{name}", daemon=True)
        self._thread.start()

    def _run(self, make: Callable[[], Sink]) -> None:
        sink = None
        try:
            sink = make()
        except Exception as err:  # noqa: BLE001 - any failure of the sink is reported, never raised
            self.error = err
        while True:
            item = self._queue.get()
            if item is None:
                break
            if self.error is None:
                try:
                    sink.write(*item)
                except Exception as err:  # noqa: BLE001
                    self.error = err
        if sink is not None and self.error is None:
            try:
                sink.close()
            except Exception as err:  # noqa: BLE001
                self.error = err

    def write(self, step: int, values: dict[str, Any]) -> None:
        self._queue.put((step, dict(values)))

    def flush(self) -> None:
        pass

    def close(self, timeout_s: float = 120.0) -> None:
        """Waits (at most ``timeout_s``) for the queued rows to be written and the sink to close."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive() and self.error is None:
            self.error = TimeoutError(f"rows still queued after {timeout_s:.0f} s")


def _external(kind: str) -> Callable[..., Sink]:
    def make(cfg: Config, run_dir: Path, reporter: Reporter, unit: str) -> Sink:
        from jaxtrain.metrics import external
        cls = {"tensorboard": external.TensorBoardSink, "mlflow": external.MlflowSink,
               "wandb": external.WandbSink}[kind]
        if kind == "mlflow":  # an HTTP round trip per row: off the loop's thread
            return Background(lambda: cls(cfg, run_dir, _warning(reporter)), kind)
        return cls(cfg, run_dir)
    return make


def _warning(reporter: Reporter) -> Callable[[str], None]:
    """A sink's warning (e.g. params cut) as a yellow ``warning:`` line on the console."""
    from rich.markup import escape

    def warn(msg: str) -> None:
        reporter.info(f"[yellow]warning:[/] {escape(msg)}")  # escaped: '[truncated, ...]' is not markup
    return warn


# metrics.sinks name -> (cfg, run_dir, reporter, unit) -> Sink; the names are config.schema.SINKS.
SINKS: dict[str, Callable[..., Sink]] = {
    "console": lambda cfg, run_dir, reporter, unit: ConsoleSink(reporter, unit),
    "jsonl": lambda cfg, run_dir, reporter, unit: JsonlSink(run_dir),
    "tensorboard": _external("tensorboard"),
    "mlflow": _external("mlflow"),
    "wandb": _external("wandb"),
}
# The package each external sink needs, and the extra that installs it.
PACKAGES = {"tensorboard": ("tensorboardX", "tensorboard"), "mlflow": ("mlflow", "mlflow"),
            "wandb": ("wandb", "wandb")}


def check(cfg: Config) -> None:
    """Checks the configured sinks can be made (before anything is written).

    Raises:
      ConfigError: a sink's package is not installed, or the mlflow sink has no tracking URI.
    """
    for name in cfg.metrics.sinks:
        if name in PACKAGES and importlib.util.find_spec(PACKAGES[name][0]) is None:
            raise ConfigError(f"metrics.sinks: the {name} sink needs the {PACKAGES[name][0]} package "
                              f"(pip install -e \".[{PACKAGES[name][1]}]\")")
    if "mlflow" in cfg.metrics.sinks and not tracking_uri(cfg):
        raise ConfigError("metrics.mlflow_tracking_uri: the mlflow sink needs a tracking server "
                          "(set it, or $MLFLOW_TRACKING_URI, e.g. http://127.0.0.1:5000)")


class Sinks:
    """The configured sinks as one: every row goes to each (process 0 only; elsewhere none).

    A sink that raises, or whose background thread failed, is reported once on the console and
    dropped; training goes on.
    """

    def __init__(self, cfg: Config, run_dir: Path, reporter: Reporter, unit: str, primary: bool = True):
        self.out = reporter
        self.sinks: dict[str, Any] = {}
        for name in cfg.metrics.sinks if primary else ():
            try:
                self.sinks[name] = SINKS[name](cfg, run_dir, reporter, unit)
            except Exception as err:  # noqa: BLE001 - e.g. a server that is down: a warning, not a failed run
                self._drop(name, err)

    def _drop(self, name: str, err: BaseException) -> None:
        self.sinks.pop(name, None)
        self.out.info(f"[yellow]warning:[/] metrics sink '{name}' failed ({type(err).__name__}: {err}); "
                      f"training goes on without it")

    def write(self, step: int, values: dict[str, Any]) -> None:
        for name, sink in list(self.sinks.items()):
            try:
                if getattr(sink, "error", None) is not None:
                    raise sink.error
                sink.write(step, values)
                sink.flush()
            except Exception as err:  # noqa: BLE001
                self._drop(name, err)

    def drop_after(self, step: int) -> None:
        for sink in self.sinks.values():
            if hasattr(sink, "drop_after"):
                sink.drop_after(step)

    def close(self) -> None:
        for name, sink in list(self.sinks.items()):
            try:
                sink.close()
                if getattr(sink, "error", None) is not None:
                    raise sink.error
            except Exception as err:  # noqa: BLE001
                self._drop(name, err)


def _num(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float):
        return round(value, 6) if abs(value) >= 1e-3 else float(f"{value:.6g}")
    return value


def step_of(line: bytes) -> int:
    """A metrics line's ``step`` (0 when the line is not a JSON row)."""
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError, TypeError):
        return 0


def _complete_lines(raw: bytes) -> tuple[list[bytes], bool]:
    """(the lines of a JSONL file's bytes, whether its last line was cut short: no final newline)."""
    lines = raw.splitlines()
    torn = bool(raw) and not raw.endswith(b"\n")
    return (lines[:-1] if torn else lines), torn


def read_metrics(run_dir: Path) -> list[dict]:
    """Every row of ``RUN_DIR/metrics.jsonl``; a last row cut short by a crash is left out.

    Raises:
      ConfigError: a complete line is not a JSON object (names the file and line).
    """
    path = Path(run_dir) / "metrics.jsonl"
    rows = []
    for n, line in enumerate(_complete_lines(path.read_bytes())[0], 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as err:  # also invalid UTF-8
            raise ConfigError(f"{path}: line {n} is not a JSON row ({err})") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{path}: line {n} is not a JSON object")
        rows.append(row)
    return rows
