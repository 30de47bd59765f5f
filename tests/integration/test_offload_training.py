"""Training with host-memory offload equals training without it; checkpoints move between the two; the planner
picks an offloading layout when nothing else fits, and that layout trains.

Each kind (optimizer state, parameters streamed per layer, named activations) runs 5 steps of the small Llama
with the layers scanned and recomputed (model.remat=full) on 1 device and on 8 (fsdp=4 tensor=2), from the same
batches, against the run without offload: the losses agree within 1e-6 relative (on XLA:CPU they are equal: the
transfers lower to nothing there, see jaxtrain/parallel/offload.py).
"""
import functools
import re

import jax
import numpy as np
import pytest
from conftest import SHAKESPEARE, SMALL, put_windows

from jaxtrain import config as cfglib
from jaxtrain.analysis import layouts, plan
from jaxtrain.checkpoint.checkpointer import Checkpointer
from jaxtrain.metrics import memory
from jaxtrain.train import fit, setup

# XLA's matmuls: with offload.activations the Llama MLP keeps XLA's SwiGLU (so that mlp_hidden is XLA's value
# to place), where without offload model.matmul=auto would take the CPU kernels' (another float rounding)
SCANNED = [*SMALL, "model.scan_layers=true", "model.remat=full", "model.matmul=xla"]
KINDS = {"optimizer": ["offload.optimizer=host"], "params": ["offload.params=host"],
         "activations": ["offload.activations=[attn_in,qkv,attn_out,mlp_in,mlp_hidden]"]}
MESHES = {1: ["mesh.data=1"], 8: ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"]}


@functools.cache
def windows() -> np.ndarray:
    """[step, accum, micro, T + 1] byte windows of the corpus (read when a test first needs them)."""
    if not SHAKESPEARE.is_file():
        pytest.fail(f"test corpus missing: {SHAKESPEARE} (set JAXTRAIN_SHARED to the shared/ folder)")
    text = np.frombuffer(SHAKESPEARE.read_bytes()[:100_000], np.uint8).astype(np.int32)
    starts = np.random.default_rng(0).integers(0, len(text) - 33, size=(5, 1, 8))
    return text[starts[..., None] + np.arange(33)]


def run_steps(overrides, n_devices, steps=5):
    """(losses, final state) of ``steps`` train steps on fixed batches (each loss read before the next step)."""
    s = setup(cfglib.load(None, [*SCANNED, *overrides]), jax.devices()[:n_devices], vocab=256)
    state, losses = s.fns.init(), []
    for window in windows()[:steps]:
        state, metrics = s.fns.train_step(state, put_windows(window, s.fns.batch_sharding))
        losses.append(float(metrics["loss"]))
    return losses, state


@pytest.mark.parametrize("n_devices", sorted(MESHES))
@pytest.mark.slow  # over ~20 s on 2 cores (CI's durations)
def test_every_offload_trains_like_no_offload(n_devices):
    base, base_state = run_steps(MESHES[n_devices], n_devices)
    assert base[-1] < base[0]
    for kind, overrides in KINDS.items():
        losses, state = run_steps([*MESHES[n_devices], *overrides], n_devices)
        np.testing.assert_allclose(losses, base, rtol=1e-6, err_msg=kind)
        kinds = {x.sharding.memory_kind for x in jax.tree_util.tree_leaves(state["params"])}
        assert kinds == ({"pinned_host"} if kind == "params" else {"device"}), kind
        for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(base_state)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7, err_msg=kind)


def assert_same(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow  # over ~20 s on 2 cores (CI's durations)
def test_checkpoints_restore_across_offload_and_resume_is_exact(small_cfg):
    """Saved with offload, restored without it (and the other way round), bit for bit, into the target's memory
    kinds; a run with optimizer and parameter offload resumed from step 3 equals the uninterrupted one."""
    off = ("model.scan_layers=true", "model.remat=full", "offload.optimizer=host", "offload.params=host",
           "checkpoint.every=3", "train.sample_tokens=0")
    first = fit(small_cfg("train.steps=3", "optimizer.decay_steps=6", *off, run_dir="resumed"), quiet=True)
    plain_cfg = small_cfg("model.scan_layers=true", "model.remat=full", run_dir="plain")
    plain = setup(plain_cfg, jax.devices(), vocab=256)
    ckpt = Checkpointer(plain_cfg, first.run_dir)
    restored, _ = ckpt.restore(3, plain.abstract_state())
    ckpt.close()
    assert_same(restored, first.state)
    assert {x.sharding.memory_kind for x in jax.tree_util.tree_leaves(restored)} == {"device"}

    # The other way round: a state saved without offload, restored into host memory.
    state = plain.fns.init()
    ckpt = Checkpointer(plain_cfg, plain_cfg.run.dir)
    ckpt.save(0, state, {})
    ckpt.close()
    offloaded = setup(small_cfg(*off, run_dir="plain"), jax.devices(), vocab=256)
    ckpt = Checkpointer(offloaded.cfg, plain_cfg.run.dir)
    back, _ = ckpt.restore(0, offloaded.abstract_state())
    ckpt.close()
    assert_same(back, state)
    kinds = jax.tree_util.tree_map(lambda x: x.sharding.memory_kind, back)
    assert set(jax.tree_util.tree_leaves(kinds["params"])) == {"pinned_host"}
    assert kinds["opt_state"][1][0].mu["lm_head"] == "pinned_host" and kinds["step"] == "device"

    full = fit(small_cfg("train.steps=6", *off, run_dir="full"), quiet=True)
    second = fit(small_cfg("train.steps=6", *off, run_dir="resumed"), quiet=True)
    assert second.start_step == 3
    assert [second.losses[s] for s in (4, 5, 6)] == [full.losses[s] for s in (4, 5, 6)]
    assert [first.losses[s] for s in (1, 2, 3)] == [full.losses[s] for s in (1, 2, 3)]
    assert_same(second.state, full.state)


BUDGET = 3 * 2 ** 20  # the small scanned Llama on 1 device: 3.4 MiB with remat=full, 2.7 MiB with the moments on host


def test_plan_picks_an_offloading_layout_that_trains():
    cfg = cfglib.load(None, [*SMALL, "model.scan_layers=true"])
    (cand,) = [c for c in plan.plan(cfg, 1, ["fsdp"], budget=BUDGET, vocab=256, layouts=True)
               if c.status == "compiled"]
    assert cand.fits is False  # as configured (remat none)
    win = cand.layout
    assert win is not None and win.layout.optimizer, win
    assert win.compiled_peak <= BUDGET and win.est_peak <= BUDGET and win.host > 0
    reasons = {str(c.layout): c.reason for c in cand.layouts}
    for remat in ("none", "save_matmuls", "full"):  # no layout without offload fits (remat=full: its
        # estimate is close to the budget, and below it with some XLA:CPU kernels; then its compile says so)
        assert re.fullmatch(r"(estimated|compiled) device peak [\d.]+ MiB > 3\.0 MiB",
                            reasons[f"remat={remat} offload=-"]), reasons
    assert all(r for lay, r in reasons.items() if lay != str(win.layout))  # each other one says why
    assert any("ms/step more than " + str(win.layout) in r for r in reasons.values())
    text = layouts.layouts_text([cand], BUDGET)
    assert text.splitlines()[1].startswith(f"  fsdp 1,1,1,1,1,1: {win.layout}: est. ")

    chosen = win.layout.apply(cfg)
    s = setup(chosen, jax.devices()[:1], vocab=256)
    compiled, abstract = s.compile_abstract()
    assert memory.state_report(abstract, s.fns.state_shardings, compiled).compiled["device_peak"] <= BUDGET
    losses, _ = run_steps(win.layout.overrides(), 1, steps=3)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
