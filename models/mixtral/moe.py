"""The sparse MoE MLP of the mixtral family: router, top-k, experts, and the router losses.

Router (Mixtral, Jiang et al. 2024; HF ``MixtralSparseMoeBlock``): logits = x W_r in float32,
p = softmax(logits) over the experts, the top-k experts per token, and their k probabilities
renormalised to sum to 1 as the combine weights. The experts run in
:func:`jaxtrain.moe.experts.routed_experts` (dropless or capacity, expert-parallel when the
rules shard ``exp``).

Losses, over the T tokens of the batch (all positions):
  * load balancing (Switch Transformer, Fedus et al. 2022, eq. 4, with top-k as in GShard):
    ``aux = E * sum_e f_e * P_e``, f_e = the fraction of the T*k routed copies sent to expert e,
    P_e = the mean router probability of e. 1.0 when perfectly balanced. (HF's
    ``load_balancing_loss_func`` sums over the k choices, so it equals ``top_k * aux``.)
  * router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): ``z = mean_tokens(logsumexp(logits)^2)``.
"""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.models.layers import param, project
from jaxtrain.models.mixtral.config import MixtralConfig
from jaxtrain.moe.experts import routed_experts, top_k
from jaxtrain.parallel.activations import constrain


def capacity_slots(idx: jax.Array, n_experts: int, valid: jax.Array) -> jax.Array:
    """Slot of each copy in its expert's buffer, per sequence: idx [batch, length, k] -> same, int32.

    Priority as in GShard: every token's first choice, in position order, before any second choice.
    Copies of padding (``valid`` [batch, length] False) take no slot: theirs is ``length * k``,
    past any capacity.
    """
    b, t, k = idx.shape
    order = idx.swapaxes(1, 2).reshape(b, k * t)  # choice-major
    real = jnp.broadcast_to(valid[:, None, :], (b, k, t)).reshape(b, k * t)
    taken = jnp.cumsum(jax.nn.one_hot(order, n_experts, dtype=jnp.int32) * real[..., None], axis=1) - 1
    slot = jnp.where(real, jnp.take_along_axis(taken, order[..., None], axis=-1)[..., 0], k * t)
    return slot.reshape(b, k, t).swapaxes(1, 2)


def router_losses(logits: jax.Array, probs: jax.Array, idx: jax.Array,
                  valid: Optional[jax.Array] = None) -> dict[str, jax.Array]:
    """logits, probs [..., E] float32; idx [..., k]; valid [...] bool (padding: False; None: all real)
    -> {'aux', 'z' (scalars), 'frac' [E]} over the real tokens only (see module doc)."""
    n_exp, k = logits.shape[-1], idx.shape[-1]
    w = jnp.ones(idx.shape[:-1], jnp.float32).reshape(-1) if valid is None else valid.reshape(-1).astype(jnp.float32)
    n = jnp.maximum(w.sum(), 1.0)
    copies = jax.nn.one_hot(idx.reshape(-1, k), n_exp, dtype=jnp.float32).sum(1)  # [T, E]
    frac = (copies * w[:, None]).sum(0) / (n * k)  # over the T*k copies of real tokens
    mean_prob = (probs.reshape(-1, n_exp) * w[:, None]).sum(0) / n
    z = (jnp.square(jax.nn.logsumexp(logits, axis=-1)).reshape(-1) * w).sum() / n
    return {"aux": n_exp * jnp.sum(frac * mean_prob), "z": z, "frac": frac}


class MoE(nnx.Module):
    """Sparse MoE SwiGLU MLP. x [batch, length, embed] -> (y [batch, length, embed], stats).

    Parameters: router [embed, E]; w_gate, w_up [exp, embed, mlp]; w_down [exp, mlp, embed].
    stats: {'aux', 'z', 'dropped' (fraction of copies dropped): scalars, 'frac': [E]}.
    """

    def __init__(self, cfg: MixtralConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        d, f, e, pd = cfg.d_model, cfg.d_ff, cfg.n_experts, cfg.param_dtype
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.router = param(rngs, (d, e), ("embed", None), cfg.init_std, pd)
        self.w_gate = param(rngs, (e, d, f), ("exp", "embed", "mlp"), cfg.init_std, pd)
        self.w_up = param(rngs, (e, d, f), ("exp", "embed", "mlp"), cfg.init_std, pd)
        self.w_down = param(rngs, (e, f, d), ("exp", "mlp", "embed"), out_std, pd)

    def __call__(self, x: jax.Array, mask: Optional[jax.Array] = None) -> tuple[jax.Array, dict]:
        """``mask`` [batch, length] (0: padding; None: every token is real): padding is routed nowhere,
        takes no capacity, is not counted as dropped and is left out of the router losses."""
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        x = constrain(x, "batch", "length", "embed")
        valid = jnp.ones(x.shape[:2], bool) if mask is None else mask.astype(bool)
        logits = project(x.astype(jnp.float32), self.router[...].astype(jnp.float32),
                         implementation=cfg.matmul)  # [b, t, E]
        probs = jax.nn.softmax(logits, axis=-1)
        top, idx = top_k(probs, cfg.top_k)
        combine = jnp.where(valid[..., None], top / top.sum(-1, keepdims=True), 0.0)
        stats = router_losses(logits, probs, idx, valid)
        slots, capacity = None, None
        real_copies = jnp.broadcast_to(valid[..., None], idx.shape)
        if cfg.routing == "capacity":
            capacity = cfg.capacity(x.shape[1])  # the buffers' slots: the (padded) length's
            slots = capacity_slots(idx, cfg.n_experts, valid)
            # Each sequence has the capacity of its real tokens: the same tokens drop the same copies
            # however far they are padded (sized from the padded length, 8 real tokens dropped 0.375 of
            # their copies alone and none padded to 16). A copy past its own capacity goes past the buffers.
            table = jnp.asarray([cfg.capacity(n) if n else 0 for n in range(x.shape[1] + 1)], slots.dtype)
            own = table[valid.sum(1)]  # [b]: cfg.capacity of each sequence's real tokens, exactly
            slots = jnp.where(slots < own[:, None, None], slots, capacity)
            dropped = (slots >= capacity) & real_copies
            stats["dropped"] = dropped.sum() / jnp.maximum(real_copies.sum(), 1)
        else:
            stats["dropped"] = jnp.zeros((), jnp.float32)
            idx = jnp.where(real_copies, idx, cfg.n_experts)  # expert E: no expert, never dispatched
        y = routed_experts(x, idx.astype(jnp.int32), combine, self.w_gate[...].astype(dt),
                           self.w_up[...].astype(dt), self.w_down[...].astype(dt), slots, capacity,
                           cfg.grouped_matmul)
        return y, stats
