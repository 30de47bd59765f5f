"""Sinks that hand rows to other tools: TensorBoard event files, an MLflow tracking server, W&B.

Each writes the numeric values of a row (``None``, strings and lists are left out) under the
row's group: ``train/<key>``, ``val/<key>`` (eval rows, without the ``val_`` prefix) and
``checkpoint/<key>``. Needs the package of the sink (the ``tensorboard``, ``mlflow`` or
``wandb`` extra; ``jaxtrain.metrics.sinks.check`` names it when missing).
"""
from __future__ import annotations

import logging
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from jaxtrain.config import Config

ARTIFACTS = ("config.yaml", "versions.json", "tokenizer.json")  # what a run directory says about itself


def tracking_uri(cfg: Config) -> Optional[str]:
    """``metrics.mlflow_tracking_uri``, else ``$MLFLOW_TRACKING_URI``."""
    return cfg.metrics.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None


def scalars(values: dict[str, Any]) -> Iterator[tuple[str, float]]:
    """(tag, value) for every finite-or-not number of a row, tagged by the row's group."""
    if "val_loss" in values:
        group = "val"
    elif "checkpoint_saved" in values or "checkpoint_failed" in values:
        group = "checkpoint"
    else:
        group = "train"
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        name = key[4:] if group == "val" and key.startswith("val_") else key
        yield f"{group}/{name}", float(value)


def flat_config(cfg: Config) -> dict[str, str]:
    """The resolved config as ``{'train.steps': '300', ...}`` (every leaf, as text)."""
    out: dict[str, str] = {}

    def walk(tree: dict, prefix: str) -> None:
        for key, value in tree.items():
            if isinstance(value, dict) and value:
                walk(value, f"{prefix}{key}.")
            else:
                out[f"{prefix}{key}"] = str(value)
    walk(cfg.to_dict(), "")
    return out


def param_limit() -> int:
    """The longest param value (characters) the installed MLflow accepts: 6000 in MLflow 2 and 3."""
    try:
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH
        return int(MAX_PARAM_VAL_LENGTH)
    except ImportError:  # a private module: moved or gone in another MLflow
        return 6000


def fit_params(params: dict[str, str], limit: int) -> tuple[dict[str, str], dict[str, int]]:
    """``params`` with each value longer than ``limit`` characters cut to exactly ``limit``, ending in
    ``...[truncated, N chars]`` (N: the full length); and ``{key: full length}`` of those cut."""
    out, cut = {}, {}
    for key, value in params.items():
        if len(value) > limit:
            marker = f"...[truncated, {len(value)} chars]"
            out[key], cut[key] = value[:limit - len(marker)] + marker, len(value)
        else:
            out[key] = value
    return out, cut


def quiet_mlflow() -> None:
    """MLflow client defaults for a training job (each only if not set): give up on a server that
    is down after ~15 s, not minutes, and send no usage telemetry."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


class TensorBoardSink:
    """Event files in ``RUN_DIR/tensorboard`` (``tensorboard --logdir RUN_DIR/tensorboard``), via tensorboardX.

    The event file is opened at the first row (or :meth:`drop_after`), so a resumed run's file can
    start with TensorBoard's purge marker. Each file's name ends in the nanosecond clock, so two
    writers started within one second neither overwrite each other (tensorboardX names files by
    the second and opens them with ``wb``) nor sort out of order.
    """

    def __init__(self, cfg: Config, run_dir: Path):
        import tensorboardX  # noqa: F401 - a missing package fails here, before any row
        self.dir = Path(run_dir) / "tensorboard"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._earlier = any(self.dir.glob("*tfevents*"))  # files of an earlier run in this directory
        self._purge_step: Optional[int] = None
        self._writer = None

    def drop_after(self, step: int) -> None:
        """Hides the rows past ``step`` (the restored checkpoint's) that an earlier, interrupted run
        wrote: the new file starts with a SessionLog.START event at ``step + 1`` (tensorboardX's
        ``purge_step``), and TensorBoard's readers drop every earlier-read event at or past it.
        Call it before the first row; without earlier event files it does nothing."""
        if self._earlier and self._writer is None:
            self._purge_step = step + 1  # TensorBoard keeps events with step < the START event's step
            self.writer.flush()  # now, so the marker is there even if this run logs no row

    @property
    def writer(self):
        if self._writer is None:
            from tensorboardX import SummaryWriter
            self._writer = SummaryWriter(str(self.dir), purge_step=self._purge_step,
                                         filename_suffix=f".{time.time_ns()}")
        return self._writer

    def write(self, step: int, values: dict[str, Any]) -> None:
        for tag, value in scalars(values):
            self.writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class MlflowSink:
    """One MLflow run per run directory on ``metrics.mlflow_tracking_uri``, in ``metrics.mlflow_experiment``.

    Its id is kept in ``RUN_DIR/mlflow_run_id``, so a resumed run continues the same MLflow run.
    A new run gets the resolved config as params (a value over MLflow's limit, :func:`param_limit`,
    is cut by :func:`fit_params` and named in one warning, through ``warn``: by default the
    ``jaxtrain`` logger); rows become metrics (one ``log_batch`` each);
    at close, ``config.yaml``, ``versions.json`` and ``tokenizer.json`` are logged as artifacts
    and the run is marked finished.
    """

    def __init__(self, cfg: Config, run_dir: Path, warn: Optional[Callable[[str], None]] = None):
        quiet_mlflow()
        from mlflow import MlflowClient
        self.run_dir = Path(run_dir)
        self.client = MlflowClient(tracking_uri(cfg))
        id_file = self.run_dir / "mlflow_run_id"
        if id_file.exists():
            self.run_id = id_file.read_text().strip()
            self.client.get_run(self.run_id)  # raises if the server no longer has it
            self.client.update_run(self.run_id, status="RUNNING")
            return
        experiment = self.client.get_experiment_by_name(cfg.metrics.mlflow_experiment)
        exp_id = experiment.experiment_id if experiment else self.client.create_experiment(
            cfg.metrics.mlflow_experiment)
        run = self.client.create_run(exp_id, run_name=self.run_dir.name,
                                     tags={"jaxtrain.run_dir": str(self.run_dir.absolute())})
        self.run_id = run.info.run_id
        self._log_params(cfg, warn or logging.getLogger("jaxtrain").warning)
        id_file.write_text(self.run_id + "\n")

    def _log_params(self, cfg: Config, warn: Callable[[str], None]) -> None:
        """The flat config as params, 100 per ``log_batch`` (MLflow's batch limit); values over
        :func:`param_limit` are cut and named in one ``warn`` call (the server would otherwise cut
        them unmarked, warning only in its own log, or refuse the batch when its
        ``MLFLOW_TRUNCATE_LONG_VALUES`` is false)."""
        from mlflow.entities import Param
        limit = param_limit()
        values, cut = fit_params(flat_config(cfg), limit)
        if cut:
            warn(f"metrics sink 'mlflow': MLflow keeps at most {limit} characters of a param value; cut to "
                 f"{limit}, ending in '...[truncated, N chars]': "
                 + ", ".join(f"{k} ({n} chars)" for k, n in cut.items())
                 + " (the whole config is the run's config.yaml artifact)")
        params = [Param(k, v) for k, v in values.items()]
        for i in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def write(self, step: int, values: dict[str, Any]) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        metrics = [Metric(tag, value, now, step) for tag, value in scalars(values) if math.isfinite(value)]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        for name in ARTIFACTS:
            if (self.run_dir / name).is_file():
                self.client.log_artifact(self.run_id, str(self.run_dir / name))
        self.client.set_terminated(self.run_id)


class WandbSink:
    """A W&B run in ``RUN_DIR/wandb`` (``metrics.wandb_mode: offline`` by default: nothing leaves the
    machine; ``wandb sync RUN_DIR/wandb/offline-run-*`` uploads it later). Its id is kept in
    ``RUN_DIR/wandb_run_id``, so a resumed run continues it."""

    def __init__(self, cfg: Config, run_dir: Path):
        import wandb
        run_dir = Path(run_dir)
        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        self.run = wandb.init(project=cfg.metrics.wandb_project, name=run_dir.name, id=run_id, resume="allow",
                              dir=str(run_dir), mode=cfg.metrics.wandb_mode, config=cfg.to_dict(),
                              settings=wandb.Settings(silent=True, console="off"))
        id_file.write_text(run_id + "\n")

    def write(self, step: int, values: dict[str, Any]) -> None:
        row = dict(scalars(values))
        if row:
            self.run.log(row, step=step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()
