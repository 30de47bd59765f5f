"""No run hangs or dies at its end: evaluation is one program, a stuck step ends by name, and SIGTERM
always ends a process within its grace period, even while the main thread is blocked in native code.

A step is hung on purpose by a ``jax.pure_callback`` in the loss that sleeps on its Nth call.
"""
import re
import signal
import sys
import time
from pathlib import Path

import jax
import pytest
import xla_test_flags
from test_preempt import DEADLINE_S, Child, crash_trials

from jaxtrain.train import Hook, fit

HANG = """
import ctypes, sys, threading
import jax, jax.numpy as jnp
from jaxtrain.runtime import signals
signals.during_startup()
from jaxtrain.models import family
calls, libc, mutex = [0], ctypes.CDLL(None), ctypes.create_string_buffer(64)  # a default pthread mutex
def host(x):
    calls[0] += 1
    if calls[0] == 3:
        print("hanging now on", threading.current_thread().name, flush=True)
        libc.pthread_mutex_lock(mutex)
        libc.pthread_mutex_lock(mutex)  # never returns; no signal interrupts it
    return x
entropy = family.masked_cross_entropy
def hung(logits, targets, mask):
    loss, weight = entropy(logits, targets, mask)
    probe = jax.pure_callback(host, jax.ShapeDtypeStruct((), jnp.float32), jax.lax.stop_gradient(loss))
    return loss + 0.0 * probe, weight
family.masked_cross_entropy = hung
from jaxtrain.cli.train import main
sys.exit(main(sys.argv[1:]))
"""


def hung_child(tmp_path, corpus_path, *overrides: str) -> Child:
    """A trainer whose third train step never finishes: its loss's callback deadlocks in native code.
    On one device XLA:CPU usually runs this small step on the calling thread, so the main thread itself
    is blocked where Python's signal handlers never run (the case SIGTERM must still end); sometimes it
    runs it on one of its own threads (seen in CI), and the main thread waits for it in native code."""
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    args = crash_trials.command(tmp_path / "run", corpus_path, 6)[3:]
    return Child([sys.executable, str(script), *args, "checkpoint.enabled=false", "model.n_layers=1", *overrides])


def devices(n: int) -> dict:
    env = crash_trials.environment()
    env["XLA_FLAGS"] = xla_test_flags.with_devices(n)
    return env


def test_a_hung_step_ends_with_the_named_error_and_every_threads_stack(tmp_path, corpus_path):
    child = hung_child(tmp_path, corpus_path, "train.hang_timeout_s=3")
    thread = child.wait_for_line("hanging now on ").split()[-1]
    t0 = time.monotonic()
    out = child.finish(timeout=60)
    assert child.proc.returncode == 5, out
    assert time.monotonic() - t0 < 30, out  # 3 s of limit, polled every 0.2 s
    stacks = tmp_path / "run" / "hang_stacks.process0.txt"
    message = re.search(r"^error: train\.hang_timeout_s: the train step at step (\d) made no progress for ([\d.]+) s "
                        r"\(limit 3 s\); the process is alive but stuck .*Every thread's Python stack is in "
                        + re.escape(str(stacks)) + r"\. Committed checkpoints are intact; rerun to resume$",
                        out, re.M)
    assert message, out
    assert message.group(1) == "3" and float(message.group(2)) >= 3
    text = stacks.read_text()
    if thread == "MainThread":  # the callback's frames sit on top of the trainer's in one stack
        assert re.search(r'File ".*hang\.py", line \d+ in host\n(.*\n)*.* in run\n', text), text
    else:  # the callback's thread and the main thread each have theirs
        assert re.search(r'File ".*hang\.py", line \d+ in host\n', text) and " in run\n" in text, text


DATA_HANG = """
import sys, threading
from jaxtrain.runtime import signals
signals.during_startup()
from jaxtrain.train import loop
draw, calls = loop.Lookahead._draw, [0]
def stuck(self):
    calls[0] += 1
    if calls[0] == 3:
        print("the data hangs now", flush=True)
        threading.Event().wait()  # a read that never returns
    return draw(self)
loop.Lookahead._draw = stuck
from jaxtrain.cli.train import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_data_pipeline_that_never_returns_a_batch_ends_by_name(tmp_path, corpus_path):
    """The loop's wait for a batch is bounded like a step: the third draw blocks forever (on the loop's
    own thread, or on the thread that draws the next batch while a step runs inline)."""
    script = tmp_path / "data_hang.py"
    script.write_text(DATA_HANG)
    args = crash_trials.command(tmp_path / "run", corpus_path, 6)[3:]
    child = Child([sys.executable, str(script), *args, "checkpoint.enabled=false", "model.n_layers=1",
                   "train.hang_timeout_s=3"])
    child.wait_for_line("the data hangs now")
    out = child.finish(timeout=60)
    assert child.proc.returncode == 5, out
    assert re.search(r"^error: train\.hang_timeout_s: the next batch from the data pipeline at step \d made no "
                     r"progress for [\d.]+ s \(limit 3 s\); the process is alive but stuck \(the data pipeline "
                     r"never returned a batch: a read that hangs \(a remote store, a network filesystem\)\)\. "
                     r"Every thread's Python stack is in ", out, re.M), out
    assert "in stuck" in (tmp_path / "run" / "hang_stacks.process0.txt").read_text()


def test_sigterm_into_a_hung_step_exits_75_within_the_grace_period(tmp_path, corpus_path):
    child = hung_child(tmp_path, corpus_path, "train.hang_timeout_s=600", "checkpoint.grace_period_s=2")
    child.wait_for_line("hanging now on ")
    time.sleep(0.5)
    t0 = time.monotonic()
    child.proc.send_signal(signal.SIGTERM)
    out = child.finish(timeout=60)
    assert child.proc.returncode == 75, out
    assert time.monotonic() - t0 < 20, out
    assert re.search(r"^error: checkpoint\.grace_period_s=2 s passed after SIGTERM before the checkpoint "
                     r"committed; it was waiting for the train step at step 3 \([\d.]+ s so far\); exiting "
                     r"\(the latest committed checkpoint is intact\)$", out, re.M), out


class CountCalls(Hook):
    """Counts the evaluation's programs and the batches each held; a per-batch evaluation call fails the test."""

    def __init__(self):
        self.batches = []

    def on_start(self, loop):
        evaluate = loop.setup.fns.evaluate

        def counted(params, val):
            self.batches.append(next(iter(val.values())).shape[0])
            return evaluate(params, val)

        def per_batch(*_):
            raise AssertionError("an evaluation dispatched the one-batch eval_step")
        loop.setup.fns.evaluate, loop.setup.fns.eval_step = counted, per_batch


def test_an_evaluation_is_one_program_per_piece_and_equals_the_per_batch_mean(small_cfg):
    cfg = small_cfg("train.steps=4", "train.eval_every=2", "train.eval_batches=36", "checkpoint.enabled=false",
                    "train.sample_tokens=0")
    hook = CountCalls()
    result = fit(cfg, quiet=True, hooks=[hook])
    # Steps 2 and 4 (the final loss is step 4's), each 18 pieces of 2 batches: at most 32 pieces (a point
    # to stop at between two), each one program of a scan over its batches.
    assert hook.batches == [2] * 36
    # The pieces' value is the token-weighted mean of the batches' losses, evaluated one by one.
    from jaxtrain.train import setup
    from jaxtrain.train.trainer import put_validation
    s = setup(cfg, load_data=True)
    params = result.state["params"]
    val = put_validation(s.data.val, s.fns.batch_sharding)
    scanned = jax.device_get(s.fns.evaluate(params, val))
    one_by_one = [jax.device_get(s.fns.eval_step(params, {k: v[i] for k, v in val.items()})) for i in range(36)]
    for i, o in enumerate(one_by_one):
        assert scanned["loss"][i] == pytest.approx(float(o["loss"]), rel=1e-6)
        assert scanned["weight"][i] == float(o["weight"])
    ev = {r["step"]: r["val_loss"] for r in result.rows if "val_loss" in r}
    w = [float(o["weight"]) for o in one_by_one]
    mean = sum(float(o["loss"]) * wi for o, wi in zip(one_by_one, w)) / sum(w)
    assert ev[4] == pytest.approx(mean, rel=1e-6) and result.val_loss == ev[4]
    lowered = s.fns.evaluate.lower(params, val).as_text()
    assert lowered.count("stablehlo.while") == 1  # the batches are a loop inside the one program


@pytest.mark.parametrize("config, overrides", [
    ("configs/shakespeare_char.yaml", ["model.attention=ring", "sharding.rules=sp", "mesh.sequence=4",
                                       "mesh.data=2", "train.global_batch=4", "data.seq_len=16"]),
    ("configs/moe_shakespeare.yaml", ["sharding.rules=ep", "mesh.expert=8", "train.global_batch=8",
                                      "data.seq_len=16"]),
], ids=["ring-sp", "moe-ep"])
def test_one_process_on_8_devices_finishes_with_100_evaluation_batches(tmp_path, corpus_path, config, overrides):
    """Once each here; benchmarks/end_of_run.py runs them 20 times (the closing note has its count)."""
    env = devices(8)
    cmd = [sys.executable, "-m", "jaxtrain.train", "--config", config, f"data.path={corpus_path}",
           f"run.dir={tmp_path / 'run'}", "train.steps=3", "train.eval_batches=100", "train.sample_tokens=16",
           "run.progress=false", "checkpoint.enabled=false", "model.n_layers=1", *overrides]
    # One layer, small batches of short windows, no checkpoint: what aborted was the count of
    # dispatched multi-device programs at the end of the run, not their size.
    child = Child(cmd, env=env)
    out = child.finish(timeout=DEADLINE_S)
    assert child.proc.returncode == 0, out
    assert "validation loss " in out and "(mean over 100 batches)" in out, out


def test_two_processes_evaluate_500_batches_and_finish(tmp_path, corpus_path):
    """2 processes x 4 devices: the evaluation that hung for ever when every batch was its own
    dispatched program (data=2 fsdp=2 tensor=2 then; data=2 across the processes and fsdp=4 here, as
    the tensor axis's all-reduces made each batch 2.5x slower over Gloo, 9.5 s against 3.7 s for 500
    batches on 2 cores). The validation set goes onto the mesh without an all-gather (a probe reports
    any device_put consistency check of host data; the 8-scalar hyperparameters are the one left)."""
    import multiproc as mp
    from test_multiprocess import args
    run_dir = tmp_path / "run"
    job = mp.run(2, 4, args(corpus_path, run_dir, "train.steps=2", "train.eval_every=2", "train.eval_batches=500",
                            "train.sample_tokens=0", "checkpoint.enabled=false", "train.global_batch=8",
                            "data.seq_len=16", "model.n_layers=1", "mesh.fsdp=4", "mesh.tensor=1"), timeout=240,
                 extra_env={"PYTHONPATH": str(Path(__file__).resolve().parents[1] / "helpers" / "probes")})
    evals = [r for r in mp.rows(run_dir) if "val_loss" in r]
    assert [r["step"] for r in evals] == [2] and 0 < evals[0]["val_loss"] < 10
    assert "(mean over 500 batches)" in job.output(0)
    for i in (0, 1):
        gathered = [int(n) for n in re.findall(r"^probe: assert_equal all-gathers (\d+) bytes", job.output(i), re.M)]
        assert sum(gathered) <= 64, (i, gathered)  # the validation set alone is 500 x 8 x 16 x 3 x 4 bytes
