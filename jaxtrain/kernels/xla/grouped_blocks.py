"""The dropless MoE's grouped SwiGLU as batched matmuls over fixed-size blocks of sorted rows.

For a backend whose grouped GEMM is missing or slow: XLA:GPU in JAX 0.11.2 expands
``jax.lax.ragged_dot`` into zero-padded dense matmuls, so one H200 ran a layer of 8 experts at
7.9x the dense SwiGLU of the same FLOPs (``benchmarks/moe_kernels.py``). Here the rows, sorted by
expert, are cut into blocks of ``w`` rows that each start inside one expert's group (the windows of
:mod:`jaxtrain.kernels.xla.grouped_windows`, MegaBlocks' padded blocks: Gale et al. 2023), gathered into
``[blocks, w, embed]``, and multiplied in one batched matmul by their experts' weights gathered
per block (``[blocks, embed, mlp]``). The block count is static, ``ceil(M / w) + E``, so the work
is at most ``E * w`` rows more than the routed copies, plus the weight gathers.

Every sorted row is owned by exactly one block (a block's tail may read the next group's rows;
those results are never used). Outputs and row gradients are gathered from the owning block, never
scattered or summed, and each expert's weight gradient is the sum of its blocks' products taken by
a one-hot matmul in float32: no atomics, so the result does not change from run to run.
"""
from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

from jaxtrain.kernels.rows import permute_rows, vary_alike
from jaxtrain.kernels.xla.grouped_windows import swiglu_grads, window_layout


def block_rows(m: int, n_exp: int) -> int:
    """Rows per block: the power of two nearest ``sqrt(500 * m / n_exp)``, in [64, 4096].

    Each block moves its expert's three weight matrices about five times (gathered forward and
    backward, its weight gradients written and summed): ~30 bytes per weight element. Each expert
    pads about half a block: ~18 FLOPs per weight element per padded row. With an H200's ~4 TB/s and
    ~600 TFLOP/s (measured there), the total, ``(m / w + n_exp) * 30 / 4e12 + n_exp * w / 2 * 18 / 6e14``
    seconds per weight element, is least near ``w = sqrt(500 * m / n_exp)`` (1024 rows for 32768 copies
    and 8 experts: 40 blocks). An estimate from those two rates, not a measured optimum.
    """
    w = (500 * m / n_exp) ** 0.5
    return int(min(4096, max(64, 1 << round(math.log2(w)))))


def _gather_blocks(xs: jax.Array, start: jax.Array, w: int) -> jax.Array:
    """xs [M + w, d] -> [blocks, w, d]: the w rows from each block's start."""
    return xs[start[:, None] + jnp.arange(w)[None, :]]


def _weights(owner, w_gate, w_up, w_down):
    return w_gate[owner], w_up[owner], w_down[owner]  # [blocks, d, f], [blocks, d, f], [blocks, f, d]


def _bmm(a, b):
    return jnp.einsum("bij,bjk->bik", a, b)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blocks(w: int, xs, start, valid, owner, flat, w_gate, w_up, w_down):
    return _blocks_fwd(w, xs, start, valid, owner, flat, w_gate, w_up, w_down)[0]


def _blocks_fwd(w, xs, start, valid, owner, flat, w_gate, w_up, w_down):
    xb = _gather_blocks(xs, start, w)
    wg, wu, wd = _weights(owner, w_gate, w_up, w_down)
    g, u = _bmm(xb, wg), _bmm(xb, wu)
    yb = _bmm(jax.nn.silu(g) * u, wd)
    flat_y = jnp.concatenate([yb.reshape(-1, yb.shape[-1]), jnp.zeros((1, yb.shape[-1]), yb.dtype)])
    return flat_y[flat], (xs, start, valid, owner, flat, w_gate, w_up, w_down, g, u)


def _blocks_bwd(w, res, d_out):
    xs, start, valid, owner, flat, w_gate, w_up, w_down, g, u = res
    n_blk, d = start.shape[0], xs.shape[1]
    xb = _gather_blocks(xs, start, w)
    wg, wu, wd = _weights(owner, w_gate, w_up, w_down)
    own = (jnp.arange(w)[None, :] < valid[:, None])[..., None]  # [blocks, w, 1]: the rows a block owns
    d_pad = jnp.concatenate([d_out, jnp.zeros((w, d), d_out.dtype)])
    dy = jnp.where(own, _gather_blocks(d_pad, start, w), 0)
    dg, du = swiglu_grads(jnp.einsum("bwd,bfd->bwf", dy, wd), g, u)
    one_hot = jax.nn.one_hot(owner, w_gate.shape[0], dtype=jnp.float32)  # [blocks, E]

    def per_expert(per_block, like):  # [blocks, ...] -> [E, ...]: each expert's blocks summed, in f32
        return jnp.einsum("be,b...->e...", one_hot, per_block, preferred_element_type=jnp.float32).astype(like.dtype)

    d_down = per_expert(jnp.einsum("bwf,bwd->bfd", jax.nn.silu(g) * u, dy), w_down)
    d_gate = per_expert(jnp.einsum("bwd,bwf->bdf", xb, dg), w_gate)
    d_up = per_expert(jnp.einsum("bwd,bwf->bdf", xb, du), w_up)
    dxb = jnp.einsum("bwf,bdf->bwd", dg, wg) + jnp.einsum("bwf,bdf->bwd", du, wu)
    flat_dx = jnp.concatenate([dxb.reshape(n_blk * w, d), jnp.zeros((1, d), dxb.dtype)])
    d_xs = jnp.concatenate([flat_dx[flat], jnp.zeros((xs.shape[0] - flat.shape[0], d), xs.dtype)])
    return d_xs, None, None, None, None, d_gate, d_up, d_down


_blocks.defvjp(_blocks_fwd, _blocks_bwd)


def blocked_swiglu(rows: jax.Array, expert: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                   w_down: jax.Array, rows_per_block: int | None = None) -> jax.Array:
    """Each row through its expert's SwiGLU ``(silu(x w_gate[e]) * (x w_up[e])) w_down[e]``.

    Args:
      rows: [M, embed]; expert: [M] int32 in [0, E], where E means no expert (output 0).
      w_gate, w_up: [E, embed, mlp]; w_down: [E, mlp, embed]; all in the rows' dtype.
      rows_per_block: default :func:`block_rows`.
    Returns:
      [M, embed] in the rows' dtype; differentiable in rows and the weights.
    """
    m = rows.shape[0]
    n_exp = w_gate.shape[0]
    w = rows_per_block or block_rows(m, n_exp)
    lay = window_layout(rows, expert, n_exp, w)  # the blocks are its windows
    # Each sorted row's place in the flattened blocks: its expert's block pos // w at offset pos % w; no
    # expert: the zero row past the blocks.
    e_sorted = jnp.sort(expert)
    e_c = jnp.minimum(e_sorted, n_exp - 1)
    pos = jnp.arange(m) - lay.group_start[e_c]
    flat = jnp.where(e_sorted < n_exp, (lay.first[e_c] + pos // w) * w + pos % w, lay.start.shape[0] * w)
    xs, w_gate, w_up, w_down = vary_alike(lay.xs, w_gate, w_up, w_down)
    out = _blocks(w, xs, lay.start, lay.valid, lay.owner, flat.astype(jnp.int32), w_gate, w_up, w_down)
    return permute_rows(out, lay.inverse, lay.order)
