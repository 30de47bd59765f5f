"""The MoE experts through the XLA:CPU grouped kernels (jaxtrain/kernels/cpu/grouped.py, grouped.cc) and
``model.grouped_matmul``: the layer against the NumPy reference for both routings, when ``auto`` takes the
kernels, and the named error where ``cpu_fused`` cannot run. (Values and gradients of the kernels alone
against float64: test_moe.py's grouped-matmul test.)"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh
from test_moe import CFG, layer, reference

from jaxtrain.config import MESH_AXES
from jaxtrain.errors import ConfigError
from jaxtrain.kernels import ops, registry
from jaxtrain.kernels.cpu import library as cpu_fused
from jaxtrain.models.mixtral.model import LOGICAL_AXES
from jaxtrain.parallel.activations import activation_sharding
from jaxtrain.parallel.rules import Rules

pytestmark = pytest.mark.kernels


def on_one_device():
    """The trainer's context while it traces a one-device run, with a rule for every logical name."""
    mesh = Mesh(np.asarray(jax.devices()[:1]).reshape((1,) * len(MESH_AXES)), MESH_AXES,
                axis_types=(AxisType.Auto,) * len(MESH_AXES))
    return activation_sharding(Rules("one", {name: [None] for name in LOGICAL_AXES}), mesh)


def compiled_layer(cfg, seed):
    """(the layer's outputs, the reference's, and the HLO text of its jitted forward)."""
    moe_layer, x, ws = layer(cfg, seed)
    fn = jax.jit(lambda m, v: m(v))
    with on_one_device():
        (y, stats), text = fn(moe_layer, x), fn.lower(moe_layer, x).as_text()
    capacity = cfg.capacity(x.shape[1]) if cfg.routing == "capacity" else None
    return (y, stats), reference(np.asarray(x, np.float64), *ws, cfg.top_k, capacity), text


@pytest.mark.parametrize("routing", ["dropless", "capacity"])
@pytest.mark.parametrize("grouped", ["auto", "cpu_fused"])
def test_the_layer_through_the_grouped_kernels_equals_the_reference(routing, grouped):
    cfg = CFG.model_copy(update={"grouped_matmul": grouped, "routing": routing, "capacity_factor": 0.5})
    (y, stats), (ref, dropped, _), text = compiled_layer(cfg, seed=3)
    assert text.count(f"custom_call @{cpu_fused.GROUPED_FORWARD}(") == 1  # the experts' products: the kernels
    np.testing.assert_allclose(np.asarray(y), ref, atol=1e-5, rtol=0)
    assert float(stats["dropped"]) == pytest.approx(dropped.mean()) and (routing == "dropless") != dropped.any()


def test_auto_takes_the_kernels_where_they_run_and_says_why_not_elsewhere():
    rows, w, wd = jnp.zeros((8, 16)), jnp.zeros((4, 16, 24)), jnp.zeros((4, 24, 16))
    call = ops.GroupedCall(rows, w, w, wd)
    # This process has 8 devices: outside the trainer's sharding XLA's partitioner would gather the rows.
    outside = f"outside the trainer's sharding context on {jax.device_count()} devices"
    chosen = ops.choice("grouped_matmul", "auto", call)
    assert chosen.impl.name == "cpu_fused"
    assert chosen.impl.refuses(call, True, ops.call_facts("grouped_matmul")) == outside
    assert ops.pick("grouped_matmul", "auto", call).name == "windows"  # the next candidate takes it
    with on_one_device():
        assert ops.pick("grouped_matmul", "auto", call).name == "cpu_fused"
        half = ops.GroupedCall(rows.astype(jnp.bfloat16), w, w, wd)
        assert ops.pick("grouped_matmul", "auto", half).name == "windows"
        with pytest.raises(ConfigError) as e:
            ops.pick("grouped_matmul", "cpu_fused", half)
    why = ("operands of rows bfloat16, w_gate float32, w_up float32, w_down float32; it takes float32 "
           "(model.dtype=float32)")
    assert str(e.value) == f"model.grouped_matmul=cpu_fused cannot run here: {why} (use auto or windows)"
    one = registry.choose("grouped_matmul", "auto", registry.Facts("cpu", devices=1, dtype="float32"))
    assert one.line() == "model.grouped_matmul=auto -> cpu_fused (a task per run of one expert's rows)"
    gpu = registry.choose("grouped_matmul", "auto", registry.Facts("gpu", devices=1), available=False)
    assert gpu.impl.name == "ragged_dot"
    bf16 = registry.choose("grouped_matmul", "auto", registry.Facts("cpu", dtype="bfloat16"), available=False)
    assert bf16.line() == ("model.grouped_matmul=auto -> windows (cpu_fused: computes in float32, model.dtype is "
                           "bfloat16; 2-D matmuls over windows of each expert's rows)")


def test_an_explicit_cpu_fused_outside_the_trainers_sharding_is_a_named_error():
    cfg = CFG.model_copy(update={"grouped_matmul": "cpu_fused"})
    moe_layer, x, _ = layer(cfg)
    with pytest.raises(ConfigError) as e:
        jax.jit(lambda m, v: m(v))(moe_layer, x)
    assert str(e.value) == (f"model.grouped_matmul=cpu_fused cannot run here: outside the trainer's sharding "
                            f"context on {jax.device_count()} devices (use auto or windows)")


@pytest.mark.parametrize("grouped", ["ragged_dot", "cpu_fused"])
def test_a_one_device_evaluation_runs_models_jax_cannot_vmap_one_batch_at_a_time(small_cfg, grouped):
    """On one device the evaluation runs small batches side by side (a vmap); JAX 0.10 cannot vmap
    ragged_dot as the dropless path uses it, and the run died at its first evaluation (found by a new user).
    Now those go one by one, with the per-batch values of one eval_step each."""
    from jaxtrain.train import setup
    from jaxtrain.train.evaluation import eval_group
    from jaxtrain.train.trainer import put_validation
    cfg = small_cfg("model.family=mixtral", "model.n_experts=4", f"model.grouped_matmul={grouped}",
                    "train.eval_batches=4", "mesh.data=1")
    s = setup(cfg, jax.devices()[:1], load_data=True)
    assert s.mesh.size == 1 and eval_group(4, cfg.micro_batch * cfg.data.seq_len) == 4  # grouped, where it can
    params, val = s.fns.init()["params"], put_validation(s.data.val, s.fns.batch_sharding)
    scanned = jax.device_get(s.fns.evaluate(params, val))
    for i in range(4):
        one = jax.device_get(s.fns.eval_step(params, {k: v[i] for k, v in val.items()}))
        assert scanned["loss"][i] == pytest.approx(float(one["loss"]), rel=1e-6)
