"""Building blocks every decoder family shares: the parameter initialiser, the projection, RMSNorm.

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

from jaxtrain.parallel.activations import devices_along


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple, std: float, dtype: str) -> nnx.Param:
    """A ``shape`` parameter of ``dtype`` (a numpy name) drawn from N(0, std^2), logical axes ``axes``
    (one name, or None for a replicated dim, per dim)."""
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.dtype(dtype)), axes=axes)


def project(x: jax.Array, w: jax.Array, n_in: int = 1) -> jax.Array:
    """Contracts x's last ``n_in`` dims with w's first ``n_in``: [*lead, *in] x [*in, *out] -> [*lead, *out].

    Done as one 2-D matmul on [prod(lead), prod(in)] (row-major reshapes are free): XLA:CPU
    lowers a 3-D dot_general's weight gradient (contracting batch and length) with a
    transposing copy fused into the producer, which made the 25M benchmark step ~1.8x
    slower. When the rules split the logical 'length' over devices (sp), a plain tensordot
    instead: merging a split length into the batch made GSPMD all-gather ~10x more. (tp splits
    'residual_length' instead; the projection gathers it either way, with the same collectives.)
    """
    lead, dims_in, dims_out = x.shape[:x.ndim - n_in], w.shape[:n_in], w.shape[n_in:]
    if len(lead) == 2 and devices_along(lead, ("batch", "length"), 1) > 1:
        # The length is split over devices (sequence parallelism): merging it into the batch
        # would make GSPMD gather it, so contract the 3-D layout directly.
        return jnp.tensordot(x, w, axes=n_in)
    k = math.prod(dims_in)
    return (x.reshape(-1, k) @ w.reshape(k, -1)).reshape(*lead, *dims_out)


class RMSNorm(nnx.Module):
    """y = x / sqrt(mean(x^2) + eps) * scale, computed in float32. x: [..., embed] -> same shape and dtype.

    Reads ``cfg.d_model``, ``cfg.norm_eps`` and ``cfg.param_dtype``; ``scale`` [embed] starts at 1.
    """

    def __init__(self, cfg: Any):
        self.eps = cfg.norm_eps
        self.scale = nnx.Param(jnp.ones((cfg.d_model,), jnp.dtype(cfg.param_dtype)), axes=("embed",))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)
