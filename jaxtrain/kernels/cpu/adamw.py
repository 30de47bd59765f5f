"""The train step's guarded AdamW update through one XLA:CPU kernel (``adamw.cc``): the gradients'
global norm, the non-finite guard, clipping and AdamW over every parameter in one call, under
``optimizer.implementation`` ``cpu_fused`` (and ``auto`` where that picks it;
:func:`jaxtrain.train.optimizer.implementation`). PyTorch's ``Adam(fused=True)`` and torchtitan's
``optimizer.implementation=fused`` are the same idea.

Why: XLA:CPU ran the update as a fusion per parameter and moment inside a conditional, and the norm as
a reduction per gradient: ~100 small thunks, ~1 ms of the ~20 ms shakespeare-char step on a 2-core
Intel Xeon. The kernel makes two passes (the norm, then the update) over chunks of every leaf on both
threads, in place (its results alias the donated state).

Given the same norm, its params and moments are optax's (``jaxtrain.train.optimizer.optimizer``) bit
for bit as the trainer compiles them (``adamw.cc`` says how); the norm itself differs from
``optax.tree.norm`` by float rounding (its sums run in another order). The optimizer state keeps
optax's structure, so checkpoints do not depend on the choice.
"""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax._src import numerics

from jaxtrain.kernels.cpu import library


def placement_problem(platform: str, devices: int, host_state: bool) -> Optional[str]:
    """Why the kernel cannot run where the config places the update, or None: another backend, more than
    one device (its custom call is opaque to XLA's partitioner), or the state in host memory
    (``offload.optimizer``, ``offload.params``). Shared by the config's check and the step's."""
    if platform != "cpu":
        return f"an XLA:CPU kernel; the backend is '{platform}'"
    if devices > 1:
        return f"runs on one device, here {devices}"
    if host_state:
        return "the state lives in host memory (offload.optimizer or offload.params)"
    return None


def _is_adam(x) -> bool:
    return isinstance(x, optax.ScaleByAdamState)


def guarded_update(h: dict, decay: Any, count: jax.Array, loss: jax.Array, grads: Any, params: Any,
                   opt_state: Any, lr: jax.Array) -> tuple[Any, Any, jax.Array, jax.Array]:
    """One guarded AdamW update: ``(params, opt_state, grad_norm, finite)``.

    Args:
      h: the step's hyperparameters (:func:`jaxtrain.train.optimizer.hyperparameters`).
      decay: the params' pytree of bools, True where weight decay applies.
      count: int32[], updates applied so far (Adam's count); loss: float32[], the step's loss.
      grads, params: float32 pytrees of the same structure and shapes.
      opt_state: :func:`jaxtrain.train.optimizer.optimizer`'s state, float32 moments.
      lr: float32[], this update's learning rate.
    Returns:
      The updated params and state (unchanged where ``finite`` is false, Adam's count included), the
      gradients' global L2 norm (float32[]) and whether the loss and that norm are finite (bool[]).
    Raises:
      RuntimeError: the kernel is not available (:func:`jaxtrain.kernels.cpu.library.problem`).
      ValueError: a leaf that is not float32.
    """
    why = library.problem()
    if why:
        raise RuntimeError(f"optimizer.implementation=cpu_fused: {why}")
    adam = next(s for s in jax.tree_util.tree_leaves(opt_state, is_leaf=_is_adam) if _is_adam(s))
    leaves, treedef = jax.tree_util.tree_flatten(params)
    flat = [leaves, treedef.flatten_up_to(grads), treedef.flatten_up_to(adam.mu), treedef.flatten_up_to(adam.nu)]
    for group in flat:
        for x in group:
            if x.dtype != jnp.float32:
                raise ValueError(f"optimizer.implementation=cpu_fused takes float32 params, gradients and moments; "
                                 f"got {x.dtype}{list(x.shape)}")
    count_inc = numerics.safe_increment(count)
    # optax's scale_by_adam: its bias corrections, computed as it does (so the same bits)
    bc1, bc2 = 1 - h["b1"] ** count_inc, 1 - h["b2"] ** count_inc
    hyper = jnp.stack([jnp.asarray(v, jnp.float32) for v in (loss, lr, h["b1"], h["b2"], h["eps"],
                                                             h["weight_decay"], h["clip_norm"], bc1, bc2)])
    n = len(leaves)
    out_types = [jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in leaves] * 3
    out = jax.ffi.ffi_call(library.ADAMW, (*out_types, jax.ShapeDtypeStruct((), jnp.float32)),
                           input_output_aliases={1 + i: i for i in range(n)}
                           | {1 + 2 * n + i: n + i for i in range(2 * n)})(
        hyper, *flat[0], *flat[1], *flat[2], *flat[3],
        decay=np.asarray(treedef.flatten_up_to(decay), np.int32))
    new_params, mu, nu, norm = out[:n], out[n:2 * n], out[2 * n:3 * n], out[3 * n]
    finite = jnp.isfinite(loss) & jnp.isfinite(norm)
    new_adam = adam._replace(count=jnp.where(finite, count_inc, count), mu=treedef.unflatten(mu),
                             nu=treedef.unflatten(nu))
    new_state = jax.tree_util.tree_map(lambda s: new_adam if _is_adam(s) else s, opt_state, is_leaf=_is_adam)
    return treedef.unflatten(new_params), new_state, norm, finite
