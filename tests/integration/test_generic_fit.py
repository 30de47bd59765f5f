"""jaxtrain.fit with any Flax NNX model: the digits MLP example, on 1 and 8 devices, resume, named errors."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import config as cfglib
from jaxtrain.data import ArrayData
from jaxtrain.errors import DataError, ShardingError
from jaxtrain.examples import digits
from jaxtrain.train import ModelSpec, fit


def digits_cfg(tmp_path, *overrides, run_dir="run"):
    return cfglib.load("digits_mlp", [f"run.dir={tmp_path / run_dir}", "run.progress=false", "train.log_every=1",
                                      *overrides])


def test_the_example_trains_from_its_config_to_97_percent(tmp_path, capsys):
    """The README's command: 400 steps of the 64-128-10 MLP, data-parallel over the 8 test devices."""
    assert digits.main([f"run.dir={tmp_path / 'run'}", "run.progress=false"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in rows if "val_accuracy" in r}
    assert sorted(evals) == [100, 200, 300, 400]
    assert evals[400]["val_accuracy"] >= 0.97, evals[400]  # 0.9744 on 352 held-out images
    assert evals[400]["val_loss"] < 0.15
    out = capsys.readouterr().out
    assert "mesh data=8 fsdp=1 tensor=1 sequence=1 expert=1 (8 devices) | rules fsdp | model digits_mlp" in out
    assert f"validation accuracy {evals[400]['val_accuracy']:.4f} at step 400" in out
    assert all(r["mfu"] > 0 and "examples_per_sec" in r for r in rows if "loss" in r)


def test_eight_devices_equal_one_and_resume_is_exact(tmp_path):
    one_cfg = digits_cfg(tmp_path, "train.steps=6", "optimizer.warmup_steps=2", "mesh.data=1",
                         "checkpoint.enabled=false", run_dir="one")
    one = fit(one_cfg, digits.model_spec(one_cfg), digits.data(one_cfg), devices=jax.devices()[:1], quiet=True)
    eight = ("mesh.data=1", "mesh.fsdp=8", "checkpoint.every=3")
    cfg = digits_cfg(tmp_path, "train.steps=6", "optimizer.warmup_steps=2", *eight, run_dir="eight")
    full = fit(cfg, digits.model_spec(cfg), digits.data(cfg), quiet=True)
    assert full.state["params"]["w1"].sharding.spec == jax.sharding.PartitionSpec("fsdp", None)
    np.testing.assert_allclose([full.losses[s] for s in range(1, 7)], [one.losses[s] for s in range(1, 7)],
                               rtol=1e-4)
    first = digits_cfg(tmp_path, "train.steps=3", "optimizer.warmup_steps=2", "optimizer.decay_steps=6", *eight,
                       run_dir="resumed")
    fit(first, digits.model_spec(first), digits.data(first), quiet=True)
    again = digits_cfg(tmp_path, "train.steps=6", "optimizer.warmup_steps=2", *eight, run_dir="resumed")
    second = fit(again, digits.model_spec(again), digits.data(again), quiet=True)
    assert second.start_step == 3
    assert [second.losses[s] for s in (4, 5, 6)] == [full.losses[s] for s in (4, 5, 6)]


class NoAxes(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jnp.zeros((4, 2)))

    def __call__(self, x):
        return x @ self.w[...]


class WithBatchStats(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jnp.zeros((4, 2)), axes=("embed", "classes"))
        self.norm = nnx.BatchNorm(2, rngs=rngs)

    def __call__(self, x):
        return self.norm(x @ self.w[...])


def mse(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean(), {}


def test_what_cannot_be_trained_is_named(tmp_path):
    cfg = digits_cfg(tmp_path, "mesh.data=1")
    x = np.zeros((64, 4), np.float32)
    data = ArrayData({"x": x, "y": x[:, :2]}, {"x": x, "y": x[:, :2]}, cfg)
    with pytest.raises(ShardingError) as e:
        fit(cfg, ModelSpec(NoAxes, mse, name="no_axes"), data, devices=jax.devices()[:1])
    assert str(e.value) == ("model 'no_axes': parameter(s) without logical axis names: w (4, 2); create them as "
                            "nnx.Param(value, axes=(...)), one name per dimension")
    with pytest.raises(ShardingError, match=r"^model 'bn': state that is not an nnx.Param cannot be trained here "
                                            r"\(norm\.mean, norm\.var\)$"):
        fit(cfg, ModelSpec(WithBatchStats, mse, name="bn"), data, devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="a ModelSpec needs its data source"):
        fit(cfg, ModelSpec(NoAxes, mse))
    llama = cfglib.load(None, [f"run.dir={tmp_path / 'run'}", "mesh.data=1"])
    with pytest.raises(cfglib.ConfigError, match=r"^model.family: a ModelSpec given in Python is a custom model; "
                                                 r"set model.family: custom .*not 'llama'$"):
        fit(llama, ModelSpec(NoAxes, mse), data, devices=jax.devices()[:1])
    assert not (tmp_path / "run").exists()  # nothing written for a run that cannot start


def test_array_data_errors_are_named(tmp_path):
    cfg = digits_cfg(tmp_path)
    x = np.zeros((40, 4), np.float32)
    with pytest.raises(DataError, match=r"^data: 20 training examples, fewer than one batch \(train.global_batch=32"):
        ArrayData({"x": x[:20]}, {"x": x}, cfg)
    with pytest.raises(DataError, match=r"^data: 10 validation examples, fewer than one micro-batch \(32\)$"):
        ArrayData({"x": x}, {"x": x[:10]}, cfg)
    with pytest.raises(DataError, match=r"^data: the train fields have different lengths \{'x': 40, 'y': 39\}$"):
        ArrayData({"x": x, "y": x[:39]}, {"x": x, "y": x}, cfg)
    with pytest.raises(DataError, match=r"^data: validation fields \['x'\] differ from training fields \['x', 'y'\]$"):
        ArrayData({"x": x, "y": x}, {"x": x}, cfg)


def bad_metrics(model, batch):
    return mse(model, batch)[0], {"lr": jnp.float32(7.0)}


def vector_loss(model, batch):
    return (model(batch["x"]) - batch["y"]) ** 2, {}


def test_a_loss_that_breaks_the_contract_is_named_before_the_run(tmp_path):
    cfg = digits_cfg(tmp_path, "mesh.data=1")
    x = np.zeros((64, 4), np.float32)
    data = ArrayData({"x": x, "y": x[:, :2]}, {"x": x, "y": x[:, :2]}, cfg)
    make = lambda rngs: WithAxes(rngs)  # noqa: E731
    with pytest.raises(cfglib.ConfigError) as e:
        fit(cfg, ModelSpec(make, bad_metrics, name="m"), data, devices=jax.devices()[:1])
    assert str(e.value) == ("model 'm': the loss's metrics may not be named lr (the step reports loss, grad_norm, "
                            "lr, nonfinite itself)")
    with pytest.raises(cfglib.ConfigError) as e:  # (pytest's match= would also read the note JAX adds)
        fit(cfg, ModelSpec(make, vector_loss, name="m"), data, devices=jax.devices()[:1])
    assert str(e.value) == "model 'm': the loss must return a scalar first, got shape (32, 2)"
    with pytest.raises(DataError, match=r"^data: train field\(s\) y have no leading examples dimension$"):
        ArrayData({"x": x, "y": np.float32(1)}, {"x": x, "y": x}, cfg)
    assert not (tmp_path / "run").exists()


class WithAxes(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jnp.zeros((4, 2)), axes=("embed", "classes"))

    def __call__(self, x):
        return x @ self.w[...]
