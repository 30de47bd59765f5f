"""Building blocks every decoder family shares: the parameter initialiser, the projection, RMSNorm.

The products and norms go through the kernel registry (:mod:`jaxtrain.kernels.ops`), which runs each
with the implementation ``model.matmul`` names (``auto``: the plan's choice for the run).

They take a family's config object and read only the keys named in each docstring, so a family
(``models/<name>/config.py``) provides them under these names. Every parameter carries its
logical axis names in the ``axes`` metadata; no mesh is named here.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.kernels import ops
from jaxtrain.parallel.activations import devices_along

# A kernel's matmul outputs carry this name, so that model.remat=save_matmuls keeps them as it keeps XLA's
# dots (models/decoder.py).
MATMUL_NAME = ops.MATMUL_NAME


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple, std: float, dtype: str) -> nnx.Param:
    """A ``shape`` parameter of ``dtype`` (a numpy name) drawn from N(0, std^2), logical axes ``axes``
    (one name, or None for a replicated dim, per dim)."""
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.dtype(dtype)), axes=axes)


def project(x: jax.Array, w: jax.Array, n_in: int = 1, implementation: str = "auto") -> jax.Array:
    """Contracts x's last ``n_in`` dims with w's first ``n_in``: [*lead, *in] x [*in, *out] -> [*lead, *out].

    Done as one 2-D matmul on [prod(lead), prod(in)] (row-major reshapes are free): XLA:CPU
    lowers a 3-D dot_general's weight gradient (contracting batch and length) with a
    transposing copy fused into the producer, which made the 25M benchmark step ~1.8x
    slower. When the rules split the logical 'length' over devices (sp), a plain tensordot
    instead: merging a split length into the batch made GSPMD all-gather ~10x more. (tp splits
    'residual_length' instead; the projection gathers it either way, with the same collectives.)
    ``implementation``: ``model.matmul`` (:func:`jaxtrain.kernels.ops.matmul`).

    Raises:
      ConfigError: an explicit ``model.matmul`` that cannot take this product.
    """
    lead, dims_in, dims_out = x.shape[:x.ndim - n_in], w.shape[:n_in], w.shape[n_in:]
    if len(lead) == 2 and devices_along(lead, ("batch", "length"), 1) > 1:
        # The length is split over devices (sequence parallelism): merging it into the batch
        # would make GSPMD gather it, so contract the 3-D layout directly.
        return jnp.tensordot(x, w, axes=n_in)
    k = math.prod(dims_in)
    x2, w2 = x.reshape(-1, k), w.reshape(k, -1)
    return ops.matmul(x2, w2, implementation).reshape(*lead, *dims_out)


def projections(x: jax.Array, ws: tuple[jax.Array, ...], implementation: str = "auto") -> tuple[jax.Array, ...]:
    """``project(x, w, implementation=implementation)`` for each w of ``ws`` (q, k and v from one input:
    [*lead, in] x [in, *out_i]). Where one implementation takes every product together, its input
    gradient is one call summing them (:func:`jaxtrain.kernels.ops.matmuls`), not each product's own and
    XLA's adds. Raises as :func:`project`."""
    outs = ops.matmuls(x.reshape(-1, x.shape[-1]), tuple(w.reshape(w.shape[0], -1) for w in ws), implementation)
    if outs is None:
        return tuple(project(x, w, implementation=implementation) for w in ws)
    return tuple(o.reshape(*x.shape[:-1], *w.shape[1:]) for o, w in zip(outs, ws))


class RMSNorm(nnx.Module):
    """y = x / sqrt(mean(x^2) + eps) * scale, computed in float32. x: [..., embed] -> same shape and dtype.

    Reads ``cfg.d_model``, ``cfg.norm_eps``, ``cfg.param_dtype`` and ``cfg.matmul`` (a fused norm where that
    implementation has one: :func:`jaxtrain.kernels.ops.rms_norm`); ``scale`` [embed] starts at 1.
    """

    def __init__(self, cfg: Any):
        self.eps, self.matmul = cfg.norm_eps, cfg.matmul
        self.scale = nnx.Param(jnp.ones((cfg.d_model,), jnp.dtype(cfg.param_dtype)), axes=("embed",))

    def __call__(self, x: jax.Array) -> jax.Array:
        fused = ops.rms_norm(x, self.scale[...].astype(jnp.float32), self.eps, self.matmul)
        if fused is not None:
            return fused
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)
