"""Elastic resumes with real processes (jaxtrain.train.elastic): a job of 2 processes x 4 devices
resumes on 1 x 4 (gradient accumulation x2, a note says so) and then on 2 x 4 again, with
``mesh.data=-1`` and no config edit. Every loss equals the uninterrupted 8-device run's, and every
global batch drawn is the uninterrupted run's (a probe logs a digest of each draw)."""
from pathlib import Path

import batch_log
import multiproc as mp
import pytest

from jaxtrain import config as cfglib
from jaxtrain.data import arrays
from jaxtrain.train import fit

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
TINY = ["model.n_layers=1", "mesh.data=-1", "train.global_batch=16", "train.log_every=1", "train.eval_every=1000",
        "train.eval_batches=1", "train.sample_tokens=0", "run.progress=false", "checkpoint.every=2",
        "checkpoint.keep=10", "optimizer.warmup_steps=2", "optimizer.decay_steps=8",
        "distributed.init_timeout_s=60", "distributed.peer_timeout_s=20"]
CONFIG = "configs/shakespeare_char.yaml"
NOTE = ("note: elastic: 4 batch devices (data*fsdp*expert): train.grad_accum 2 instead of 1 keeps "
        "train.global_batch=16 and distributed.device_micro_batch=2")


def _args(corpus: str, run_dir: Path, steps: int) -> list[str]:
    return ["--config", CONFIG, f"data.path={corpus}", f"run.dir={run_dir}", *TINY, f"train.steps={steps}"]


@pytest.mark.slow  # over ~20 s on 2 cores (CI's durations)
def test_resume_on_fewer_then_more_devices_keeps_both_batches(tmp_path, corpus_path, monkeypatch):
    ref_log = tmp_path / "reference.batches"
    monkeypatch.setattr(arrays.BatchIterator, "__init__", batch_log.logging_init(str(ref_log)))
    reference = fit(cfglib.load(CONFIG, _args(corpus_path, tmp_path / "ref", 8)[2:]), quiet=True).losses
    monkeypatch.undo()
    ref_batches = batch_log.read(ref_log)
    assert sorted(reference) == list(range(1, 9)) and len(ref_batches) >= 8

    run_dir, outputs, seen = tmp_path / "run", [], []
    for leg, (processes, first, last) in enumerate([(2, 1, 4), (1, 5, 6), (2, 7, 8)]):
        log = tmp_path / f"leg{leg}.batches"
        env = {"PYTHONPATH": f"{HELPERS / 'batch_probe'}:{HELPERS}", batch_log.ENV: str(log)}
        job = mp.run(processes, 4, _args(corpus_path, run_dir, last), extra_env=env, timeout=240)
        outputs.append(job.output(0))
        seen += batch_log.read(log)[:last - first + 1]  # a draw past the leg's last step is never trained on
    assert seen == ref_batches[:8]  # the same rows, in the same order, on 8, 4 and 8 devices

    assert "mesh data=8 " in outputs[0] and "(8 devices)" in outputs[0] and "note: elastic" not in outputs[0]
    assert f"resumed from {run_dir / 'checkpoints'}/4 (resharded from mesh" in outputs[1]
    assert "mesh data=4 " in outputs[1] and NOTE in outputs[1], outputs[1][-3000:]
    assert f"resumed from {run_dir / 'checkpoints'}/6" in outputs[2] and "note: elastic" not in outputs[2]
    losses = mp.losses(run_dir)
    assert sorted(losses) == list(range(1, 9)), losses
    assert all(abs(losses[s] - reference[s]) <= 1e-5 for s in losses), (losses, reference)
    saved = cfglib.load(str(run_dir / "config.yaml"))
    assert (saved.train.grad_accum, saved.distributed.device_micro_batch) == (1, 2)
