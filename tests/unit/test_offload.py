"""Host-memory offload (jaxtrain.parallel.offload): named config errors, the compiled step's memory kinds
and host annotations, the memory model's device/host split, the activation names, a custom model."""
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMALL, put_windows
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtrain import config as cfglib
from jaxtrain.data import ArrayData
from jaxtrain.errors import ConfigError
from jaxtrain.kernels.target import lowering_for
from jaxtrain.metrics import memory
from jaxtrain.parallel import offload
from jaxtrain.train import ModelSpec, fit, setup

SCANNED = [*SMALL, "model.scan_layers=true", "model.remat=full"]


def small(*overrides):
    return cfglib.load(None, [*SCANNED, *overrides])


@pytest.mark.parametrize("overrides, message", [
    (["model.scan_layers=false", "offload.params=host"],
     "offload.params: host fetches each layer's weights inside the scan over stacked layers; set "
     "model.scan_layers=true"),
    (["model.remat=none", "offload.params=host"],
     "offload.params: host needs model.remat=full or save_matmuls (with remat none the backward pass would keep "
     "every layer's fetched weights in device memory)"),
    (["mesh.stage=2", "offload.params=host"],
     "offload.params: host is not supported with pipeline stages (mesh.stage=2); use mesh.stage=1"),
    (["offload.activations=[qkv,mlp_in,qkv]"],
     "offload.activations: 'qkv' named twice in ['qkv', 'mlp_in', 'qkv']"),
    (["model.remat=none", "offload.activations=[qkv]"],
     "offload.activations: saving activations to host instead of recomputing them needs model.remat=full or "
     "save_matmuls (with remat none nothing is recomputed, and the backward pass keeps derivative terms, not the "
     "named activations)"),
    (["offload.activations=[' ']"], "offload.activations: empty name in [' ']"),
    (["offload.optimizer=cpu"], "offload.optimizer: Input should be 'device' or 'host' (got 'cpu')"),
])
def test_named_config_errors(overrides, message):
    with pytest.raises(ConfigError) as err:
        small(*overrides)
    assert str(err.value) == message


def test_unknown_activation_names_list_the_known_ones():
    for family, tags in (("llama", "attn_in, attn_out, mlp_hidden, mlp_in, qkv"),
                         ("mixtral", "attn_in, attn_out, mlp_in, qkv")):
        with pytest.raises(ConfigError) as err:
            setup(small(f"model.family={family}", "offload.activations=[qkv,attn_scores]"), jax.devices()[:1],
                  vocab=256)
        assert str(err.value) == f"offload.activations: 'attn_scores' not tagged by model '{family}'; it tags: {tags}"


def host_typed_eqns(jaxpr, depth=0, found=None):
    """(primitive, nesting depth) of every equation with a host-typed output, in every nested jaxpr."""
    found = [] if found is None else found
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        if any(getattr(v.aval, "memory_space", None) == jax.memory.Space.Host for v in eqn.outvars):
            found.append((eqn.primitive.name, depth))
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else (v,):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    host_typed_eqns(sub, depth + 1, found)
    return found


def test_optimizer_offload_compiled_step(capfd):
    """bf16 params with float32 masters: the masters and both moments are pinned_host in the compiled step's
    inputs and outputs (donated), S(5) in its entry layout; in the traced step the only host-typed values are
    the final puts back (every gradient and intermediate is a device value); lowered for cuda, each host leaf is
    fetched (twice for the masters: forward and update) and put back; compiling prints no host-compute warning."""
    s = setup(small("offload.optimizer=host", "model.param_dtype=bfloat16", "model.dtype=bfloat16"),
              jax.devices()[:1], vocab=256)
    step = s.fns.train_step
    capfd.readouterr()
    traced = step.inner.trace(s.abstract_state(), s.abstract_batch(), step.hparams)
    compiled = traced.lower().compile()
    n = len(jax.tree_util.tree_leaves(s.abstract_state()["params"]))  # 21
    host_leaves = 3 * n  # masters, mu, nu
    kinds = lambda tree: Counter(x.memory_kind for x in jax.tree_util.tree_leaves(tree))  # noqa: E731
    state_in = compiled.input_shardings[0][0]
    assert kinds(state_in["params"]) == {"pinned_host": n}
    assert kinds(state_in["opt_state"]) == {"pinned_host": 2 * n, "device": 1}  # Adam's count stays
    assert kinds(compiled.output_shardings[0]) == kinds(state_in) == {"pinned_host": host_leaves, "device": 3}
    entry = compiled.as_text().splitlines()[0]
    assert entry.count("S(5)") == 2 * host_leaves  # host memory space: each leaf in and out
    assert re.search(r"input_output_alias=\{[^}]+\}", entry)  # donated
    assert Counter(host_typed_eqns(traced.jaxpr)) == {("device_put", 0): host_leaves}
    with lowering_for("gpu"):
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    placements = Counter(re.findall(r'_xla_buffer_placement = "(\w+)"', text))
    assert placements["pinned_host"] == 2 * host_leaves  # the puts back, and the results' annotations
    assert placements["device"] >= n + host_leaves  # masters for the forward; masters and moments for the update
    assert "host" not in capfd.readouterr().err.lower()


def test_memory_model_device_bytes_drop_by_the_offloaded_bytes():
    base_s = setup(small(), jax.devices()[:1], vocab=256)
    base = memory.state_report(base_s.abstract_state(), base_s.fns.state_shardings)
    assert base.host == 0
    opt_s = setup(small("offload.optimizer=host"), jax.devices()[:1], vocab=256)
    opt = memory.state_report(opt_s.abstract_state(), opt_s.fns.state_shardings)
    moments = base.opt_state - 4  # all but Adam's int32 count
    assert (opt.opt_state, opt.opt_state_host, opt.params_host) == (4, moments, 0)  # float32 params: no masters
    assert opt.state == base.state - moments and opt.host == moments
    par_s = setup(small("offload.optimizer=host", "offload.params=host"), jax.devices()[:1], vocab=256)
    par = memory.state_report(par_s.abstract_state(), par_s.fns.state_shardings)
    assert (par.params, par.params_host, par.grads) == (0, base.params, base.params)  # grads stay on device
    assert par.state == base.state - moments - base.params and par.host == moments + base.params
    # The compiled figures: XLA:CPU counts pinned_host in the arguments and reports no host bytes.
    compiled, abstract = opt_s.compile_abstract()
    rep = memory.state_report(abstract, opt_s.fns.state_shardings, compiled)
    assert compiled.memory_analysis().host_argument_size_in_bytes == 0
    assert rep.compiled["host_source"] == "memory model" and rep.compiled["host"] == moments
    assert rep.compiled["device_peak"] == rep.compiled["peak"] - moments
    assert "; host memory: params 0 B, optimizer 834.5 KiB | compiled: " in rep.summary()
    assert "device peak" in rep.summary() and "XLA:CPU counts pinned_host in the arguments" in rep.summary()


def test_activation_estimate_moves_named_residuals_to_host():
    s = setup(small("model.remat=save_matmuls"), jax.devices()[:1], vocab=256)
    micro = {k: jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for k, x in s.abstract_batch().items()}
    plain = memory.activation_bytes(s.model_spec, micro)
    moved = memory.activation_bytes(s.model_spec, micro,
                                    lambda: offload.active(offload.Plan(activations=("qkv", "mlp_hidden"))))
    # 2 layers x 4 bytes x [8, 32] tokens x (q, k, v: 4|2|2 heads x 16, the SwiGLU hidden: 128)
    per_token = 2 * 4 * 8 * 32
    assert plain[1] == 0 and moved[1] == per_token * (4 * 16 + 2 * 16 + 2 * 16 + 128)
    # q, k, v were recomputed (not matmul outputs: rotary, the heads' split), so the device keeps no less;
    # the hidden product was recomputed too, but the up-projection it is made from was a saved matmul
    assert moved[0] == plain[0] - per_token * 128


def test_offloading_policy_combines_with_the_base_policy():
    def f(x, w):
        y = checkpoint_name(x @ w, "a")
        return jnp.sin(checkpoint_name(jnp.sin(y) @ w, "b")).sum()
    policy = offload.offloading_policy(["a"], jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    res = jax.make_jaxpr(lambda x, w: jax.vjp(jax.checkpoint(f, policy=policy), x, w)[1])(
        jnp.ones((3, 4)), jnp.ones((4, 4))).out_avals
    assert sorted(str(a.memory_space) for a in res if a.shape == (3, 4)) == [
        "MemorySpace.Device", "MemorySpace.Device", "MemorySpace.Host"]  # x, the saved dot 'b'; 'a' offloaded
    assert offload.offloading_policy([], None) is None


class TaggedMLP(nnx.Module):
    """A custom model: tags its hidden layer and wraps it in offload.checkpoint."""

    def __init__(self, rngs):
        self.w1 = nnx.Param(jax.random.normal(rngs.params(), (8, 16)) * 0.3, axes=("embed", "mlp"))
        self.w2 = nnx.Param(jax.random.normal(rngs.params(), (16, 2)) * 0.3, axes=("mlp", "classes"))

    def __call__(self, x):
        hidden = offload.checkpoint(lambda x, w: checkpoint_name(jnp.tanh(x @ w), "hidden"))(x, self.w1[...])
        return hidden @ self.w2[...]


def mse(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean(), {}


def test_a_custom_model_trains_alike_with_every_offload(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype(np.float32)
    y = np.stack([x[:, 0] - x[:, 1], x[:, 2]], 1).astype(np.float32)
    losses = {}
    for name, extra in [("base", []), ("all", ["offload.optimizer=host", "offload.params=host",
                                               "offload.activations=[hidden]"])]:
        cfg = cfglib.load(None, ["model.family=custom", "mesh.data=1", "train.global_batch=8", "train.steps=5",
                                 "train.eval_every=1000", "train.eval_batches=1", "train.log_every=1",
                                 "run.progress=false", "checkpoint.enabled=false", "sharding.rules=dp",
                                 "sharding.extra_rules={classes: [null]}", f"run.dir={tmp_path / name}", *extra])
        spec = ModelSpec(make=TaggedMLP, loss=mse, name="tagged_mlp")
        out = fit(cfg, spec, ArrayData({"x": x, "y": y}, {"x": x[:8], "y": y[:8]}, cfg), devices=jax.devices()[:1],
                  quiet=True)
        losses[name] = [out.losses[s] for s in range(1, 6)]
        if name == "all":
            assert {p.sharding.memory_kind for p in jax.tree_util.tree_leaves(out.state["params"])} == {"pinned_host"}
    np.testing.assert_allclose(losses["all"], losses["base"], rtol=1e-6)
    cfg = cfg.model_copy(update={"offload": cfg.offload.model_copy(update={"activations": ["hiden"]})})
    with pytest.raises(ConfigError, match=r"^offload.activations: 'hiden' not tagged by model 'tagged_mlp'; "
                                          r"it tags: hidden$"):
        fit(cfg, ModelSpec(make=TaggedMLP, loss=mse, name="tagged_mlp"),
            ArrayData({"x": x, "y": y}, {"x": x[:8], "y": y[:8]}, cfg), devices=jax.devices()[:1], quiet=True)


def test_a_nonfinite_step_keeps_the_host_resident_state():
    """The per-leaf guard of guarded_update: a NaN step changes no parameter or moment (NaN kept as NaN)."""
    fns = setup(small("offload.optimizer=host", "offload.params=host"), jax.devices()[:1], vocab=256).fns
    batch = put_windows(np.random.default_rng(0).integers(0, 256, (1, 8, 33), dtype=np.int32), fns.batch_sharding)
    good, m = fns.train_step(fns.init(), batch)
    assert int(m["nonfinite"]) == 0
    bad = jax.tree_util.tree_map(lambda x: x, good)
    head = good["params"]["lm_head"]
    bad["params"]["lm_head"] = jax.device_put(np.full(head.shape, np.nan, np.float32), head.sharding)
    snapshot = jax.device_get(bad)
    after, m = fns.train_step(bad, batch)
    assert int(m["nonfinite"]) == 1 and int(after["step"]) == 2
    assert after["params"]["lm_head"].sharding.memory_kind == "pinned_host"
    got = jax.device_get(after)
    for key in ("params", "opt_state"):
        for x, y in zip(jax.tree_util.tree_leaves(got[key]), jax.tree_util.tree_leaves(snapshot[key])):
            np.testing.assert_array_equal(x, y)
