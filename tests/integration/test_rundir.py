"""The run directory: never overwritten by a failed resume, locked, no duplicate metric rows."""
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxtrain.errors import CheckpointError, ConfigError, ShardingError
from jaxtrain.metrics.sinks import read_metrics
from jaxtrain.parallel.rules import Rules, check_mesh_used
from jaxtrain.train import fit, rundir
from jaxtrain.train.sample import generate


def test_resume_into_another_model_is_named_and_keeps_config(small_cfg):
    cfg = small_cfg("train.steps=2", "checkpoint.every=2", "mesh.data=1", run_dir="r")
    fit(cfg, devices=jax.devices()[:1], quiet=True)
    saved = open(f"{cfg.run.dir}/config.yaml").read()
    other = small_cfg("train.steps=4", "checkpoint.every=2", "mesh.data=1", "model.d_model=32",
                      "model.n_layers=3", run_dir="r")
    with pytest.raises(CheckpointError) as e:
        fit(other, devices=jax.devices()[:1], quiet=True)
    assert str(e.value).endswith(
        "\nconfig keys changed since the checkpoint (use a new run.dir or the saved values):\n"
        "  model.d_model: checkpoint has 64, config has 32\n"
        "  model.n_layers: checkpoint has 2, config has 3")
    assert "params.layers.0.attn.wq: saved shape (64, 4, 16) float32, expected (32, 4, 8) float32" in str(e.value)
    assert open(f"{cfg.run.dir}/config.yaml").read() == saved


def test_resume_drops_metric_rows_past_the_checkpoint(small_cfg):
    cfg = small_cfg("train.steps=4", "checkpoint.every=2", "mesh.data=1", run_dir="m")
    fit(cfg, devices=jax.devices()[:1], quiet=True)
    path = f"{cfg.run.dir}/metrics.jsonl"
    with open(path, "a") as f:  # rows of a run that died after step 4's checkpoint
        f.write(json.dumps({"step": 5, "loss": 1.0}) + "\n" + json.dumps({"step": 6, "loss": 1.0}) + "\n")
    fit(small_cfg("train.steps=6", "checkpoint.every=2", "mesh.data=1", run_dir="m"),
                 devices=jax.devices()[:1], quiet=True)
    steps = [r["step"] for r in read_metrics(cfg.run.dir) if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_run_dir_is_locked(tmp_path):
    lock = rundir.RunLock(tmp_path)
    with pytest.raises(ConfigError, match=r"^run.dir: '.*' is in use by another training process \(pid \d+\)$"):
        rundir.RunLock(tmp_path)
    lock.release()
    rundir.RunLock(tmp_path).release()  # free again


def test_foreign_directory_is_not_overwritten(small_cfg, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("my notes\n")
    with pytest.raises(ConfigError, match="is not empty and is not a jaxtrain run directory"):
        with rundir.opened(small_cfg(f"run.dir={mine}")):
            pass
    assert (mine / "config.yaml").read_text() == "my notes\n"


def test_unused_mesh_axis_is_named_error():
    with pytest.raises(ShardingError) as e:
        check_mesh_used(Rules.load("fsdp_tp"), {"data": 1, "fsdp": 1, "tensor": 1, "sequence": 8, "expert": 1})
    assert str(e.value) == ("mesh.sequence=8: rule set 'fsdp_tp' maps no logical name to mesh axis 'sequence', so "
                            "the 8 devices along it would repeat the same work; use a rule set that shards over "
                            "'sequence' or set mesh.sequence=1")
    check_mesh_used(Rules.load("sp"), {"data": 1, "fsdp": 1, "tensor": 1, "sequence": 8, "expert": 1})


def test_sampling_never_emits_banned_or_padding_ids():
    favourite = np.zeros((1, 4, 10), np.float32)
    favourite[..., 3] = 50.0  # <unk>, by far the likeliest
    favourite[..., 8:] = 60.0  # padding ids beyond the tokenizer
    ids = generate(lambda p, buf: favourite, None, np.array([1]), 20, 4, temperature=1.0, seed=0,
                   banned=(3,), vocab_limit=8)
    assert len(ids) == 21 and not set(ids[1:].tolist()) & {3, 8, 9}


def test_resume_notes_name_changed_data_and_optimizer_keys(small_cfg):
    from jaxtrain.train import rundir
    cfg = small_cfg("train.steps=4")
    Path(cfg.run.dir).mkdir(parents=True)
    rundir.write_config_file(cfg, Path(cfg.run.dir))
    shape_keys, notes = rundir.resume_changes(
        small_cfg("train.steps=4", "optimizer.lr=5e-4", "optimizer.b2=0.95", "data.seed=3", "model.remat=full"),
        Path(cfg.run.dir))
    assert shape_keys == []
    assert notes == ["model.remat changed from 'none' to 'full'", "data.seed changed from 0 to 3",
                     "optimizer.lr changed from 0.001 to 0.0005", "optimizer.b2 changed from 0.99 to 0.95"]


def test_resume_notes_treat_unset_model_keys_as_what_they_stand_for(small_cfg):
    # An HF import records vocab_size and max_positions from config.json; the user's own config leaves
    # them unset (0: the tokenizer's, None: data.seq_len). Same values: no note. Different: named.
    from jaxtrain.train import rundir
    cfg = small_cfg("model.vocab_size=66", "model.max_positions=" + str(small_cfg().data.seq_len))
    Path(cfg.run.dir).mkdir(parents=True)
    rundir.write_config_file(cfg, Path(cfg.run.dir))
    assert rundir.resume_changes(small_cfg(), Path(cfg.run.dir), vocab=66) == ([], [])
    shape_keys, notes = rundir.resume_changes(small_cfg("model.max_positions=2048"), Path(cfg.run.dir), vocab=65)
    seq = small_cfg().data.seq_len
    assert shape_keys == ["model.vocab_size: checkpoint has 66, config has 0"]
    assert notes == [f"model.max_positions changed from {seq} to 2048"]
    shape_keys, notes = rundir.resume_changes(small_cfg(f"data.seq_len={seq // 2}"), Path(cfg.run.dir), vocab=66)
    assert notes == [f"model.max_positions changed from {seq} to None (data.seq_len: {seq // 2}); set "
                     f"model.max_positions={seq} to keep it", f"data.seq_len changed from {seq} to {seq // 2}"]


def test_the_jitted_sampler_equals_a_token_by_token_loop_with_a_sliding_window():
    import jax.numpy as jnp

    def logits_fn(p, buf):  # position t favours (7 * sum(buf[:t+1]) + t) mod 10: depends on the window
        t = jnp.arange(buf.shape[1])
        return (jax.nn.one_hot((7 * jnp.cumsum(buf[0]) + t) % 10, 10) * 5.0 + p)[None]

    def host(prompt, n, seq_len):  # the plain loop: the last seq_len tokens, argmax at the last one
        out = list(prompt)
        for _ in range(n):
            ctx = np.asarray(out[-seq_len:])
            t = len(ctx) - 1
            out.append(int(np.argmax(np.asarray(logits_fn(0.0, jnp.asarray(ctx)[None]))[0, t])))
        return out

    ids = generate(logits_fn, 0.0, np.array([2, 5]), 12, 4, temperature=0.0, seed=0)
    assert ids.tolist() == host([2, 5], 12, 4)
    assert len(set(ids.tolist())) > 3  # the sequence moves, so the window bookkeeping is exercised
    ids = generate(logits_fn, 0.0, np.array([1, 2, 3, 4, 5, 6]), 5, 4, 0.0, 0)
    assert ids.tolist() == host([1, 2, 3, 4, 5, 6], 5, 4)


def test_a_sample_is_printed_with_its_control_characters_escaped(capsys):
    """An early byte-level sample is random bytes: ESC (and the C1 CSI) would start terminal escape
    sequences. Newlines stay (and tabs, which rich expands)."""
    from jaxtrain.metrics.console import Reporter
    Reporter(quiet=True, total=1).text("sample", "To be\x1b(0 or not\x07\x9b\x00\r\nthat")
    assert capsys.readouterr().out == "sample:\nTo be\\x1b(0 or not\\x07\\x9b\\x00\\x0d\nthat\n"


def test_no_sample_is_drawn_or_printed_when_train_sample_tokens_is_0(small_cfg, capsys):
    cfg = small_cfg("train.steps=1", "train.sample_tokens=0", "train.eval_batches=1", "checkpoint.enabled=false",
                    "mesh.data=1")
    result = fit(cfg, devices=jax.devices()[:1], quiet=True)
    out = capsys.readouterr().out
    assert result.sample == "" and f"validation loss {result.val_loss:.4f} (mean over 1 batch)\n" in out
    assert "sample:" not in out, out


def test_a_changed_checkpoint_dir_never_starts_a_run_over(small_cfg, tmp_path):
    """A mistyped checkpoint.dir finds no checkpoint: starting at step 0 would drop the run's metrics
    and rewrite its config.yaml. Refused (exit 2), and both are left as they were."""
    cfg = small_cfg("train.steps=4", "checkpoint.every=2", "mesh.data=1", run_dir="c")
    fit(cfg, devices=jax.devices()[:1], quiet=True)
    files = {name: (Path(cfg.run.dir) / name).read_bytes() for name in ("metrics.jsonl", "config.yaml")}
    typo = tmp_path / "ckpts_typo"
    with pytest.raises(ConfigError) as e:
        fit(small_cfg("train.steps=6", "checkpoint.every=2", "mesh.data=1", f"checkpoint.dir={typo}", run_dir="c"),
            devices=jax.devices()[:1], quiet=True)
    assert e.value.exit_code == 2
    assert str(e.value) == (f"checkpoint.dir: {typo} holds no checkpoint, but run.dir {cfg.run.dir} holds a run to "
                            f"step 4 whose checkpoints were in {cfg.run.dir}/checkpoints (the default): starting it "
                            f"over would drop its metrics. To resume, set checkpoint.dir back; to start a new run, "
                            f"use a new run.dir. Its metrics.jsonl and config.yaml are left as they were")
    assert {name: (Path(cfg.run.dir) / name).read_bytes() for name in files} == files
    assert not typo.exists() or not any(typo.iterdir())


def test_a_run_without_a_checkpoint_starts_over_and_says_so(small_cfg, capsys):
    cfg = small_cfg("train.steps=3", "checkpoint.enabled=false", "mesh.data=1", run_dir="n")
    fit(cfg, devices=jax.devices()[:1], quiet=True)
    fit(small_cfg("train.steps=2", "checkpoint.enabled=false", "mesh.data=1", run_dir="n"),
        devices=jax.devices()[:1], quiet=True)
    assert ("no checkpoint to resume: starting at step 0 (metrics.jsonl's rows to step 3, of an earlier attempt, "
            "are dropped)") in capsys.readouterr().out
    assert max(r["step"] for r in read_metrics(cfg.run.dir)) == 2


def test_a_row_cut_short_by_a_crash_is_dropped_on_resume_and_skipped_by_readers(small_cfg):
    cfg = small_cfg("train.steps=4", "checkpoint.every=2", "mesh.data=1", run_dir="t")
    fit(cfg, devices=jax.devices()[:1], quiet=True)
    path = Path(cfg.run.dir) / "metrics.jsonl"
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"time": 1.0, "step": 5, "lo')  # SIGKILL in the middle of a write
    assert read_metrics(cfg.run.dir) == [json.loads(line) for line in whole.splitlines()]
    fit(small_cfg("train.steps=6", "checkpoint.every=2", "mesh.data=1", run_dir="t"), devices=jax.devices()[:1],
        quiet=True)
    lines = path.read_bytes().splitlines()
    assert all(isinstance(json.loads(line), dict) for line in lines)  # no row was appended to the cut one
    assert [r["step"] for r in map(json.loads, lines) if "loss" in r][-2:] == [5, 6]
    path.write_bytes(b'{"step": 1}\nnot json\n{"step": 2}\n')  # damage inside the file: named, never guessed
    with pytest.raises(ConfigError, match=r"metrics.jsonl: line 2 is not a JSON row"):
        read_metrics(cfg.run.dir)


def test_a_layout_key_that_still_restores_is_said(small_cfg, capsys):
    cfg = small_cfg("train.steps=2", "checkpoint.every=2", "mesh.data=1", run_dir="d")
    fit(cfg, devices=jax.devices()[:1], quiet=True)
    fit(small_cfg("train.steps=3", "checkpoint.every=2", "mesh.data=1", "model.param_dtype=bfloat16", run_dir="d"),
        devices=jax.devices()[:1], quiet=True)
    assert ("note: model.param_dtype: checkpoint has 'float32', config has 'bfloat16' (restored as the config says)"
            in capsys.readouterr().out)


def test_a_resume_with_another_global_batch_is_refused_and_leaves_the_run_as_it_was(small_cfg):
    """The data position counts steps of the saved batch: a resume 16 -> 32 skipped rows 64-127 of the data
    order (5eb7ae3). Now a named error before anything is written; the same batch resumes."""
    first = fit(small_cfg("train.steps=2", "checkpoint.every=2", run_dir="gb"), quiet=True)
    saved = (first.run_dir / "config.yaml").read_bytes()
    with pytest.raises(ConfigError) as e:
        fit(small_cfg("train.steps=4", "checkpoint.every=2", "train.global_batch=16", run_dir="gb"), quiet=True)
    assert str(e.value) == ("train.global_batch: 16, but the checkpoint's data position was reached with 8 sequences "
                            "a step; resuming with another batch would skip or repeat training data. Resume with "
                            "train.global_batch=8, or start a new run.dir")
    assert (first.run_dir / "config.yaml").read_bytes() == saved
    again = fit(small_cfg("train.steps=4", "checkpoint.every=2", run_dir="gb"), quiet=True)
    assert sorted(again.losses) == [3, 4]
