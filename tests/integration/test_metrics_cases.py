"""Correctness cases of the metric sinks and the registry hand-off, against real tools on loopback:
TensorBoard rows after a resume (read back with tensorboard's own reader, which applies purges),
MLflow params over the server's length limit, and `export --register` waiting for READY and
checking the registry's copy of the files before it moves an alias (a real `mlflow server`)."""
import hashlib
import json
import shutil
import time
from pathlib import Path

import jax
import pytest
from test_observability import series

from jaxtrain.checkpoint import checkpointer as ckptlib
from jaxtrain.cli import export as export_cli
from jaxtrain.interop import hf
from jaxtrain.metrics import external
from jaxtrain.metrics.console import Reporter
from jaxtrain.metrics.sinks import Sinks, read_metrics
from jaxtrain.train import fit, rundir, setup


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# --- 1. TensorBoard after a resume ---------------------------------------------------------------

def test_tensorboard_after_a_resume_shows_every_step_once_with_the_resumed_values(small_cfg):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    common = ("metrics.sinks=[jsonl, tensorboard]", "checkpoint.every=2", "train.eval_every=2", "mesh.data=1",
              "optimizer.decay_steps=6")
    first = fit(small_cfg("train.steps=6", *common), devices=jax.devices()[:1], quiet=True)
    first_lr = {r["step"]: r["lr"] for r in read_metrics(first.run_dir) if "lr" in r}
    # The first run "died" after step 6 with only step 2 committed: its rows of steps 3-6 are orphans.
    for step in (4, 6):
        shutil.rmtree(first.run_dir / "checkpoints" / str(step))
    # A changed LR (allowed on resume) makes the resumed rows differ from the orphans.
    second = fit(small_cfg("train.steps=4", "optimizer.lr=3e-3", *common), devices=jax.devices()[:1], quiet=True)
    assert second.start_step == 2

    rows = read_metrics(second.run_dir)  # the jsonl sink's rows: already cut back at step 2, then resumed
    lr = {r["step"]: r["lr"] for r in rows if "lr" in r}
    loss = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert sorted(loss) == [1, 2, 3, 4] and lr[3] != pytest.approx(first_lr[3])
    events = EventAccumulator(str(second.run_dir / "tensorboard"))
    events.Reload()
    assert len(list((second.run_dir / "tensorboard").glob("*tfevents*"))) == 2
    assert series(events.Scalars("train/loss")) == ([1, 2, 3, 4], pytest.approx([loss[s] for s in (1, 2, 3, 4)]))
    assert series(events.Scalars("train/lr")) == ([1, 2, 3, 4], pytest.approx([lr[s] for s in (1, 2, 3, 4)]))
    assert [e.step for e in events.Scalars("val/loss")] == [2, 4]
    for tag in events.Tags()["scalars"]:  # no tag keeps a step twice, or one past the resumed run's end
        steps = [e.step for e in events.Scalars(tag)]
        assert steps == sorted(set(steps)) and max(steps) <= 4, (tag, steps)


def test_a_resume_that_logs_nothing_still_hides_the_orphans(tmp_path, small_cfg):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    cfg = small_cfg()
    old = external.TensorBoardSink(cfg, tmp_path)
    for step in range(1, 6):
        old.write(step, {"loss": float(step)})
    old.close()
    resumed = external.TensorBoardSink(cfg, tmp_path)  # restored at step 3, then stopped at once
    resumed.drop_after(3)
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert series(events.Scalars("train/loss")) == ([1, 2, 3], [1.0, 2.0, 3.0])
    fresh = external.TensorBoardSink(cfg, tmp_path / "new")  # no earlier files: no marker, no file yet
    fresh.drop_after(0)
    fresh.close()
    assert list((tmp_path / "new" / "tensorboard").iterdir()) == []


# --- 2. MLflow params over the length limit -------------------------------------------------------

def test_an_overlong_mlflow_param_is_cut_with_a_marker_and_named_in_one_warning(small_cfg, mlflow_server,
                                                                                tmp_path, capsys):
    from mlflow import MlflowClient
    limit = external.param_limit()
    assert limit == 6000  # MLflow 3's MAX_PARAM_VAL_LENGTH
    cfg = small_cfg("train.sample_prompt=" + "p" * (limit + 2000), "data.separator=" + "s" * (limit + 1),
                    "data.bos_token=" + "b" * limit, "data.mode=packed", "data.add_bos=true",  # where both are read
                    f"metrics.mlflow_tracking_uri={mlflow_server}",
                    "metrics.sinks=[mlflow]", "metrics.mlflow_experiment=long-params")
    run_dir = tmp_path / "long"
    run_dir.mkdir()
    capsys.readouterr()
    out = Sinks(cfg, run_dir, Reporter(quiet=True, total=1), "tokens")  # the sink as fit makes it
    out.write(1, {"loss": 2.5})
    out.close()
    assert out.sinks, "the mlflow sink failed"
    printed = capsys.readouterr().out
    assert printed.count("warning:") == 1, printed
    text = " ".join(printed.split())  # rich may wrap the line; MLflow prints its run link after it
    assert text[text.index("warning:"):text.index("artifact)") + 9] == (
        f"warning: metrics sink 'mlflow': MLflow keeps at most {limit} characters of a param value; cut to "
        f"{limit}, ending in '...[truncated, N chars]': data.separator ({limit + 1} chars), "
        f"train.sample_prompt ({limit + 2000} chars) (the whole config is the run's config.yaml artifact)")

    params = MlflowClient(mlflow_server).get_run((run_dir / "mlflow_run_id").read_text().strip()).data.params
    prompt, sep = params["train.sample_prompt"], params["data.separator"]
    marker = f"...[truncated, {limit + 2000} chars]"
    assert len(prompt) == limit and prompt == "p" * (limit - len(marker)) + marker
    assert len(sep) == limit and sep.endswith("s...[truncated, 6001 chars]")
    assert params["data.bos_token"] == "b" * limit  # at the limit: kept whole
    assert params["train.steps"] == str(cfg.train.steps)


# --- 3. export --register: READY, then the files' hashes, then the alias -------------------------

def saved_run(cfg, step: int = 3) -> Path:
    """A run directory (config.yaml, committed checkpoint ``step`` of freshly initialised params), no training."""
    state = setup(cfg, jax.devices()[:1], vocab=256).fns.init()
    with rundir.opened(cfg) as run_dir:
        rundir.write_config_file(cfg, run_dir)
        ckpt = ckptlib.Checkpointer(cfg, run_dir)
        ckpt.save(step, state, {})
        ckpt.close()
    return Path(run_dir)


@pytest.fixture
def registry(small_cfg, mlflow_server, monkeypatch):
    """(run dir with committed step 3, the server's MlflowClient); the server is $MLFLOW_TRACKING_URI."""
    from mlflow import MlflowClient
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    cfg = small_cfg("model.vocab_size=256", "mesh.data=1", "metrics.mlflow_experiment=register-cases")
    return saved_run(cfg), MlflowClient(mlflow_server)


def exported(run_dir: Path, tmp: Path) -> dict[str, str]:
    """sha256 of each file of the same export made locally."""
    hf.export(run_dir, tmp, 3)
    return {p.name: sha256(p) for p in sorted(tmp.iterdir())}


def register(run_dir: Path, name: str, *extra: str) -> int:
    return export_cli.main([str(run_dir), "--register", name, "--alias", "candidate", *extra])


def test_register_waits_for_ready_checks_the_hashes_then_moves_the_alias(registry, tmp_path, monkeypatch, capsys):
    import mlflow.artifacts
    run_dir, client = registry
    read_back = []
    real = mlflow.artifacts.download_artifacts
    monkeypatch.setattr(mlflow.artifacts, "download_artifacts",
                        lambda **kw: read_back.append(kw["artifact_uri"]) or real(**kw))
    assert register(run_dir, "cases-ok") == 0 and register(run_dir, "cases-ok") == 0
    out = capsys.readouterr().out
    assert "registered cases-ok version 2 (step 3, alias 'candidate')\n" \
           "READY; sha256 of its 2 files read back from the registry match the export\n" in out
    assert read_back == ["models:/cases-ok/1", "models:/cases-ok/2"]
    monkeypatch.setattr(mlflow.artifacts, "download_artifacts", real)
    v2 = client.get_model_version_by_alias("cases-ok", "candidate")
    assert (v2.version, v2.status) == ("2", "READY")
    want = exported(run_dir, tmp_path / "local")
    assert set(want) == {"model.safetensors", "config.json"}
    assert json.loads(v2.tags["jaxtrain.files_sha256"]) == want
    served = Path(client.download_artifacts(v2.run_id, "model-step-3", str(tmp_path / "served")))
    assert {p.name: sha256(p) for p in served.iterdir()} == want


def test_register_a_file_that_differs_in_the_registry_is_named_and_the_alias_stays(registry, tmp_path,
                                                                                   monkeypatch, capsys):
    from mlflow import MlflowClient
    run_dir, client = registry
    assert register(run_dir, "cases-bad") == 0
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{}")  # the store keeps other bytes than were uploaded
    real = MlflowClient.log_artifacts

    def corrupting(self, run_id, local_dir, artifact_path=None):
        real(self, run_id, local_dir, artifact_path)
        self.log_artifact(run_id, str(bad / "config.json"), artifact_path)
    monkeypatch.setattr(MlflowClient, "log_artifacts", corrupting)
    capsys.readouterr()
    assert register(run_dir, "cases-bad") == 1  # the registry failed, not the input
    want = exported(run_dir, tmp_path / "local")["config.json"]
    err = capsys.readouterr().err  # after MLflow's download progress bar
    assert err.endswith(
        f"\nerror: --register: model 'cases-bad' version 2: the registry's files differ from the export: "
        f"config.json has sha256 {sha256(bad / 'config.json')[:12]}..., exported {want[:12]}...; "
        f"version 2 deleted; alias 'candidate' not moved\n"), err
    assert client.get_model_version_by_alias("cases-bad", "candidate").version == "1"
    # nothing half-registered: the version whose files differ is gone (at 94de100 it stayed, READY)
    assert [v.version for v in client.search_model_versions("name='cases-bad'")] == ["1"]


@pytest.mark.parametrize("ends", ["FAILED_REGISTRATION", "PENDING_REGISTRATION"])
def test_register_a_version_that_fails_or_stays_pending_is_named_and_the_alias_stays(registry, monkeypatch, capsys,
                                                                                     ends):
    from mlflow import MlflowClient
    name = f"cases-{ends.lower()}"
    run_dir, client = registry
    assert register(run_dir, name) == 0
    polls = []

    def status(version, polled):  # the real server's version, in the status a slow/failing registry reports
        polls.append(polled)
        version._status = "PENDING_REGISTRATION" if not polled else ends
        version._status_message = "storage copy failed" if ends.startswith("FAILED") else None
        return version
    create, get = MlflowClient.create_model_version, MlflowClient.get_model_version
    monkeypatch.setattr(MlflowClient, "create_model_version", lambda self, *a, **kw: status(create(self, *a, **kw), 0))
    monkeypatch.setattr(MlflowClient, "get_model_version", lambda self, *a, **kw: status(get(self, *a, **kw), 1))
    capsys.readouterr()
    start = time.monotonic()
    assert register(run_dir, name, "--ready-timeout-s", "1.5") == 1
    took = time.monotonic() - start
    err = capsys.readouterr().err
    if ends == "FAILED_REGISTRATION":
        assert err == (f"error: --register: model '{name}' version 2 ended FAILED_REGISTRATION: storage copy "
                       f"failed; version 2 deleted; alias 'candidate' not moved\n")
        assert polls == [0, 1]
    else:
        assert err == (f"error: --register: model '{name}' version 2 is still PENDING_REGISTRATION after 1.5 s "
                       f"(--ready-timeout-s); version 2 deleted; alias 'candidate' not moved\n")
        assert 2 <= len(polls) <= 4 and took < 30  # polled about once a second, and gave up
    monkeypatch.undo()
    assert client.get_model_version_by_alias(name, "candidate").version == "1"
    assert [v.version for v in client.search_model_versions(f"name='{name}'")] == ["1"]


def test_register_uses_the_runs_tracking_uri_without_the_environment(small_cfg, mlflow_server, monkeypatch, capsys):
    """The server named by the run's own metrics.mlflow_tracking_uri, no $MLFLOW_TRACKING_URI: every call
    (the version, its READY wait, the read-back of its files) goes there (5eb7ae3: an MlflowException
    traceback, exit 1, with the version already created)."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = small_cfg("model.vocab_size=256", "mesh.data=1", "metrics.mlflow_experiment=register-uri",
                    f"metrics.mlflow_tracking_uri={mlflow_server}")
    run_dir = saved_run(cfg)
    assert register(run_dir, "cases-uri") == 0, capsys.readouterr().err
    assert "registered cases-uri version 1 (step 3, alias 'candidate')" in capsys.readouterr().out
