"""Checkpoints on gs:// through a real GCS emulator (fake-gcs-server on 127.0.0.1, see tests/gcs_server.py):
Orbax/TensorStore write the steps, gcsfs lists them and writes the markers."""
import json

import google_crc32c
import jax
import numpy as np
import pytest

from jaxtrain.checkpoint import checkpointer as ckptlib
from jaxtrain.checkpoint import storage
from jaxtrain.errors import CorruptCheckpointError
from jaxtrain.train import fit, setup

# The S3 test's run (same mesh and schedule), so the persistent compile cache serves both.
RUN = ("checkpoint.every=2", "checkpoint.keep=2", "optimizer.decay_steps=8", "mesh.data=1", "mesh.fsdp=2",
       "mesh.tensor=2")


def steps_in(fs, prefix):
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(prefix))


def test_save_list_gc_restore_and_resume_on_gcs(gcs, small_cfg, monkeypatch):
    bucket = gcs.new_bucket("ckpts")
    url, prefix = f"gs://{bucket}/runs/a", f"{bucket}/runs/a"
    fs = gcs.fs()
    devices = jax.devices()[:4]

    # Commit order: when a marker is written, every object Orbax writes for that step is already there.
    at_marker = {}
    write_text = storage.Store.write_text

    def spy(self, rel, text):
        if rel.endswith(ckptlib.MARKER):
            step = rel.split("/")[0]
            at_marker[int(step)] = {p[len(f"{prefix}/{step}/"):] for p in fs.find(f"{prefix}/{step}")}
        write_text(self, rel, text)
    monkeypatch.setattr(storage.Store, "write_text", spy)

    cfg = small_cfg("train.steps=6", f"checkpoint.dir={url}", *RUN)
    full = fit(cfg, devices=devices, quiet=True)  # the uninterrupted run
    assert [r["checkpoint_saved"] for r in full.rows if "checkpoint_saved" in r] == [2, 4, 6]
    assert [r["checkpoints_removed"] for r in full.rows if "checkpoint_saved" in r] == [[], [], [2]]
    assert sorted(at_marker) == [2, 4, 6]
    for objects in at_marker.values():
        assert ckptlib.MARKER not in objects
        assert {"commit_success.txt", "_CHECKPOINT_METADATA", "state/_METADATA", "state/manifest.ocdbt",
                "data/metadata", "config/metadata"} <= objects, sorted(objects)
    assert steps_in(fs, prefix) == ["4", "6"]  # keep=2: step 2 collected, marker and data
    assert not fs.exists(f"{prefix}/2") and fs.exists(f"{prefix}/6/{ckptlib.MARKER}")
    assert not (full.run_dir / "checkpoints").exists()  # nothing went to the local run dir

    # List and restore, bit for bit, through a fresh checkpointer (a new process would do the same).
    ckpt = ckptlib.Checkpointer(cfg, full.run_dir)
    assert list(ckpt.committed()) == [4, 6] and ckpt.removed == []
    assert ckpt.saved_mesh(6) == {"data": 1, "fsdp": 2, "tensor": 2, "sequence": 1, "expert": 1, "stage": 1}
    state, data = ckpt.restore(6, setup(cfg, devices, vocab=256).abstract_state())
    ckpt.close()
    for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(full.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert data and isinstance(data, dict)

    # A crash after Orbax wrote step 6 but before its marker, and a step 8 that got no further than one
    # object: neither is ever restored, both are removed, and the rerun resumes from 4 with exactly the
    # uninterrupted run's losses.
    fs.rm_file(f"{prefix}/6/{ckptlib.MARKER}")
    fs.pipe_file(f"{prefix}/8/state/partial", b"x")
    for step in (6, 8):  # the pending markers those saves wrote before they began
        fs.pipe_file(f"{prefix}/{ckptlib.pending_name(step)}", b"{}")
    from gcs_server import forget_gcs_clients
    forget_gcs_clients()  # as in a new process: no gcsfs listing cached from before the crash
    ckpt = ckptlib.Checkpointer(cfg, full.run_dir)
    assert ckpt.removed == ["6", "8"] and list(ckpt.committed()) == [4] and steps_in(fs, prefix) == ["4"]
    with pytest.raises(ckptlib.CheckpointError, match="checkpoint step 6 .* is not committed"):
        ckpt.restore(6, None)
    ckpt.close()
    resumed = fit(cfg, devices=devices, quiet=True)
    assert resumed.start_step == 4 and sorted(resumed.losses) == [5, 6]
    assert [resumed.losses[s] for s in (5, 6)] == [full.losses[s] for s in (5, 6)]  # bit-identical
    assert steps_in(fs, prefix) == ["4", "6"]
    ckpt = ckptlib.Checkpointer(cfg, full.run_dir)
    assert list(ckpt.committed()) == [4, 6]
    # The marker's checksums are the CRC32C GCS keeps; an object rewritten with other bytes is caught.
    files = json.loads(fs.cat_file(f"{prefix}/6/{ckptlib.MARKER}"))["files"]
    rel = max(files, key=lambda r: files[r][0])
    data = fs.cat_file(f"{prefix}/6/{rel}")
    assert files[rel] == [len(data), google_crc32c.Checksum(data).hexdigest().decode()]
    fs.pipe_file(f"{prefix}/6/{rel}", bytes([data[0] ^ 1]) + data[1:])
    with pytest.raises(CorruptCheckpointError, match=f"checkpoint step 6 in {url} is corrupt: {rel}: CRC32C"):
        ckpt.restore(6, setup(cfg, devices, vocab=256).abstract_state())
    ckpt.close()


def test_a_missing_bucket_is_named_before_training(gcs, small_cfg):
    cfg = small_cfg("checkpoint.dir=gs://no-such-bucket/run", "mesh.data=1")
    with pytest.raises(ckptlib.CheckpointError) as err:
        ckptlib.Checkpointer(cfg, cfg.run.dir)
    assert str(err.value) == "checkpoint.dir: bucket 'no-such-bucket' does not exist" and err.value.exit_code == 2
