"""Building blocks every decoder family shares: the parameter initialiser, the projection (and its
matmul's implementation, ``model.matmul``), RMSNorm.

They take a family's config object and read only the keys named in each docstring, so a family
(``models/<name>/config.py``) provides them under these names. Every parameter carries its
logical axis names in the ``axes`` metadata; no mesh is named here.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.errors import ConfigError
from jaxtrain.kernels import cpu_fused, cpu_matmul, cpu_norm, target
from jaxtrain.parallel import offload
from jaxtrain.parallel.activations import active_sharding, devices_along
from jaxtrain.runtime import once

MATMULS = ("auto", "xla", "cpu_fused")
# model.matmul=auto takes the fused kernel for products of fewer FLOPs only. Measured on a 2-core Intel
# Xeon, one op at a time against XLA's dots: the shakespeare-char model's (17-68 MFLOP) 1.4-2.2x as fast,
# the 25M model's (1.1-2.9 GFLOP) 0.65-1.06x, and its train step 1.17-1.24x as slow (docs/benchmarks.md).
AUTO_MAX_FLOPS = 256e6
# The fused kernel's outputs carry this name, so that model.remat=save_matmuls keeps them as it keeps
# XLA's dots (models/decoder.py).
MATMUL_NAME = "cpu_matmul"
_logged: set = set()


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
    ``implementation``: ``model.matmul`` (:func:`matmul_choice`).

    Raises:
      ConfigError: ``cpu_fused`` where it cannot run (another backend, more than one device,
        non-float32 operands, no kernel).
    """
    lead, dims_in, dims_out = x.shape[:x.ndim - n_in], w.shape[:n_in], w.shape[n_in:]
    if len(lead) == 2 and devices_along(lead, ("batch", "length"), 1) > 1:
        # The length is split over devices (sequence parallelism): merging it into the batch
        # would make GSPMD gather it, so contract the 3-D layout directly.
        return jnp.tensordot(x, w, axes=n_in)
    k = math.prod(dims_in)
    x2, w2 = x.reshape(-1, k), w.reshape(k, -1)
    if matmul_choice(implementation, x2, w2) == "cpu_fused":
        out = checkpoint_name(cpu_matmul.matmul(x2, w2), MATMUL_NAME)
    else:
        out = x2 @ w2
    return out.reshape(*lead, *dims_out)


def projections(x: jax.Array, ws: tuple[jax.Array, ...], implementation: str = "auto") -> tuple[jax.Array, ...]:
    """``project(x, w, implementation=implementation)`` for each w of ``ws`` (q, k and v from one input:
    [*lead, in] x [in, *out_i]). Where the kernel takes every product, its input gradient is one kernel
    call summing them (:func:`jaxtrain.kernels.cpu_matmul.matmuls`), not each product's own and XLA's
    adds. Raises as :func:`project`."""
    x2 = x.reshape(-1, x.shape[-1])
    flat = [w.reshape(w.shape[0], -1) for w in ws]
    if not all(matmul_choice(implementation, x2, w) == "cpu_fused" for w in flat):
        return tuple(project(x, w, implementation=implementation) for w in ws)
    outs = cpu_matmul.matmuls(x2, tuple(flat))
    return tuple(checkpoint_name(o, MATMUL_NAME).reshape(*x.shape[:-1], *w.shape[1:]) for o, w in zip(outs, ws))


def fused_matmul_problem(x: jax.Array, w: jax.Array) -> Optional[str]:
    """Why the fused XLA:CPU matmul (:mod:`jaxtrain.kernels.cpu_matmul`) cannot take ``x @ w`` here, or
    None: another backend, more than one device (the trainer's mesh while it traces, else every device
    JAX has: a custom call is opaque to XLA's partitioner), its operands, or a kernel that did not build."""
    return _placement_problem() or cpu_matmul.shape_problem(x, w) or cpu_fused.problem()


def _placement_problem() -> Optional[str]:
    backend = target.backend()
    if backend != "cpu":
        return f"an XLA:CPU kernel; the backend is '{backend}'"
    active = active_sharding()
    devices = active[1].size if active is not None else jax.device_count()
    if devices > 1:
        return f"runs on one device, here {devices}"
    return None


def matmul_choice(implementation: str, x: jax.Array, w: jax.Array) -> str:
    """``model.matmul``: 'xla' (XLA's dot), 'cpu_fused' (the fused XLA:CPU kernel), or 'auto': the
    kernel where :func:`fused_matmul_problem` finds nothing against it and the product ``x @ w``
    ([tokens, in] x [in, out]) is under :data:`AUTO_MAX_FLOPS`, else XLA's dot (said once per reason).

    Raises:
      ConfigError: an unknown name, or ``cpu_fused`` where it cannot run.
    """
    if implementation not in MATMULS:
        raise ConfigError(f"model.matmul: unknown implementation '{implementation}' (known: {', '.join(MATMULS)})")
    if implementation == "xla":
        return "xla"
    why = fused_matmul_problem(x, w)
    if implementation == "cpu_fused":
        if why:
            raise ConfigError(f"model.matmul=cpu_fused cannot run here: {why} (use auto or xla)")
        return "cpu_fused"
    if why is None and 2 * x.shape[0] * x.shape[1] * w.shape[1] >= AUTO_MAX_FLOPS:
        why = (f"a {list(x.shape)} x {list(w.shape)} product: {AUTO_MAX_FLOPS / 1e6:.0f} MFLOP or more, where "
               f"XLA's dots are as fast")
    return once.auto_kernel(_logged, "model.matmul", why, "xla",
                            f"backend cpu, one device, float32, products under {AUTO_MAX_FLOPS / 1e6:.0f} MFLOP")


def fused_mlp(implementation: str, x: jax.Array, w_gate: jax.Array) -> bool:
    """Whether a SwiGLU MLP on ``x`` [*lead, embed] goes through the fused kernels
    (:mod:`jaxtrain.kernels.cpu_mlp`): where ``model.matmul`` takes the kernel for its gate product
    ``x @ w_gate`` (:func:`matmul_choice`, which raises as it says), and no activation is being
    offloaded (``offload.activations`` places XLA's named values; the kernel's are its own)."""
    if offload.offloaded_activations():
        return False
    return matmul_choice(implementation, x.reshape(-1, x.shape[-1]), w_gate) == "cpu_fused"


def fused_norm(implementation: str, x: jax.Array) -> bool:
    """Whether an RMSNorm of ``x`` [..., embed] goes through the XLA:CPU kernel
    (:mod:`jaxtrain.kernels.cpu_norm`): with ``model.matmul`` ``cpu_fused`` or ``auto``, for float32 x
    on a CPU backend and one device, where the kernels built (else XLA's, silently: the projections'
    :func:`matmul_choice` says why)."""
    return (implementation in ("auto", "cpu_fused") and x.dtype == jnp.float32 and x.ndim >= 1
            and _placement_problem() is None and cpu_fused.problem() is None)


class RMSNorm(nnx.Module):
    """y = x / sqrt(mean(x^2) + eps) * scale, computed in float32. x: [..., embed] -> same shape and dtype.

    Reads ``cfg.d_model``, ``cfg.norm_eps``, ``cfg.param_dtype`` and ``cfg.matmul`` (the XLA:CPU kernel
    where :func:`fused_norm` says so); ``scale`` [embed] starts at 1.
    """

    def __init__(self, cfg: Any):
        self.eps, self.matmul = cfg.norm_eps, cfg.matmul
        self.scale = nnx.Param(jnp.ones((cfg.d_model,), jnp.dtype(cfg.param_dtype)), axes=("embed",))

    def __call__(self, x: jax.Array) -> jax.Array:
        if fused_norm(self.matmul, x):
            out = cpu_norm.rms_norm(x.reshape(-1, x.shape[-1]), self.scale[...].astype(jnp.float32), self.eps)
            return out.reshape(x.shape)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)
