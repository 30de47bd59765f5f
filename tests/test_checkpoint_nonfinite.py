"""Non-finite guard: a NaN/inf step is skipped and counted; too many in a row stop the run."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import checkpoint as ckptlib
from jaxtrain.data import windows as windowslib
from jaxtrain import step as steplib
from jaxtrain import train as trainlib
from jaxtrain.mesh import build_mesh
from jaxtrain.partitioning import Rules


def test_nonfinite_step_keeps_params_and_opt_state(small_cfg):
    cfg = small_cfg("mesh.data=1")
    trainer = steplib.build(cfg, build_mesh(cfg.mesh, jax.devices()[:1]), Rules.load("fsdp_tp"), 256)
    batch = jax.device_put(np.random.default_rng(0).integers(0, 256, (1, 8, 33), dtype=np.int32),
                           trainer.batch_sharding)
    good, m_good = trainer.train_step(trainer.init(), batch)
    assert int(m_good["nonfinite"]) == 0 and int(good["step"]) == 1
    bad = jax.tree_util.tree_map(lambda x: x, good)
    bad["params"]["lm_head"] = jnp.full_like(good["params"]["lm_head"], jnp.nan)
    snapshot = jax.device_get(bad)
    after, m = trainer.train_step(bad, batch)
    assert int(m["nonfinite"]) == 1 and np.isnan(float(m["loss"]))
    assert int(after["step"]) == 2  # the step (and the data) still advance
    got = jax.device_get(after)
    for key in ("params", "opt_state"):  # untouched, NaN included (assert_array_equal treats NaN == NaN)
        for x, y in zip(jax.tree_util.tree_leaves(got[key]), jax.tree_util.tree_leaves(snapshot[key])):
            np.testing.assert_array_equal(x, y)


def test_too_many_nonfinite_steps_stop_the_run(small_cfg, monkeypatch, capsys):
    """Batches from step 5 on carry token 255 and a loss that is NaN on it (fault injection)."""
    train_dataset, cross_entropy = windowslib.train_dataset, steplib.masked_cross_entropy
    monkeypatch.setattr(windowslib, "train_dataset", lambda *a: train_dataset(*a).map_with_index(
        lambda i, b: np.full_like(b, 255) if i >= 4 else b))
    monkeypatch.setattr(steplib, "masked_cross_entropy", lambda logits, targets, *rest: cross_entropy(
        logits, targets, *rest) + jnp.where(jnp.any(targets == 255), jnp.nan, 0.0))
    cfg = small_cfg("train.steps=20", "checkpoint.every=3", "train.max_nonfinite_steps=3", "mesh.data=1")
    with pytest.raises(trainlib.NonFiniteError) as err:
        trainlib.run(cfg, devices=jax.devices()[:1], quiet=True)
    ckdir = cfg.run.dir + "/checkpoints"
    assert str(err.value) == (
        "train.max_nonfinite_steps: 3 steps in a row (steps 5..7) had a non-finite loss or gradient and were "
        f"skipped; stopping. The last good checkpoint is step 6 in {ckdir}")
    rows = [r for r in map(__import__("json").loads, open(cfg.run.dir + "/metrics.jsonl")) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 8))
    assert [r["nonfinite_steps"] for r in rows] == [0, 0, 0, 0, 1, 2, 3]  # skipped so far, this step included
    ckpt = ckptlib.Checkpointer(cfg, cfg.run.dir)
    assert list(ckpt.committed()) == [3, 6]
    trainer = steplib.build(cfg, build_mesh(cfg.mesh, jax.devices()[:1]), Rules.load("fsdp_tp"), 256)
    state, _ = ckpt.restore(6, ckptlib.abstract_like(jax.eval_shape(trainer.init), trainer.state_shardings))
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree_util.tree_leaves(state["params"]))
    ckpt.close()
    # The CLI resumes at 6 (on 8 devices now), fails the same way, exit code 3.
    assert trainlib.main(["--config", cfg.run.dir + "/config.yaml", "mesh.data=-1"]) == 3
    assert "train.max_nonfinite_steps: 3 steps in a row (steps 7..9)" in capsys.readouterr().err
