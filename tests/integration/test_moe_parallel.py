"""The mixtral family on 8 simulated devices: expert parallelism trains like 1 device.

5 AdamW steps of a small Mixtral (8 experts, top-2) under ``sharding.rules=ep`` must give the
1-device losses within 1e-4 relative, for ``expert=8``, ``data=2 expert=4`` and
``fsdp=2 tensor=2 expert=2`` with dropless routing, and ``data=2 expert=4`` with capacity routing. The
live shardings of the parameters and optimizer state equal tests/golden/sharding_ep_mixtral.json (regenerate with
``JAXTRAIN_REGEN_GOLDEN=1``, then review the diff). The compiled step moves tokens with
all-to-all and never all-gathers an expert weight.
"""
import json
import os
import re

import jax
import numpy as np
import pytest
from conftest import SMALL, put_windows
from test_sharding_matrix import GOLDEN, shardings_json

from jaxtrain import config as cfglib
from jaxtrain.train import setup

REGEN = os.environ.get("JAXTRAIN_REGEN_GOLDEN") == "1"
VOCAB = 256
MOE = [*SMALL, "model.family=mixtral", "model.n_experts=8", "model.top_k=2", "model.d_ff=64",
       "sharding.rules=ep"]
MESHES = {  # name: (data, fsdp, tensor, sequence, expert, stage)
    "expert8": (1, 1, 1, 1, 8),
    "data2_expert4": (2, 1, 1, 1, 4),
    "fsdp2_tensor2_expert2": (1, 2, 2, 1, 2),
}


def make_cfg(mesh, *extra):
    sizes = [f"mesh.{a}={s}" for a, s in zip(cfglib.MESH_AXES, mesh)]
    return cfglib.load(None, [*MOE, *sizes, *extra])


def train(cfg, devices, windows):
    fns = setup(cfg, devices, vocab=VOCAB).fns
    state, rows, batch = fns.init(), [], None
    for w in windows:
        batch = put_windows(w, fns.batch_sharding)
        state, metrics = fns.train_step(state, batch)
        rows.append({k: float(v) for k, v in metrics.items()})
    return rows, state, batch


@pytest.fixture(scope="module")
def one_device(windows):
    """routing -> (overrides, the 1-device losses), each computed once."""
    cache = {}

    def get(routing):
        if routing not in cache:
            extra = [f"model.routing={routing}", "model.capacity_factor=1.0"]
            rows, _, _ = train(make_cfg((1, 1, 1, 1, 1), *extra), jax.devices()[:1], windows)
            losses = [r["loss"] for r in rows]
            assert losses[-1] < losses[0] - 0.1  # it learns
            if routing == "capacity":
                assert all(r["moe_dropped_frac"] > 0 for r in rows)  # copies are dropped on every step
            cache[routing] = extra, losses
        return cache[routing]
    return get


# Dropless on every mesh; capacity routing on one (the suite's time budget).
@pytest.mark.parametrize("routing, mesh", [("dropless", m) for m in MESHES] + [("capacity", "data2_expert4")])
def test_expert_parallel_losses_equal_one_device(routing, mesh, one_device, windows):
    extra, reference = one_device(routing)
    cfg = make_cfg(MESHES[mesh], *extra)
    rows, state, batch = train(cfg, jax.devices(), windows)
    np.testing.assert_allclose([r["loss"] for r in rows], reference, rtol=1e-4)
    if (routing, mesh) != ("dropless", "fsdp2_tensor2_expert2"):
        return
    actual = shardings_json(cfg, state, batch["inputs"])
    golden = GOLDEN / "sharding_ep_mixtral.json"
    if REGEN:
        golden.write_text(json.dumps(actual, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"regenerated {golden}")
    assert actual == json.loads(golden.read_text())
    w = actual["params"]["layers.0.moe.w_gate"]
    assert w == ["expert", "fsdp", "tensor"]  # [exp, embed, mlp]


def test_expert_parallel_blocks_equal_one_device_windows(one_device, windows):
    """model.grouped_matmul=blocks (batched matmuls over blocks, inside the expert-parallel shard_map)
    trains like the 1-device dropless run on CPU's default windows."""
    extra, reference = one_device("dropless")
    rows, _, _ = train(make_cfg(MESHES["data2_expert4"], *extra, "model.grouped_matmul=blocks"), jax.devices(),
                       windows)
    np.testing.assert_allclose([r["loss"] for r in rows], reference, rtol=1e-4)


def test_the_step_moves_tokens_by_all_to_all_and_gathers_no_expert_weight():
    from jaxtrain.analysis import collectives
    compiled, _ = setup(make_cfg(MESHES["expert8"]), jax.devices(), vocab=VOCAB).compile_abstract()
    found = collectives.parse(compiled.as_text())
    kinds = {c.kind for c in found}
    assert "all-to-all" in kinds, kinds
    # Expert weights are [8 experts, 64, 64]; a device holds [1, 64, 64]. Gathering one would
    # produce the full [8, 64, 64] (or the 8 experts of its gradient all-reduced).
    full = re.compile(r"\[8,64,64\]")
    assert not [c for c in found if c.kind in ("all-gather", "all-reduce") and full.search(c.shape)]
    moved = sum(c.bytes * c.count for c in found if c.kind == "all-to-all")
    # Dropless on CPU (the dense stand-in for the ragged all-to-all): per layer, 2 exchanges forward
    # (tokens out, results back) and 2 backward, each [8 devices, 64 copies, 64] float32 (one
    # sequence of 32 tokens per device, top-2), plus the expert ids and row counts (< 10%).
    exchanges = 2 * 4 * 8 * 64 * 64 * 4
    assert exchanges <= moved < 1.1 * exchanges, (moved, exchanges)


@pytest.mark.parametrize("batch_rule, axis, message", [
    ([("data", "fsdp")], "expert", "dimension 0 ('exp') uses mesh axis 'expert', which does not split the tokens "
                                   "in rule set 'ep' (add it to the 'batch' rule)"),
    ([("data", "fsdp", "expert", "tensor")], "tensor", "dimension 2 ('mlp') uses mesh axis 'tensor', which also "
                                                       "splits the tokens ('batch'/'length') in rule set 'ep'"),
])
def test_expert_layouts_that_would_send_tokens_twice_or_mix_them_are_named_errors(batch_rule, axis, message):
    import jax.numpy as jnp

    from jaxtrain.errors import ShardingError
    from jaxtrain.moe.experts import routed_experts
    from jaxtrain.parallel.activations import activation_sharding
    from jaxtrain.parallel.rules import Rules
    rules = Rules.load("ep")
    rules.table["batch"] = batch_rule
    mesh = jax.make_mesh((1, 1, 2, 1, 4, 1), cfglib.MESH_AXES)
    x, idx = jnp.zeros((8, 4, 16)), jnp.zeros((8, 4, 2), jnp.int32)
    w, wd = jnp.zeros((8, 16, 32)), jnp.zeros((8, 32, 16))
    with activation_sharding(rules, mesh), pytest.raises(ShardingError) as e:
        jax.eval_shape(lambda: routed_experts(x, idx, jnp.ones((8, 4, 2)), w, w, wd))
    assert str(e.value) == "moe expert weights: " + message
