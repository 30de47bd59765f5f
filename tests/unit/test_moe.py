"""The mixtral family's MoE layer against a naive NumPy reference, and the router losses by hand.

The reference sends every token through its top-k experts one at a time (softmax over the
router logits, top-k, the k weights renormalised as in Mixtral), and for capacity routing
drops a copy when its expert already holds ``capacity`` copies of the sequence, first
choices in position order before second choices (GShard's priority).
"""
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.models.mixtral import MixtralConfig
from jaxtrain.models.mixtral.moe import MoE, router_losses

CFG = MixtralConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, n_kv_heads=2, d_ff=24, n_experts=4, top_k=2)


def silu(v):
    return v / (1.0 + np.exp(-v))


def reference(x, router, wg, wu, wd, k, capacity=None):
    """x [b, t, d] float64 -> (y [b, t, d], dropped [b, t, k] bool, chosen experts [b, t, k])."""
    b, t, _ = x.shape
    logits = x @ router
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    chosen = np.argsort(-p, axis=-1, kind="stable")[..., :k]
    y, dropped = np.zeros_like(x), np.zeros((b, t, k), bool)
    for s in range(b):
        held = np.zeros(router.shape[1], int)
        for j in range(k):  # choice-major priority
            for i in range(t):
                e = chosen[s, i, j]
                if capacity is not None and held[e] >= capacity:
                    dropped[s, i, j] = True
                    continue
                held[e] += 1
                w = p[s, i, e] / p[s, i, chosen[s, i]].sum()
                h = silu(x[s, i] @ wg[e]) * (x[s, i] @ wu[e])
                y[s, i] += w * (h @ wd[e])
    return y, dropped, chosen


def layer(cfg, seed=0):
    moe = MoE(cfg, nnx.Rngs(seed))
    # Larger router weights than the init's, so the routing is far from uniform (and from ties).
    moe.router[...] = moe.router[...] * 40
    x = jax.random.normal(jax.random.key(seed + 1), (3, 16, cfg.d_model), jnp.float32)
    ws = [np.asarray(moe.router[...], np.float64)] + [np.asarray(w[...], np.float64)
                                                        for w in (moe.w_gate, moe.w_up, moe.w_down)]
    return moe, x, ws


@pytest.mark.parametrize("grouped", ["auto", "blocks", "ragged_dot"])
def test_dropless_routing_and_outputs_equal_the_reference(grouped):
    moe, x, ws = layer(CFG.model_copy(update={"grouped_matmul": grouped}))
    y, stats = jax.jit(lambda m, v: m(v))(moe, x)
    ref, dropped, chosen = reference(np.asarray(x, np.float64), *ws, CFG.top_k)
    np.testing.assert_allclose(np.asarray(y), ref, atol=1e-5, rtol=0)
    assert not dropped.any() and float(stats["dropped"]) == 0.0
    counts = np.bincount(chosen.ravel(), minlength=CFG.n_experts) / chosen.size
    np.testing.assert_allclose(np.asarray(stats["frac"]), counts, atol=1e-7)
    assert counts.max() - counts.min() > 0.04  # unequal shares: the check is not trivial


@pytest.mark.parametrize("factor", [0.5, 1.0])
def test_capacity_routing_drops_exactly_the_reference_tokens(factor):
    cfg = CFG.model_copy(update={"routing": "capacity", "capacity_factor": factor})
    moe, x, ws = layer(cfg, seed=3)
    capacity = cfg.capacity(x.shape[1])
    assert capacity == math.ceil(factor * 16 * 2 / 4)
    y, stats = jax.jit(lambda m, v: m(v))(moe, x)
    ref, dropped, _ = reference(np.asarray(x, np.float64), *ws, cfg.top_k, capacity)
    assert dropped.any()
    np.testing.assert_allclose(np.asarray(y), ref, atol=1e-5, rtol=0)
    assert float(stats["dropped"]) == pytest.approx(dropped.mean())


def test_router_losses_equal_the_papers_formulas_on_a_hand_built_routing():
    # 4 tokens, 2 experts, top-1. Logits chosen so probabilities are simple.
    logits = jnp.log(jnp.array([[0.75, 0.25], [0.75, 0.25], [0.5, 0.5], [0.25, 0.75]], jnp.float32))
    probs = jax.nn.softmax(logits, -1)
    idx = jnp.array([[0], [0], [0], [1]])
    out = router_losses(logits, probs, idx)
    # Switch: aux = N * sum_i f_i P_i; f = (3/4, 1/4); P = mean probs = (0.5625, 0.4375).
    assert float(out["aux"]) == pytest.approx(2 * (0.75 * 0.5625 + 0.25 * 0.4375), abs=1e-6)
    np.testing.assert_allclose(np.asarray(out["frac"]), [0.75, 0.25])
    # ST-MoE: z = mean over tokens of logsumexp(logits)^2; these logits are log-probabilities: lse = 0.
    assert float(out["z"]) == pytest.approx(0.0, abs=1e-6)
    shifted = router_losses(logits + 2.0, probs, idx)
    assert float(shifted["z"]) == pytest.approx(4.0, abs=1e-5)


def test_balanced_routing_gives_an_aux_loss_of_one():
    logits = jnp.zeros((8, 4), jnp.float32)
    idx = jnp.array([[i % 4, (i + 1) % 4] for i in range(8)])
    out = router_losses(logits, jax.nn.softmax(logits, -1), idx)
    assert float(out["aux"]) == pytest.approx(1.0, abs=1e-6)
    assert float(out["z"]) == pytest.approx(math.log(4) ** 2, abs=1e-5)


@pytest.mark.parametrize("n, share", [
    (100, [0.5, 0.3, 0.1, 0.0, 0.1]),
    (300, [0.5, 0.3, 0.1, 0.0, 0.1]),  # the busiest expert's ~150 rows span 3 windows of 64
    (300, [1.0, 0.0, 0.0, 0.0, 0.0]),  # every row to one expert: 5 windows of one group
    (100, [0.0, 0.0, 0.0, 0.0, 1.0]),  # no row has an expert: all zeros
], ids=["mixed", "multi-window", "one-expert", "none"])
@pytest.mark.parametrize("kernel", ["windows", "blocks", pytest.param("cpu_fused", marks=pytest.mark.kernels)])
def test_the_windowed_and_blocked_grouped_matmuls_equal_ragged_dot_values_and_gradients(n, share, kernel):
    """Each path in float32 against the ragged_dot path in float64: the windowed (or blocked, or XLA:CPU
    kernels') worst error is at most 4x ragged_dot's own (the tolerance follows the summands' scale on this CPU:
    an Intel Xeon's float32 gradients differ from an AMD EPYC's by up to 5e-3 here, both accurate).
    The blocks are 32 rows here, so the busiest groups span several."""
    from jaxtrain.kernels.cpu.grouped import grouped_swiglu
    from jaxtrain.kernels.xla.grouped_blocks import blocked_swiglu
    from jaxtrain.kernels.xla.grouped_windows import windowed_swiglu
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(n, 16))
    expert = jnp.asarray(rng.choice(5, size=n, p=share), jnp.int32)  # 4 = no expert
    ws = [rng.normal(size=s) for s in ((4, 16, 24), (4, 16, 24), (4, 24, 16))]

    def ragged(r, wg, wu, wd):  # the ragged_dot path, whatever the backend
        order = jnp.argsort(expert, stable=True)
        sizes = jnp.bincount(expert, length=5)[:4]
        xs = r[order]
        h = jax.nn.silu(jax.lax.ragged_dot(xs, wg, sizes)) * jax.lax.ragged_dot(xs, wu, sizes)
        ys = jnp.where((jnp.arange(n) < sizes.sum())[:, None], jax.lax.ragged_dot(h, wd, sizes), 0)
        return jnp.zeros_like(ys).at[order].set(ys)

    def windowed(r, wg, wu, wd):
        if kernel == "cpu_fused":
            return grouped_swiglu(r, expert, wg, wu, wd)
        if kernel == "blocks":
            return blocked_swiglu(r, expert, wg, wu, wd, rows_per_block=32)
        return windowed_swiglu(r, expert, wg, wu, wd)

    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731

    def outputs(f, dtype):
        args = [jnp.asarray(a, dtype) for a in (rows, *ws)]
        both = jax.jit(lambda *a: (f(*a), *jax.grad(loss(f), argnums=(0, 1, 2, 3))(*a)))  # one program
        return [np.asarray(x, np.float64) for x in both(*args)]

    with jax.enable_x64(True):
        exact = outputs(ragged, jnp.float64)
    names = ["values", "d rows", "d w_gate", "d w_up", "d w_down"]
    for name, got, ref, want in zip(names, outputs(windowed, jnp.float32), outputs(ragged, jnp.float32), exact):
        err, ref_err = np.abs(got - want).max(), np.abs(ref - want).max()
        scale = np.abs(want).max()
        assert err <= 4 * ref_err + 1e-6 * scale, (name, err, ref_err, scale)
        assert ref_err <= 1e-4 * scale, (name, ref_err, scale)  # float32 itself is near the float64 values
    assert not np.asarray(windowed(jnp.asarray(rows, jnp.float32), *[jnp.asarray(w, jnp.float32) for w in ws]))[
        np.asarray(expert) == 4].any()  # rows without an expert: 0


def test_block_rows_balance_weight_traffic_against_padding():
    from jaxtrain.kernels.xla.grouped_blocks import block_rows
    # sqrt(500 * m / E) to the nearest power of two: 1431 -> 1024, 2024 -> 2048, 2862 -> 2048; clipped.
    assert [block_rows(32768, 8), block_rows(65536, 8), block_rows(131072, 8)] == [1024, 2048, 2048]
    assert [block_rows(64, 64), block_rows(1 << 30, 1)] == [64, 4096]


def test_the_blocked_grouped_matmul_sums_nothing_by_scatter():
    """Its outputs and row gradients are gathered from each row's one owning block and its weight
    gradients summed by a one-hot matmul: no floating-point scatter-add (atomics on a GPU, so
    run-to-run noise)."""
    from jaxtrain.kernels.xla.grouped_blocks import blocked_swiglu
    rng = np.random.default_rng(3)
    rows = jnp.asarray(rng.normal(size=(40, 8)), jnp.float32)
    expert = jnp.asarray(rng.integers(0, 5, size=40), jnp.int32)
    ws = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((4, 8, 12), (4, 8, 12), (4, 12, 8))]
    loss = lambda *a: jnp.sum(blocked_swiglu(a[0], expert, *a[1:], rows_per_block=8) ** 2)  # noqa: E731
    jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(rows, *ws))
    adds = re.findall(r"(\w+)\[[\d,]*\] = scatter-add", jaxpr)
    assert adds and all(dtype.startswith("i") for dtype in adds), adds  # the bincount's integer counts only


def test_permute_rows_equals_indexing_and_its_backward_is_a_gather():
    """The sort permutation of the windowed path: x[order] forward, and a gradient equal (bitwise: each
    row's gradient is moved, never summed) to autodiff's scatter-add, computed with no scatter."""
    from jaxtrain.kernels.rows import inverse_permutation, permute_rows
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(50, 7)), jnp.float32)
    order = jnp.asarray(rng.permutation(50), jnp.int32)
    inverse = inverse_permutation(order)
    np.testing.assert_array_equal(np.asarray(inverse)[np.asarray(order)], np.arange(50))
    weights = jnp.asarray(rng.normal(size=(50, 7)), jnp.float32)
    ours = lambda a: jnp.sum(jnp.sin(permute_rows(a, order, inverse)) * weights)  # noqa: E731
    plain = lambda a: jnp.sum(jnp.sin(a[order]) * weights)  # noqa: E731
    np.testing.assert_array_equal(np.asarray(permute_rows(x, order, inverse)), np.asarray(x)[np.asarray(order)])
    np.testing.assert_array_equal(np.asarray(jax.grad(ours)(x)), np.asarray(jax.grad(plain)(x)))
    assert "scatter" in str(jax.make_jaxpr(jax.grad(plain))(x))  # what autodiff of the indexing does
    assert "scatter" not in str(jax.make_jaxpr(jax.grad(ours))(x))


def test_the_cpu_per_expert_swiglu_equals_the_batched_one_with_its_gradients(monkeypatch):
    """Capacity buffers on CPU run one 2-D SwiGLU per expert; the batched form (GPU/TPU, or more
    experts than UNROLL_EXPERTS) gives the same values, forward and backward (bitwise on the AMD
    EPYC this was written on; a CPU whose 2-D and batched matmul kernels sum in another order may
    differ in the last bits, hence the float32-rounding tolerance)."""
    from jaxtrain.kernels.xla import grouped as kernels
    rng = np.random.default_rng(1)
    args = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((4, 40, 16), (4, 16, 24), (4, 16, 24), (4, 24, 16))]

    def both():  # a fresh jit each time: the path is chosen while tracing
        f = kernels.buffers_swiglu
        return jax.jit(lambda *a: (f(*a), *jax.grad(lambda *b: jnp.sum(jnp.sin(f(*b))), argnums=(0, 1, 2, 3))(*a)))

    def dots():  # a fresh function each time: make_jaxpr caches a function's trace
        return str(jax.make_jaxpr(lambda *a: kernels.buffers_swiglu(*a))(*args)).count("dot_general")

    per_expert = both()(*args)
    assert dots() == 3 * 4  # one SwiGLU's three matmuls per expert
    monkeypatch.setattr(kernels, "UNROLL_EXPERTS", 3)  # 4 experts: batched
    assert dots() == 3
    batched = both()(*args)
    for got, want in zip(per_expert, batched):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6 * float(jnp.abs(want).max()))


def test_flops_per_token_count_the_active_parameters():
    from jaxtrain.models.mixtral import Mixtral
    from jaxtrain.models.mixtral.flops import active_matmul_params, flops_per_token
    cfg = CFG.model_copy(update={"top_k": 1})
    model = Mixtral(cfg, nnx.Rngs(0))
    sizes = {"/".join(map(str, p)): v.size for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    total = sum(sizes.values())
    norms = sum(n for k, n in sizes.items() if k.endswith("scale"))
    expert = 3 * cfg.d_model * cfg.d_ff  # one SwiGLU expert
    # Everything but the embedding lookup and the norm scales, with 1 of the 4 experts per layer.
    inactive = cfg.n_layers * (cfg.n_experts - cfg.top_k) * expert
    assert active_matmul_params(cfg) == total - sizes["embed/embedding"] - norms - inactive
    attention = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * 32
    assert flops_per_token(cfg, 32) == 6 * active_matmul_params(cfg) + attention
    top2 = CFG
    assert active_matmul_params(top2) - active_matmul_params(cfg) == cfg.n_layers * expert


def test_routing_keys_are_checked_and_named():

    from jaxtrain import config as cfglib
    from jaxtrain.errors import ConfigError
    from jaxtrain.kernels import registry
    # The schema's choices are the registry's: a value the config accepts is one an implementation runs.
    assert set(registry.names("grouped_matmul")) == {"auto", "ragged_dot", "windows", "blocks", "cpu_fused"}
    for override, message in [
        ("model.top_k=9", "model.top_k: 9 is more than model.n_experts=8"),
        ("model.capacity_factor=0", "model.capacity_factor: must be a finite number > 0, got 0.0"),
        ("model.capacity_factor=inf", "model.capacity_factor: must be a finite number, got inf"),
        ("model.routing=tokens", "model.routing"),
        ("model.grouped_matmul=megablox", "model.grouped_matmul"),
        ("model.aux_loss_weight=-1", "model.aux_loss_weight: must be >= 0, got -1.0"),
    ]:
        with pytest.raises(ConfigError) as e:
            cfglib.load(None, ["model.family=mixtral", override])
        assert str(e.value).startswith(message), str(e.value)


def test_capacity_is_sized_from_the_real_tokens_not_the_padded_length():
    """The same 8 real tokens drop the same copies alone and padded to 16 (5eb7ae3: 0.375 alone, 0 padded:
    the padded length's capacity let every copy through)."""
    cfg = CFG.model_copy(update={"routing": "capacity", "capacity_factor": 0.5})
    moe, x, ws = layer(cfg, seed=5)
    alone = x[:, :8]
    padded = jnp.concatenate([alone, jnp.zeros_like(alone)], axis=1)
    mask = jnp.concatenate([jnp.ones((3, 8)), jnp.zeros((3, 8))], axis=1)
    y1, s1 = moe(alone)
    y2, s2 = moe(padded, mask)
    ref, dropped, _ = reference(np.asarray(alone, np.float64), *ws, cfg.top_k, cfg.capacity(8))
    assert 0 < float(s1["dropped"]) == pytest.approx(dropped.mean()) == pytest.approx(float(s2["dropped"]))
    np.testing.assert_allclose(np.asarray(y1), ref, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(y2[:, :8]), ref, atol=1e-5, rtol=0)
