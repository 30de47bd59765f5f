"""End-to-end training: sharded == unsharded, resume == uninterrupted, grad accumulation, default job."""
import json
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import put_windows
from jax.sharding import PartitionSpec as P

from jaxtrain.cli import train as train_cli
from jaxtrain.parallel.rules import path_str
from jaxtrain.train import fit, setup


def first_device():
    return jax.devices()[:1]


def test_sharded_equals_unsharded(small_cfg):
    common = ("train.steps=10", "checkpoint.enabled=false")
    one = fit(small_cfg(*common, "mesh.data=1", run_dir="one"), devices=first_device(), quiet=True)
    cfg8 = small_cfg(*common, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", run_dir="eight")
    eight = fit(cfg8, quiet=True)
    l1, l8 = one.losses, eight.losses
    assert sorted(l1) == sorted(l8) == list(range(1, 11))
    np.testing.assert_allclose([l8[s] for s in l8], [l1[s] for s in l1], rtol=1e-4)
    assert l1[10] < l1[1] - 0.5  # it actually learns

    # The live shardings are exactly what the rules file says, for every parameter and Adam moment.
    s = setup(cfg8, vocab=256)
    axes = dict(jax.tree_util.tree_flatten_with_path(s.fns.param_axes, is_leaf=lambda x: isinstance(x, tuple))[0])
    shapes = jax.tree_util.tree_flatten_with_path(s.abstract_state()["params"])[0]
    expected = {path_str(p): s.rules.partition_spec(path_str(p), axes[p], x.shape, s.mesh) for p, x in shapes}
    params = eight.state["params"]
    actual = {path_str(p): x.sharding.spec for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert actual == expected
    mu = eight.state["opt_state"][1][0].mu
    assert {path_str(p): x.sharding.spec for p, x in jax.tree_util.tree_flatten_with_path(mu)[0]} == expected
    # Golden values, written out by hand from sharding_rules/fsdp_tp.yaml.
    assert actual["embed.embedding"] == P("tensor", "fsdp")
    assert actual["layers.0.attn.wq"] == P("fsdp", "tensor", None)
    assert actual["layers.1.attn.wo"] == P("tensor", None, "fsdp")
    assert actual["layers.0.mlp.w_down"] == P("tensor", "fsdp")
    assert actual["lm_head"] == P("fsdp", "tensor")
    assert actual["final_norm.scale"] == P("fsdp")


def test_resume_equals_uninterrupted(small_cfg):
    ckpt = ("checkpoint.every=15", "checkpoint.async_save=true")
    full = fit(small_cfg("train.steps=30", *ckpt, run_dir="full"), quiet=True)
    first = fit(small_cfg("train.steps=15", "optimizer.decay_steps=30", *ckpt, run_dir="resumed"),
                         quiet=True)
    assert first.start_step == 0 and max(first.losses) == 15
    second = fit(small_cfg("train.steps=30", *ckpt, run_dir="resumed"), quiet=True)
    assert second.start_step == 15
    assert sorted(second.losses) == list(range(16, 31))
    assert [second.losses[s] for s in range(16, 31)] == [full.losses[s] for s in range(16, 31)]
    assert [first.losses[s] for s in range(1, 16)] == [full.losses[s] for s in range(1, 16)]
    for a, b in zip(jax.tree_util.tree_leaves(second.state), jax.tree_util.tree_leaves(full.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_save_made_with_the_next_batch_fetched_resumes_at_that_batch(small_cfg):
    """The loop assembles batch N+1 while step N runs; the save after step 4 records the position of
    batch 5 (held, not yet trained on), so a resume from it trains on the same batches."""
    from jaxtrain.train.loop import Lookahead
    cfg = ("train.steps=8", "checkpoint.every=4", "checkpoint.keep=2")
    full = fit(small_cfg(*cfg, run_dir="ahead"), quiet=True)
    shutil.rmtree(full.run_dir / "checkpoints" / "8")
    again = fit(small_cfg(*cfg, run_dir="ahead"), quiet=True)
    assert again.start_step == 4 and [again.losses[s] for s in range(5, 9)] == [full.losses[s] for s in range(5, 9)]
    # and what the loop does to the iterator, on a counter
    counter = Lookahead(iter_with_state())
    assert next(counter) == 0 and counter.get_state() == {"next": 1}
    counter.fetch()
    counter.fetch()  # a second fetch holds the same batch
    assert counter.get_state() == {"next": 1} and next(counter) == 1 and counter.get_state() == {"next": 2}
    # the same, drawn on a thread (a run whose step runs inline on the loop's thread)
    threaded = Lookahead(iter_with_state(), threaded=True)
    assert next(threaded) == 0
    threaded.fetch()
    threaded.fetch()
    assert threaded.get_state() == {"next": 1} and next(threaded) == 1 and threaded.get_state() == {"next": 2}
    threaded.fetch()
    assert next(threaded) == 2 and threaded.inner.n == 3  # nothing drawn beyond what was asked for
    threaded.inner.fail = True
    threaded.fetch()  # the thread's error reaches the loop when it takes the batch
    with pytest.raises(ValueError, match="no batch 3"):
        next(threaded)
    threaded.close()


class iter_with_state:
    def __init__(self):
        self.n, self.fail = 0, False

    def __next__(self):
        if self.fail:
            raise ValueError(f"no batch {self.n}")
        self.n += 1
        return self.n - 1

    def get_state(self):
        return {"next": self.n}


def test_grad_accumulation_matches_full_batch(small_cfg, corpus_path):
    devices = first_device()
    window = np.random.default_rng(0).integers(0, 256, size=(12, 33)).astype(np.int32)
    outs = []
    for accum in (1, 4):
        cfg = small_cfg("mesh.data=1", "train.global_batch=12", f"train.grad_accum={accum}")
        fns = setup(cfg, devices, vocab=256).fns
        outs.append(fns.grads(fns.init()["params"], put_windows(window.reshape(accum, 12 // accum, 33),
                                                              fns.batch_sharding)))
    (l1, _, g1), (l4, _, g4) = outs
    assert float(l1) == pytest.approx(float(l4), rel=1e-6)
    scale = max(float(np.abs(np.asarray(g)).max()) for g in jax.tree_util.tree_leaves(g1))
    for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g4)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6 * scale)


def test_default_main_job(tmp_path, capsys):
    run_dir = tmp_path / "default"
    rc = train_cli.main(["train.steps=6", "train.log_every=3", "train.eval_batches=2", "train.sample_tokens=16",
                        "checkpoint.every=3", f"run.dir={run_dir}", "run.progress=false"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "validation loss " in out and "sample:\ndef " in out
    steps = ocp.CheckpointManager((run_dir / "checkpoints").absolute()).all_steps()
    assert sorted(steps) == [3, 6]
    step_dir = run_dir / "checkpoints" / "6"
    assert {p.name for p in step_dir.iterdir()} >= {"state", "data", "_CHECKPOINT_METADATA"}
    assert not [p for p in (run_dir / "checkpoints").iterdir() if "tmp" in p.name]
    for name in ("config.yaml", "versions.json", "metrics.jsonl", "tokenizer.json"):
        assert (run_dir / name).is_file(), name
    # the run plan: what auto resolved to, and why: on the tests' 8 simulated devices, XLA's update,
    # matmuls and blockwise, each saying why the C++ kernels were passed over
    resolved = json.loads((run_dir / "resolved.json").read_text())
    assert set(resolved) == {"mesh", "rules", "kernels", "offload", "pipeline", "shardings", "train_step_options"}
    assert resolved["mesh"] == {"data": 8, "fsdp": 1, "tensor": 1, "sequence": 1, "expert": 1, "stage": 1}
    kernels = resolved["kernels"]
    assert {k: (v["choice"], v["provider"]) for k, v in kernels.items()} == {
        "model.attention": ("blockwise", "xla"), "model.matmul": ("xla", "xla"),
        "optimizer.implementation": ("xla", "xla")}
    assert kernels["optimizer.implementation"] == {
        "choice": "xla", "provider": "xla", "reason": "optax's clip and AdamW",
        "passed_over": {"cpu_fused": "runs on one device, here 8"}}
    assert resolved["pipeline"] == {"stages": 1, "microbatches": 1, "schedule": "gpipe", "repeats": 1}


def test_a_relaunch_writes_its_own_kernel_choices_over_an_earlier_launchs(small_cfg):
    run = fit(small_cfg("train.steps=1", "checkpoint.enabled=false", run_dir="r"), quiet=True).run_dir
    assert json.loads((run / "resolved.json").read_text())["kernels"]["model.attention"]["choice"] == "blockwise"
    fit(small_cfg("train.steps=1", "checkpoint.enabled=false", "model.attention=xla", "model.matmul=xla",
                  "optimizer.implementation=xla", run_dir="r"), quiet=True)
    kernels = json.loads((run / "resolved.json").read_text())["kernels"]
    assert kernels == {key: {"choice": "xla", "provider": "xla", "reason": "set in the config"}
                       for key in ("model.attention", "model.matmul", "optimizer.implementation")}


def test_a_launch_that_trains_nothing_leaves_config_yaml_as_it_was(small_cfg, capsys):
    """config.yaml says what the run's steps were trained with: a relaunch already at train.steps (here with
    another learning rate) evaluates but trains nothing, so it does not rewrite it."""
    done = fit(small_cfg("train.steps=2", "checkpoint.every=2", run_dir="done"), quiet=True)
    before = [(done.run_dir / name).read_bytes() for name in ("config.yaml", "resolved.json")]
    capsys.readouterr()
    # (another attention too: resolved.json, what auto resolved to for those steps, is left as well)
    again = fit(small_cfg("train.steps=2", "checkpoint.every=2", "optimizer.lr=0.5", "model.attention=xla",
                          run_dir="done"))
    assert again.start_step == 2
    assert [(done.run_dir / name).read_bytes() for name in ("config.yaml", "resolved.json")] == before
    assert ("checkpoint step 2 >= train.steps=2: nothing to train (raise train.steps to continue); config.yaml is "
            "left as it was") in " ".join(capsys.readouterr().out.split())
