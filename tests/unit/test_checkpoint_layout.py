"""The two halves of the checkpointer on their own, without Orbax or a model: the names of a checkpoint
directory (``layout.Layout``) and the typed record of a save in flight with its timeout (``pending``)."""
import json
from concurrent.futures import Future

import pytest
from etils import epath

from jaxtrain.checkpoint import checkpointer as ckptlib
from jaxtrain.checkpoint import layout, pending, storage
from jaxtrain.errors import SaveTimeoutError


def a_step(root, step: int, marker=None) -> None:
    (root / str(step) / "state").mkdir(parents=True)
    (root / str(step) / "state" / "shard").write_bytes(b"x" * step)
    if marker is not None:
        (root / str(step) / layout.MARKER).write_text(marker)


def test_commit_cycle_and_what_each_name_means(tmp_path):
    lay = layout.Layout(storage.Store(epath.Path(tmp_path)))
    assert not lay.remote and lay.latest_step() is None and lay.committed() == {}
    a_step(tmp_path, 3)
    lay.begin(3)
    assert json.loads((tmp_path / layout.pending_name(3)).read_text())["step"] == 3
    assert lay.occupied(3) and not lay.occupied(4) and lay.marker(3) is None
    lay.commit(3, metrics={"val_loss": 1.5}, mesh={"fsdp": 2}, process_count=1, tree={"w": [[2], "float32"]},
               files={"state/shard": [3, "00000000"]})
    marker = json.loads((tmp_path / "3" / layout.MARKER).read_text())
    assert list(marker) == ["format", "step", "time", "metrics", "mesh", "process_count", "tree", "files"]
    assert marker["format"] == layout.FORMAT and not (tmp_path / layout.pending_name(3)).exists()
    a_step(tmp_path, 5, marker='{"step": 5, ')  # torn
    a_step(tmp_path, 6, marker=json.dumps({"step": 7, "files": {"a": [1, ""]}, "tree": {}}))  # another step's
    a_step(tmp_path, 8)  # not ours: no marker, no pending marker
    (tmp_path / "9.corrupt").mkdir()
    (tmp_path / "9.corrupt2").mkdir()
    good, bad = lay.markers()
    assert list(good) == [3] and bad[5].startswith("is not valid JSON (") and bad[6] == "does not record step 6"
    assert lay.restorable() == [3, 5, 6] and lay.latest_step() == 3
    assert lay.set_aside_names() == ["9.corrupt", "9.corrupt2"] and lay.set_aside_name(9) == "9.corrupt3"
    assert lay.cleanup_unfinished() == ([], ["8"])  # nothing of ours is unfinished; 8 is left alone


def test_cleanup_discard_delete_and_move_aside(tmp_path):
    lay = layout.Layout(storage.Store(epath.Path(tmp_path)))
    for step in (2, 4):
        a_step(tmp_path, step)
        lay.commit(step, metrics={}, mesh={}, process_count=1, tree={}, files={"state/shard": [step, ""]})
    a_step(tmp_path, 6)  # killed before its marker
    (tmp_path / "7.orbax-checkpoint-tmp-99").mkdir()  # killed mid-write
    for step in (6, 7, 4):  # 4: killed after its marker, before the pending marker went
        lay.begin(step)
    assert lay.cleanup_unfinished() == (["6", "7.orbax-checkpoint-tmp-99"], [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "4"]

    a_step(tmp_path, 8)
    (tmp_path / "8.orbax-checkpoint-tmp-1").mkdir()
    lay.begin(8)
    lay.discard(8)  # a failed save: the step, its temporaries and its pending marker
    lay.delete([2])  # garbage collection of a committed step
    assert sorted(p.name for p in tmp_path.iterdir()) == ["4"]
    lay.move_aside(4, lay.set_aside_name(4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["4.corrupt"] and lay.committed() == {}


def test_names_stay_importable_from_the_checkpointer_module():
    assert ckptlib.MARKER == "COMMIT.json" and ckptlib.pending_name(12) == "12.jaxtrain-pending"
    assert ckptlib.PendingSave is pending.PendingSave and ckptlib.CheckpointError.exit_code == 2
    assert callable(ckptlib.abstract_like)


def test_pending_record_phases():
    p = pending.PendingSave(step=4, began_s=0.0, started_s=0.0, blocking_s=0.1, metrics={}, tree={})
    assert not p.written and not p.ready
    p.work = Future()
    assert p.written and not p.ready
    p.work.set_result(pending.CommitWork(files={"a": [1, ""]}, checksum_s=0.01))
    assert p.ready and p.work.result().uploaded_bytes == 0


def test_a_save_past_its_limit_is_a_named_timeout_after_progress_lines(monkeypatch):
    monkeypatch.setattr(pending, "FIRST_NOTE_S", 0.0)
    lines = []
    p = pending.PendingSave(step=7, began_s=0.0, started_s=pending.time.monotonic(), blocking_s=0.0,
                            metrics={}, tree={})
    with pytest.raises(SaveTimeoutError) as err:
        pending.wait_for(p, lambda: False, "being written", 0.1, lines.append,
                         lambda: "the last committed checkpoint is step 5 in /x")
    assert str(err.value) == ("checkpoint.save_timeout_s: checkpoint step 7 was still being written 0.1 s after it "
                              "began; stopping. The last committed checkpoint is step 5 in /x; the unfinished step "
                              "is removed on the next start")
    assert err.value.exit_code == 4
    assert lines and lines[0].startswith("waiting for checkpoint step 7: still being written (")
    assert lines[0].endswith(" s of checkpoint.save_timeout_s=0.1)")
    pending.wait_for(p, lambda: True, "being written", 0.0, lines.append, lambda: "")  # done: never times out
