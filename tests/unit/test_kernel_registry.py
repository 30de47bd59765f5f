"""The kernel registry: the values each key takes, auto resolved once from the run's facts, calls the choice
refuses handed on under auto and named errors for an explicit choice, a provider another package adds."""
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

from jaxtrain.errors import AttentionBackendError, ConfigError
from jaxtrain.kernels import context, ops, registry
from jaxtrain.kernels import hooks as provider_hooks
from jaxtrain.kernels.registry import Facts
from jaxtrain.kernels.target import lowering_for


def names(plan):
    return {op: c.impl.name for op, c in plan.choices.items()}


def test_auto_resolves_per_backend_from_the_facts_alone():
    gpu = registry.plan({}, Facts(backend="gpu", dtype="bfloat16", head_dim=64))
    assert names(gpu) == {"attention": "cudnn", "matmul": "xla", "grouped_matmul": "ragged_dot", "optimizer": "xla"}
    assert names(registry.plan({}, Facts(backend="gpu", dtype="float32")))["attention"] == "pallas"
    assert names(registry.plan({}, Facts(backend="tpu")))["attention"] == "pallas"
    tpu = registry.plan({}, Facts(backend="tpu")).choice("attention")
    assert (tpu.impl.provider, tpu.impl.backends) == ("pallas_tpu", ("tpu",))
    # Several devices: the CPU provider's one-device kernels are passed over, and said why.
    facts = Facts(backend="cpu", devices=8, dtype="float32")  # as if the library built (nothing here runs it)
    cpu8 = registry.KernelPlan(facts, {op: registry.choose(op, "auto", facts, available=False) for op in registry.KEYS})
    assert names(cpu8) == {"attention": "blockwise", "matmul": "xla", "grouped_matmul": "cpu_fused", "optimizer": "xla"}
    assert cpu8.choice("attention").line() == ("model.attention=auto -> blockwise (cpu_fused: runs on one device, "
                                               "here 8; causal self-attention by query blocks)")
    # The rules split the length: blockwise's blocks would move between devices, so XLA's attention.
    split = registry.plan({}, Facts(backend="cpu", devices=8, length_split=True)).choice("attention")
    assert split.impl.name == "xla" and dict(split.passed_over)["blockwise"].startswith("the rules split the length")


def test_what_the_config_shows_decides_before_anything_is_traced():
    packed = registry.choose("attention", "auto", Facts(backend="cpu", segment_ids=True), available=False)
    assert packed.impl.name == "blockwise"
    assert dict(packed.passed_over) == {"cpu_fused": "segment ids (packed or padded documents: data.mode)"}
    bf16 = registry.choose("matmul", "auto", Facts(backend="cpu", dtype="bfloat16"), available=False)
    assert bf16.impl.name == "xla" and dict(bf16.passed_over) == {"cpu_fused": "computes in float32, model.dtype is "
                                                                               "bfloat16"}
    host = registry.choose("optimizer", "auto", Facts(backend="cpu", host_state=True), available=False)
    assert dict(host.passed_over) == {"cpu_fused": "the state lives in host memory (offload.optimizer or "
                                                   "offload.params)"}
    low = registry.choose("optimizer", "auto", Facts(backend="cpu", state_dtypes=("bfloat16", "float32")),
                          available=False)
    assert dict(low.passed_over)["cpu_fused"] == ("float32 params and moments only, here bfloat16 "
                                                 "(optimizer.master_weights=false)")


def test_an_explicit_choice_that_cannot_run_is_a_named_error_never_a_fallback():
    with pytest.raises(AttentionBackendError) as e:
        registry.check("attention", "cudnn", Facts(backend="cpu"))
    assert str(e.value) == ("model.attention: cudnn runs on gpu; the backend is 'cpu' "
                            "(use auto, xla, blockwise, ring, pallas or cpu_fused)")
    with pytest.raises(ConfigError) as e:
        registry.check("optimizer", "cpu_fused", Facts(backend="cpu", devices=2))
    assert str(e.value) == ("optimizer.implementation=cpu_fused cannot run here: runs on one device, here 2 "
                            "(use auto or xla)")
    with pytest.raises(AttentionBackendError) as e:
        registry.check("attention", "cpu_fused", Facts(backend="cpu", seq_len=100))
    assert str(e.value) == ("model.attention=cpu_fused cannot run here: length 100 (data.seq_len) is not a multiple "
                            "of 16 up to 1024 (use auto or blockwise)")
    with pytest.raises(ConfigError) as e:
        registry.check("grouped_matmul", "bogus", Facts(backend="cpu"))
    assert str(e.value) == ("model.grouped_matmul: unknown implementation 'bogus' "
                            "(known: auto, ragged_dot, windows, blocks, cpu_fused)")
    # It runs, but auto would not pick it here: a warning beside the choice.
    blockwise = registry.choose("attention", "blockwise", Facts(backend="cpu", devices=8, length_split=True))
    assert blockwise.warning.startswith("the rules split the length over devices")


@pytest.mark.kernels  # the explicit cpu_fused must be available to reach the call's own check
def test_a_call_the_choice_refuses_goes_to_the_next_candidate_under_auto_only():
    q32 = jnp.zeros((1, 8, 2, 64), jnp.float32)  # 8 long: the fused CPU kernel takes multiples of 16
    q16, seg = q32.astype(jnp.bfloat16), jnp.zeros((1, 8), jnp.int32)
    call = lambda q, s=None: ops.AttentionCall(q, q, s, None, True)  # noqa: E731
    facts = Facts(backend="cpu", devices=1)  # resolved as if the library built (nothing here runs it)
    plan = registry.KernelPlan(facts, {op: registry.choose(op, "auto", facts, available=False) for op in registry.KEYS})
    with context.planned(plan):
        assert plan.choice("attention").impl.name == "cpu_fused"
        assert ops.pick("attention", "auto", call(q32)).name == "blockwise"  # refused by length: the next one
        assert not ops.rotates_inside("auto", q32, q32)
        with pytest.raises(AttentionBackendError) as e:
            ops.pick("attention", "cpu_fused", call(q32))
        assert str(e.value) == ("model.attention=cpu_fused cannot run here: length 8 is not a multiple of 16 "
                                "(use auto or blockwise)")
        with lowering_for("gpu"):  # traced for another backend: resolved for that one
            assert ops.pick("attention", "auto", call(q16)).name == "cudnn"
            assert ops.pick("attention", "auto", call(q16, seg)).name == "pallas"  # cuDNN takes no segment ids
            assert ops.pick("attention", "auto", call(q32)).name == "pallas"
        with lowering_for("tpu"):
            assert ops.pick("attention", "auto", call(q32)).name == "pallas"


def test_a_model_called_alone_resolves_each_call_from_jaxs_devices():
    x, w = jnp.ones((4, 8)), jnp.ones((8, 3))
    assert jax.device_count() == 8  # the tests' simulated devices: the one-device kernels do not take it
    assert ops.choice("matmul", "auto").impl.name == "xla"
    assert float(ops.matmul(x, w)[0, 0]) == 8.0
    with pytest.raises(ConfigError, match=r"model.matmul=cpu_fused cannot run here: runs on one device, here 8"):
        ops.matmul(x, w, "cpu_fused")


PLUGIN = textwrap.dedent('''
    from jaxtrain.kernels.hooks import RuntimeHooks
    from jaxtrain.kernels.registry import Implementation

    def doubled(x, w):
        return 2 * (x @ w)

    class Hooks(RuntimeHooks):
        def runs_inline(self, n_devices):
            return n_devices == 3

    class Provider:
        name = "twice"
        hooks = Hooks()

        def implementations(self):
            return [Implementation("matmul", "twice", ("cpu",), {"matmul": doubled}, auto={"cpu": -1},
                                   reason="a test's provider, ahead of every other")]

    PROVIDER = Provider()
''')


def test_a_provider_another_package_adds_is_named_by_the_config_and_picked_by_auto(tmp_path, monkeypatch):
    (tmp_path / "twice_kernels.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(registry.PROVIDERS, "twice", "twice_kernels")
    registry._impls.clear()
    try:
        assert "twice" in registry.names("matmul") and registry.known("matmul", "twice")
        from jaxtrain import config as cfglib
        assert cfglib.load(None, ["model.matmul=twice"]).model.matmul == "twice"
        chosen = registry.choose("matmul", "auto", Facts(backend="cpu"), available=False)
        assert (chosen.impl.provider, chosen.impl.name) == ("twice", "twice")
        assert float(ops.matmul(jnp.ones((2, 4)), jnp.ones((4, 1)), "twice")[0, 0]) == 8.0
        assert provider_hooks.runs_inline(3)  # the plugin's hook says so for 3 devices (and no other)
        plugin = [h for h in provider_hooks.hooks() if type(h).__module__ == "twice_kernels"]
        assert [(h.runs_inline(3), h.runs_inline(1)) for h in plugin] == [(True, False)]
    finally:
        registry.PROVIDERS.pop("twice", None)
        registry._loaded.pop("twice", None)
        registry._impls.clear()
        sys.modules.pop("twice_kernels", None)


def test_a_provider_module_without_its_provider_is_named():
    registry.register("empty", "json")  # a module with no PROVIDER
    try:
        with pytest.raises(ConfigError, match="kernel provider 'empty': module json defines no PROVIDER named 'empty'"):
            registry.providers()
    finally:
        registry.PROVIDERS.pop("empty")
        registry._impls.clear()
