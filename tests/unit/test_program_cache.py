"""The program cache: exported init, train step and evaluation kept across runs
(jaxtrain.train.program_cache)."""
from __future__ import annotations

import dataclasses
from collections import namedtuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jaxtrain.errors import InputError
from jaxtrain.kernels.cpu import program_cache, program_files
from jaxtrain.train import fit
from jaxtrain.train.assembly import setup


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The cache on, in a folder of the test's own; off again afterwards."""
    monkeypatch.setenv(program_cache.DIR_VAR, str(tmp_path / "programs"))
    monkeypatch.delenv(program_cache.SWITCH, raising=False)
    assert program_cache.enable()
    yield tmp_path / "programs"
    program_cache.disable()


def _exports(monkeypatch) -> list:
    calls = []
    real = program_cache._export
    monkeypatch.setattr(program_cache, "_export", lambda fn, *a: calls.append(fn) or real(fn, *a))
    return calls


def _losses(result) -> list:
    return [(r["step"], r.get("loss"), r.get("grad_norm"), r.get("val_loss")) for r in result.rows
            if "loss" in r or "val_loss" in r]


def test_a_run_from_the_cache_equals_a_traced_run_bitwise(small_cfg, cache, monkeypatch):
    """Cache off, cold (exports and stores the three programs), warm (loads all three, exports
    nothing): the same losses, gradient norms and validation loss to the last bit."""
    one = jax.devices()[:1]
    cfg = lambda name: small_cfg("train.steps=3", "train.log_every=1", "train.eval_every=3",  # noqa: E731
                                 "mesh.data=1", "checkpoint.enabled=false", run_dir=name)
    program_cache.disable()
    traced = _losses(fit(cfg("off"), devices=one, quiet=True))
    program_cache.enable()
    exports, calls = _exports(monkeypatch), []
    real_call = program_cache.Program.__call__
    monkeypatch.setattr(program_cache.Program, "__call__", lambda p, *a: calls.append(p.loaded) or real_call(p, *a))
    cold = _losses(fit(cfg("cold"), devices=one, quiet=True))
    assert len(exports) == 3  # init, train step, evaluation
    assert calls == [False] * 5  # and they ran: init, 3 steps, one evaluation
    [entry] = list(cache.iterdir())
    assert sorted(p.name for p in entry.iterdir()) == [
        "evaluate.jaxexp", "evaluate.json", "init.jaxexp", "init.json", "train_step.jaxexp", "train_step.json"]
    exports.clear(), calls.clear()
    warm = _losses(fit(cfg("warm"), devices=one, quiet=True))
    assert exports == [] and calls == [True] * 5
    assert len(traced) == 4 and traced[-1][3] is not None
    assert cold == traced and warm == traced


def _setup(small_cfg, *overrides, devices=1):
    return setup(small_cfg("mesh.data=-1", *overrides), jax.devices()[:devices], vocab=256)


def test_the_key_follows_what_shapes_a_program(small_cfg, cache, monkeypatch, tmp_path):
    base = program_cache.key(_setup(small_cfg))
    same = ["train.steps=7", "train.eval_batches=3", "train.log_every=2", "checkpoint.every=5", "run.progress=false",
            "data.seed=3", "data.val_fraction=0.2"]
    for override in same:  # the loop's keys: the same programs
        assert program_cache.key(_setup(small_cfg, override)) == base, override
    other = ["model.n_layers=3", "train.seed=5", "train.global_batch=16", "optimizer.weight_decay=0.0",
             "data.seq_len=16", "data.mode=packed"]
    for override in other:
        assert program_cache.key(_setup(small_cfg, override)) != base, override
    source = tmp_path / "module.py"  # an edited source file: another key
    source.write_text("x = 1\n")
    sources = program_cache.sources()
    monkeypatch.setattr(program_cache, "sources", lambda: [*sources, ("jaxtrain/module.py", source)])
    before = program_cache.key(_setup(small_cfg))
    source.write_text("x = 2\n")
    assert program_cache.key(_setup(small_cfg)) != before != base


def _evaluation(s, n_batches: int):
    state = s.abstract_state()
    sharding = s.fns.batch_sharding
    batches = {k: jax.ShapeDtypeStruct((n_batches, s.cfg.micro_batch, s.cfg.data.seq_len), jnp.int32,
                                       sharding=sharding) for k in ("inputs", "targets", "loss_mask")}
    return program_cache.evaluate(s, state["params"], batches)


def test_a_damaged_entry_is_traced_again_and_replaced(small_cfg, cache):
    s = _setup(small_cfg)
    assert _evaluation(s, 2).loaded is False
    assert _evaluation(s, 2).loaded is True
    path = cache / s._program_key / "evaluate.jaxexp"
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])  # e.g. a write cut short by a full disk
    assert _evaluation(s, 2).loaded is False
    assert len(path.read_bytes()) == len(good)  # replaced by a whole one
    assert _evaluation(s, 2).loaded is True
    (cache / s._program_key / "evaluate.json").write_text("{not json")
    assert _evaluation(s, 2).loaded is False
    assert _evaluation(s, 2).loaded is True


@pytest.mark.kernels  # auto picks the fused attention where it built
def test_a_loaded_program_traces_nothing_and_the_plan_says_what_auto_chose(small_cfg, cache):
    """What auto chose is the run plan's, resolved before anything is traced: a run that loads its programs
    from the cache traces no model and still has every choice (resolved.json, the start-up lines)."""
    s = _setup(small_cfg)
    assert s.plan.kernels.choice("attention").impl.name == "cpu_fused"
    assert _evaluation(s, 2).loaded is False
    assert _evaluation(s, 2).loaded is True
    assert s.plan.kernels.lines()[0] == ("model.attention=auto -> cpu_fused (one fused kernel per (batch, kv head), "
                                         "the rotary embedding inside)")


def test_a_failed_store_is_said_once_and_the_run_goes_on(small_cfg, cache, monkeypatch):
    import logging
    lines: list = []
    handler = logging.Handler()
    handler.emit = lambda r: lines.append(r.getMessage())
    monkeypatch.setattr(logging.getLogger("jaxtrain"), "handlers", [handler])
    monkeypatch.setattr(program_files, "_store_failed", [])
    s = _setup(small_cfg)
    s._program_key = program_cache.key(s)
    (cache / s._program_key).write_text("a file where the entry's folder goes")
    assert _evaluation(s, 2).loaded is False and _evaluation(s, 2).loaded is False  # compiled all the same
    assert lines == [f"warning: jaxtrain's program cache: storing the traced evaluate in {cache / s._program_key} "
                     f"failed (File exists); later runs trace it again"]


def test_an_entry_for_other_shapes_is_not_used(small_cfg, cache):
    s = _setup(small_cfg)
    assert _evaluation(s, 2).loaded is False
    program = _evaluation(s, 3)  # train.eval_batches changed: the key is the same, the shapes are not
    assert program.loaded is False
    assert program.compiled.in_avals[0][-1].shape == (3, s.cfg.micro_batch, s.cfg.data.seq_len)


def test_where_the_cache_does_not_apply(small_cfg, cache):
    assert program_cache.applies(_setup(small_cfg))
    assert not program_cache.applies(_setup(small_cfg, devices=2))  # one device only
    assert not program_cache.applies(_setup(small_cfg, "offload.optimizer=host"))
    s = _setup(small_cfg)
    plugin = dataclasses.replace(s.family, model=type("Model", (), {"__module__": "someone.models"}))
    assert not program_cache.applies(dataclasses.replace(s, family=plugin))  # code the key does not hash
    program_cache.disable()
    assert not program_cache.applies(s)
    assert program_cache.init(s) is None


def test_the_switch(monkeypatch):
    assert program_cache.enable({}) is True
    assert program_cache.enable({program_cache.SWITCH: "0"}) is False
    with pytest.raises(InputError) as err:
        program_cache.enable({program_cache.SWITCH: "off"})
    assert str(err.value) == ("JAXTRAIN_PROGRAM_CACHE='off': expected 1 (keep exported programs across runs, "
                              "the default) or 0 (trace every run)")
    program_cache.disable()


def test_output_structures_round_trip_through_json():
    State = namedtuple("State", "mu nu")
    state = {"params": {"w": 1.0}, "opt": (State(1.0, 2.0),)}
    refs = {"state": jax.tree_util.tree_structure(state)}
    out = (state, {"loss": 1.0, "aux": [None, 2.0]})
    encoded = program_files.encode(out, refs)
    assert encoded == {"tuple": [{"ref": "state"}, {"dict": {"loss": "leaf", "aux": {"list": [None, "leaf"]}}}]}
    decoded = program_files.decode(__import__("json").loads(__import__("json").dumps(encoded)), refs)
    assert jax.tree_util.tree_structure(decoded) == jax.tree_util.tree_structure(out)
    with pytest.raises(TypeError, match="cannot record a State node"):
        program_files.encode((State(1.0, 2.0),), {})


def test_linear_algebra_kernels_are_registered_only_for_a_program_that_calls_them(monkeypatch):
    from jax._src.lax import linalg
    calls = []
    monkeypatch.setattr(linalg, "initialize_lapack", lambda: calls.append(1))
    plain = export.export(jax.jit(lambda x: x @ x))(jax.ShapeDtypeStruct((4, 4), jnp.float32))
    solver = export.export(jax.jit(jnp.linalg.cholesky))(jax.ShapeDtypeStruct((4, 4), jnp.float32))
    assert not program_cache.calls_lapack(plain)
    assert program_cache.calls_lapack(solver)  # its custom call: lapack_spotrf_ffi
    x = jnp.eye(4)
    with program_cache._without_lapack(True):
        np.testing.assert_array_equal(jax.jit(plain.call).lower(x).compile()(x), x)
    assert calls == []
    with program_cache._without_lapack(False):
        jax.jit(solver.call).lower(x).compile()
    assert calls == [1]


def test_a_program_that_cannot_be_exported_is_tried_once(small_cfg, cache, monkeypatch):
    """e.g. a kernel's custom call jax.export refuses: jit compiles it, and later runs do not trace it
    a second time only to fail again."""
    s = _setup(small_cfg)
    tries = []

    def refuse(*args):
        tries.append(1)
        raise ValueError("Cannot serialize code with custom calls whose targets have no compatibility guarantees")
    monkeypatch.setattr(program_cache, "_export", refuse)
    assert _evaluation(s, 2) is None and _evaluation(s, 2) is None
    assert tries == [1]
    assert (cache / s._program_key / "evaluate.unexportable").read_text().startswith("ValueError: Cannot serialize")


def test_a_stored_program_that_does_not_compile_is_exported_again_next_time(small_cfg, cache, monkeypatch):
    """A stored entry that loads but fails to compile is dropped, not marked unexportable: the next run
    exports it anew (a program this run exported itself and cannot compile is marked, as above)."""
    s = _setup(small_cfg)
    assert _evaluation(s, 2).loaded is False
    real = program_cache._without_lapack

    def failing(skip):
        raise RuntimeError("INTERNAL: the stored program does not compile here")
    monkeypatch.setattr(program_cache, "_without_lapack", failing)
    assert _evaluation(s, 2) is None  # jit compiles it instead
    entry = cache / s._program_key
    assert not (entry / "evaluate.unexportable").exists() and not (entry / "evaluate.jaxexp").exists()
    monkeypatch.setattr(program_cache, "_without_lapack", real)
    exports = _exports(monkeypatch)
    assert _evaluation(s, 2).loaded is False and len(exports) == 1  # exported anew
    assert _evaluation(s, 2).loaded is True


def test_an_attention_fallback_is_its_own_entry_and_bad_input_is_not_unexportable(small_cfg, cache, monkeypatch):
    """model.attention=auto traces the fused CPU kernel only where it built: a run where it did not
    (no compiler, say) must not hand its blockwise program to a later run where it did. And a config
    the model refuses while traced is the run's error, not a program the cache cannot take."""
    from jaxtrain.errors import ConfigError
    from jaxtrain.kernels.cpu import library as cpu_fused
    s = _setup(small_cfg)
    built = program_cache.key(s)
    monkeypatch.setattr(cpu_fused, "problem", lambda: "no C++ compiler")  # the plan then resolves otherwise
    without = _setup(small_cfg)
    assert without.plan.kernels.choice("attention").impl.name == "blockwise"
    assert program_cache.key(without) != built
    assert program_cache.key(_setup(small_cfg, "model.attention=blockwise")) == program_cache.key(
        _setup(small_cfg, "model.attention=blockwise"))

    def refuses(*_):
        raise ConfigError("model.attention=cpu_fused cannot run here: test")
    with pytest.raises(ConfigError, match="cannot run here: test"):
        program_cache.compiled(s, "evaluate", jax.jit(refuses), (), lambda out: out)
    assert not list(cache.rglob("*.unexportable"))
