"""Registry hand-off: a run's checkpoint as a new version of an MLflow registered model.

    python -m jaxtrain.export RUN_DIR --register NAME [--alias candidate] [--step N]

The step (default: the latest committed) is exported as Hugging Face safetensors
(``jaxtrain.interop.hf``), logged as artifacts of the run's MLflow run (the one the ``mlflow``
sink wrote, its id in ``RUN_DIR/mlflow_run_id``; else a new run in ``metrics.mlflow_experiment``),
and registered as a new version of model ``NAME`` whose tags carry its lineage: the run
directory, the step, the SHA-256 of ``config.yaml``, the validation loss at that step and the
package versions, and the SHA-256 of each exported file (``jaxtrain.files_sha256``, JSON). The
version must then become READY (``--ready-timeout-s``) and its files, read back from the
registry, must hash as exported; only then does ``--alias`` point at it (an alias moves, e.g.
from the previous candidate). Otherwise :class:`RegistryError` names what went wrong, the version
is deleted (no consumer finds a version whose files were never confirmed) and the alias stays
where it was. The server is ``metrics.mlflow_tracking_uri`` or ``$MLFLOW_TRACKING_URI``.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from jaxtrain.checkpoint.checkpointer import Checkpointer
from jaxtrain.config import load
from jaxtrain.errors import CheckpointError, ConfigError, RegistryError
from jaxtrain.interop import hf
from jaxtrain.metrics.external import quiet_mlflow, tracking_uri
from jaxtrain.metrics.sinks import read_metrics

READY_TIMEOUT_S = 300.0  # default wait for a new version to leave PENDING_REGISTRATION


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
             uri: Optional[str] = None, ready_timeout_s: float = READY_TIMEOUT_S) -> Any:
    """Registers ``step`` of ``run_dir`` as a new version of MLflow model ``name``; returns the READY
    ModelVersion, whose files were checked. ``ready_timeout_s``: seconds to wait for READY.

    Raises:
      ConfigError: not a run directory, no tracking server, or a family without HF converter.
      CheckpointError: no committed checkpoint, or no such step.
      RegistryError: the version failed, was not READY within ``ready_timeout_s``, or a file read
        back from the registry differs from the export (named); the version was deleted (nothing
        half-registered) and the alias was not moved.
    """
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"export: '{run_dir}' is not a run directory (no config.yaml)")
    cfg = load(str(run_dir / "config.yaml"))
    uri = uri or tracking_uri(cfg)
    if not uri:
        raise ConfigError("--register: needs an MLflow tracking server (--tracking-uri, metrics.mlflow_tracking_uri "
                          "or $MLFLOW_TRACKING_URI)")
    step, committed = _step(cfg, run_dir, step)
    quiet_mlflow()
    from mlflow import MlflowClient
    client = MlflowClient(uri)
    with tempfile.TemporaryDirectory(prefix="jaxtrain-register-") as tmp:
        hf.export(run_dir, Path(tmp), step)
        digests = file_digests(Path(tmp))
        run_id = _mlflow_run(client, run_dir, cfg.metrics.mlflow_experiment)
        path = f"model-step-{step}"
        client.log_artifacts(run_id, tmp, artifact_path=path)
    _ensure_model(client, name)
    source = f"{client.get_run(run_id).info.artifact_uri}/{path}"
    tags = {**lineage(run_dir, step, committed), "jaxtrain.files_sha256": json.dumps(digests, sort_keys=True)}
    version = client.create_model_version(name, source=source, run_id=run_id, tags=tags, await_creation_for=0,
                                          description=f"{run_dir.name} step {step} (jaxtrain)")
    try:
        version = wait_ready(client, version, ready_timeout_s)
        check_files(uri, version, digests)
    except Exception as err:  # noqa: BLE001 - whatever failed (a RegistryError, MLflow's own): nothing half-registered
        message = str(err) if isinstance(err, RegistryError) else \
            f"--register: model '{name}' version {version.version}: {type(err).__name__}: {str(err)[:300]}"
        message += _withdraw(client, name, version.version)
        raise RegistryError(message + (f"; alias '{alias}' not moved" if alias else "")) from None
    if alias:
        client.set_registered_model_alias(name, alias, version.version)
    return version


def _withdraw(client, name: str, number: str) -> str:
    """Deletes version ``number`` of ``name``, which failed its checks (no consumer may find a version
    whose files were never confirmed); what to add to the error."""
    try:
        client.delete_model_version(name, number)
    except Exception as err:  # noqa: BLE001 - the failure itself is what is raised; say this too
        return f"; deleting version {number} failed too ({type(err).__name__}: {str(err)[:200]}): delete it by hand"
    return f"; version {number} deleted"


def _step(cfg, run_dir: Path, step: Optional[int]) -> tuple[int, dict]:
    """(the step to register: ``step`` or the latest committed, the committed steps).

    Raises:
      CheckpointError: no committed checkpoint.
    """
    ckpt = Checkpointer(cfg, run_dir)
    try:
        committed = ckpt.committed()
    finally:
        ckpt.close()
    step = max(committed) if step is None and committed else step
    if step is None:
        raise CheckpointError(f"export: no committed checkpoint in {run_dir}")
    return step, committed


def _ensure_model(client, name: str) -> None:
    """Creates registered model ``name`` unless it exists."""
    from mlflow.exceptions import MlflowException
    try:
        client.create_registered_model(name)
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise


def file_digests(root: Path) -> dict[str, str]:
    """``{path relative to root: sha256 hex}`` of every file under ``root``, read in 1 MiB chunks."""
    out = {}
    for path in sorted(p for p in Path(root).rglob("*") if p.is_file()):
        digest = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        out[path.relative_to(root).as_posix()] = digest.hexdigest()
    return out


def wait_ready(client, version: Any, timeout_s: float, poll_s: float = 1.0) -> Any:
    """Polls ``get_model_version`` every ``poll_s`` seconds until ``version`` is READY; returns it.

    Raises:
      RegistryError: it ended in another status (FAILED_REGISTRATION), or was still pending after
        ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    label = f"--register: model '{version.name}' version {version.version}"
    while version.status != "READY":
        if version.status != "PENDING_REGISTRATION":
            raise RegistryError(f"{label} ended {version.status}: {version.status_message or 'no message'}")
        left = deadline - time.monotonic()
        if left <= 0:
            raise RegistryError(f"{label} is still PENDING_REGISTRATION after {timeout_s:g} s "
                                f"(--ready-timeout-s)")
        time.sleep(min(poll_s, left))
        version = client.get_model_version(version.name, version.version)
    return version


def check_files(uri: str, version: Any, expected: dict[str, str]) -> None:
    """Downloads the files of ``version`` (``models:/NAME/VERSION``, what a consumer gets) from the
    registry at ``uri`` and compares their SHA-256 with ``expected`` (:func:`file_digests`).

    Raises:
      RegistryError: a file differs, is missing, or is not in the export; each one is named.
    """
    import mlflow.artifacts
    with tempfile.TemporaryDirectory(prefix="jaxtrain-register-check-") as tmp, _environment_uri(uri):
        local = mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{version.name}/{version.version}",
                                                    dst_path=tmp, tracking_uri=uri, registry_uri=uri)
        got = file_digests(Path(local))
    bad = [_difference(f, expected.get(f), got.get(f)) for f in sorted(expected.keys() | got.keys())
           if expected.get(f) != got.get(f)]
    if bad:
        raise RegistryError(f"--register: model '{version.name}' version {version.version}: the registry's files "
                            f"differ from the export: " + "; ".join(bad))


@contextlib.contextmanager
def _environment_uri(uri: str) -> Iterator[None]:
    """``$MLFLOW_TRACKING_URI`` and ``$MLFLOW_REGISTRY_URI`` set to ``uri`` while inside: MLflow 3 resolves
    a ``models:/`` URI against the process's registry, not the one download_artifacts is given (without
    the variable, the run's own metrics.mlflow_tracking_uri failed with 'Registered Model ... not found'
    after the version was created)."""
    saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    os.environ.update(dict.fromkeys(saved, uri))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _difference(name: str, want: Optional[str], got: Optional[str]) -> str:
    if got is None:
        return f"{name} is missing"
    if want is None:
        return f"{name} is not in the export"
    return f"{name} has sha256 {got[:12]}..., exported {want[:12]}..."


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
