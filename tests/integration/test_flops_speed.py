"""Speed levers change nothing numerically: scan over layers, remat policies; the profiler trace."""
import gzip
import json

import jax
import numpy as np
import pytest
from conftest import put_windows

from jaxtrain.train import fit, setup


def gradients(cfg, devices, window):
    """(initial params, loss, gradients) of one batch: the step's gradient, before any Adam update."""
    s = setup(cfg, devices, vocab=256)
    params = s.fns.init()["params"]
    loss, _, grads = s.fns.grads(params, put_windows(window[None], s.fns.batch_sharding))
    return jax.device_get(params), float(loss), jax.device_get(grads), s


def stacked(params):
    """Per-layer layout {'layers': {0: {...}, 1: {...}}} -> the scan layout (leading 'layers' dim)."""
    layers = params["layers"]
    out = dict(params)
    out["layers"] = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *[layers[i] for i in sorted(layers)])
    return out


def test_scan_and_remat_match_the_plain_step(small_cfg):
    # Gradients, not params after an Adam step: Adam's first g/(|g|+eps) turns the reordering noise
    # of a near-zero gradient element into a difference of order lr.
    window = np.random.default_rng(0).integers(0, 256, size=(8, 33)).astype(np.int32)
    init0, loss0, grads0, _ = gradients(small_cfg("mesh.data=1"), jax.devices()[:1], window)
    scale = max(float(np.abs(g).max()) for g in jax.tree_util.tree_leaves(grads0))
    variants = [
        ("model.scan_layers=true", "model.remat=none", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"),
        ("model.scan_layers=true", "model.remat=full", "mesh.data=1"),
        ("model.scan_layers=false", "model.remat=save_matmuls", "mesh.data=1"),
    ]
    for overrides in variants:
        cfg = small_cfg(*overrides)
        devices = jax.devices() if "mesh.tensor=2" in overrides else jax.devices()[:1]
        init, loss, grads, s = gradients(cfg, devices, window)
        scan = cfg.model.scan_layers
        expect_init, expect_grads = (stacked(init0), stacked(grads0)) if scan else (init0, grads0)
        jax.tree_util.tree_map(np.testing.assert_array_equal, init, expect_init)  # same initial values
        assert loss == pytest.approx(loss0, rel=1e-6), overrides
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * scale),
                               grads, expect_grads)
        if scan:  # the stacked dim is the 'layers' logical name (on the size-1 'stage' axis), the rest as before
            assert s.fns.state_shardings["params"]["layers"]["attn"]["wq"].spec[0] == "stage"
            assert grads["layers"]["attn"]["wq"].shape == (2, 64, 4, 16)


def test_profile_writes_a_trace_into_the_run_dir(small_cfg):
    cfg = small_cfg("train.steps=4", "checkpoint.enabled=false", "mesh.data=1", "profile.start_step=2",
                    "profile.steps=2")
    result = fit(cfg, devices=jax.devices()[:1], quiet=True)
    traces = list((result.run_dir / "profile").rglob("*.trace.json.gz"))
    assert len(traces) == 1 and list((result.run_dir / "profile").rglob("*.xplane.pb"))
    events = json.loads(gzip.decompress(traces[0].read_bytes()))["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any("step_fn" in n for n in names), sorted(names)[:50]  # the train step's executions are in it
