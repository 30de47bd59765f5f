"""The guarded AdamW update kernel (jaxtrain/kernels/cpu/adamw.py, cpu/adamw.cc) against the XLA path
the train step takes without it (optax's clip + AdamW in a cond): the same bits where the norm does
not clip, float32 rounding where it does (the norm's sums run in another order); the non-finite
guard; results not aliased to their operands; when optimizer.implementation picks it. (The train
step against optax with it: test_optimizer.py; a run resumed bit for bit: test_train.py.)"""
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxtrain.errors import ConfigError
from jaxtrain.kernels import registry
from jaxtrain.kernels.cpu import adamw as cpu_adamw
from jaxtrain.kernels.cpu import library as cpu_fused
from jaxtrain.runtime.xla_flags import CPU_FLAGS
from jaxtrain.train import optimizer as opt
from jaxtrain.train import setup

pytestmark = pytest.mark.kernels  # needs the C++ compiler (tests/conftest.py skips them without)

HERE = Path(__file__).parent
# leaf sizes around the 16-float vectors and the 8192-float chunks, a decaying matrix and a vector
AXES = {"w": ("embed", "mlp"), "odd": ("vocab", "embed"), "big": ("embed", "mlp"), "norm": ("embed",),
        "empty": ("embed", "heads")}
SHAPES = {"w": (128, 344), "odd": (7, 5), "big": (3, 8193), "norm": (17,), "empty": (0, 4)}
H = dict(lr=3e-3, min_lr=1e-4, warmup_steps=2.0, decay_steps=10.0, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.1)


def tree(seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(rng.standard_normal(s) * scale, jnp.float32) for k, s in SHAPES.items()}


def hyper(clip):
    return {k: jnp.asarray(float(v)) for k, v in {**H, "clip_norm": clip}.items()}


def xla_step(params, state, grads, loss, h):
    """The train step's update without the kernel (jaxtrain/train/step.py)."""
    count = opt.applied_count(state)
    norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(norm)

    def update(p, s):
        updates, s = opt.optimizer(h, AXES, count, norm).update(grads, s, p)
        return optax.apply_updates(p, updates), s

    p, s = jax.lax.cond(finite, update, lambda p, s: (p, s), params, state)
    return p, s, norm, finite


def kernel_step(params, state, grads, loss, h):
    count = opt.applied_count(state)
    return cpu_adamw.guarded_update(h, opt.decay_mask(AXES), count, loss, grads, params, state,
                                    opt.learning_rate(h, count))


def run(step, clip, steps=3, loss=1.0):
    h = hyper(clip)
    params = tree(0)
    state = opt.optimizer(h, AXES).init(params)
    f = jax.jit(step, donate_argnums=(0, 1))
    out = []
    for i in range(steps):
        params, state, norm, finite = f(params, state, tree(10 + i, 0.05), jnp.float32(loss), h)
        out.append(jax.device_get((params, state, norm, finite)))
    return out


def same_bits_unclipped() -> None:
    """Where the norm does not clip, the kernel's params and moments are the XLA path's bit for bit."""
    assert cpu_fused.problem() is None
    for (p, s, n, f), (p2, s2, n2, f2) in zip(run(xla_step, 1e9), run(kernel_step, 1e9)):
        assert bool(f) and bool(f2)
        np.testing.assert_allclose(n2, n, rtol=1e-6)
        for a, b in zip(jax.tree_util.tree_leaves((p, s)), jax.tree_util.tree_leaves((p2, s2))):
            np.testing.assert_array_equal(b, a)


def test_the_update_is_the_xla_paths_bit_for_bit_when_nothing_clips_as_the_trainer_compiles():
    """In a process compiling as ``python -m jaxtrain.train`` does: the tests' own processes turn LLVM's
    optimisation off (tests/helpers/xla_test_flags.py), and with it the fused multiply-adds that XLA's
    update has and the kernel copies."""
    env = {**os.environ, "XLA_FLAGS": " ".join(f"--{k}={v}" for k, v in CPU_FLAGS.items()),
           "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent), str(HERE.parent / "helpers"),
                                          os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", "import test_cpu_adamw as t; t.same_bits_unclipped(); print('same')"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.split()[-1:] == ["same"], done.stderr[-3000:]


@pytest.mark.parametrize("clip", [1e9, 0.5])
def test_it_differs_from_the_xla_path_by_float_rounding_only(clip):
    """In this process (no fused multiply-adds in XLA's update); clipping at 0.5, the norms differ by
    their sums' order too."""
    for (p, s, n, _), (p2, s2, n2, _) in zip(run(xla_step, clip), run(kernel_step, clip)):
        assert (float(n) > clip) == (clip == 0.5)
        np.testing.assert_allclose(n2, n, rtol=1e-6)
        for a, b in zip(jax.tree_util.tree_leaves((p, s)), jax.tree_util.tree_leaves((p2, s2))):
            np.testing.assert_allclose(b, a, rtol=2e-6, atol=1e-6 * float(np.abs(a).max(initial=0)))


def test_the_norm_is_every_gradients_l2_norm():
    _, _, norm, _ = run(kernel_step, 1.0, steps=1)[0]  # the first step's gradients: tree(10, 0.05)
    want = np.sqrt(sum((np.asarray(g, np.float64) ** 2).sum() for g in jax.tree_util.tree_leaves(tree(10, 0.05))))
    assert float(norm) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("loss,bad_grad", [(float("nan"), None), (1.0, float("inf")), (float("inf"), None)])
def test_a_non_finite_loss_or_gradient_changes_nothing(loss, bad_grad):
    h = hyper(1.0)
    params = tree(0)
    state = opt.optimizer(h, AXES).init(params)
    params, state, _, _ = jax.jit(kernel_step)(params, state, tree(1, 0.05), jnp.float32(1.0), h)  # count 1
    before = jax.device_get((params, state))
    grads = tree(2, 0.05)
    if bad_grad is not None:
        grads["odd"] = grads["odd"].at[3, 2].set(bad_grad)
    p, s, norm, finite = jax.jit(kernel_step, donate_argnums=(0, 1))(params, state, grads, jnp.float32(loss), h)
    assert not bool(finite)
    assert int(opt.applied_count(s)) == 1
    for a, b in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(jax.device_get((p, s)))):
        np.testing.assert_array_equal(b, a)


def test_gradients_whose_squares_overflow_float32_only_in_total_are_skipped_as_xla_skips_them():
    """Each leaf's sum of squares is finite (2.5e38), their total is not: XLA's float32 norm is inf and the
    step is skipped; so is the kernel's (its sums in double are rounded to float32 first). Found by a new
    user's attempts: the kernel had applied a clipped update with a norm of 2.2e19."""
    h = hyper(1.0)
    params = {"a": jnp.ones((4,), jnp.float32), "b": jnp.ones((4,), jnp.float32)}
    axes = {"a": ("embed",), "b": ("embed",)}
    state = opt.optimizer(h, axes).init(params)
    grads = {k: jnp.full((4,), 7.9e18, jnp.float32) for k in params}  # 4 x 7.9e18^2 = 2.5e38 a leaf
    count = jnp.int32(0)
    got = cpu_adamw.guarded_update(h, opt.decay_mask(axes), count, jnp.float32(1.0), grads, params, state,
                                   opt.learning_rate(h, count))
    assert np.isinf(optax.tree.norm(grads)) and np.isinf(got[2]) and not bool(got[3])
    assert int(opt.applied_count(got[1])) == 0
    np.testing.assert_array_equal(got[0]["a"], params["a"])


def test_operands_not_donated_stay_as_they_were_and_give_the_same_result():
    """Outside a donating jit, XLA gives the results their own buffers: the kernel copies in first."""
    h = hyper(1e9)
    params = tree(0)
    state = opt.optimizer(h, AXES).init(params)
    grads = tree(5, 0.05)
    kept = jax.device_get((params, state))
    eager = jax.device_get(kernel_step(params, state, grads, jnp.float32(1.0), h))
    for a, b in zip(jax.tree_util.tree_leaves(kept), jax.tree_util.tree_leaves(jax.device_get((params, state)))):
        np.testing.assert_array_equal(b, a)
    donated = jax.device_get(jax.jit(kernel_step, donate_argnums=(0, 1))(params, state, grads, jnp.float32(1.0), h))
    for a, b in zip(jax.tree_util.tree_leaves(eager), jax.tree_util.tree_leaves(donated)):
        np.testing.assert_array_equal(b, a)


def test_a_leaf_that_is_not_float32_is_a_named_error():
    h = hyper(1.0)
    params = {"w": jnp.zeros((4, 4), jnp.bfloat16)}
    state = opt.optimizer(h, {"w": ("embed", "mlp")}).init(params)
    with pytest.raises(ValueError) as err:
        cpu_adamw.guarded_update(h, {"w": True}, jnp.int32(0), jnp.float32(1.0), params, params, state, h["lr"])
    assert str(err.value) == ("optimizer.implementation=cpu_fused takes float32 params, gradients and moments; "
                              "got bfloat16[4, 4]")


def test_implementation_auto_takes_it_on_one_float32_cpu_device_and_cpu_fused_elsewhere_is_a_named_error():
    def choose(value="auto", **facts):
        return registry.choose("optimizer", value, registry.Facts(**{"backend": "cpu", "devices": 1, **facts}))

    assert choose().impl.name == "cpu_fused" and choose("xla").impl.name == "xla"
    problems = {choose(devices=8): "runs on one device, here 8",
                choose(state_dtypes=("bfloat16", "float32")):
                    "float32 params and moments only, here bfloat16 (optimizer.master_weights=false)",
                choose(host_state=True): "the state lives in host memory (offload.optimizer or offload.params)"}
    for got, want in problems.items():
        assert got.impl.name == "xla" and dict(got.passed_over) == {"cpu_fused": want}
    with pytest.raises(ConfigError) as err:
        choose("cpu_fused", devices=8)
    assert str(err.value) == ("optimizer.implementation=cpu_fused cannot run here: runs on one device, here 8 "
                              "(use auto or xla)")
    with pytest.raises(ConfigError) as err:
        choose("cpu_fused", backend="gpu")
    assert str(err.value) == "optimizer.implementation: cpu_fused runs on cpu; the backend is 'gpu' (use auto or xla)"


def test_the_train_step_calls_it_once_under_auto_and_not_under_xla(small_cfg):
    def text(*overrides, devices=1):
        s = setup(small_cfg(f"mesh.data={devices}", *overrides), jax.devices()[:devices], vocab=256)
        return s.fns.train_step.lower(s.abstract_state(), s.abstract_batch()).as_text()

    assert text().count(cpu_fused.ADAMW) == 1
    assert cpu_fused.ADAMW not in text("optimizer.implementation=xla")
    assert cpu_fused.ADAMW not in text(devices=2)  # auto: XLA's on two devices
    with pytest.raises(ConfigError) as err:  # what the config shows: named by the config's check
        text("optimizer.implementation=cpu_fused", devices=2)
    assert str(err.value) == f"{KEY} runs on one device, here 2 (use auto or xla)"
    with pytest.raises(ConfigError) as err:  # what it does not (the state's dtypes): by the step's
        text("optimizer.implementation=cpu_fused", "model.param_dtype=bfloat16", "optimizer.master_weights=false")
    assert str(err.value) == ("optimizer.implementation=cpu_fused cannot run here: float32 params and moments only, "
                              "here bfloat16 (optimizer.master_weights=false) (use auto or xla)")


KEY = "optimizer.implementation=cpu_fused cannot run here:"


@pytest.mark.parametrize("overrides,mesh,platform,message", [
    ([], {"data": 2}, "cpu", f"{KEY} runs on one device, here 2 (use auto or xla)"),
    ([], {}, "gpu", "optimizer.implementation: cpu_fused runs on cpu; the backend is 'gpu' (use auto or xla)"),
    (["offload.optimizer=host"], {}, "cpu", f"{KEY} the state lives in host memory (offload.optimizer or "
                                            f"offload.params) (use auto or xla)"),
])
def test_an_explicit_choice_the_config_cannot_give_is_named_before_anything_is_built(small_cfg, overrides, mesh,
                                                                                     platform, message):
    from jaxtrain.config import MESH_AXES, check_against_mesh
    with pytest.raises(ConfigError) as err:
        check_against_mesh(small_cfg("optimizer.implementation=cpu_fused", *overrides),
                           {**{a: 1 for a in MESH_AXES}, **mesh}, platform)
    assert str(err.value) == message
