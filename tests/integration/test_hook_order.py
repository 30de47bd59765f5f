"""The loop owns the order of the hooks: it follows what each declares it produces and reads, so the
order they are given in changes no output (the rows, the checkpoints, the sample, the final state)."""
import json
import os
import signal

import jax
import numpy as np
import pytest

from jaxtrain.train import Hook, fit, trainer
from jaxtrain.train.loop import ordered

TIMING = ("time", "step_time_s", "tokens_per_sec", "mfu", "data_wait_s", "checkpoint_block_s", "compile_s",
          "eval_time_s", "save_blocking_s", "save_total_s", "checksum_s")


def run(small_cfg, monkeypatch, reverse: bool, name: str):
    builtin = trainer.builtin_hooks
    if reverse:
        monkeypatch.setattr(trainer, "builtin_hooks", lambda *a: builtin(*a)[::-1])
    cfg = small_cfg("train.steps=6", "train.eval_every=2", "train.log_every=1", "checkpoint.every=2",
                    "checkpoint.keep_best=1", "mesh.data=1", run_dir=name)
    result = fit(cfg, devices=jax.devices()[:1], quiet=True)
    monkeypatch.setattr(trainer, "builtin_hooks", builtin)
    rows = [json.loads(line) for line in open(f"{cfg.run.dir}/metrics.jsonl")]
    kept = sorted(json.dumps({k: v for k, v in r.items() if k not in TIMING}, sort_keys=True) for r in rows)
    return result, kept


def test_the_order_hooks_are_given_in_changes_no_output(small_cfg, monkeypatch):
    given, rows_given = run(small_cfg, monkeypatch, False, "given")
    reversed_, rows_reversed = run(small_cfg, monkeypatch, True, "reversed")
    assert rows_given == rows_reversed and len(rows_given) >= 6 + 3 + 3  # train, eval and checkpoint rows
    assert given.sample == reversed_.sample and given.val_loss == reversed_.val_loss
    for a, b in zip(jax.tree_util.tree_leaves(given.state), jax.tree_util.tree_leaves(reversed_.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    kept = [sorted(p.name for p in (r.run_dir / "checkpoints").iterdir()) for r in (given, reversed_)]
    assert kept[0] == kept[1] and "6" in kept[0], kept  # the same steps kept (best by val_loss, and the last)


class SignalAt(Hook):
    """Sends this process SIGTERM before step ``at`` is dispatched, as a preemption notice would."""

    def __init__(self, at: int):
        self.at = at

    def before_step(self, loop, step: int) -> None:
        if step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_stop_at_an_evaluation_step_saves_without_evaluating(small_cfg):
    """The grace period is the save's: the evaluation due at the stop step (and keep_best's) is skipped,
    the stop step is committed (without a metric), and the run ends there."""
    cfg = small_cfg("train.steps=6", "train.eval_every=2", "train.log_every=1", "checkpoint.every=100",
                    "checkpoint.keep_best=1", "mesh.data=1", run_dir="stopped")
    result = fit(cfg, devices=jax.devices()[:1], quiet=True, hooks=[SignalAt(4)])
    assert result.preempted == "SIGTERM" and result.val_loss is None
    assert [r["step"] for r in result.rows if "val_loss" in r] == [2]  # not at 4, where it stopped
    assert [r["step"] for r in result.rows if "loss" in r] == [1, 2, 3, 4]
    marker = json.loads((result.run_dir / "checkpoints" / "4" / "COMMIT.json").read_text())
    assert marker["step"] == 4 and marker["metrics"] == {}


class Producer(Hook):
    produces = "row"


class Reader(Hook):
    reads = ("row",)


class ReadsStop(Hook):
    produces, reads = "stop", ("row",)


class ReadsRow(Hook):
    produces, reads = "row", ("stop",)


def test_hooks_run_after_the_producers_of_what_they_read_and_bad_declarations_are_named():
    reader, producer = Reader(), Producer()
    assert ordered([reader, producer]) == [producer, reader]
    with pytest.raises(ValueError, match="^Reader reads 'row', which no hook produces$"):
        ordered([reader])
    with pytest.raises(ValueError, match="^Producer and Producer both produce 'row'$"):
        ordered([Producer(), Producer()])
    with pytest.raises(ValueError, match="^hooks read each other's fields in a cycle: ReadsStop, ReadsRow$"):
        ordered([ReadsStop(), ReadsRow()])
