"""Elastic resumes (jaxtrain.train.elastic): the gradient accumulation that keeps the global batch and the
per-device micro-batch on another device count, the named error when none does, and the data iterators
continuing at the same global rows across a change of devices and accumulation."""
import jax
import numpy as np
import pytest
import yaml
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain import config as cfglib
from jaxtrain.config import MeshConfig
from jaxtrain.data import arrays, pipeline, store
from jaxtrain.errors import ConfigError
from jaxtrain.parallel.mesh import build_mesh
from jaxtrain.train import elastic


class Notes:
    def __init__(self):
        self.lines = []

    def info(self, line):
        self.lines.append(line)


def _cfg(tmp_path, *overrides):
    return cfglib.load(None, [f"run.dir={tmp_path}", "train.global_batch=16", "mesh.data=-1", *overrides])


def _saved(tmp_path, checkpoint=True, **distributed):
    """An earlier run's config.yaml in run.dir, and (``checkpoint``) something in its checkpoint directory."""
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"distributed": distributed, "train": {"grad_accum": 1}}))
    if checkpoint:
        (tmp_path / "checkpoints" / "100").mkdir(parents=True)


def test_a_fresh_run_in_a_reused_run_dir_keeps_its_own_micro_batch(tmp_path):
    """Nothing to resume (no checkpoint, or checkpoints off): the earlier run's recorded micro-batch does
    not apply; a new global batch is not an elastic resume's error (found by a new user's attempts)."""
    _saved(tmp_path, checkpoint=False, device_micro_batch=12)
    for overrides in ([], ["checkpoint.enabled=false"]):
        cfg = elastic.adapt(_cfg(tmp_path, *overrides), [None] * 2)
        assert (cfg.train.grad_accum, cfg.distributed.device_micro_batch) == (1, 8)
    (tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp-1733").mkdir(parents=True)  # a save's leftover: fresh
    assert elastic.adapt(_cfg(tmp_path), [None] * 2).distributed.device_micro_batch == 8
    (tmp_path / "checkpoints" / "100").mkdir(parents=True)
    with pytest.raises(ConfigError, match="elastic resume: train.global_batch=16 is not a whole number"):
        elastic.adapt(_cfg(tmp_path), [None] * 2)
    assert elastic.adapt(_cfg(tmp_path, "checkpoint.enabled=false"), [None] * 2).train.grad_accum == 1


def test_a_first_run_records_its_per_device_micro_batch(tmp_path):
    notes = Notes()
    cfg = elastic.adapt(_cfg(tmp_path), [None] * 8, notes)
    assert (cfg.train.grad_accum, cfg.distributed.device_micro_batch, notes.lines) == (1, 2, [])


@pytest.mark.parametrize("devices, accum", [(4, 2), (2, 4), (1, 8), (8, 1)])
def test_a_resume_keeps_both_batches_by_accumulating(tmp_path, devices, accum):
    _saved(tmp_path, device_micro_batch=2)
    notes = Notes()
    cfg = elastic.adapt(_cfg(tmp_path), [None] * devices, notes)
    assert (cfg.train.global_batch, cfg.train.grad_accum, cfg.micro_batch // devices) == (16, accum, 2)
    expected = [] if accum == 1 else [
        f"[yellow]note:[/] elastic: {devices} batch devices (data*fsdp*expert): train.grad_accum {accum} instead of 1 "
        f"keeps train.global_batch=16 and distributed.device_micro_batch=2"]
    assert notes.lines == expected


def test_only_the_batch_axes_count(tmp_path):
    _saved(tmp_path, device_micro_batch=2)
    cfg = elastic.adapt(_cfg(tmp_path, "mesh.tensor=2"), [None] * 8)  # data=4 x tensor=2: 4 batch devices
    assert cfg.train.grad_accum == 2


def test_no_whole_accumulation_is_named(tmp_path):
    _saved(tmp_path, device_micro_batch=2)
    with pytest.raises(ConfigError) as err:
        elastic.adapt(_cfg(tmp_path), [None] * 16)
    assert str(err.value) == (
        "train.grad_accum: elastic resume: train.global_batch=16 is not a whole number of micro-batches of 32 "
        "sequences (distributed.device_micro_batch=2 on each of 16 batch devices, data*fsdp*expert), so no gradient "
        "accumulation keeps both; resume on a device count for which it is, set distributed.device_micro_batch to a "
        "size that divides, or set distributed.elastic=false to keep train.grad_accum instead")


def test_explicit_size_switch_off_and_indivisible_first_runs(tmp_path):
    assert elastic.adapt(_cfg(tmp_path, "distributed.device_micro_batch=1"), [None] * 8).train.grad_accum == 2
    _saved(tmp_path, device_micro_batch=2)
    off = elastic.adapt(_cfg(tmp_path, "distributed.elastic=false", "train.grad_accum=4"), [None] * 4)
    assert (off.train.grad_accum, off.distributed.device_micro_batch) == (4, None)
    fresh = tmp_path / "fresh"
    cfg = elastic.adapt(_cfg(fresh, "train.global_batch=12"), [None] * 8)  # 12 on 8: setup names it
    assert (cfg.train.grad_accum, cfg.distributed.device_micro_batch) == (1, None)
    assert elastic.saved_device_micro_batch(fresh) is None


def _sharding(devices: int) -> NamedSharding:
    mesh = build_mesh(MeshConfig(data=devices), jax.devices()[:devices])
    return NamedSharding(mesh, P(None, ("data", "fsdp", "expert"), None))


def _flat(batch) -> dict:
    """A [accum, micro, ...] batch as its global rows in order."""
    return {k: np.asarray(v).reshape(-1, *v.shape[2:]) for k, v in batch.items()}


@pytest.mark.parametrize("kind", ["documents", "windows"])
def test_iterators_continue_at_the_same_rows_on_other_devices_and_accumulation(kind):
    """8 devices without accumulation, then the saved position restored on 4 devices accumulating x2: the rows
    an uninterrupted 8-device run would have seen next, in the same order."""
    if kind == "documents":
        docs = [np.random.default_rng(i).integers(1, 250, size=7 + i % 40).astype(np.int32) for i in range(80)]
        sched = pipeline.Schedule([(store.MemoryStore(docs, store.new_stats()), np.arange(80), None)], 16, "packed", 0)

        def make(accum, devices):
            return pipeline.DocBatchIterator(sched, 16, accum, _sharding(devices))
    else:
        rows = np.arange(100 * 5, dtype=np.int32).reshape(100, 5)
        cfg = cfglib.load(None, ["train.global_batch=16"])

        def make(accum, devices):
            cfg.train.grad_accum = accum
            return arrays.ArrayData({"x": rows}, {"x": rows[:16]}, cfg).iterator(_sharding(devices))
    whole = make(1, 8)
    reference = [_flat(next(whole)) for _ in range(4)]
    first = make(1, 8)
    next(first), next(first)
    resumed = make(2, 4)
    resumed.set_state(first.get_state())
    for want in reference[2:]:
        got = next(resumed)
        assert next(iter(got.values())).shape[:2] == (2, 8)
        for k in want:
            np.testing.assert_array_equal(_flat(got)[k], want[k])
