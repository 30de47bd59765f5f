"""Metric sinks against real tools: TensorBoard event files read back with tensorboard's reader, a real
`mlflow server` (SQLite) started here, W&B's offline files; a sink that fails; the registry hand-off."""
import glob
import hashlib
import json
import socket
import struct
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxtrain.cli import export as export_cli
from jaxtrain.errors import ConfigError
from jaxtrain.metrics import sinks
from jaxtrain.metrics.sinks import read_metrics
from jaxtrain.train import fit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def series(points) -> tuple[list, list]:
    """(steps, values) of TensorBoard scalar events or MLflow metric history."""
    return [p.step for p in points], [p.value for p in points]


def wandb_history(run_dir: Path) -> list[dict]:
    """History rows of the W&B offline run in ``run_dir/wandb`` (its .wandb file: a log of records in
    32 KiB blocks, each a 7-byte header (crc, length, type) and a protobuf Record)."""
    from wandb.proto import wandb_internal_pb2 as pb
    rows = []
    for path in sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))):
        data, pos, parts, pending = Path(path).read_bytes(), 7, [], b""
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
            if kind == 1:
                parts.append(chunk)
            elif kind in (2, 3):
                pending += chunk
            elif kind == 4:
                parts.append(pending + chunk)
                pending = b""
        for part in parts:
            record = pb.Record()
            record.ParseFromString(part)
            if record.WhichOneof("record_type") == "history":
                rows.append({"/".join(item.nested_key) or item.key: json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_tensorboard_mlflow_and_wandb_get_every_row_and_a_resume_continues(small_cfg, mlflow_server, monkeypatch):
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    every = ("metrics.sinks=[jsonl, tensorboard, mlflow, wandb]", f"metrics.mlflow_tracking_uri={mlflow_server}",
             "metrics.mlflow_experiment=sinks-test", "train.eval_every=2", "checkpoint.every=2", "mesh.data=1")
    first = fit(small_cfg("train.steps=4", "optimizer.decay_steps=6", *every), devices=jax.devices()[:1], quiet=True)
    rows = read_metrics(first.run_dir)
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    vals = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    assert sorted(losses) == [1, 2, 3, 4] and sorted(vals) == [2, 4]

    events = EventAccumulator(str(first.run_dir / "tensorboard"))
    events.Reload()
    assert {"train/loss", "train/lr", "train/tokens_per_sec", "val/loss", "checkpoint/save_total_s"} <= \
        set(events.Tags()["scalars"])
    assert series(events.Scalars("train/loss")) == ([1, 2, 3, 4], pytest.approx([losses[s] for s in (1, 2, 3, 4)]))
    assert series(events.Scalars("val/loss")) == ([2, 4], pytest.approx([vals[2], vals[4]]))

    client = MlflowClient(mlflow_server)
    run_id = (first.run_dir / "mlflow_run_id").read_text().strip()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["train.steps"] == "4" and run.data.params["model.d_model"] == "64"
    assert {a.path for a in client.list_artifacts(run_id)} == {"config.yaml", "versions.json", "tokenizer.json"}
    assert series(client.get_metric_history(run_id, "train/loss")) == \
        ([1, 2, 3, 4], pytest.approx([losses[s] for s in (1, 2, 3, 4)]))

    history = [r for r in wandb_history(first.run_dir) if "train/loss" in r]
    assert [r["_step"] for r in history] == [1, 2, 3, 4]
    assert [r["train/loss"] for r in history] == pytest.approx([losses[s] for s in (1, 2, 3, 4)])

    # The same command resumed to 6 steps continues the same MLflow run (and W&B run).
    second = fit(small_cfg("train.steps=6", *every), devices=jax.devices()[:1], quiet=True)
    assert second.start_step == 4 and (second.run_dir / "mlflow_run_id").read_text().strip() == run_id
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == [1, 2, 3, 4, 5, 6]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert [r["_step"] for r in wandb_history(second.run_dir) if "train/loss" in r] == [1, 2, 3, 4, 5, 6]


def test_a_sink_that_fails_warns_once_and_training_goes_on(small_cfg, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = fit(small_cfg("train.steps=3", "mesh.data=1", "checkpoint.enabled=false",
                           "metrics.sinks=[console, jsonl, mlflow]", f"metrics.mlflow_tracking_uri={down}"),
                 devices=jax.devices()[:1], quiet=True)
    out = capsys.readouterr().out
    assert out.count("warning: metrics sink 'mlflow' failed (") == 1, out
    assert "training goes on without it" in out
    assert sorted(result.losses) == [1, 2, 3] and result.val_loss is not None
    assert [r["step"] for r in read_metrics(result.run_dir) if "loss" in r] == [1, 2, 3]


def test_sinks_that_cannot_be_made_are_named_before_the_run(small_cfg, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ConfigError) as e:
        fit(small_cfg("metrics.sinks=[mlflow]"))
    assert str(e.value) == ("metrics.mlflow_tracking_uri: the mlflow sink needs a tracking server (set it, or "
                            "$MLFLOW_TRACKING_URI, e.g. http://127.0.0.1:5000)")
    real = sinks.importlib.util.find_spec
    monkeypatch.setattr(sinks.importlib.util, "find_spec", lambda n: None if n == "tensorboardX" else real(n))
    with pytest.raises(ConfigError) as e:
        fit(small_cfg("metrics.sinks=[jsonl, tensorboard]"))
    assert str(e.value) == ("metrics.sinks: the tensorboard sink needs the tensorboardX package "
                            "(pip install -e \".[tensorboard]\")")
    with pytest.raises(ConfigError, match=r"^metrics.sinks: a sink named twice in \['jsonl', 'jsonl'\]$"):
        small_cfg("metrics.sinks=[jsonl, jsonl]")


def test_register_hands_each_checkpoint_to_the_registry_with_its_lineage(small_cfg, mlflow_server, monkeypatch,
                                                                        capsys):
    from mlflow import MlflowClient
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    common = ("model.vocab_size=256", "train.eval_every=2", "checkpoint.every=2", "mesh.data=1",
              "metrics.mlflow_experiment=registry-test")
    first = fit(small_cfg("train.steps=2", "optimizer.warmup_steps=1", "optimizer.decay_steps=4", *common,
                          run_dir="reg"),
                devices=jax.devices()[:1], quiet=True)
    assert export_cli.main([str(first.run_dir), "--register", "tiny-llama", "--alias", "candidate"]) == 0
    assert "registered tiny-llama version 1 (step 2, alias 'candidate')" in capsys.readouterr().out
    second = fit(small_cfg("train.steps=4", "optimizer.warmup_steps=1", *common, run_dir="reg"),
                 devices=jax.devices()[:1], quiet=True)
    assert export_cli.main([str(second.run_dir), "--register", "tiny-llama", "--alias", "candidate"]) == 0

    client = MlflowClient(mlflow_server)
    assert client.get_model_version_by_alias("tiny-llama", "candidate").version == "2"  # the alias moved
    v1, v2 = (client.get_model_version("tiny-llama", v) for v in ("1", "2"))
    vals = {r["step"]: r["val_loss"] for r in read_metrics(second.run_dir) if "val_loss" in r}
    config_sha = hashlib.sha256((second.run_dir / "config.yaml").read_bytes()).hexdigest()
    versions = json.loads((second.run_dir / "versions.json").read_text())
    assert v2.tags["jaxtrain.step"] == "4" and v1.tags["jaxtrain.step"] == "2"
    assert float(v1.tags["jaxtrain.val_loss"]) == pytest.approx(vals[2]) and \
        float(v2.tags["jaxtrain.val_loss"]) == pytest.approx(vals[4])
    assert v2.tags["jaxtrain.config_sha256"] == config_sha
    assert v2.tags["jaxtrain.run_dir"] == str(second.run_dir.absolute())
    assert v2.tags["version.jax"] == versions["jax"] == jax.__version__
    # The version's artifacts are the exported safetensors of that step.
    files = {a.path.rsplit("/", 1)[-1] for a in client.list_artifacts(v2.run_id, "model-step-4")}
    assert files == {"model.safetensors", "config.json"}
    local = client.download_artifacts(v2.run_id, "model-step-4/model.safetensors")
    from safetensors.numpy import load_file
    tensors = load_file(local)
    assert tensors["model.norm.weight"].shape == (64,)
    np.testing.assert_array_equal(tensors["model.norm.weight"],
                                  np.asarray(second.state["params"]["final_norm"]["scale"]))
