"""A run plan's evaluation and sampling programs: one validation micro-batch, every validation batch in
one program, and the model's forward pass for the end-of-run sample."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxtrain.parallel import offload

EVAL_GROUP_TOKENS = 4096


def eval_group(n_batches: int, batch_tokens: int) -> int:
    """How many validation batches the evaluation runs side by side (a ``jax.vmap`` inside its scan):
    the largest divisor of ``n_batches`` whose batches hold at most :data:`EVAL_GROUP_TOKENS` tokens
    together, else 1. Each batch's values are its own, as one by one (the same ops per batch).

    Why: XLA:CPU runs the matmuls of a small batch (the shakespeare config's 12 x 64 tokens) far
    from its peak; 5 of them side by side took its 40-batch evaluation from ~0.52 to ~0.45 s
    (9 alternated rounds, AMD EPYC). The bound keeps the group's activations small."""
    most = min(n_batches, max(1, EVAL_GROUP_TOKENS // max(1, batch_tokens)))
    return max(g for g in range(1, most + 1) if n_batches % g == 0)


EVAL_PIECES = 32  # at most: an evaluation is cut into this many programs, each a point to stop at


def eval_piece(n_batches: int, group: int) -> int:
    """The validation batches in each of an evaluation's programs: a multiple of ``group`` (the batches
    run side by side, :func:`eval_group`) that divides ``n_batches``, giving at most :data:`EVAL_PIECES`
    programs, and as many as that allows. One length for all: one compiled program.

    Why: a preemption that comes during an evaluation must not wait for the whole validation set
    (its grace period is the save's): the loop looks for a stop between pieces and, when one is
    agreed, abandons the evaluation and saves the finished step. One program per piece, never one
    per batch: a long validation set never floods the devices' queue (XLA:CPU deadlocks on ~100
    unread multi-device programs in flight). A count with no such divisor (a prime) stays one program.
    """
    groups = n_batches // group
    return group * min(d for d in range(1, groups + 1) if groups % d == 0 and groups // d <= EVAL_PIECES)


class Functions(NamedTuple):
    """``eval_step``: (params, {field: [micro, ...]}) -> {'loss', 'weight', <aux metrics>};
    ``evaluate``: (params, {field: [n_batches, micro, ...]}) -> the same, each [n_batches];
    ``apply``: (params, inputs) -> the model's output (logits for sampling);
    ``piece``: n_batches -> the batches each evaluation program holds (:func:`eval_piece`)."""

    eval_step: Callable
    evaluate: Callable
    apply: Callable
    piece: Callable[[int], int]


def functions(plan: Any, model: Any, tracing: Callable) -> Functions:
    """The evaluation functions of ``model`` (a :class:`jaxtrain.train.step.Model`) under ``plan``, traced
    inside ``tracing(plan)``; the sample's forward pass outside the run's sharding (a [1, length] window
    that the batch axes cannot split), so its kernels are chosen per call."""
    cfg, spec = plan.cfg, model.spec

    def eval_fn(params, batch):
        with tracing(plan):
            loss, aux = model.loss(offload.for_forward(params, plan.offload), batch)
        if spec.eval_loss is not None:  # e.g. a MoE's cross-entropy; the router losses keep their columns
            loss = aux.pop(spec.eval_loss)
        aux.setdefault("weight", jnp.ones((), jnp.float32))
        return {"loss": loss, **aux}

    side_by_side = plan.mesh.size == 1 and plan.schedule.stages == 1 and not (plan.offload.state
                                                                               or plan.offload.activations)

    def evaluate(params, batches):
        """Every validation batch in one program (a scan): one dispatch per evaluation, so a long
        validation set never floods the devices' queue (XLA:CPU deadlocks on ~100 unread multi-device
        programs in flight); the per-batch values come back for the host's float64 weighted mean.
        On one device, small batches go through the scan in groups (see :func:`eval_group`), or one at a
        time where the model has an op JAX cannot vmap."""
        n = jax.tree_util.tree_leaves(batches)[0].shape[0]
        g = eval_group(n, cfg.micro_batch * cfg.data.seq_len) if side_by_side else 1
        if g > 1:
            grouped = jax.tree_util.tree_map(lambda x: x.reshape(n // g, g, *x.shape[1:]), batches)
            try:
                out = jax.lax.scan(lambda carry, b: (carry, jax.vmap(eval_fn, (None, 0))(params, b)), None,
                                   grouped)[1]
                return jax.tree_util.tree_map(lambda x: x.reshape(n, *x.shape[2:]), out)
            except NotImplementedError:  # an op JAX cannot vmap (JAX 0.10's ragged_dot): one batch at a time
                pass
        return jax.lax.scan(lambda carry, b: (carry, eval_fn(params, b)), None, batches)[1]

    def apply(params, inputs):
        with tracing(plan, sharded=False):
            return model.of(offload.for_forward(params, plan.offload))(inputs)

    def piece(n_batches: int) -> int:
        return eval_piece(n_batches, eval_group(n_batches, cfg.micro_batch * cfg.data.seq_len) if side_by_side else 1)

    return Functions(eval_fn, evaluate, apply, piece)
