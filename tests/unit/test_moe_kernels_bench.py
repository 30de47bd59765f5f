"""benchmarks/moe_kernels.py times formulations that compute the same thing: its routing and its
cases' gradients, without timing anything."""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import moe_kernels as mk  # noqa: E402


def test_balanced_routing_gives_every_expert_the_same_copies_and_each_token_distinct_experts():
    e = mk.balanced_routing(1024, 8, 2, seed=3).reshape(1024, 2)
    assert np.bincount(e.reshape(-1), minlength=8).tolist() == [256] * 8
    assert (e[:, 0] != e[:, 1]).all()
    assert not np.array_equal(e, mk.balanced_routing(1024, 8, 2, seed=4).reshape(1024, 2))  # the seed shuffles


@pytest.mark.kernels  # the cases include the C++ kernels
def test_every_expert_case_has_the_gradients_of_one_swiglu_per_expert():
    cases, diffs = mk.build(seed=1)
    assert list(cases) == ["dense 2-D", "dense cpu_fused", "per-expert 2-D", "batched [E, M/E]", "dropless windows",
                           "dropless blocks", "ragged_dot", "dropless cpu_fused"]  # the kernels build here
    assert set(diffs) == set(list(cases)[2:]) and diffs["per-expert 2-D"] == 0.0
    assert all(d < 1e-5 for d in diffs.values()), diffs
    # The reference itself, from numpy: the token gradient of sum(y^2), y = sum over a token's copies.
    fn, (x, wg, wu, wd) = cases["per-expert 2-D"]
    e = mk.balanced_routing(mk.TOKENS, mk.N_EXP, mk.TOP_K, seed=1).reshape(mk.TOKENS, mk.TOP_K)
    xs, g, u, d = (np.asarray(a, np.float64) for a in (x, wg, wu, wd))
    dx = np.zeros_like(xs)
    for j in range(mk.TOP_K):
        a, b = np.einsum("td,tdf->tf", xs, g[e[:, j]]), np.einsum("td,tdf->tf", xs, u[e[:, j]])
        sig = 1 / (1 + np.exp(-a))
        y = np.einsum("tf,tfd->td", a * sig * b, d[e[:, j]])
        dh = np.einsum("td,tfd->tf", 2 * y, d[e[:, j]])  # each copy's own square: sum over copies of y_j^2
        da, db = dh * b * (sig + a * sig * (1 - sig)), dh * a * sig
        dx += np.einsum("tf,tdf->td", da, g[e[:, j]]) + np.einsum("tf,tdf->td", db, u[e[:, j]])
    np.testing.assert_allclose(np.asarray(fn(x, wg, wu, wd)[0]), dx, rtol=1e-4, atol=1e-4)
