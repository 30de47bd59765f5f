"""Row permutations and ``shard_map`` variance casts shared by the grouped kernels and the MoE dispatch
(``jaxtrain.moe``), on every backend."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _varying(a: jax.Array) -> set[str]:
    """The manual mesh axes ``a`` varies over (JAX <= 0.9 names them ``vma``; 0.10 ``manual_axis_type``)."""
    t = jax.typeof(a)
    if hasattr(t, "vma"):
        return set(t.vma)
    manual = getattr(t, "manual_axis_type", None)
    return set(manual.varying) if manual is not None else set()


def vary_alike(*arrays: jax.Array) -> list[jax.Array]:
    """Inside ``shard_map``: each array cast to vary over every mesh axis any of them varies over.

    The written-out backward pass returns, e.g., a weight gradient that varies over ``data`` like the
    rows it came from; a custom VJP's cotangent must have its primal's type, and the transpose of
    this cast sums the gradient over the axes its primal did not vary over (as autodiff does).
    Outside ``shard_map`` (or with its check off) nothing varies and nothing changes.
    """
    vma = [_varying(a) for a in arrays]
    axes = set().union(*vma)
    out = []
    for a, have in zip(arrays, vma):
        missing = tuple(sorted(axes - have))
        out.append(jax.lax.pcast(a, missing, to="varying") if missing else a)
    return out


def vary_like(a: jax.Array, ref: jax.Array) -> jax.Array:
    """``a`` cast to vary over every manual mesh axis ``ref`` varies over (inside ``shard_map``): an FFI
    call's results vary over none, where a custom VJP's cotangent must have its primal's type."""
    missing = tuple(sorted(_varying(ref) - _varying(a)))
    return jax.lax.pcast(a, missing, to="varying") if missing else a


@jax.custom_vjp
def permute_rows(x: jax.Array, order: jax.Array, inverse: jax.Array) -> jax.Array:
    """``x[order]`` for a permutation ``order`` of x's rows, whose inverse is ``inverse``
    (``inverse[order[i]] == i``). x [M, ...]; order, inverse [M] int32 -> [M, ...].

    Autodiff would transpose the row gather into a scatter-add; a permutation's transpose is the
    inverse permutation, so here the backward pass is a gather too. The expert-parallel dropless path
    uses it on every backend; on CPU, ``moe_shakespeare`` under ``ep`` ``expert=8`` went from 560-593 to
    482-520 ms a step with it (2-core AMD EPYC), and one device's step did not change.
    """
    return x[order]


def _permute_fwd(x, order, inverse):
    return x[order], (order, inverse)


def _permute_bwd(res, g):
    order, inverse = res
    return g[inverse], None, None


permute_rows.defvjp(_permute_fwd, _permute_bwd)


def inverse_permutation(order: jax.Array) -> jax.Array:
    """[M] int32 permutation -> its inverse (an integer scatter of M indices)."""
    m = order.shape[0]
    return jnp.zeros((m,), order.dtype).at[order].set(jnp.arange(m, dtype=order.dtype))
