"""Registry hand-off: a run's checkpoint as a new version of an MLflow registered model.

    python -m jaxtrain.export RUN_DIR --register NAME [--alias candidate] [--step N]

The step (default: the latest committed) is exported as Hugging Face safetensors
(``jaxtrain.train.hf``), logged as artifacts of the run's MLflow run (the one the ``mlflow``
sink wrote, its id in ``RUN_DIR/mlflow_run_id``; else a new run in ``metrics.mlflow_experiment``),
and registered as a new version of model ``NAME`` whose tags carry its lineage: the run
directory, the step, the SHA-256 of ``config.yaml``, the validation loss at that step and the
package versions. ``--alias`` then points at the new version (an alias moves, e.g. from the
previous candidate). The server is ``metrics.mlflow_tracking_uri`` or ``$MLFLOW_TRACKING_URI``.
"""
from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any, Optional

from jaxtrain.checkpoint.checkpointer import Checkpointer, CheckpointError
from jaxtrain.config import ConfigError, load
from jaxtrain.metrics.external import quiet_mlflow
from jaxtrain.metrics.sinks import read_metrics, tracking_uri
from jaxtrain.train import hf


def lineage(run_dir: Path, step: int, committed: dict) -> dict[str, str]:
    """The tags of a registered version: where it came from and what it was at ``step``."""
    tags = {"jaxtrain.run_dir": str(Path(run_dir).absolute()), "jaxtrain.step": str(step),
            "jaxtrain.config_sha256": hashlib.sha256((run_dir / "config.yaml").read_bytes()).hexdigest()}
    val = (committed.get(step) or {}).get("metrics", {}).get("val_loss")
    if val is None and (run_dir / "metrics.jsonl").is_file():  # the latest evaluation at or before the step
        evals = [r for r in read_metrics(run_dir) if "val_loss" in r and r["step"] <= step]
        val = evals[-1]["val_loss"] if evals else None
    tags["jaxtrain.val_loss"] = "n/a" if val is None else repr(float(val))
    if (run_dir / "versions.json").is_file():
        for pkg, version in json.loads((run_dir / "versions.json").read_text()).items():
            tags[f"version.{pkg}"] = str(version)
    return tags


def register(run_dir: Path, name: str, alias: Optional[str] = None, step: Optional[int] = None,
             uri: Optional[str] = None) -> Any:
    """Registers ``step`` of ``run_dir`` as a new version of MLflow model ``name``; returns the ModelVersion.

    Raises:
      ConfigError: not a run directory, no tracking server, or a family without HF converter.
      CheckpointError: no committed checkpoint, or no such step.
    """
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"export: '{run_dir}' is not a run directory (no config.yaml)")
    cfg = load(str(run_dir / "config.yaml"))
    uri = uri or tracking_uri(cfg)
    if not uri:
        raise ConfigError("--register: needs an MLflow tracking server (--tracking-uri, metrics.mlflow_tracking_uri "
                          "or $MLFLOW_TRACKING_URI)")
    ckpt = Checkpointer(cfg, run_dir)
    try:
        committed = ckpt.committed()
    finally:
        ckpt.close()
    step = max(committed) if step is None and committed else step
    if step is None:
        raise CheckpointError(f"export: no committed checkpoint in {run_dir}")
    quiet_mlflow()
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException
    client = MlflowClient(uri)
    with tempfile.TemporaryDirectory(prefix="jaxtrain-register-") as tmp:
        hf.export(run_dir, Path(tmp), step)
        run_id = _mlflow_run(client, run_dir, cfg.metrics.mlflow_experiment)
        path = f"model-step-{step}"
        client.log_artifacts(run_id, tmp, artifact_path=path)
    try:
        client.create_registered_model(name)
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    source = f"{client.get_run(run_id).info.artifact_uri}/{path}"
    version = client.create_model_version(name, source=source, run_id=run_id, tags=lineage(run_dir, step, committed),
                                          description=f"{run_dir.name} step {step} (jaxtrain)")
    if alias:
        client.set_registered_model_alias(name, alias, version.version)
    return version


def _mlflow_run(client, run_dir: Path, experiment: str) -> str:
    """The run's own MLflow run (the mlflow sink's), else a new one named after the run directory."""
    id_file = run_dir / "mlflow_run_id"
    if id_file.is_file():
        return id_file.read_text().strip()
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(experiment)
    run = client.create_run(exp_id, run_name=f"{run_dir.name} (export)",
                            tags={"jaxtrain.run_dir": str(run_dir.absolute())})
    client.set_terminated(run.info.run_id)
    return run.info.run_id
