"""Two real processes (jax.distributed on 127.0.0.1, gloo CPU collectives) read one global batch;
a data position moves between 1 and 2 processes without a duplicate or a gap."""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import portpicker
import xla_test_flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain import config as cfglib
from jaxtrain import data as datalib
from jaxtrain.cli import prepare
from jaxtrain.parallel.mesh import build_mesh

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "data_multihost_worker.py"


def test_two_processes_read_the_global_batch_and_resume_across_process_counts(tmp_path, corpus_path):
    text = open(corpus_path, encoding="utf-8").read()
    rng = np.random.default_rng(0)
    with open(tmp_path / "docs.jsonl", "w") as f:
        for _ in range(200):
            a = int(rng.integers(0, len(text) - 300))
            f.write(json.dumps({"text": text[a:a + int(rng.integers(3, 200))]}) + "\n")
    assert prepare.main([f"data.path={tmp_path / 'docs.jsonl'}", "--out", str(tmp_path / "cache"),
                         "--no-progress"]) == 0
    overrides = [f"data.path={tmp_path / 'cache'}", "data.mode=packed", "data.seq_len=16",
                 "train.global_batch=16", "train.grad_accum=2", "train.eval_batches=1", "mesh.data=4",
                 "mesh.fsdp=2"]
    cfg = cfglib.load(None, overrides)

    # The reference: one process with all 8 devices.
    sharding = NamedSharding(build_mesh(cfg.mesh), P(None, ("data", "fsdp", "expert"), None))
    data = datalib.load(cfg)
    it = data.iterator(sharding)
    ref, states = [], [it.get_state()]
    for _ in range(6):
        ref.append({k: np.asarray(v) for k, v in next(it).items()})
        states.append(it.get_state())

    # 1 -> 2: two processes (4 devices each) continue from the state after step 2.
    port = portpicker.pick_unused_port()
    env = {**os.environ, "XLA_FLAGS": xla_test_flags.with_devices(4), "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(port), "2", str(i), str(tmp_path / f"p{i}.npz"),
                               "4", json.dumps(states[2]), json.dumps(overrides)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(2)]
    try:
        logs = [p.communicate(timeout=150)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-3000:] for log in logs)
    out = [np.load(tmp_path / f"p{i}.npz") for i in range(2)]
    for k in range(4):
        want = ref[2 + k]
        for name in want:
            a, b = out[0][f"{k}/{name}"], out[1][f"{k}/{name}"]
            assert ((a >= 0) != (b >= 0)).all(), name  # every element on exactly one process
            np.testing.assert_array_equal(np.where(a >= 0, a, b), want[name])  # union == the global batch
        assert (out[0][f"{k}/inputs"][:, :4] >= 0).all() and (out[1][f"{k}/inputs"][:, 4:] >= 0).all()  # own half
        assert int(out[0][f"{k}/sum"]) == int(out[1][f"{k}/sum"]) == int(want["inputs"].sum()
                                                                          + 7 * want["targets"].sum())
        for o in out:  # both processes hold the same global position as the single process
            assert json.loads(o[f"{k}/state"].tobytes()) == states[3 + k]

    # Each process read from the cache only the documents of its own rows (prefetch may read ahead).
    sched, micro = data.schedule, 8
    for pid, o in enumerate(out):
        own = {d for step in range(2, 6 + 4) for a in range(2) for j in range(4 * pid, 4 * pid + 4)
               for d, _, _ in sched.layout(0).segments(step * 16 + a * micro + j)}
        assert 0 < len(o["read"]) and set(o["read"].tolist()) <= own and len(own) < len(sched.pairs) / 2

    # 2 -> 1: one process resumes from the two processes' state after their step 4 (global step 4).
    it2 = datalib.load(cfg).iterator(sharding)
    it2.set_state(json.loads(out[0]["1/state"].tobytes()))
    for want in ref[4:]:
        got = next(it2)
        for name in want:
            np.testing.assert_array_equal(np.asarray(got[name]), want[name])
    assert jax.process_count() == 1
