"""Checkpoints: resharding restore, dtypes, named mismatch errors, commit markers, failed saves, policy."""
import json
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxtrain.checkpoint import checkpointer as ckptlib
from jaxtrain.cli import train as train_cli
from jaxtrain.train import fit, setup


def trainer_on(cfg, devices):
    return setup(cfg, devices, vocab=256)


def abstract_of(s):
    return s.abstract_state()


def assert_trees_identical(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def fsdp8_run(tmp_path_factory, corpus_path):
    """A 6-step run on 8 devices with mesh fsdp=8, committed checkpoints at steps 4 and 6."""
    from conftest import SMALL

    from jaxtrain import config as cfglib
    root = tmp_path_factory.mktemp("fsdp8")

    def cfg(*extra, run_dir="a"):
        return cfglib.load(None, [*SMALL, f"data.path={corpus_path}", f"run.dir={root / run_dir}", "train.steps=6",
                                  "checkpoint.every=4", "mesh.data=1", "mesh.fsdp=8", *extra])
    result = fit(cfg(), quiet=True)
    return cfg, result


def test_resharding_restore_is_bit_identical_and_training_continues(fsdp8_run):
    cfg, full = fsdp8_run
    ckpt = ckptlib.Checkpointer(cfg(), full.run_dir)
    assert list(ckpt.committed()) == [4, 6] and ckpt.saved_mesh(6)["fsdp"] == 8
    # No Orbax _sharding file: the restores below land in the live shardings without it.
    assert (full.run_dir / "checkpoints" / "6" / "state" / "manifest.ocdbt").is_file()
    assert not (full.run_dir / "checkpoints" / "6" / "state" / "_sharding").exists()
    for mesh_args, n in ((("mesh.fsdp=2", "mesh.tensor=2"), 4), (("mesh.fsdp=1",), 1)):
        target = trainer_on(cfg(*mesh_args), jax.devices()[:n])
        state, data = ckpt.restore(6, abstract_of(target))
        assert_trees_identical(state, full.state)  # params, Adam moments, step and rng, bit for bit
        assert len(state["params"]["layers"][0]["attn"]["wq"].sharding.device_set) == n
        if n == 4:
            assert state["params"]["layers"][0]["attn"]["wq"].sharding.spec == P("fsdp", "tensor", None)
        assert data == json.loads(json.dumps(data))  # plain JSON data position
    ckpt.close()

    # `train` reshards by itself: drop step 6 and resume step 4 on 4 devices (fsdp=2, tensor=2).
    resumed_dir = full.run_dir.parent / "b"
    shutil.copytree(full.run_dir, resumed_dir)
    # Killed between Orbax's rename and our marker: uncommitted, so cleaned up and never restored.
    (resumed_dir / "checkpoints" / "6" / ckptlib.MARKER).unlink()
    (resumed_dir / "checkpoints" / ckptlib.pending_name(6)).write_text("{}")
    second = fit(cfg("mesh.fsdp=2", "mesh.tensor=2", run_dir="b"), devices=jax.devices()[:4], quiet=True)
    assert second.start_step == 4 and sorted(second.losses) == [5, 6]
    np.testing.assert_allclose([second.losses[s] for s in (5, 6)], [full.losses[s] for s in (5, 6)], rtol=1e-5)


def test_shape_mismatch_lists_every_path(fsdp8_run, capsys):
    cfg, full = fsdp8_run
    with pytest.raises(ckptlib.CheckpointError) as err:
        fit(cfg("model.d_ff=96"), quiet=True)
    msg = str(err.value)
    assert f"checkpoint step 6 in {full.run_dir / 'checkpoints'} does not match the current config" in msg
    lines, hint = msg.split("\nconfig keys changed since the checkpoint")
    lines = lines.splitlines()[1:]
    # w_gate, w_up, w_down of 2 layers, in params and in both Adam moments.
    assert len(lines) == 18, msg
    assert hint.endswith("\n  model.d_ff: checkpoint has 128, config has 96")
    assert "  params.layers.0.mlp.w_gate: saved shape (64, 128) float32, expected (64, 96) float32" in lines
    assert "  params.layers.1.mlp.w_down: saved shape (128, 64) float32, expected (96, 64) float32" in lines
    assert "  opt_state.1.0.mu.layers.1.mlp.w_up: saved shape (64, 128) float32, expected (64, 96) float32" in lines
    assert train_cli.main(["--config", str(full.run_dir / "config.yaml"), "model.d_ff=96"]) == 2
    assert "params.layers.0.mlp.w_gate: saved shape (64, 128)" in capsys.readouterr().err
    assert list(ckptlib.Checkpointer(cfg(), full.run_dir).committed()) == [4, 6]  # nothing damaged


def test_dtypes_and_structure_survive(small_cfg):
    cfg = small_cfg("model.param_dtype=bfloat16", "optimizer.master_weights=false",  # bf16 in the state
                    "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2")
    trainer = trainer_on(cfg, jax.devices()[:4])
    state = trainer.fns.init()
    state["step"] = jax.device_put(jnp.int32(16777217), state["step"].sharding)  # not representable in f32
    ckpt = ckptlib.Checkpointer(cfg, cfg.run.dir)
    ckpt.save(7, state, {"next_index": 3})
    assert ckpt.finish() is True
    restored, data = ckpt.restore(7, abstract_of(trainer))
    ckpt.close()
    assert data == {"next_index": 3}
    assert restored["params"]["layers"][0]["attn"]["wq"].dtype == jnp.bfloat16
    assert restored["step"].dtype == jnp.int32 and int(restored["step"]) == 16777217
    assert restored["rng"].dtype == jnp.uint32
    assert_trees_identical(restored, state)


def test_one_process_writes_each_replicated_array_whole(small_cfg, monkeypatch):
    # Orbax's replica-parallel write would cut each of these into 8 parts, one eager compiled slice each.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    everywhere = jax.sharding.NamedSharding(mesh, P())
    state = {f"w{i}": jax.device_put(np.arange(64 * (i + 1), dtype=np.float32).reshape(8, -1), everywhere)
             for i in range(3)}
    slices = []
    real = jax.lax.slice_in_dim
    monkeypatch.setattr(jax.lax, "slice_in_dim", lambda *a, **k: slices.append(a[0].shape) or real(*a, **k))
    cfg = small_cfg()
    ckpt = ckptlib.Checkpointer(cfg, cfg.run.dir)
    ckpt.save(1, state, {})
    assert ckpt.finish() is True
    assert slices == []
    restored, _ = ckpt.restore(1, ckptlib.abstract_like(state, jax.tree_util.tree_map(lambda x: x.sharding, state)))
    ckpt.close()
    assert_trees_identical(restored, state)
    assert restored["w2"].sharding == everywhere


def test_unfinished_saves_are_cleaned_and_nothing_else(fsdp8_run):
    cfg, full = fsdp8_run
    root = full.run_dir.parent / "c"
    shutil.copytree(full.run_dir, root)
    ck = root / "checkpoints"
    # Our own unfinished saves, each with the pending marker a save writes before it begins:
    shutil.copytree(ck / "6", ck / "8")
    (ck / "8" / ckptlib.MARKER).unlink()  # killed between Orbax's rename and our marker
    shutil.copytree(ck / "6", ck / "10.orbax-checkpoint-tmp-1234")  # killed mid-write
    shutil.copytree(ck / "6", ck / "12")
    (ck / "12" / ckptlib.MARKER).write_text('{"format": 1, "step": 12, "ti')  # a torn marker
    for step in (8, 10, 12, 6):  # 6: killed after its marker, before the pending one was removed
        (ck / ckptlib.pending_name(step)).write_text("{}")
    # Not ours: a step copied in by hand without its marker, and a user's own folder.
    shutil.copytree(ck / "4", ck / "5")
    (ck / "5" / ckptlib.MARKER).unlink()
    (ck / "7").mkdir()
    (ck / "7" / "notes.txt").write_text("mine")
    ckpt = ckptlib.Checkpointer(cfg(run_dir="c"), root)
    assert ckpt.removed == ["10.orbax-checkpoint-tmp-1234", "12", "8"]
    assert ckpt.ignored == ["5", "7"]
    assert sorted(p.name for p in ck.iterdir()) == ["4", "5", "6", "7"]
    assert (ck / "7" / "notes.txt").read_text() == "mine" and ckpt.latest_step() == 6
    with pytest.raises(ckptlib.CheckpointError, match="checkpoint step 8 .* is not committed"):
        ckpt.restore(8, None)
    # Saving over a directory that is not ours is refused, and the directory is untouched.
    state = trainer_on(cfg(), jax.devices()).fns.init()
    with pytest.raises(ckptlib.CheckpointError) as err:
        ckpt.save(7, state, {})
    assert str(err.value) == (f"checkpoint.dir: {ck}/7 already exists but is not a committed checkpoint of this "
                              f"run; it is left as it is. Move it away, or use another checkpoint.dir")
    assert sorted(p.name for p in ck.iterdir()) == ["4", "5", "6", "7"] and err.value.exit_code == 2
    ckpt.close()


def test_failed_async_save_is_reported_not_recorded(small_cfg, monkeypatch):
    from orbax.checkpoint._src.path import atomicity
    cfg = small_cfg("mesh.data=1")
    trainer = trainer_on(cfg, jax.devices()[:1])
    state = trainer.fns.init()
    rows = []
    ckpt = ckptlib.Checkpointer(cfg, cfg.run.dir, report=rows.append)
    ckpt.save(1, state, {})
    assert ckpt.finish() is True

    async def broken(self, *args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", broken)
    ckpt.save(2, state, {})
    assert ckpt.finish() is False
    assert rows[-1]["step"] == 2 and rows[-1]["latest_committed"] == 1
    assert "No space left on device" in rows[-1]["checkpoint_failed"], rows[-1]
    assert ckpt.latest_step() == 1 and list(ckpt.committed()) == [1]
    assert sorted(p.name for p in ckpt.directory.iterdir() if p.name[0].isdigit()) == ["1"]
    ckpt.close()


def test_retention_policy(small_cfg):
    cfg = small_cfg("checkpoint.keep=2", "checkpoint.keep_best=2", "checkpoint.best_metric=val_loss",
                    "checkpoint.keep_period=50")
    ckpt = ckptlib.Checkpointer.__new__(ckptlib.Checkpointer)
    ckpt.options = cfg.checkpoint
    losses = {10: 3.0, 20: 1.5, 30: 2.0, 40: 1.0, 50: 4.0, 60: 2.5, 70: 2.6, 80: None}
    committed = {s: {"metrics": {} if v is None else {"val_loss": v}} for s, v in losses.items()}
    assert ckpt.keep_set(committed) == {70, 80, 40, 20, 50}
    ckpt.options = small_cfg("checkpoint.keep=1", "checkpoint.keep_best=1", "checkpoint.best_mode=max").checkpoint
    assert ckpt.keep_set(committed) == {80, 50}


def test_policy_in_a_run_keeps_last_and_best(small_cfg):
    cfg = small_cfg("train.steps=8", "checkpoint.every=2", "checkpoint.keep=1", "checkpoint.keep_best=1",
                    "checkpoint.keep_period=4", "mesh.data=1", "train.eval_batches=1")
    result = fit(cfg, devices=jax.devices()[:1], quiet=True)
    committed = ckptlib.Checkpointer(cfg, result.run_dir).committed()
    evals = {r["step"]: r["val_loss"] for r in result.rows if "val_loss" in r}
    assert sorted(evals) == [2, 4, 6, 8]  # keep_best evaluates at every save
    best = min(evals, key=evals.get)
    assert set(committed) == {8, 4, best}
    assert all(committed[s]["metrics"] == {"val_loss": evals[s]} for s in committed)
    saved = [r for r in result.rows if "checkpoint_saved" in r]
    assert [r["checkpoint_saved"] for r in saved] == [2, 4, 6, 8]
    assert all(0 <= r["save_blocking_s"] <= r["save_total_s"] for r in saved)


SLOW_SAVE_S = 3.0  # far above the SMALL model's 2-batch evaluation


def test_the_last_save_starts_while_the_last_evaluation_runs_and_records_its_metrics(small_cfg, monkeypatch):
    from jaxtrain.train import Hook
    save, seen, loops, events = ckptlib.Checkpointer.save, [], [], []

    class Keep(Hook):
        def on_start(self, loop):
            loops.append(loop)
            evaluate = loop.setup.fns.evaluate

            def dispatch(*a, **k):
                events.append("evaluation dispatched")
                return evaluate(*a, **k)
            loop.setup.fns.evaluate = dispatch

    def spy(self, step, *a, **k):  # was this step's evaluation already read when its save began?
        seen.append((step, loops[0].last_eval.get("step") == step))
        events.append(f"save {step}")
        if step == 4:
            time.sleep(SLOW_SAVE_S)  # a slow blocking part: the save's time, not the evaluation's
        return save(self, step, *a, **k)
    monkeypatch.setattr(ckptlib.Checkpointer, "save", spy)
    cfg = small_cfg("train.steps=4", "train.eval_every=2", "checkpoint.every=2", "mesh.data=1")
    result = fit(cfg, devices=jax.devices()[:1], quiet=True, hooks=[Keep()])
    assert seen == [(2, True), (4, False)]  # step 2 after its evaluation; the last one during it
    # ... started before the evaluation's program: a one-device CPU program runs inline in the CLI, so a
    # save started after the dispatch would wait for the whole evaluation
    assert events == ["evaluation dispatched", "save 2", "save 4", "evaluation dispatched"]
    last = next(r for r in result.rows if r["step"] == 4 and "val_loss" in r)
    assert last["eval_time_s"] < SLOW_SAVE_S and loops[0].paused["checkpoint"] >= SLOW_SAVE_S
    committed = ckptlib.Checkpointer(cfg, result.run_dir).committed()
    evals = {r["step"]: r["val_loss"] for r in result.rows if "val_loss" in r}
    assert sorted(committed) == [2, 4] and all(committed[s]["metrics"] == {"val_loss": evals[s]} for s in (2, 4))


def test_save_due_by_steps_seconds_and_final(small_cfg, monkeypatch):
    from jaxtrain.checkpoint import checkpointer as mod
    clock = [1000.0]
    monkeypatch.setattr(mod.time, "monotonic", lambda: clock[0])
    ckpt = ckptlib.Checkpointer.__new__(ckptlib.Checkpointer)
    ckpt.options = small_cfg("checkpoint.every=10", "checkpoint.every_seconds=60").checkpoint
    ckpt._last_save_time, ckpt._last_step = 1000.0, None
    assert [s for s in range(1, 25) if ckpt.due(s)] == [10, 20]
    clock[0] = 1059.9
    assert not ckpt.due(21)
    clock[0] = 1060.0
    assert ckpt.due(21) and ckpt.due(23, final=True)
    ckpt._last_step = 23
    assert not ckpt.due(23, final=True)  # already saved at this step
