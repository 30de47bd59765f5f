"""The XLA provider's grouped SwiGLU for the MoE experts: ``jax.lax.ragged_dot`` over the rows sorted by
expert (a grouped GEMM where the backend has one), and the capacity buffers' per-expert SwiGLU.

The windowed and blocked variants (``model.grouped_matmul`` ``windows`` and ``blocks``) are
:mod:`.grouped_windows` and :mod:`.grouped_blocks`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.kernels import target

UNROLL_EXPERTS = 16  # on CPU, up to this many local experts run as one 2-D SwiGLU each


def ragged_swiglu(rows: jax.Array, expert: jax.Array, w_gate, w_up, w_down) -> jax.Array:
    """rows [M, embed], expert [M] int32 in [0, E] (E: no expert, output 0) -> [M, embed]: three
    ``ragged_dot`` calls over the rows sorted by expert (XLA:CPU and, in JAX 0.11.2, XLA:GPU expand them
    into padded dense matmuls)."""
    n_exp = w_gate.shape[0]
    order = jnp.argsort(expert, stable=True)
    sizes = jnp.bincount(expert, length=n_exp + 1)[:n_exp].astype(jnp.int32)
    xs = rows[order]
    h = jax.nn.silu(jax.lax.ragged_dot(xs, w_gate, sizes)) * jax.lax.ragged_dot(xs, w_up, sizes)
    ys = jax.lax.ragged_dot(h, w_down, sizes)
    ys = jnp.where((jnp.arange(rows.shape[0]) < sizes.sum())[:, None], ys, 0)  # rows past the groups
    return jnp.zeros_like(ys).at[order].set(ys)


def buffers_swiglu(rows: jax.Array, w_gate, w_up, w_down) -> jax.Array:
    """rows [E, slots, embed] through expert e's SwiGLU each -> [E, slots, embed].

    One batched matmul per weight on GPU and TPU. On CPU, with at most :data:`UNROLL_EXPERTS` experts, one
    2-D SwiGLU per expert instead (the same values; bit for bit on the AMD EPYC it was measured on, though
    another CPU's kernels may round differently): XLA:CPU runs a 2-D matmul faster than a slice of a
    batched one and runs two experts' at once on two cores (``benchmarks/moe_kernels.py``: "per-expert
    2-D" against "batched [E, M/E]").
    """
    if target.backend() == "cpu" and rows.shape[0] <= UNROLL_EXPERTS:
        return jnp.stack([(jax.nn.silu(rows[e] @ w_gate[e]) * (rows[e] @ w_up[e])) @ w_down[e]
                          for e in range(rows.shape[0])])
    h = jax.nn.silu(jnp.einsum("emd,edf->emf", rows, w_gate)) * jnp.einsum("emd,edf->emf", rows, w_up)
    return jnp.einsum("emf,efd->emd", h, w_down)
