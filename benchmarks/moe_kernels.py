"""The routed experts' matmuls on XLA:CPU against the dense SwiGLU of the same active parameters.

    python benchmarks/moe_kernels.py [--rounds 5] [--iters 20] [--write-results] [--quick]
                                     [--shape T,D,F,E,K] [--dtype bfloat16]

What bounds a dropless MoE step on CPU, one layer's experts at a time. The shapes are
``configs/moe_shakespeare.yaml`` at global batch 16: T = 1024 tokens of d_model 128, 8 experts of
d_ff 192, top-2, so M = 2048 routed copies; its dense twin (``configs/shakespeare_char.yaml`` with
``model.d_ff=384``) has the same FLOPs per token. The routing is balanced (M/E copies per expert), so every
expert formulation below does the same useful work; each is timed as one jitted forward and
backward (the gradient of sum(y^2) with respect to the tokens and the three weights):

  dense 2-D           the dense SwiGLU, [T, 128] x [128, 384]: the cost to match
  dense cpu_fused     the same through jaxtrain's XLA:CPU kernels (``jaxtrain.kernels.cpu_mlp``), as the
                      dense model's train step runs it on one CPU device (float32 only)
  per-expert 2-D      one 2-D SwiGLU per expert on its M/E copies (static slices): the best a
                      grouped GEMM could do with XLA:CPU's 2-D matmuls, and only possible when the
                      group sizes are known at compile time
  batched [E, M/E]    one batched matmul over the experts' buffers: capacity routing at factor 1.0
                      as GPU and TPU run it (on CPU jaxtrain's capacity path runs per-expert 2-D)
  dropless windows    jaxtrain's CPU dropless path (``jaxtrain.kernels.grouped_cpu``): copies
                      sorted by expert, one 2-D SwiGLU per window of w rows inside one group
  dropless blocks     the same windows as blocks of one batched matmul, with each block's expert
                      weights gathered (``jaxtrain.kernels.grouped_blocks``)
  ragged_dot          ``jax.lax.ragged_dot`` on the sorted copies, which XLA:CPU expands into
                      one masked dense matmul per expert (E x the FLOPs)
  dropless cpu_fused  jaxtrain's XLA:CPU grouped kernels (``jaxtrain.kernels.cpu_grouped``): each
                      expert's rows, no window wasted (float32 only)

The cases alternate within each round; a case's figure is the median over rounds of its median
time. Every expert formulation's gradients are checked against the per-expert 2-D ones (the
largest relative difference is printed). ``--write-results`` appends rows to RESULTS.md.
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from _bench import append_result_rows, commit, hardware

from jaxtrain.kernels.cpu import grouped as cpu_grouped
from jaxtrain.kernels.cpu import library as cpu_fused
from jaxtrain.kernels.cpu import mlp as cpu_mlp
from jaxtrain.kernels.xla.grouped_blocks import blocked_swiglu
from jaxtrain.kernels.xla.grouped_windows import windowed_swiglu

TOKENS, D_MODEL, D_FF, N_EXP, TOP_K = 1024, 128, 192, 8, 2
HEADER = "| date (UTC) | hardware | commit | case | ms (fwd+bwd, median) | vs dense 2-D | max rel. diff |"
INTRO = ("## MoE expert matmuls vs the dense SwiGLU (benchmarks/moe_kernels.py)\n\nOne layer, forward and backward: "
         f"{TOKENS} tokens, d_model {D_MODEL}, {N_EXP} experts of d_ff {D_FF}, top-{TOP_K} "
         f"(balanced routing) against a dense d_ff {TOP_K * D_FF}.")


def swiglu(x, wg, wu, wd):
    """x [rows, D] through one SwiGLU: [D, F], [D, F], [F, D] -> [rows, D]."""
    return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd


def balanced_routing(tokens: int, n_exp: int, k: int, seed: int = 0) -> np.ndarray:
    """expert [tokens * k] int32 (token-major): each expert gets tokens*k/n_exp copies and a token's k
    copies go to k different experts (token t: experts e_t, e_t + 1, ... mod n_exp, e_t shuffled)."""
    first = np.random.default_rng(seed).permutation(np.arange(tokens) % n_exp)
    return ((first[:, None] + np.arange(k)[None, :]) % n_exp).reshape(-1).astype(np.int32)


def kernels_apply(dtype: str) -> bool:
    """Whether jaxtrain's XLA:CPU kernels take this case: float32 on a CPU backend, the kernels built."""
    return dtype == "float32" and jax.default_backend() == "cpu" and cpu_fused.problem() is None


def expert_cases(expert: np.ndarray, n_exp: int = N_EXP, kernels: bool = False) -> dict[str, Callable]:
    """name -> f(rows [M, D], wg [E, D, F], wu, wd [E, F, D]) -> [M, D] (each row through its expert);
    ``kernels``: with the XLA:CPU grouped kernels' case."""
    m = expert.shape[0]
    order = np.argsort(expert, kind="stable")  # static: the routing is fixed for the benchmark
    sizes = np.bincount(expert, minlength=n_exp)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    inverse = np.argsort(order)

    def per_expert(rows, wg, wu, wd):
        xs = rows[order]
        ys = [swiglu(xs[s:s + n], wg[e], wu[e], wd[e]) for e, (s, n) in enumerate(zip(starts, sizes))]
        return jnp.concatenate(ys)[inverse]

    def batched(rows, wg, wu, wd):
        xs = rows[order].reshape(n_exp, m // n_exp, -1)
        h = jax.nn.silu(jnp.einsum("emd,edf->emf", xs, wg)) * jnp.einsum("emd,edf->emf", xs, wu)
        return jnp.einsum("emf,efd->emd", h, wd).reshape(m, -1)[inverse]

    def windows(rows, wg, wu, wd):
        return windowed_swiglu(rows, jnp.asarray(expert), wg, wu, wd)

    def blocks(rows, wg, wu, wd):
        return blocked_swiglu(rows, jnp.asarray(expert), wg, wu, wd)

    def ragged(rows, wg, wu, wd):
        group = jnp.asarray(sizes, jnp.int32)
        xs = rows[order]
        h = jax.nn.silu(jax.lax.ragged_dot(xs, wg, group)) * jax.lax.ragged_dot(xs, wu, group)
        return jax.lax.ragged_dot(h, wd, group)[inverse]

    def fused(rows, wg, wu, wd):
        return cpu_grouped.grouped_swiglu(rows, jnp.asarray(expert), wg, wu, wd)

    assert sizes.min() == sizes.max() == m // n_exp, "the batched case needs balanced routing"
    cases = {"per-expert 2-D": per_expert, "batched [E, M/E]": batched, "dropless windows": windows,
             "dropless blocks": blocks, "ragged_dot": ragged}
    return {**cases, "dropless cpu_fused": fused} if kernels else cases


def grad_fn(fn: Callable, tok_of_row=None) -> Callable:
    """jit(grad of sum(fn(...)^2)) with respect to every argument; rows come from tokens via tok_of_row."""
    def loss(x, *w):
        rows = x if tok_of_row is None else x[tok_of_row]
        return jnp.sum(jnp.square(fn(rows, *w)))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))


def build(seed: int = 0, shape: tuple[int, ...] = (TOKENS, D_MODEL, D_FF, N_EXP, TOP_K),
          dtype: str = "float32") -> tuple[dict[str, tuple[Callable, tuple]], dict[str, float]]:
    """The timed cases (name -> (jitted fwd+bwd, args)) and each expert case's largest relative
    gradient difference from the per-expert 2-D reference. ``shape`` is (tokens, d_model, d_ff,
    experts, top_k)."""
    tokens, d_model, d_ff, n_exp, top_k = shape
    rng = np.random.default_rng(seed)
    arr = lambda *s, scale=1.0: jnp.asarray(rng.standard_normal(s) * scale, dtype)  # noqa: E731
    x = arr(tokens, d_model)
    dense_w = (arr(d_model, top_k * d_ff, scale=0.05), arr(d_model, top_k * d_ff, scale=0.05),
               arr(top_k * d_ff, d_model, scale=0.05))
    exp_w = (arr(n_exp, d_model, d_ff, scale=0.05), arr(n_exp, d_model, d_ff, scale=0.05),
             arr(n_exp, d_ff, d_model, scale=0.05))
    expert = balanced_routing(tokens, n_exp, top_k, seed)
    tok = jnp.asarray(np.arange(tokens * top_k) // top_k)
    kernels = kernels_apply(dtype)
    cases = {"dense 2-D": (grad_fn(swiglu), (x, *dense_w))}
    if kernels:
        cases["dense cpu_fused"] = (grad_fn(lambda *a: cpu_mlp.mlp(*a, names=())), (x, *dense_w))
    for name, fn in expert_cases(expert, n_exp, kernels).items():
        cases[name] = (grad_fn(fn, tok), (x, *exp_w))
    ref = cases["per-expert 2-D"][0](*cases["per-expert 2-D"][1])
    diffs = {}
    for name in [n for n in cases if not n.startswith("dense")]:
        got = cases[name][0](*cases[name][1])
        diffs[name] = max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - r)) / jnp.max(jnp.abs(r)))
                          for g, r in zip(got, (r.astype(jnp.float32) for r in ref)))
    return cases, diffs


def time_case(fn: Callable, args: tuple, iters: int) -> float:
    """Median wall seconds of one synchronised call, over ``iters`` calls."""
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=20, help="timed calls per case and round")
    p.add_argument("--write-results", action="store_true")
    p.add_argument("--quick", action="store_true", help="1 round of 2 calls: checks the plumbing")
    p.add_argument("--shape", default=f"{TOKENS},{D_MODEL},{D_FF},{N_EXP},{TOP_K}",
                   help="tokens,d_model,d_ff,experts,top_k (tokens * top_k divisible by experts)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = p.parse_args(argv)
    if a.rounds < 1 or a.iters < 1:
        p.error("--rounds and --iters: at least 1")
    try:
        shape = tuple(int(v) for v in a.shape.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 5 or min(shape) < 1 or (shape[0] * shape[4]) % shape[3]:
        p.error(f"--shape {a.shape!r}: five positive integers tokens,d_model,d_ff,experts,top_k with "
                "tokens * top_k divisible by experts")
    tokens, _, _, n_exp, top_k = shape
    rounds, iters = (1, 2) if a.quick else (a.rounds, a.iters)
    cases, diffs = build(shape=shape, dtype=a.dtype)
    for fn, args in cases.values():  # compile and warm up
        jax.block_until_ready(fn(*args))
    medians: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(rounds):
        for name, (fn, args) in cases.items():
            medians[name].append(time_case(fn, args, iters))
        print(f"round {r + 1}/{rounds}: " + ", ".join(f"{n} {1e3 * m[-1]:.2f} ms" for n, m in medians.items()),
              flush=True)
    dense = statistics.median(medians["dense 2-D"])
    dev = jax.devices()[0]
    where = hardware() + ("" if dev.platform == "cpu" else f"; {dev.device_kind}")
    default = shape == (TOKENS, D_MODEL, D_FF, N_EXP, TOP_K) and a.dtype == "float32"
    label = "" if default else f" [{a.shape}, {a.dtype}]"
    print(f"\n{where}: one layer's SwiGLU, forward and backward ({tokens} tokens, {n_exp} experts, "
          f"top-{top_k}){label}")
    print(f"{'case':20s} {'ms':>8s} {'vs dense':>9s} {'max rel. diff':>14s}")
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    rows = []
    for name in cases:
        ms = 1e3 * statistics.median(medians[name])
        diff = f"{diffs[name]:.1e}" if name in diffs else "-"
        print(f"{name:20s} {ms:8.2f} {ms / (1e3 * dense):8.2f}x {diff:>14s}")
        rows.append(f"| {date} | {where} | {commit()} | {name}{label}{' (quick)' if a.quick else ''} | {ms:.2f} | "
                    f"{ms / (1e3 * dense):.2f}x | {diff} |")
    if a.write_results:
        append_result_rows(HEADER, rows, INTRO)
    return 0


if __name__ == "__main__":
    sys.exit(main())
