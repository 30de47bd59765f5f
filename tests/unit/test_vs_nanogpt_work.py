"""benchmarks/vs_nanogpt.py gives both sides the same work: its arithmetic, without running either."""
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import vs_nanogpt as v  # noqa: E402


def test_jaxtrain_evaluates_as_many_batches_as_nanogpt():
    # nanoGPT: both splits, 20 batches each, at 0, 250, ...; jaxtrain: every 250 and at the end.
    assert v.equal_eval_batches(1) == 40  # start-up: nanoGPT's iteration-0 evaluation against one at step 1
    assert v.equal_eval_batches(300) == 40  # 2 x 40 batches against 2 evaluations (250, 300)
    assert v.equal_eval_batches(2000) == 45  # 9 x 40 against 8 (250 ... 2000)
    assert "train.eval_batches=40" in v.jaxtrain_cmd(1, Path("r")) and "--max_iters=1" in v.nanogpt_cmd(1)


def test_steady_times_leave_out_warm_up_and_evaluations_and_are_nan_without_any(tmp_path):
    log = "".join(f"iter {i}: loss 2.0, time {t}ms, mfu 1.0%\n" for i, t in enumerate([900, 50, 40, 42, 44]))
    assert v.nanogpt_steady_ms(log) == 42  # iterations 2, 3, 4
    assert math.isnan(v.nanogpt_steady_ms("iter 0: loss 4.2, time 3000.0ms, mfu -100.00%\n"))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "step_time_s": 0.9}\n{"step": 1, "val_loss": 2.0}\n')
    assert math.isnan(v.jaxtrain_steady_ms(tmp_path)) and v.shown(float("nan")) == "n/a"
    assert v.shown(1.234, ".2f", "x") == "1.23x"


def test_the_paired_ratio_is_the_median_of_the_rounds_own_ratios():
    # a machine that slowed down in round 2: each round's pair still compares like with like
    assert v.paired_ratio([40.0, 80.0, 42.0], [30.0, 50.0, 35.0]) == 40.0 / 30.0  # of 1.33, 1.6, 1.2
    assert v.paired_ratio([40.0, float("nan")], [20.0, 30.0]) == 2.0
    assert math.isnan(v.paired_ratio([float("nan")], [float("nan")]))
