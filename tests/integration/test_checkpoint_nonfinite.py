"""Non-finite guard: a NaN/inf step is skipped and counted; too many in a row stop the run."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import put_windows

from jaxtrain.checkpoint import checkpointer as ckptlib
from jaxtrain.cli import train as train_cli
from jaxtrain.data import windows as windowslib
from jaxtrain.errors import NonFiniteError
from jaxtrain.models import family as familylib
from jaxtrain.train import fit, setup


def test_nonfinite_step_keeps_params_and_opt_state(small_cfg):
    cfg = small_cfg("mesh.data=1")
    fns = setup(cfg, jax.devices()[:1], vocab=256).fns
    batch = put_windows(np.random.default_rng(0).integers(0, 256, (1, 8, 33), dtype=np.int32), fns.batch_sharding)
    good, m_good = fns.train_step(fns.init(), batch)
    assert int(m_good["nonfinite"]) == 0 and int(good["step"]) == 1
    bad = jax.tree_util.tree_map(lambda x: x, good)
    bad["params"]["lm_head"] = jnp.full_like(good["params"]["lm_head"], jnp.nan)
    snapshot = jax.device_get(bad)
    after, m = fns.train_step(bad, batch)
    assert int(m["nonfinite"]) == 1 and np.isnan(float(m["loss"]))
    assert int(after["step"]) == 2  # the step (and the data) still advance
    got = jax.device_get(after)
    for key in ("params", "opt_state"):  # untouched, NaN included (assert_array_equal treats NaN == NaN)
        for x, y in zip(jax.tree_util.tree_leaves(got[key]), jax.tree_util.tree_leaves(snapshot[key])):
            np.testing.assert_array_equal(x, y)


def test_too_many_nonfinite_steps_stop_the_run(small_cfg, monkeypatch, capsys):
    """Batches from step 5 on carry token 255 and a loss that is NaN on it (fault injection)."""
    train_dataset, cross_entropy = windowslib.train_dataset, familylib.masked_cross_entropy

    def poisoned(logits, targets, mask):
        loss, weight = cross_entropy(logits, targets, mask)
        return loss + jnp.where(jnp.any(targets == 255), jnp.nan, 0.0), weight
    monkeypatch.setattr(windowslib, "train_dataset", lambda *a: train_dataset(*a).map_with_index(
        lambda i, b: np.full_like(b, 255) if i >= 4 else b))
    monkeypatch.setattr(familylib, "masked_cross_entropy", poisoned)
    cfg = small_cfg("train.steps=20", "checkpoint.every=3", "train.max_nonfinite_steps=3", "mesh.data=1")
    with pytest.raises(NonFiniteError) as err:
        fit(cfg, devices=jax.devices()[:1], quiet=True)
    ckdir = cfg.run.dir + "/checkpoints"
    assert str(err.value) == (
        "train.max_nonfinite_steps: 3 steps in a row (steps 5..7) had a non-finite loss or gradient and were "
        f"skipped; stopping. The last good checkpoint is step 3 in {ckdir}")
    rows = [r for r in map(__import__("json").loads, open(cfg.run.dir + "/metrics.jsonl")) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 8))
    assert [r["nonfinite_steps"] for r in rows] == [0, 0, 0, 0, 1, 2, 3]  # skipped so far, this step included
    ckpt = ckptlib.Checkpointer(cfg, cfg.run.dir)
    assert list(ckpt.committed()) == [3]  # no save while steps are being skipped: 3 is not rotated away
    state, _ = ckpt.restore(3, setup(cfg, jax.devices()[:1], vocab=256).abstract_state())
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree_util.tree_leaves(state["params"]))
    ckpt.close()
    # The CLI resumes at 3 (on 8 devices now), fails the same way, exit code 3.
    assert train_cli.main(["--config", cfg.run.dir + "/config.yaml", "mesh.data=-1"]) == 3
    assert "train.max_nonfinite_steps: 3 steps in a row (steps 5..7)" in capsys.readouterr().err


def _poison(monkeypatch, train_from=None, val=False):
    """A loss that is NaN on token 255; training batches from index ``train_from`` on, and/or every
    validation window, are made of it (shakespeare's bytes never are)."""
    train_dataset, val_batches, cross_entropy = (windowslib.train_dataset, windowslib.val_batches,
                                                 familylib.masked_cross_entropy)

    def poisoned(logits, targets, mask):
        loss, weight = cross_entropy(logits, targets, mask)
        return loss + jnp.where(jnp.any(targets == 255), jnp.nan, 0.0), weight
    monkeypatch.setattr(familylib, "masked_cross_entropy", poisoned)
    if train_from is not None:
        monkeypatch.setattr(windowslib, "train_dataset", lambda *a: train_dataset(*a).map_with_index(
            lambda i, b: np.full_like(b, 255) if i >= train_from else b))
    if val:
        monkeypatch.setattr(windowslib, "val_batches", lambda *a: np.full_like(val_batches(*a), 255))


def test_a_run_that_skipped_every_step_fails(small_cfg, monkeypatch):
    _poison(monkeypatch, train_from=0)
    cfg = small_cfg("train.steps=4", "checkpoint.every=2", "train.max_nonfinite_steps=100", "mesh.data=1")
    with pytest.raises(NonFiniteError) as err:
        fit(cfg, devices=jax.devices()[:1], quiet=True)
    assert err.value.exit_code == 3
    assert str(err.value) == ("every step of this run (1..4) had a non-finite loss or gradient and was skipped; "
                              f"stopping. The last good checkpoint is step 4 in {cfg.run.dir}/checkpoints")
    ckpt = ckptlib.Checkpointer(cfg, cfg.run.dir)
    assert list(ckpt.committed()) == [4]  # the final save: untouched init params and the data position
    ckpt.close()


@pytest.mark.parametrize("steps, eval_every, every, bad, good", [
    (6, 2, 1, 2, 1),  # a periodic evaluation finds it: the step's save is never begun
    (4, 1000, 2, 4, 2),  # the last: its save began while it was evaluated, and is removed
], ids=["periodic", "last"])
def test_a_nonfinite_validation_loss_fails_and_is_never_saved(small_cfg, monkeypatch, steps, eval_every, every,
                                                              bad, good):
    _poison(monkeypatch, val=True)
    cfg = small_cfg(f"train.steps={steps}", f"train.eval_every={eval_every}", f"checkpoint.every={every}",
                    "mesh.data=1")
    with pytest.raises(NonFiniteError) as err:
        fit(cfg, devices=jax.devices()[:1], quiet=True)
    assert str(err.value) == (f"the validation loss is nan at step {bad}: the run diverged; stopping. The last "
                              f"good checkpoint is step {good} in {cfg.run.dir}/checkpoints")
    ckpt = ckptlib.Checkpointer(cfg, cfg.run.dir)
    assert list(ckpt.committed()) == [good] and not (ckpt.store.root / str(bad)).exists()
    ckpt.close()
    rows = list(map(__import__("json").loads, open(cfg.run.dir + "/metrics.jsonl")))
    evals = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in evals] == [bad] and np.isnan(evals[0]["val_loss"])
    failed = [(r["step"], r["latest_committed"], r["checkpoint_failed"].split(":")[0]) for r in rows
              if "checkpoint_failed" in r]
    assert failed == ([(bad, good, "NonFiniteError")] if bad == steps else [])


def test_a_removed_saves_own_write_error_is_said_not_raised(small_cfg, monkeypatch, capsys):
    """The last step's begun save fails to write as well: the run still fails as diverged, the write
    error is said (a storage fault must not go unnoticed), and the step is removed all the same."""
    _poison(monkeypatch, val=True)
    done = ckptlib.Checkpointer._orbax_done

    def failing(self, p):
        done(self, p)
        if p.step == 4:
            raise OSError("No space left on device")
    monkeypatch.setattr(ckptlib.Checkpointer, "_orbax_done", failing)
    cfg = small_cfg("train.steps=4", "train.eval_every=1000", "checkpoint.every=2", "mesh.data=1")
    with pytest.raises(NonFiniteError, match="the validation loss is nan at step 4"):
        fit(cfg, devices=jax.devices()[:1], quiet=True)
    out = capsys.readouterr()
    assert ("checkpoint step 4: its write failed too (OSError: No space left on device); it is removed either way"
            in out.out + out.err)
    ckpt = ckptlib.Checkpointer(cfg, cfg.run.dir)
    assert list(ckpt.committed()) == [2] and not (ckpt.store.root / "4").exists()
    ckpt.close()
