"""AdamW with global-norm clipping and a warmup-cosine learning rate (``optimizer.*`` keys)."""
from __future__ import annotations

import jax
import optax

from jaxtrain.config import Config


def lr_schedule(cfg: Config) -> optax.Schedule:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine to ``min_lr`` at ``decay_steps`` (1/step)."""
    o = cfg.optimizer
    base = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=o.lr, warmup_steps=o.warmup_steps,
        decay_steps=max(cfg.decay_steps, o.warmup_steps + 1), end_value=o.min_lr)
    # Step s (0-based) trains with base(s + 1), so the first step already moves (nanoGPT's get_lr).
    return lambda count: base(count + 1)


def optimizer(cfg: Config, param_axes) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW (Loshchilov & Hutter 2019).

    Weight decay applies to matrices only: parameters with two or more logical dimensions
    besides a stacked ``layers`` dim (``param_axes``: the params' pytree of logical-name tuples).
    """
    o = cfg.optimizer
    decay = jax.tree_util.tree_map(lambda axes: sum(a != "layers" for a in axes) >= 2, param_axes,
                                   is_leaf=lambda x: isinstance(x, tuple))
    return optax.chain(
        optax.clip_by_global_norm(o.clip_norm),
        optax.adamw(lr_schedule(cfg), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay))


def applied_count(opt_state) -> jax.Array:
    """How many updates the optimizer has applied: the learning-rate schedule's own step (a skipped
    non-finite step does not advance it, so ``lr_schedule(cfg)(applied_count(opt_state))`` is the
    rate the next update will use)."""
    is_count = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
    return next(s.count for s in jax.tree_util.tree_leaves(opt_state, is_leaf=is_count) if is_count(s))
