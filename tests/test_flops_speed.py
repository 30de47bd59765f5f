"""Speed levers change nothing numerically: scan over layers, remat policies; the profiler trace."""
import gzip
import json

import jax
import numpy as np
import pytest

from jaxtrain import step as steplib
from jaxtrain import train as trainlib
from jaxtrain.mesh import build_mesh
from jaxtrain.partitioning import Rules


def one_step(cfg, devices, window):
    trainer = steplib.build(cfg, build_mesh(cfg.mesh, devices), Rules.load("fsdp_tp"), 256)
    state = trainer.init()
    init = jax.device_get(state["params"])
    state, m = trainer.train_step(state, jax.device_put(window[None], trainer.batch_sharding))
    return init, jax.device_get(state["params"]), float(m["loss"]), trainer


def stacked(params):
    """Per-layer layout {'layers': {0: {...}, 1: {...}}} -> the scan layout (leading 'layers' dim)."""
    layers = params["layers"]
    out = dict(params)
    out["layers"] = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *[layers[i] for i in sorted(layers)])
    return out


def test_scan_and_remat_match_the_plain_step(small_cfg):
    window = np.random.default_rng(0).integers(0, 256, size=(8, 33)).astype(np.int32)
    init0, after0, loss0, _ = one_step(small_cfg("mesh.data=1"), jax.devices()[:1], window)
    variants = [
        ("model.scan_layers=true", "model.remat=none", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"),
        ("model.scan_layers=true", "model.remat=full", "mesh.data=1"),
        ("model.scan_layers=false", "model.remat=save_matmuls", "mesh.data=1"),
    ]
    for overrides in variants:
        cfg = small_cfg(*overrides)
        devices = jax.devices() if "mesh.tensor=2" in overrides else jax.devices()[:1]
        init, after, loss, trainer = one_step(cfg, devices, window)
        scan = cfg.model.scan_layers
        expect_init, expect_after = (stacked(init0), stacked(after0)) if scan else (init0, after0)
        jax.tree_util.tree_map(np.testing.assert_array_equal, init, expect_init)  # same initial values
        assert loss == pytest.approx(loss0, rel=1e-6), overrides
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=2e-6), after, expect_after)
        if scan:  # the stacked dim is the 'layers' logical name (replicated by fsdp_tp), the rest as before
            assert trainer.state_shardings["params"]["layers"]["attn"]["wq"].spec[0] is None
            assert after["layers"]["attn"]["wq"].shape == (2, 64, 4, 16)


def test_profile_writes_a_trace_into_the_run_dir(small_cfg):
    cfg = small_cfg("train.steps=4", "checkpoint.enabled=false", "mesh.data=1", "profile.start_step=2",
                    "profile.steps=2")
    result = trainlib.run(cfg, devices=jax.devices()[:1], quiet=True)
    traces = list((result.run_dir / "profile").rglob("*.trace.json.gz"))
    assert len(traces) == 1 and list((result.run_dir / "profile").rglob("*.xplane.pb"))
    events = json.loads(gzip.decompress(traces[0].read_bytes()))["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any("step_fn" in n for n in names), sorted(names)[:50]  # the train step's executions are in it
