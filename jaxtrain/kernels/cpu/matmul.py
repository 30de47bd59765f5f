"""The projections' matmul as an XLA:CPU kernel (``matmul.cc``, XLA FFI), float32, with its
gradients through the same kernel: ``model.matmul=cpu_fused`` (:func:`jaxtrain.models.layers.project`).

Why: XLA:CPU's dots split a small product (the shakespeare-char model's ``[768, 128] x [128, 344]``
and its gradients) poorly over two cores. The kernel cuts each call into runs of token rows and starts
each thread on the run its CPU had before, and sums the weight gradient's contraction over the tokens
as one half per thread (see ``matmul.cc``): on a 2-core Intel Xeon its products ran 1.4-2.2x
XLA's, and the shakespeare-char train step took 0.90x the time (docs/benchmarks.md).

Built and registered with the attention kernel (:mod:`jaxtrain.kernels.cpu.library`). One device only:
a custom call is opaque to XLA's partitioner. Reverse-mode gradients of first order only (a
``jax.custom_vjp`` whose backward is two more kernel calls): ``jax.jvp`` and gradients of gradients
raise JAX's error.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jaxtrain.kernels.cpu import library


def shape_problem(x: jax.Array, w: jax.Array) -> Optional[str]:
    """Why the kernel cannot take ``x @ w``, or None: it takes 2-D float32 operands."""
    if x.ndim != 2 or w.ndim != 2:
        return f"operands of ranks {x.ndim} and {w.ndim} (it takes 2-D)"
    if x.dtype != jnp.float32 or w.dtype != jnp.float32:
        return f"operands of {x.dtype} and {w.dtype}; it takes float32 (model.dtype=float32)"
    return None


def call(a: jax.Array, b: jax.Array, transpose_a: bool, transpose_b: bool) -> jax.Array:
    """One kernel call: ``op(a) op(b)`` with op a transpose where asked, [M, N] float32."""
    m = a.shape[1] if transpose_a else a.shape[0]
    n = b.shape[0] if transpose_b else b.shape[1]
    # sequential under vmap: each member is the 2-D product it would be alone, bit for bit
    return jax.ffi.ffi_call(library.MATMUL, jax.ShapeDtypeStruct((m, n), jnp.float32),
                            vmap_method="sequential")(a, b, transpose_a=transpose_a, transpose_b=transpose_b)


def rows_vmap(fn):
    """``fn(x, *weights)`` (2-D x [rows, in]; results [rows, ...], one array or a tuple) such that under
    ``vmap`` with the weights shared (the grouped evaluation's), it is one call over all the members'
    rows: the same bits as one call per member, as a row's result does not depend on the other rows.
    With a batched weight, one call per member."""
    wrapped = jax.custom_batching.custom_vmap(fn)

    @wrapped.def_vmap
    def _rule(axis_size, in_batched, x, *weights):
        x_batched, *w_batched = in_batched
        if any(w_batched):
            args = [a if b else jnp.broadcast_to(a, (axis_size, *a.shape))
                    for a, b in zip((x, *weights), in_batched)]
            out = jax.lax.map(lambda a: wrapped(*a), tuple(args))
            return out, jax.tree.map(lambda _: True, out)
        if not x_batched:
            out = wrapped(x, *weights)
            return out, jax.tree.map(lambda _: False, out)
        out = wrapped(x.reshape(-1, x.shape[-1]), *weights)
        out = jax.tree.map(lambda o: o.reshape(axis_size, -1, *o.shape[1:]), out)
        return out, jax.tree.map(lambda _: True, out)

    return wrapped


product = rows_vmap(lambda x, w: call(x, w, False, False))  # x @ w, without a gradient rule


def call_sum(pairs) -> jax.Array:
    """One kernel call (``mlp.cc``'s MatmulSum): ``sum_i a_i b_i^T`` over pairs (a_i [M, K_i],
    b_i [N, K_i]), [M, N] float32; each product summed over its K as one call of it would, then added in
    order."""
    m, n = pairs[0][0].shape[0], pairs[0][1].shape[0]
    return jax.ffi.ffi_call(library.MATMUL_SUM, jax.ShapeDtypeStruct((m, n), jnp.float32), vmap_method="sequential")(
        *(a for pair in pairs for a in pair))


@jax.custom_vjp
def _shared(x, ws):
    return tuple(product(x, w) for w in ws)


def _shared_fwd(x, ws):
    return _shared(x, ws), (x, ws)


def _shared_bwd(res, dys):
    x, ws = res
    return call_sum(tuple(zip(dys, ws))), tuple(call(x, dy, True, False) for dy in dys)


_shared.defvjp(_shared_fwd, _shared_bwd)


def matmuls(x: jax.Array, ws: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """``x @ w`` for each w (q, k and v from one input), with one kernel call for the input's gradient
    ``sum_i dy_i w_i^T`` where each product alone would add its own (XLA adds them in passes of their own).

    Args:
      x: [tokens, in] float32; ws: [in, out_i] float32 each.
    Returns: [tokens, out_i] float32 each, the bits :func:`matmul` gives.
    Raises: as :func:`matmul`.
    """
    for w in ws:
        _check(x, w)
    return _shared(x, tuple(ws))


@jax.custom_vjp
def _matmul(x, w):
    return product(x, w)


def _matmul_fwd(x, w):
    return product(x, w), (x, w)


def _matmul_bwd(res, dy):
    x, w = res
    return call(dy, w, False, True), call(x, dy, True, False)  # dx = dy w^T, dw = x^T dy


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` through the kernel, and its gradients (``dy w^T`` and ``x^T dy``) likewise.

    Args:
      x: [tokens, in] float32; w: [in, out] float32.
    Returns: [tokens, out] float32, each element summed over ``in`` in an order that depends only on
      ``in`` (so a row is the same bit for bit whatever the other rows are).
    Raises:
      RuntimeError: the kernel is not available (:func:`jaxtrain.kernels.cpu.library.problem` says why).
      ValueError: operands the kernel does not take (:func:`shape_problem`).
    """
    _check(x, w)
    return _matmul(x, w)


def _check(x: jax.Array, w: jax.Array) -> None:
    why = library.problem()
    if why:
        raise RuntimeError(f"model.matmul=cpu_fused: {why}")
    why = shape_problem(x, w)
    if why:
        raise ValueError(f"model.matmul=cpu_fused: {why}")
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"model.matmul=cpu_fused: x {x.shape} and w {w.shape} do not contract")
