"""benchmarks/offload.py alternates its variants round by round: its order and arithmetic, without timing."""
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import offload as bench  # noqa: E402


def test_variants_alternate_within_each_round_and_keep_every_rounds_median():
    calls, times = [], iter([0.010, 0.012, 0.020, 0.018, 0.011, 0.013])
    out, medians = bench.run_rounds(lambda v: calls.append(v) or {"stats": {"median_s": next(times)}, "v": v},
                                    ["none", "optimizer"], 3)
    assert calls == ["none", "optimizer"] * 3  # never all of one variant, then all of the other
    assert medians == {"none": [0.010, 0.020, 0.011], "optimizer": [0.012, 0.018, 0.013]}
    assert out["optimizer"]["stats"]["median_s"] == 0.012  # the first round's result holds the memory figures
    # The paired ratio, as main() prints it: per round, then the median (1.2, 0.9, 1.18... -> 1.18).
    assert statistics.median(m / n for m, n in zip(medians["optimizer"], medians["none"])) == 0.013 / 0.011
