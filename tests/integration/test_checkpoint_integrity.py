"""Committed checkpoints carry each file's size and CRC32C: a truncated or altered step is a named
error naming the step and file, checkpoint.fallback resumes from the previous good step, and a
save stuck past checkpoint.save_timeout_s ends the run with exit code 4, the last commit intact."""
import json
import os
import subprocess
import sys
from pathlib import Path

import google_crc32c
import jax
import pytest
import xla_test_flags
from conftest import REPO, SMALL

from jaxtrain.checkpoint import checkpointer as ckptlib
from jaxtrain.config import load
from jaxtrain.errors import CorruptCheckpointError
from jaxtrain.train import Hook, fit, setup


def _files(step_dir: Path) -> dict[str, Path]:
    return {p.relative_to(step_dir).as_posix(): p for p in step_dir.rglob("*")
            if p.is_file() and p.name != ckptlib.MARKER}


def test_corrupt_steps_are_named_and_fallback_resumes_the_previous_good_one(small_cfg, capsys):
    dev = jax.devices()[:1]
    cfg = small_cfg("train.steps=4", "checkpoint.every=2", "mesh.data=1")
    full = fit(cfg, devices=dev, quiet=True)
    ck = Path(cfg.run.dir) / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["2", "4"]  # no pending markers left behind
    files, marker = _files(ck / "4"), json.loads((ck / "4" / ckptlib.MARKER).read_text())
    assert marker["format"] == 2 and set(marker["files"]) == set(files)
    for rel, path in files.items():
        data = path.read_bytes()
        assert marker["files"][rel] == [len(data), google_crc32c.Checksum(data).hexdigest().decode()]
    assert all(r["checksum_s"] >= 0 for r in full.rows if "checkpoint_saved" in r)

    big = max(files, key=lambda rel: files[rel].stat().st_size)  # the largest array file
    data = files[big].read_bytes()
    abstract = setup(cfg, dev, vocab=256).abstract_state()
    files[big].write_bytes(data[:-10])  # truncated
    ckpt = ckptlib.Checkpointer(cfg, cfg.run.dir)
    with pytest.raises(CorruptCheckpointError) as err:
        ckpt.restore(4, abstract)
    assert str(err.value) == (f"checkpoint step 4 in {ck} is corrupt: {big}: {len(data) - 10} bytes, expected "
                              f"{len(data)}. Set checkpoint.fallback=true to resume from the previous good step")
    flipped = data[:100] + bytes([data[100] ^ 1]) + data[101:]  # one bit, same size
    files[big].write_bytes(flipped)
    with pytest.raises(CorruptCheckpointError) as err:
        ckpt.restore(4, abstract)
    crc = lambda b: google_crc32c.Checksum(b).hexdigest().decode()  # noqa: E731
    assert f"{big}: CRC32C {crc(flipped)}, expected {crc(data)} (same size: the contents changed)" in str(err.value)
    ckpt.close()

    # Resuming stops with that error (exit 2) and changes nothing...
    longer = small_cfg("train.steps=6", "checkpoint.every=2", "mesh.data=1")
    with pytest.raises(CorruptCheckpointError) as err:
        fit(longer, devices=dev, quiet=True)
    assert err.value.exit_code == 2 and sorted(p.name for p in ck.iterdir()) == ["2", "4"]
    # ...unless asked to fall back: step 4 is set aside, step 2 resumed, and training redoes 3 and 4 exactly.
    capsys.readouterr()
    resumed = fit(small_cfg("train.steps=6", "checkpoint.every=2", "mesh.data=1", "checkpoint.fallback=true"),
                  devices=dev, quiet=True)
    assert f"checkpoint.fallback: checkpoint step 4 in {ck} is corrupt: {big}: CRC32C" in capsys.readouterr().out
    assert resumed.start_step == 2 and [resumed.losses[s] for s in (3, 4)] == [full.losses[s] for s in (3, 4)]
    assert sorted(p.name for p in ck.iterdir()) == ["2", "4", "4.corrupt", "6"]
    assert (ck / "4.corrupt" / big).read_bytes() == flipped  # kept as it was


def test_damaged_markers_and_unusable_fallbacks_change_nothing(small_cfg):
    dev = jax.devices()[:1]
    cfg = small_cfg("train.steps=4", "checkpoint.every=2", "mesh.data=1")
    fit(cfg, devices=dev, quiet=True)
    ck = Path(cfg.run.dir) / "checkpoints"
    longer = lambda *more: small_cfg("train.steps=6", "checkpoint.every=2", "mesh.data=1", *more)  # noqa: E731
    # Our markers are written atomically: a torn or edited one is corruption, never a silent step back.
    marker = json.loads((ck / "4" / ckptlib.MARKER).read_text())
    (ck / "4" / ckptlib.MARKER).write_text('{"step": 4, ')
    with pytest.raises(CorruptCheckpointError) as err:
        fit(longer(), devices=dev, quiet=True)
    assert str(err.value).startswith(f"checkpoint step 4 in {ck} is corrupt: COMMIT.json is not valid JSON (")
    for files in ({}, None):  # emptied, or the key removed
        marker["files"] = files
        (ck / "4" / ckptlib.MARKER).write_text(json.dumps({k: v for k, v in marker.items() if v is not None}))
        with pytest.raises(CorruptCheckpointError) as err:
            fit(longer(), devices=dev, quiet=True)
        assert str(err.value) == (f"checkpoint step 4 in {ck} is corrupt: COMMIT.json has no list of files and "
                                  f"leaves to check. Set checkpoint.fallback=true to resume from the previous good "
                                  f"step")
    # With step 2 corrupt too, a fallback has nowhere to go: an error, and nothing is moved.
    files = _files(ck / "2")
    big = max(files, key=lambda rel: files[rel].stat().st_size)
    files[big].write_bytes(files[big].read_bytes()[:-1])
    with pytest.raises(CorruptCheckpointError) as err:
        fit(longer("checkpoint.fallback=true"), devices=dev, quiet=True)
    assert str(err.value).startswith(f"checkpoint.fallback: no step in {ck} passes its check, so nothing was "
                                     f"restored or moved:\n  checkpoint step 4 in {ck} is corrupt: COMMIT.json has")
    assert sorted(p.name for p in ck.iterdir()) == ["2", "4"]


def test_a_foreign_directory_in_the_way_is_refused_before_training(small_cfg, tmp_path):
    ck = tmp_path / "ck"
    cfg = small_cfg("train.steps=4", "checkpoint.every=100", "mesh.data=1", f"checkpoint.dir={ck}")
    (ck / "3").mkdir(parents=True)
    (ck / "3" / "notes.txt").write_text("mine")
    with pytest.raises(ckptlib.CheckpointError) as err:
        fit(cfg, devices=jax.devices()[:1], quiet=True)
    assert str(err.value) == (f"checkpoint.dir: {ck} holds 3, not committed checkpoints of this run, and this run "
                              f"may save those steps (it trains 1..4); move them away or use another "
                              f"checkpoint.dir. Nothing was trained")
    assert (ck / "3" / "notes.txt").read_text() == "mine" and sorted(p.name for p in ck.iterdir()) == ["3"]
    assert (Path(cfg.run.dir) / "metrics.jsonl").read_text() == ""  # no step was trained


SLOW_FINALIZE = """
import sys, time
import orbax.checkpoint as ocp
finalize = ocp.CheckpointManager._finalize_checkpoint
def slow(self, step):  # Orbax's finalize of step 2 hangs (a stuck filesystem, say)
    if step == 2:
        time.sleep(120)
    return finalize(self, step)
ocp.CheckpointManager._finalize_checkpoint = slow
from jaxtrain.cli.train import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_stuck_save_times_out_with_exit_4_and_the_last_commit_intact(tmp_path, corpus_path):
    script = tmp_path / "slow.py"
    script.write_text(SLOW_FINALIZE)
    run = tmp_path / "run"
    args = [*SMALL, f"data.path={corpus_path}", f"run.dir={run}", "train.steps=4", "checkpoint.every=1",
            "checkpoint.save_timeout_s=7", "mesh.data=1"]
    env = {**os.environ, "XLA_FLAGS": xla_test_flags.with_devices(1), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(script), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=100)  # the hang is 120 s: a process that waits for it fails here
    assert proc.returncode == 4, proc.stderr[-3000:]
    ck = run / "checkpoints"
    assert "waiting for checkpoint step 2: still being written (" in proc.stdout + proc.stderr
    assert proc.stderr.endswith(
        "error: checkpoint.save_timeout_s: checkpoint step 2 was still being written 7 s after it began; stopping. "
        f"The last committed checkpoint is step 1 in {ck}; the unfinished step is removed on the next start\n")
    names = sorted(p.name for p in ck.iterdir())
    assert names[0] == "1" and ckptlib.pending_name(2) in names and not (ck / "2" / ckptlib.MARKER).exists()
    ckpt = ckptlib.Checkpointer(load(None, args), run)  # the next start removes the unfinished step
    assert list(ckpt.committed()) == [1] and [name.split(".")[0] for name in ckpt.removed] == ["2"]
    assert sorted(p.name for p in ck.iterdir()) == ["1"]
    ckpt.close()


class FailsAfterSaving(Hook):
    """Raises in step ``at``'s after_step, once Checkpointing (whose output it reads) started that step's save."""
    reads = ("committed",)

    def __init__(self, at: int):
        self.at = at

    def after_step(self, loop, rec):
        if rec.step == self.at:
            raise RuntimeError("a hook failed")


def test_a_run_that_fails_elsewhere_still_commits_the_save_it_had_started(small_cfg):
    """The save of step 4 is in flight (Orbax writes asynchronously) when another hook raises: the run
    waits for it as a diverged run does, then raises the hook's error; a resume starts from step 4."""
    dev = jax.devices()[:1]
    cfg = small_cfg("train.steps=6", "checkpoint.every=2", "mesh.data=1")
    with pytest.raises(RuntimeError, match="^a hook failed$"):
        fit(cfg, devices=dev, quiet=True, hooks=[FailsAfterSaving(4)])
    ck = Path(cfg.run.dir) / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["2", "4"]  # committed, no unfinished save left
    assert (ck / "4" / ckptlib.MARKER).is_file()
    assert fit(cfg, devices=dev, quiet=True).start_step == 4
