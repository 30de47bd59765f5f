"""The train step, evaluation and sample compiled ahead on their own thread (jaxtrain.train.precompile)."""
import contextlib
import os
import subprocess
import sys
import textwrap
import threading

import jax
import numpy as np
import pytest
import xla_test_flags
import yaml
from jax._src import dispatch

from jaxtrain.errors import ShardingError
from jaxtrain.train import fit, setup
from jaxtrain.train.precompile import THREAD_NAME, Precompile
from jaxtrain.train.sample import generate
from jaxtrain.train.step import TrainStep
from jaxtrain.train.trainer import put_validation


@pytest.fixture
def run(small_cfg):
    s = setup(small_cfg("train.eval_batches=3", "mesh.data=1"), jax.devices()[:1], load_data=True)
    batch = next(s.data.iterator(s.fns.batch_sharding))
    return s, batch


def raw(x: jax.Array) -> np.ndarray:
    """An array's values (a PRNG key's as its key data)."""
    return np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)


@contextlib.contextmanager
def lowered():
    """The names of the programs lowered to MLIR meanwhile (JAX's own event, one per lowering)."""
    names = []

    def listener(event, seconds, fun_name="", **kw):
        if event == dispatch.JAXPR_TO_MLIR_MODULE_EVENT:
            names.append(fun_name)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_the_step_compiled_ahead_computes_what_the_jitted_step_does(run):
    s, batch = run
    pre = Precompile(s, s.data.val)
    state = s.fns.init()
    compiled = pre.train_step(state, batch)
    assert compiled is not None and pre.seconds > 0
    new, metrics = compiled(jax.tree.map(lambda x: x.copy(), state), batch)  # the step donates its state
    ref_new, ref_metrics = s.fns.train_step(s.fns.init(), batch)
    assert float(metrics["loss"]) == float(ref_metrics["loss"])
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(ref_new)):
        np.testing.assert_array_equal(raw(a), raw(b))


def test_a_batch_or_state_other_than_compiled_for_gets_none(run):
    s, batch = run
    pre = Precompile(s)
    state = s.fns.init()
    shorter = {k: v[:, :, :-1] for k, v in batch.items()}  # another sequence length
    assert pre.train_step(state, shorter) is None
    cast = {**state, "step": state["step"].astype(np.int64 if jax.config.x64_enabled else np.int16)}
    assert pre.train_step(cast, batch) is None
    assert pre.train_step(state, batch) is not None


def test_a_step_that_fails_to_compile_ahead_is_compiled_by_the_loop_which_raises_its_error(small_cfg, monkeypatch):
    where = []
    lower = TrainStep.lower

    def refuse(self, *a, **k):
        where.append(threading.current_thread().name)
        if len(where) == 1:
            raise RuntimeError("a failure of the thread alone")  # the loop's own compile then succeeds
        return lower(self, *a, **k)
    monkeypatch.setattr(TrainStep, "lower", refuse)
    cfg = small_cfg("train.steps=1", "mesh.data=1", "checkpoint.enabled=false", "train.sample_tokens=0")
    assert np.isfinite(fit(cfg, devices=jax.devices()[:1], quiet=True).val_loss)
    assert where == ["jaxtrain-precompile", "MainThread"]

    def bad(self, *a, **k):
        raise ShardingError("activation 'x': dimension 'length' (7) does not divide over mesh axis 'sequence' (2)")
    monkeypatch.setattr(TrainStep, "lower", bad)
    with pytest.raises(ShardingError, match=r"does not divide over mesh axis 'sequence' \(2\)"):
        fit(cfg.model_copy(update={"run": cfg.run.model_copy(update={"dir": cfg.run.dir + "2"})}),
            devices=jax.devices()[:1], quiet=True)


def test_the_evaluation_compiled_ahead_is_not_lowered_again_by_its_first_call(run):
    s, _ = run
    pre = Precompile(s, s.data.val)
    pre.wait("evaluation")
    params, val = s.fns.init()["params"], put_validation(s.data.val, s.fns.batch_sharding)
    with lowered() as names:
        out = s.fns.evaluate(params, val)
        assert out["loss"].shape == (3,) and "evaluate" not in " ".join(names)
        s.fns.evaluate.lower(params, {k: v[:2] for k, v in val.items()})  # another shape: lowered anew
        assert "evaluate" in " ".join(names)


def test_the_sample_compiled_ahead_is_not_lowered_again_by_generate(small_cfg):
    cfg = small_cfg("mesh.data=1")
    s = setup(cfg, jax.devices()[:1], load_data=True)
    pre = Precompile(s, None, (7, cfg.data.seq_len, 0.8))
    pre.wait("sample")
    params = s.fns.init()["params"]
    with lowered() as names:
        ids = generate(s.fns.apply, params, np.array([1, 2, 3]), 7, cfg.data.seq_len, 0.8, seed=0)
        assert ids.shape == (10,) and "_sample_loop" not in " ".join(names)
        generate(s.fns.apply, params, np.array([1, 2, 3]), 8, cfg.data.seq_len, 0.8, seed=0)  # another length
        assert "_sample_loop" in " ".join(names)


@pytest.mark.parametrize("mesh", [("mesh.data=1",), ("mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2")])
def test_fit_traces_the_train_step_once_on_the_precompile_thread(small_cfg, monkeypatch, mesh):
    threads = []
    lower = TrainStep.lower
    monkeypatch.setattr(TrainStep, "lower", lambda self, *a, **k: (threads.append(threading.current_thread().name),
                                                                    lower(self, *a, **k))[1])
    cfg = small_cfg("train.steps=2", *mesh, "checkpoint.every=2", "train.sample_tokens=0")
    devices = jax.devices()[:cfg.mesh.fsdp * cfg.mesh.tensor]
    result = fit(cfg, devices=devices, quiet=True)
    assert threads == ["jaxtrain-precompile"]
    assert result.compile_s > 0 and np.isfinite(result.val_loss)
    # Resumed from the checkpoint: the restored state is what was compiled for, too.
    resumed = fit(cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": 3})}), devices=devices,
                  quiet=True)
    assert resumed.start_step == 2 and threads == ["jaxtrain-precompile"] * 2


def test_cancel_skips_the_compiles_not_yet_started(run):
    s, _ = run
    pre = Precompile(s, s.data.val)
    pre.cancel()  # while the step still compiles: the evaluation is then never started
    pre.wait("evaluation")
    params, val = s.fns.init()["params"], put_validation(s.data.val, s.fns.batch_sharding)
    with lowered() as names:
        s.fns.evaluate(params, val)
    assert "evaluate" in " ".join(names)


def test_a_process_that_ends_while_a_compile_is_in_flight_exits_cleanly(small_cfg, tmp_path):
    # A daemon thread torn down mid-compile aborted the interpreter (exit 134, "FATAL: exception not rethrown").
    config = tmp_path / "small.yaml"
    config.write_text(yaml.safe_dump(small_cfg("mesh.data=1").to_dict()))
    script = tmp_path / "ends_early.py"
    script.write_text(textwrap.dedent(f"""
        import threading, jax
        from jax._src import compiler
        from jaxtrain import config
        from jaxtrain.train import setup
        from jaxtrain.train.precompile import THREAD_NAME, Precompile
        compiling, backend_compile = threading.Event(), compiler.backend_compile_and_load
        def announced(*args, **kwargs):  # the precompile thread entered XLA's compile
            if threading.current_thread().name == THREAD_NAME:
                compiling.set()
            return backend_compile(*args, **kwargs)
        compiler.backend_compile_and_load = announced
        s = setup(config.load({str(config)!r}, []), jax.devices()[:1], load_data=True)
        Precompile(s, s.data.val)
        assert compiling.wait(120), "the precompile thread never reached XLA's compile"
        print([t.name for t in threading.enumerate() if t.is_alive()].count(THREAD_NAME), flush=True)
    """))
    env = {**os.environ, "XLA_FLAGS": xla_test_flags.with_devices(1)}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout) == (0, "1\n"), done.stderr[-2000:]  # it ended with the compile in flight
    assert "FATAL" not in done.stderr and THREAD_NAME == "jaxtrain-precompile"


def test_whatever_ends_the_thread_its_waiters_are_released(run, monkeypatch):
    s, _ = run

    def broken(name, compile_fn):  # an error outside the guarded compiles: nothing may wait forever
        raise RuntimeError("broken")
    monkeypatch.setattr(Precompile, "_warm", staticmethod(broken))
    pre = Precompile(s, s.data.val, (4, s.cfg.data.seq_len, 1.0))
    waiters = [threading.Thread(target=pre.wait, args=(name,)) for name in ("evaluation", "sample")]
    for w in waiters:
        w.start()
    for w in waiters:
        w.join(timeout=60)
    assert [w.is_alive() for w in waiters] == [False, False]
    assert pre.train_step(s.fns.init(), next(s.data.iterator(s.fns.batch_sharding))) is not None


@pytest.mark.parametrize("eval_batches, group", [(6, 6), (17, 1), (40, 10)])
def test_the_evaluation_groups_small_batches_and_each_batch_keeps_its_values(small_cfg, eval_batches, group):
    """On one device the evaluation runs small batches side by side (a vmap in its scan); every
    batch's loss is the one its own forward pass gives, bit for bit."""
    from jaxtrain.train.evaluation import eval_group
    s = setup(small_cfg(f"train.eval_batches={eval_batches}", "mesh.data=1"), jax.devices()[:1], load_data=True)
    assert eval_group(eval_batches, s.cfg.micro_batch * s.cfg.data.seq_len) == group  # 8 x 32 tokens a batch
    params = s.fns.init()["params"]
    val = put_validation(s.data.val, s.fns.batch_sharding)
    together = jax.device_get(s.fns.evaluate(params, val))
    for i in range(eval_batches):
        alone = jax.device_get(s.fns.eval_step(params, jax.tree_util.tree_map(lambda x: x[i], val)))
        for k in alone:
            assert together[k][i] == alone[k], (i, k)
