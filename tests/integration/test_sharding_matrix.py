"""The equivalence matrix: every rule set on 8 simulated devices trains like 1 device.

For each (rule set, mesh) of issue 3's table, 5 AdamW steps of a small Llama on 8 devices
must give the 1-device losses within 1e-4 relative, and the live shardings of the
parameters, the optimizer state and the batch must equal the golden PartitionSpecs in
tests/golden/sharding_<rules>.json. Regenerate those (then review the diff!) with
``JAXTRAIN_REGEN_GOLDEN=1 python -m pytest tests/integration/test_sharding_matrix.py``.
"""
import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import SMALL, put_windows

from jaxtrain import config as cfglib
from jaxtrain.parallel.mesh import resolve_sizes
from jaxtrain.parallel.rules import path_str
from jaxtrain.train import setup

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
REGEN = os.environ.get("JAXTRAIN_REGEN_GOLDEN") == "1"
STEPS = 5
VOCAB = 256
# 8 query heads, 4 KV heads (grouped-query attention): tensor=4 divides both.
MODEL = [*SMALL, "model.n_heads=8", "model.n_kv_heads=4"]
MATRIX = {  # rule set: mesh (data, fsdp, tensor, sequence, expert, stage)
    "dp": (8, 1, 1, 1, 1),
    "fsdp": (1, 8, 1, 1, 1),
    "zero1": (8, 1, 1, 1, 1),
    "tp": (2, 1, 4, 1, 1),
    "fsdp_tp": (2, 2, 2, 1, 1),
    "sp": (2, 1, 1, 4, 1),
    # ep (expert parallelism) is checked with the MoE family it exists for: tests/integration/test_moe_parallel.py.
    # Two pipeline stages under FSDP x tensor parallelism (the layers stacked, split over 'stage').
    "fsdp_tp_stage2": (1, 2, 2, 1, 1, 2),
}


def make_cfg(rules: str, mesh: tuple[int, ...]) -> cfglib.Config:
    sizes = [f"mesh.{a}={s}" for a, s in zip(cfglib.MESH_AXES, mesh)]
    return cfglib.load(None, [*MODEL, *sizes, f"sharding.rules={rules.split('_stage')[0]}"])


def train(cfg: cfglib.Config, devices, windows: np.ndarray):
    fns = setup(cfg, devices, vocab=VOCAB).fns
    state, losses, batch = fns.init(), [], None
    for w in windows:
        batch = put_windows(w, fns.batch_sharding)
        state, metrics = fns.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, state, batch["inputs"]


@pytest.fixture(scope="module")
def reference(windows) -> list[float]:
    losses, _, _ = train(make_cfg("dp", (1, 1, 1, 1, 1)), jax.devices()[:1], windows)
    assert losses[-1] < losses[0] - 0.1  # it learns, so the comparison means something
    return losses


def spec_json(x: jax.Array) -> list:
    """A PartitionSpec as JSON, one entry per dimension: null, an axis, or a list of axes."""
    spec = list(x.sharding.spec) + [None] * (x.ndim - len(x.sharding.spec))
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def shardings_json(cfg, state, batch) -> dict:
    tree = lambda t: {path_str(p): spec_json(x) for p, x in jax.tree_util.tree_flatten_with_path(t)[0]}  # noqa: E731
    return {"rules": cfg.sharding.rules, "mesh": resolve_sizes(cfg.mesh, 8), "batch": spec_json(batch),
            "params": tree(state["params"]), "opt_state": tree(state["opt_state"])}


@pytest.mark.parametrize("rules", list(MATRIX))
def test_rule_set_matches_one_device(rules, reference, windows):
    cfg = make_cfg(rules, MATRIX[rules])
    losses, state, batch = train(cfg, jax.devices(), windows)
    np.testing.assert_allclose(losses, reference, rtol=1e-4)
    actual = shardings_json(cfg, state, batch)
    golden = GOLDEN / f"sharding_{rules}.json"
    if REGEN:
        golden.write_text(json.dumps(actual, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"regenerated {golden}")
    assert actual == json.loads(golden.read_text())
