"""Sinks that hand rows to other tools: TensorBoard event files, an MLflow tracking server, W&B.

Each writes the numeric values of a row (``None``, strings and lists are left out) under the
row's group: ``train/<key>``, ``val/<key>`` (eval rows, without the ``val_`` prefix) and
``checkpoint/<key>``. Needs the package of the sink (the ``tensorboard``, ``mlflow`` or
``wandb`` extra; ``jaxtrain.metrics.sinks.check`` names it when missing).
"""
from __future__ import annotations

import math
import os
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

from jaxtrain.config import Config

ARTIFACTS = ("config.yaml", "versions.json", "tokenizer.json")  # what a run directory says about itself


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


def quiet_mlflow() -> None:
    """MLflow client defaults for a training job (each only if not set): give up on a server that
    is down after ~15 s, not minutes, and send no usage telemetry."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


class TensorBoardSink:
    """Event files in ``RUN_DIR/tensorboard`` (``tensorboard --logdir RUN_DIR/tensorboard``), via tensorboardX."""

    def __init__(self, cfg: Config, run_dir: Path):
        from tensorboardX import SummaryWriter
        self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def write(self, step: int, values: dict[str, Any]) -> None:
        for tag, value in scalars(values):
            self.writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MlflowSink:
    """One MLflow run per run directory on ``metrics.mlflow_tracking_uri``, in ``metrics.mlflow_experiment``.

    Its id is kept in ``RUN_DIR/mlflow_run_id``, so a resumed run continues the same MLflow run.
    A new run gets the resolved config as params; rows become metrics (one ``log_batch`` each);
    at close, ``config.yaml``, ``versions.json`` and ``tokenizer.json`` are logged as artifacts
    and the run is marked finished.
    """

    def __init__(self, cfg: Config, run_dir: Path):
        quiet_mlflow()
        from mlflow import MlflowClient
        from mlflow.entities import Param
        from jaxtrain.metrics.sinks import tracking_uri
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
        params = [Param(k, v[:6000]) for k, v in flat_config(cfg).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        id_file.write_text(self.run_id + "\n")

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
