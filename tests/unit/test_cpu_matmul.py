"""The fused XLA:CPU matmul (jaxtrain/kernels/cpu/matmul.py, cpu/matmul.cc) and ``model.matmul``:
values and gradients against float64, results that do not depend on the other rows or on the number
of cores, when ``auto`` picks it, the named errors, and ``remat=save_matmuls`` keeping its outputs."""
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh
from test_cpu_fused import on_mesh

from jaxtrain.config import MESH_AXES
from jaxtrain.errors import ConfigError
from jaxtrain.kernels import ops, registry
from jaxtrain.kernels.cpu import library as cpu_fused
from jaxtrain.kernels.cpu import matmul as cpu_matmul
from jaxtrain.models import layers
from jaxtrain.models.llama.model import LOGICAL_AXES
from jaxtrain.parallel.activations import activation_sharding
from jaxtrain.parallel.rules import Rules

pytestmark = pytest.mark.kernels  # needs the C++ compiler (tests/conftest.py skips them without)


def on_one_device():
    """The trainer's context while it traces a one-device run, with a rule for every logical name."""
    mesh = Mesh(np.asarray(jax.devices()[:1]).reshape((1,) * len(MESH_AXES)), MESH_AXES,
                axis_types=(AxisType.Auto,) * len(MESH_AXES))
    return activation_sharding(Rules("one", {name: [None] for name in LOGICAL_AXES}), mesh)


def operands(m, k, n, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32),
            rng.standard_normal((m, n)).astype(np.float32))


@pytest.mark.parametrize("m,k,n", [
    (768, 128, 344),  # the shakespeare recipe's MLP up projection: a partial last panel of columns
    (768, 344, 128),  # its down projection: K in blocks of 128 and a partial block
    (300, 20, 33),    # the weight gradient x^T dy sums 300 tokens as two halves
    (37, 19, 65),     # nothing a multiple of a tile; 65 columns: a panel of one column
    (5, 1, 1),
    (0, 128, 64),     # no token rows: dw is zeros
    (5, 0, 7),        # nothing to contract: y and dw are zeros
])
def test_values_and_gradients_match_float64(m, k, n):
    assert cpu_fused.problem() is None
    x, w, dy = operands(m, k, n)
    out, vjp = jax.vjp(jax.jit(cpu_matmul.matmul), x, w)
    dx, dw = jax.jit(vjp)(dy)
    x64, w64, dy64 = (a.astype(np.float64) for a in (x, w, dy))
    for name, got, want, depth in (("y", out, x64 @ w64, k), ("dx", dx, dy64 @ w64.T, n), ("dw", dw, x64.T @ dy64, m)):
        # float32 sums of `depth` products of unit normals: errors grow about as sqrt(depth)
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-6 * depth, err_msg=name)


def test_a_row_is_the_same_bit_for_bit_alone_or_among_others_and_under_vmap():
    # Grouped evaluation stacks batches side by side (vmap) and promises each the loss it gets alone.
    x, w, _ = operands(768, 128, 344)
    f = jax.jit(cpu_matmul.matmul)
    whole = np.asarray(f(x, w))
    for rows in (slice(5, 6), slice(0, 7), slice(380, 390), slice(767, 768)):
        np.testing.assert_array_equal(np.asarray(f(x[rows], w)), whole[rows])
    members = np.stack([x[:64], x[64:128]])
    shared = np.asarray(jax.jit(jax.vmap(cpu_matmul.matmul, (0, None)))(members, w))  # one call over both
    each = np.asarray(jax.jit(jax.vmap(cpu_matmul.matmul))(members, np.stack([w, w])))  # one call a member
    np.testing.assert_array_equal(shared, whole[:128].reshape(2, 64, 344))
    np.testing.assert_array_equal(each, whole[:128].reshape(2, 64, 344))


def test_results_do_not_depend_on_the_number_of_cores():
    """Each element is summed in an order fixed by K alone (the weight gradient as two halves of the
    tokens on one thread or two), so a run pinned to one core gets the bits two cores get; so too the
    SwiGLU MLP's kernels and the RMSNorm's (its scale gradient summed by runs of rows, then the runs)."""
    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores")
    code = textwrap.dedent("""
        import hashlib, jax, numpy as np
        from jaxtrain.kernels.cpu import matmul as cpu_matmul, mlp as cpu_mlp, norm as cpu_norm
        rng = np.random.default_rng(0)
        x, w, dy, wd = (rng.standard_normal(s).astype(np.float32) for s in ((768, 128), (128, 344), (768, 344),
                                                                            (344, 128)))
        results = []
        for fn, args, d_out in ((cpu_matmul.matmul, (x, w), dy), (lambda *a: cpu_norm.rms_norm(*a, 1e-5), (x, x[0]), x),
                                (lambda *a: cpu_mlp.mlp(*a, ("n",)), (x, w, w[:, ::-1], wd), x)):
            out, vjp = jax.vjp(jax.jit(fn), *args)
            results += [out, *vjp(d_out)]
        print(hashlib.sha256(b"".join(np.asarray(a).tobytes() for a in results)).hexdigest())
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    hashes = []
    for cores in ("0", "0,1"):
        done = subprocess.run(["taskset", "-c", cores, sys.executable, "-c", code], capture_output=True, text=True,
                              env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        hashes.append(done.stdout.split()[-1])
    assert hashes[0] == hashes[1]


def matmul_choice(implementation, x, w):
    """The implementation that runs ``x @ w`` here (the trainer's mesh: ``on_mesh``)."""
    return ops.pick("matmul", implementation, ops.MatmulCall("matmul", x, w)).name


def test_auto_picks_the_kernel_on_one_cpu_device_for_float32_and_says_why_not_elsewhere():
    x, w = jnp.zeros((64, 32)), jnp.zeros((32, 16))
    with on_mesh(1):
        assert matmul_choice("auto", x, w) == "cpu_fused"
        assert matmul_choice("auto", x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)) == "xla"
        assert matmul_choice("xla", x, w) == "xla"
        big = jnp.zeros((2048, 512)), jnp.zeros((512, 128))  # 268 MFLOP
        assert matmul_choice("auto", *big) == "xla"
        assert matmul_choice("cpu_fused", *big) == "cpu_fused"
        impl = ops.choice("matmul", "auto").impl
        assert impl.refuses(ops.MatmulCall("matmul", *big), True, registry.Facts("cpu")) == (
            "a [2048, 512] x [512, 128] product: 256 MFLOP or more, where XLA's dots are as fast")
        half = ops.MatmulCall("matmul", x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
        assert impl.refuses(half, True, registry.Facts("cpu")) == (
            "operands of bfloat16 and bfloat16; it takes float32 (model.dtype=float32)")
    with on_mesh(2):
        assert matmul_choice("auto", x, w) == "xla"
    one = registry.choose("matmul", "auto", registry.Facts("cpu", devices=1, dtype="float32"))
    assert one.line() == ("model.matmul=auto -> cpu_fused (float32 products under 256 MFLOP, the SwiGLU MLP and "
                          "RMSNorm in kernels)")
    two = registry.choose("matmul", "auto", registry.Facts("cpu", devices=2, dtype="float32"))
    assert two.line() == "model.matmul=auto -> xla (cpu_fused: runs on one device, here 2; XLA's dots)"


def test_an_explicit_choice_that_cannot_run_is_a_named_error():
    x, w = jnp.zeros((64, 32)), jnp.zeros((32, 16))
    with on_mesh(2), pytest.raises(ConfigError) as e:
        layers.project(x, w, implementation="cpu_fused")
    assert str(e.value) == "model.matmul=cpu_fused cannot run here: runs on one device, here 2 (use auto or xla)"
    with pytest.raises(ConfigError) as e:
        matmul_choice("mkl", x, w)
    assert str(e.value) == "model.matmul: unknown implementation 'mkl' (known: auto, xla, cpu_fused)"
    with pytest.raises(ValueError, match=r"model.matmul=cpu_fused: operands of bfloat16 and float32; it takes float32"):
        cpu_matmul.matmul(x.astype(jnp.bfloat16), w)


@pytest.mark.parametrize("overrides, mesh, platform, message", [
    ([], {"data": 2}, "cpu", "model.matmul=cpu_fused cannot run here: runs on one device, here 2 (use auto or xla)"),
    (["model.dtype=bfloat16"], {}, "cpu", "model.matmul=cpu_fused cannot run here: computes in float32, model.dtype "
                                          "is bfloat16 (use auto or xla)"),
    ([], {}, "gpu", "model.matmul: cpu_fused runs on cpu; the backend is 'gpu' (use auto or xla)"),
])
def test_an_explicit_choice_the_config_cannot_give_is_named_before_anything_is_built(small_cfg, overrides, mesh,
                                                                                     platform, message):
    from jaxtrain.config import check_against_mesh
    with pytest.raises(ConfigError) as e:
        check_against_mesh(small_cfg("model.matmul=cpu_fused", *overrides), {**{a: 1 for a in MESH_AXES}, **mesh},
                           platform)
    assert str(e.value) == message


MODEL_TARGETS = (cpu_fused.MATMUL, cpu_fused.SWIGLU_FORWARD, cpu_fused.SWIGLU_BACKWARD, cpu_fused.MATMUL_SUM,
                 cpu_fused.RMSNORM_FORWARD, cpu_fused.RMSNORM_BACKWARD)


def test_the_model_gives_xlas_values_and_save_matmuls_keeps_the_kernels_outputs():
    from flax import nnx

    from jaxtrain.models.llama.config import LlamaConfig
    from jaxtrain.models.llama.model import Llama
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 65, (2, 32)), jnp.int32)

    def loss_and_grads(matmul, remat="none"):
        cfg = LlamaConfig(vocab_size=65, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, matmul=matmul,
                          attention="xla", remat=remat)
        graph, params = nnx.split(Llama(cfg, nnx.Rngs(0)), nnx.Param)

        def loss(p):
            logits = nnx.merge(graph, p)(tokens)
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], -1))
        with on_one_device():
            compiled = jax.jit(jax.value_and_grad(loss)).lower(params).compile()
        text = compiled.as_text()
        return compiled(params), {t: text.count(f'custom_call_target="{t}"') for t in MODEL_TARGETS}

    (want, want_grads), xla_calls = loss_and_grads("xla")
    (got, got_grads), calls = loss_and_grads("cpu_fused")
    assert set(xla_calls.values()) == {0}
    # per layer: q, k and v forward and dw, o forward, dx and dw, w_down forward and the MLP's three weight
    # gradients; the head's three; per layer the SwiGLU's forward and backward, and one input gradient
    # each for q, k and v together and for the MLP; the five norms' forward and backward
    assert calls == {cpu_fused.MATMUL: 2 * (3 * 2 + 3 + 4) + 3, cpu_fused.SWIGLU_FORWARD: 2,
                     cpu_fused.SWIGLU_BACKWARD: 2, cpu_fused.MATMUL_SUM: 2 + 2, cpu_fused.RMSNORM_FORWARD: 5,
                     cpu_fused.RMSNORM_BACKWARD: 5}
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    _, saved = loss_and_grads("cpu_fused", "save_matmuls")
    _, full = loss_and_grads("cpu_fused", "full")
    norm = cpu_fused.RMSNORM_FORWARD
    # save_matmuls keeps every product's output and recomputes the norms, as it does XLA's
    assert saved == {**calls, norm: saved[norm]} and saved[norm] > calls[norm]
    # full recomputes the blocks' products and SwiGLUs too
    assert full[cpu_fused.MATMUL] > calls[cpu_fused.MATMUL] and full[cpu_fused.SWIGLU_FORWARD] == 2 * 2


def test_products_of_one_input_give_matmuls_bits_and_one_input_gradient_call():
    x, w, dy = operands(300, 20, 33)
    ws = (w, w[:, :17] * 2, w[:, ::-1])
    dys = (dy, dy[:, :17], dy * 3)
    outs, vjp = jax.vjp(jax.jit(cpu_matmul.matmuls), x, ws)
    for out, wi in zip(outs, ws):
        np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(cpu_matmul.matmul)(x, wi)))
    dx, dws = jax.jit(vjp)(dys)
    x64, dys64 = x.astype(np.float64), [a.astype(np.float64) for a in dys]
    want = sum(d @ wi.astype(np.float64).T for d, wi in zip(dys64, ws))
    np.testing.assert_allclose(np.asarray(dx), want, rtol=0, atol=2e-6 * 3 * 33)
    for got, d in zip(dws, dys64):
        np.testing.assert_allclose(np.asarray(got), x64.T @ d, rtol=0, atol=2e-6 * 300)
    text = jax.jit(jax.value_and_grad(lambda x, ws: sum((o * d).sum() for o, d in zip(cpu_matmul.matmuls(x, ws), dys)),
                                      argnums=(0, 1))).lower(x, ws).compile().as_text()
    assert text.count(f'custom_call_target="{cpu_fused.MATMUL_SUM}"') == 1
    assert text.count(f'custom_call_target="{cpu_fused.MATMUL}"') == 3 + 3  # forward and weight gradients
