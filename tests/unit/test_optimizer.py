"""Optimizer hyperparameters are traced inputs (one compile serves every LR), and bf16 parameters
keep float32 master weights so small updates survive."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import put_windows

from jaxtrain.train import setup
from jaxtrain.train.optimizer import _clip, hyperparameters, learning_rate


def _batch(fns, seed=0):
    windows = np.random.default_rng(seed).integers(0, 256, (1, 8, 33), dtype=np.int32)
    return put_windows(windows, fns.batch_sharding)


def test_learning_rate_equals_optax_warmup_cosine(small_cfg):
    cfg = small_cfg("optimizer.lr=3e-3", "optimizer.min_lr=1e-4", "optimizer.warmup_steps=4", "train.steps=20")
    ref = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 4, 20, 1e-4)
    h = hyperparameters(cfg)
    for count in range(25):  # update `count` uses the schedule at count + 1
        np.testing.assert_allclose(float(learning_rate(h, count)), float(ref(count + 1)), rtol=1e-6, atol=1e-12)


def test_one_compiled_step_serves_every_learning_rate(small_cfg):
    dev = jax.devices()[:1]
    a = setup(small_cfg("mesh.data=1", "optimizer.lr=0.00077"), dev, vocab=256)
    b = setup(small_cfg("mesh.data=1", "optimizer.lr=0.00078", "optimizer.min_lr=0.0", "optimizer.warmup_steps=0",
                        "optimizer.b2=0.95", "optimizer.weight_decay=0.0", "optimizer.clip_norm=0.5",
                        "train.steps=77"), dev, vocab=256)
    # The same program text: the persistent compile cache's key, so a rerun with a new LR hits it.
    text = lambda s: s.fns.train_step.lower(s.abstract_state(), s.abstract_batch()).as_text()  # noqa: E731
    assert text(a) == text(b)
    # In one process: the same compiled step runs both configs' hyperparameters...
    batch, step = _batch(a.fns), a.fns.train_step
    _, m_a = step(a.fns.init(), batch)
    _, m_b = step(a.fns.init(), batch, b.fns.train_step.hparams)
    assert step.inner._cache_size() == 1
    # ...and each gives what its own config's step gives, bit for bit.
    state_b, ref_b = b.fns.train_step(b.fns.init(), batch)
    state_ab, _ = step(a.fns.init(), batch, b.fns.train_step.hparams)
    assert float(m_a["lr"]) == pytest.approx(0.00077 / 5, rel=1e-6)  # warmup 1/5
    assert float(m_b["lr"]) == pytest.approx(0.00078 * 0.5 * (1 + np.cos(np.pi / 77)), rel=1e-6)  # cosine, 1/77
    leaves = [jax.tree_util.tree_leaves(jax.device_get(s)) for s in (state_ab, state_b)]
    for x, y in zip(*leaves):
        np.testing.assert_array_equal(x, y)


def _moved(cfg, steps=5):
    """(init params, params after ``steps`` updates at a constant lr, the state) on one device."""
    fns = setup(cfg, jax.devices()[:1], vocab=256).fns
    state = fns.init()
    init = jax.device_get(state["params"])
    for i in range(steps):
        state, m = fns.train_step(state, _batch(fns, i))
        assert int(m["nonfinite"]) == 0
    return init, jax.device_get(state["params"]), state, fns


CONSTANT_LR = ["model.param_dtype=bfloat16", "mesh.data=1", "optimizer.lr=1e-5", "optimizer.min_lr=1e-5",
               "optimizer.warmup_steps=0", "optimizer.weight_decay=0.0"]


def test_bf16_params_keep_float32_masters_and_every_small_update(small_cfg):
    init, after, state, fns = _moved(small_cfg(*CONSTANT_LR))
    assert fns.low_precision == []
    leaves = jax.tree_util.tree_leaves(state)
    assert {x.dtype for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)} == {jnp.dtype(jnp.float32)}
    moved = [np.mean(x != y) for x, y in zip(jax.tree_util.tree_leaves(init), jax.tree_util.tree_leaves(after))]
    assert min(moved) > 0.95, moved  # every tensor moves, as with float32 params
    scale = after["layers"][0]["attn_norm"]["scale"]
    assert np.all(scale != init["layers"][0]["attn_norm"]["scale"])  # 1.0 +- 5e-5 (bf16's ulp at 1 is 7.8e-3)
    # The model computes with the bf16 cast; export gets bf16 too.
    assert fns.model_params(state["params"])["lm_head"].dtype == jnp.bfloat16


def test_pure_bf16_is_opt_in_and_loses_small_updates(small_cfg):
    init, after, state, fns = _moved(small_cfg(*CONSTANT_LR, "optimizer.master_weights=false"))
    assert "lm_head" in fns.low_precision and state["params"]["lm_head"].dtype == jnp.bfloat16
    scale = after["layers"][0]["attn_norm"]["scale"]
    assert np.all(scale == init["layers"][0]["attn_norm"]["scale"])  # why master weights are the default



def test_clipping_with_a_given_norm_is_optaxs():
    """The step's clipping (the norm it already has, then one scalar factor) against
    optax.clip_by_global_norm: equal to float32 rounding when it clips, bit for bit when not."""
    tree = {"a": jax.random.normal(jax.random.key(0), (16, 8)) * 3.0, "b": jax.random.normal(jax.random.key(1), (5,))}
    norm = optax.tree.norm(tree)
    for max_norm, exact in ((0.5, False), (float(norm) * 2, True)):
        got, _ = _clip(jnp.float32(max_norm), norm).update(tree, optax.EmptyState())
        want, _ = optax.clip_by_global_norm(max_norm).update(tree, optax.EmptyState())
        for k in tree:
            if exact:
                np.testing.assert_array_equal(got[k], want[k])
            else:
                np.testing.assert_allclose(got[k], want[k], rtol=1e-6)
                assert float(optax.tree.norm(got)) == pytest.approx(max_norm, rel=1e-6)


@pytest.mark.parametrize("implementation", ["xla", pytest.param("cpu_fused", marks=pytest.mark.kernels)])
def test_the_step_updates_as_optax_clip_then_adamw(small_cfg, implementation):
    """Three steps of the compiled train step against optax's clip_by_global_norm + adamw applied
    to the same gradients (clipping on: with Adam, unclipped gradients of unequal norms give
    other moments), to float32 rounding (XLA fuses the update, optax runs op by op).

    eps is 1e-3, not the default 1e-8: Adam divides each element by its own gradient's size, so
    with eps 1e-8 an element whose gradient is ~1e-4 of the others' (a token's first occurrence:
    -3.9e-7 against a median 2.3e-3) turns the float32 rounding of the two programs' gradients
    (~4% of so small a value) into 1e-5 of its parameter. That failed on an Intel Xeon (1.03e-5 at
    step 2, one element of the embedding) and passed on an AMD EPYC. With eps 1e-3 every element's
    update is well conditioned, and the clip, the moments, the bias correction and the decay mask
    are checked as before. Both implementations of the update (optimizer.implementation): XLA's ops and
    the XLA:CPU kernel."""
    cfg = small_cfg("mesh.data=1", "optimizer.lr=1e-2", "optimizer.warmup_steps=0", "optimizer.min_lr=1e-2",
                    "optimizer.clip_norm=0.05", "optimizer.weight_decay=0.1", "optimizer.eps=1e-3",
                    f"optimizer.implementation={implementation}")
    fns = setup(cfg, jax.devices()[:1], vocab=256).fns
    state = fns.init()
    params = jax.device_get(state["params"])
    decay = jax.tree_util.tree_map(lambda axes: len(axes) >= 2, fns.param_axes, is_leaf=lambda x: isinstance(x, tuple))
    ref = optax.chain(optax.clip_by_global_norm(0.05),
                      optax.adamw(1e-2, b1=cfg.optimizer.b1, b2=cfg.optimizer.b2, eps=cfg.optimizer.eps,
                                  weight_decay=0.1, mask=decay))
    ref_state = ref.init(params)
    for i in range(3):
        batch = _batch(fns, i)
        _, _, grads = fns.grads(jax.device_put(params, fns.state_shardings["params"]), batch)
        state, m = fns.train_step(state, batch)
        assert float(m["grad_norm"]) > 0.05  # clipped
        updates, ref_state = ref.update(jax.device_get(grads), ref_state, params)
        params = optax.apply_updates(params, updates)
        got = jax.device_get(state["params"])
        for (path, want), have in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree_util.tree_leaves(got)):
            np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-5, err_msg=f"step {i} {path}")
