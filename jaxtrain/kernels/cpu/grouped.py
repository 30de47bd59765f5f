"""The dropless MoE's grouped SwiGLU through XLA:CPU kernels (``grouped.cc``), float32: the rows
sorted by expert, each expert's SwiGLU ``(silu(x Wg[e]) * (x Wu[e])) Wd[e]`` (Shazeer 2020) on its own
group of rows, and the gradients likewise: ``model.grouped_matmul`` ``cpu_fused``.

Why: XLA:CPU has no grouped GEMM. The windowed 2-D matmuls (:mod:`jaxtrain.kernels.xla.grouped_windows`) waste up
to a window of rows per expert and run the SwiGLU's elementwise work as passes of their own; here every
product is a kernel call over the groups' rows (MegaBlocks' grouped GEMM, Gale et al. 2023, without the
padded blocks), with the elementwise work folded in as in :mod:`jaxtrain.kernels.cpu.mlp`: two calls
forward (gate, up and the SwiGLU in one; then ``Wd``), five backward.

One device, first-order reverse mode only, as :mod:`jaxtrain.kernels.cpu.matmul`. Values differ from
``jax.lax.ragged_dot``'s by float rounding (summation order, the kernel's own ``exp``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.kernels.cpu import library
from jaxtrain.kernels.rows import inverse_permutation, permute_rows, vary_alike, vary_like


def _f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _call(target, out, *args, **attrs):
    # sequential under vmap: each member is the call it would be alone
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")(*args, **attrs)


def _forward(xs, sizes, w_gate, w_up, w_down):
    m, f = xs.shape[0], w_gate.shape[2]
    h, g, u = _call(library.GROUPED_FORWARD, (_f32(m, f),) * 3, xs, sizes, w_gate, w_up)
    out = _call(library.GROUPED_MATMUL_SUM, _f32(*xs.shape), sizes, h, w_down, transpose_b=False)
    return vary_like(out, xs), (xs, sizes, w_gate, w_up, w_down, h, g, u)


@jax.custom_vjp
def _experts(xs, sizes, w_gate, w_up, w_down):
    return _forward(xs, sizes, w_gate, w_up, w_down)[0]


def _backward(res, dout):
    xs, sizes, w_gate, w_up, w_down, h, g, u = res
    dg, du = _call(library.GROUPED_BACKWARD, (_f32(*g.shape),) * 2, dout, sizes, w_down, g, u)
    dx = _call(library.GROUPED_MATMUL_SUM, _f32(*xs.shape), sizes, dg, w_gate, du, w_up, transpose_b=True)

    def grad(a, b, w):  # w's gradient: sum over each group's rows of a^T b
        return vary_like(_call(library.GROUPED_WEIGHT_GRAD, _f32(*w.shape), a, sizes, b), w)

    return vary_like(dx, xs), None, grad(xs, dg, w_gate), grad(xs, du, w_up), grad(h, dout, w_down)


_experts.defvjp(_forward, _backward)


def shape_problem(rows: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> str | None:
    """Why the kernels cannot take these operands, or None: rows [M, embed]; w_gate, w_up [E, embed, mlp];
    w_down [E, mlp, embed]; all float32."""
    arrays = {"rows": rows, "w_gate": w_gate, "w_up": w_up, "w_down": w_down}
    if any(a.dtype != jnp.float32 for a in arrays.values()):
        dtypes = ", ".join(f"{k} {a.dtype}" for k, a in arrays.items())
        return f"operands of {dtypes}; it takes float32 (model.dtype=float32)"
    d = rows.shape[-1]
    e, f = (w_gate.shape[0], w_gate.shape[2]) if w_gate.ndim == 3 else (0, 0)
    if rows.ndim != 2 or w_gate.shape != (e, d, f) or w_up.shape != (e, d, f) or w_down.shape != (e, f, d):
        return ("shapes " + ", ".join(f"{k} {list(a.shape)}" for k, a in arrays.items()) +
                " (it takes rows [M, embed], w_gate and w_up [E, embed, mlp], w_down [E, mlp, embed])")
    return None


def _check(rows, w_gate, w_up, w_down) -> None:
    why = library.problem()
    if why:
        raise RuntimeError(f"model.grouped_matmul=cpu_fused: {why}")
    why = shape_problem(rows, w_gate, w_up, w_down)
    if why:
        raise ValueError(f"model.grouped_matmul=cpu_fused: {why}")


def _grouped(xs, sizes, w_gate, w_up, w_down):
    # inside shard_map: the weights' gradients vary over the axes the rows do (see vary_alike)
    xs, w_gate, w_up, w_down = vary_alike(xs, w_gate, w_up, w_down)
    return _experts(xs, sizes, w_gate, w_up, w_down)


def grouped_swiglu(rows: jax.Array, expert: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                   w_down: jax.Array) -> jax.Array:
    """Each row through its expert's SwiGLU ``(silu(x w_gate[e]) * (x w_up[e])) w_down[e]``.

    Args:
      rows: [M, embed] float32; expert: [M] int32 in [0, E], where E means no expert (output 0).
      w_gate, w_up: [E, embed, mlp] float32; w_down: [E, mlp, embed] float32.
    Returns:
      [M, embed] float32; differentiable in rows and the weights (first order, reverse mode).
    Raises:
      RuntimeError: the kernels are not available (:func:`jaxtrain.kernels.cpu.library.problem` says why).
      ValueError: operands the kernels do not take (:func:`shape_problem`).
    """
    _check(rows, w_gate, w_up, w_down)
    n_exp = w_gate.shape[0]
    order = jnp.argsort(expert, stable=True).astype(jnp.int32)
    inverse = inverse_permutation(order)
    sizes = jnp.bincount(expert, length=n_exp + 1)[:n_exp].astype(jnp.int32)  # the last: no expert, sorted last
    out = _grouped(permute_rows(rows, order, inverse), sizes, w_gate, w_up, w_down)
    return permute_rows(out, inverse, order)


def buffers_swiglu(rows: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """Expert e's SwiGLU on its buffer rows[e] (capacity routing's slots), as groups of equal size.

    Args:
      rows: [E, slots, embed] float32; w_gate, w_up: [E, embed, mlp]; w_down: [E, mlp, embed] float32.
    Returns: [E, slots, embed] float32, differentiable as :func:`grouped_swiglu`.
    Raises: as :func:`grouped_swiglu`.
    """
    n_exp, slots, d = rows.shape
    flat = rows.reshape(n_exp * slots, d)
    _check(flat, w_gate, w_up, w_down)
    out = _grouped(flat, jnp.full((n_exp,), slots, jnp.int32), w_gate, w_up, w_down)
    return out.reshape(rows.shape)
