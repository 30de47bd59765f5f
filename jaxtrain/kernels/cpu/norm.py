"""RMSNorm through an XLA:CPU kernel (``norm.cc``), float32, with its gradient likewise: the
decoders' norms under ``model.matmul`` ``cpu_fused`` (and ``auto`` where that picks the kernel;
:func:`jaxtrain.models.layers.fused_norm`).

Why: XLA:CPU made each norm several small fusions and reductions in the forward and backward, ~1.5 ms
of the ~19 ms shakespeare-char step on a 2-core Intel Xeon; the kernel does a call's rows in one pass
each, a thread on the rows its CPU had in the matmul before.

One device, first-order reverse mode only (a ``jax.custom_vjp``), as
:mod:`jaxtrain.kernels.cpu.matmul`. Its values differ from XLA's by float rounding (sums in another
order).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.kernels.cpu import library
from jaxtrain.kernels.cpu.matmul import rows_vmap


def _forward_call(x, scale, eps):
    return tuple(jax.ffi.ffi_call(library.RMSNORM_FORWARD, (jax.ShapeDtypeStruct(x.shape, jnp.float32),
                                                             jax.ShapeDtypeStruct(x.shape[:1], jnp.float32)),
                                  vmap_method="sequential")(x, scale, eps=np.float32(eps)))


@functools.lru_cache(maxsize=None)
def _forward(eps: float):
    """(y, r) [rows, D] and [rows], one call over every member's rows under vmap (rows_vmap)."""
    return rows_vmap(lambda x, scale: _forward_call(x, scale, eps))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _norm(x, scale, eps):
    return _forward(eps)(x, scale)[0]


def _norm_fwd(x, scale, eps):
    y, r = _forward(eps)(x, scale)
    return y, (x, scale, r)


def _norm_bwd(eps, res, dy):
    x, scale, r = res
    # sequential under vmap (per-example gradients): each member the call it would be alone
    return tuple(jax.ffi.ffi_call(library.RMSNORM_BACKWARD, (jax.ShapeDtypeStruct(x.shape, jnp.float32),
                                                              jax.ShapeDtypeStruct(scale.shape, jnp.float32)),
                                  vmap_method="sequential")(x, scale, r, dy))


_norm.defvjp(_norm_fwd, _norm_bwd)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """``x / sqrt(mean(x^2) + eps) * scale`` over the last dim, and its gradients, through the kernel.

    Args:
      x: [tokens, embed] float32; scale: [embed] float32; eps: added to the mean square.
    Returns: [tokens, embed] float32; a row depends only on its own row of x.
    Raises:
      RuntimeError: the kernel is not available (:func:`jaxtrain.kernels.cpu.library.problem` says why).
      ValueError: shapes or dtypes it does not take.
    """
    why = library.problem()
    if why:
        raise RuntimeError(f"model.matmul=cpu_fused: {why}")
    if x.ndim != 2 or scale.shape != x.shape[1:] or x.dtype != jnp.float32 or scale.dtype != jnp.float32:
        raise ValueError(f"model.matmul=cpu_fused: the RMSNorm kernel takes float32 x [tokens, embed] and scale "
                         f"[embed]; got x {x.dtype}{list(x.shape)}, scale {scale.dtype}{list(scale.shape)}")
    return _norm(x, scale, float(eps))
