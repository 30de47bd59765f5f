"""The 1F1B pipeline schedule (PipeDream-flush; Narayanan et al. 2021), in SPMD form: activation
memory bounded by the number of stages, not by the number of microbatches.

GPipe differentiates its loop, so every microbatch's activations live until the backward. Here
the forward and the backward run in one loop of M + 2S - 2 iterations. At iteration t, stage s runs
the forward of microbatch t - s and the backward of microbatch t - (2S - 2 - s): each iteration,
every stage does one forward and one backward (lockstep), the last stage computing the loss of the
microbatch it just finished and its backward in the same iteration. A stage keeps only its input
of the microbatches between their forward and their backward (at most 2S - 1, a ring buffer) and
recomputes the rest in its backward (``jax.vjp`` of the stage). Activations pass on to the next
stage, gradients back to the previous one, both as rolls along the sharded stage dimension.

The price of lockstep: the bubble is (2S - 2) / (M + 2S - 2) of each iteration's forward and
backward, against GPipe's (S - 1) / (M + S - 1); with M >> S both vanish, and the memory stays
bounded. It is a ``jax.custom_vjp`` over the whole loss: its forward computes the loss and every gradient
at once (the embedding's and the head's too, and a MoE's router losses through each stage's aux),
and its backward scales those gradients by the incoming cotangent. The trainer uses it for the
gradients only; evaluation runs the GPipe forward (``jaxtrain.parallel.pipeline``).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.parallel.pipeline import Schedule, _by_stage, _microbatches, _on_stage, _pick, _stage_vmap


def loss_and_grads(build: Callable, head_loss: Callable, schedule: Schedule, params: dict,
                   batch: dict) -> tuple[jax.Array, dict, dict]:
    """(loss, metrics, grads of ``params``) of one micro-batch under the 1F1B schedule.

    ``build(params) -> model`` (a shared-decoder model in the model dtypes); ``head_loss(model,
    logits, blocks' aux [layers, ...], microbatch) -> (loss, metrics with 'weight')``. The loss is
    the microbatches' losses weighted by their ``weight`` (loss-mask tokens), as one micro-batch's.
    """
    S, M = schedule.stages, schedule.microbatches
    model = build(params)
    l_graph, l_state = nnx.split(model.layers)
    n_layers = jax.tree_util.tree_leaves(l_state)[0].shape[0]
    chunk = n_layers // S
    stage_state = jax.tree_util.tree_map(lambda w: _by_stage(w, S, None, chunk), l_state)
    rest = {k: v for k, v in params.items() if k != "layers"}

    def with_rest(r):
        return build({**r, "layers": params["layers"]})

    def stage_fn(chunk_state, h, e):
        return jax.lax.scan(lambda c, st: model.block_call(nnx.merge(l_graph, st), c, e), h, chunk_state)

    x, embed_vjp = jax.vjp(lambda r: with_rest(r).embed_tokens(batch["inputs"]), rest)
    xs = _microbatches(x, M)
    mbs = {k: _microbatches(v, M) for k, v in batch.items()}
    ex = {k: _microbatches(v, M) for k, v in model.block_inputs(batch).items() if v is not None}
    weights = mbs["loss_mask"].reshape(M, -1).sum(-1).astype(jnp.float32)
    scale = weights / jnp.maximum(weights.sum(), 1.0)

    def tail(r, h, aux, mb):
        return head_loss(with_rest(r), with_rest(r).head(h), aux, mb)

    out = _loop(stage_fn, stage_state, tail, rest, xs, ex, mbs, scale, S, M, n_layers)
    (loss, metrics, d_stage, d_rest_tail, dxs) = out
    (d_rest_embed,) = embed_vjp(dxs.reshape(x.shape).astype(x.dtype))
    d_layers = jax.tree_util.tree_map(lambda g: g.reshape(n_layers, *g.shape[2:]), d_stage)
    grads = {**jax.tree_util.tree_map(jnp.add, d_rest_embed, d_rest_tail), "layers": nnx.to_pure_dict(d_layers)}
    metrics["weight"] = weights.sum()
    return loss, metrics, grads


def _loop(stage_fn, stage_state, tail, rest, xs, ex, mbs, scale, S: int, M: int, n_layers: int):
    """The lockstep 1F1B loop; see the module docstring. Returns (loss, metrics, stage grads, the
    head's grads of ``rest``, cotangents of the stage-0 inputs [M, mb, ...])."""
    K = 2 * S - 1  # ring-buffer slots per stage: the microbatches between a forward and its backward
    stages = jnp.arange(S)
    chunk = n_layers // S
    fwd = _stage_vmap(stage_fn)

    def bwd_one(p, h, e, ct_h, ct_aux):
        _, vjp = jax.vjp(lambda p_, h_: stage_fn(p_, h_, e), p, h)
        return vjp((ct_h, ct_aux))

    bwd = _stage_vmap(bwd_one)
    aux_shape = jax.eval_shape(fwd, stage_state, jnp.zeros((S, *xs.shape[1:]), xs.dtype), _pick(ex, stages * 0))[1]
    zeros_path = None if aux_shape is None else jax.tree_util.tree_map(
        lambda a: jnp.zeros((S, n_layers, *a.shape[2:]), a.dtype), aux_shape)
    metric_shape = jax.eval_shape(tail, rest, xs[0], _path_of(zeros_path, 0), _pick(mbs, jnp.int32(0)))[1]

    def body(carry, t):
        h_f, path, h_b, d_path, stash, g_stage, g_rest, dxs, loss, metrics = carry
        # Forward: stage s runs microbatch t - s.
        f_mb = t - stages
        f_ok = (f_mb >= 0) & (f_mb < M)
        f_mb = jnp.clip(f_mb, 0, M - 1)
        inp = _on_stage(h_f.at[0].set(xs[f_mb[0]]))
        stash = jax.vmap(lambda buf, x, i, ok: jnp.where(ok, buf.at[i % K].set(x), buf))(stash, inp, f_mb, f_ok)
        out, aux = fwd(stage_state, inp, _pick(ex, f_mb))
        out = _on_stage(out)
        path = _write_path(path, aux, stages, chunk)
        # The last stage's microbatch: its loss now, and the cotangents its backward starts from.
        m = f_mb[S - 1]
        (l_m, met_m), tail_vjp = jax.vjp(lambda r, h, a: tail(r, h, a, _pick(mbs, m)), rest, out[S - 1],
                                         _path_of(path, S - 1))
        c = jnp.where(f_ok[S - 1], scale[m], 0.0)
        d_r, d_h, d_a = tail_vjp((c, jax.tree_util.tree_map(jnp.zeros_like, met_m)))
        g_rest = jax.tree_util.tree_map(jnp.add, g_rest, d_r)
        loss = loss + c * l_m
        metrics = jax.tree_util.tree_map(lambda acc, v: acc + c * v, metrics, _metrics_only(met_m))
        # Backward: stage s runs microbatch t - (2S - 2 - s), from its stashed input.
        b_mb = t - (2 * S - 2 - stages)
        b_ok = (b_mb >= 0) & (b_mb < M)
        b_mb = jnp.clip(b_mb, 0, M - 1)
        ct_h = _on_stage(h_b.at[S - 1].set(d_h.astype(h_b.dtype)))
        d_path = None if d_path is None else jax.tree_util.tree_map(lambda dp, da: dp.at[S - 1].set(da), d_path, d_a)
        saved = jax.vmap(lambda buf, i: buf[i % K])(stash, b_mb)
        d_p, d_in = bwd(stage_state, _on_stage(saved), _pick(ex, b_mb), ct_h, _chunk_of(d_path, stages, chunk))
        keep = lambda a, g: a + jnp.where(b_ok.reshape(-1, *([1] * (g.ndim - 1))), g, 0).astype(a.dtype)  # noqa: E731
        g_stage = jax.tree_util.tree_map(keep, g_stage, d_p)
        dxs = jnp.where(b_ok[0], jax.lax.dynamic_update_index_in_dim(dxs, d_in[0].astype(dxs.dtype), b_mb[0], 0), dxs)
        roll_b = lambda a: jnp.roll(a, -1, axis=0)  # noqa: E731 - stage s -> s - 1
        carry = (jnp.roll(out, 1, axis=0), _roll(path, 1), _on_stage(roll_b(d_in)), _roll(d_path, -1), stash,
                 g_stage, g_rest, dxs, loss, metrics)
        return carry, None

    zeros_like_f32 = lambda tree: jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)  # noqa: E731
    h0 = _on_stage(jnp.zeros((S, *xs.shape[1:]), xs.dtype))
    init = (h0, zeros_path, h0, zeros_path, jnp.zeros((S, K, *xs.shape[1:]), xs.dtype),
            zeros_like_f32(stage_state), zeros_like_f32(rest), jnp.zeros(xs.shape, jnp.float32),
            jnp.zeros((), jnp.float32), zeros_like_f32(_metrics_only(metric_shape)))
    carry, _ = jax.lax.scan(body, init, jnp.arange(M + 2 * S - 2))
    _, _, _, _, _, g_stage, g_rest, dxs, loss, metrics = carry
    return loss, metrics, g_stage, g_rest, dxs


def _metrics_only(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k != "weight"}


def _write_path(path, aux, stages, chunk: int):
    """Each stage writes its layers' aux [S, chunk, ...] into the path it carries [S, layers, ...]."""
    if path is None:
        return None

    def write(p, a):
        return jax.vmap(lambda row, x, s: jax.lax.dynamic_update_slice_in_dim(row, x.astype(row.dtype), s * chunk, 0))(
            p, a, stages)
    return jax.tree_util.tree_map(write, path, aux)


def _chunk_of(d_path, stages, chunk: int):
    """Each stage's slice [S, chunk, ...] of the aux cotangents it carries [S, layers, ...]."""
    if d_path is None:
        return None
    return jax.tree_util.tree_map(
        lambda p: jax.vmap(lambda row, s: jax.lax.dynamic_slice_in_dim(row, s * chunk, chunk, 0))(p, stages), d_path)


def _path_of(path, s: int):
    return None if path is None else jax.tree_util.tree_map(lambda p: p[s], path)


def _roll(tree, shift: int):
    return None if tree is None else jax.tree_util.tree_map(lambda a: jnp.roll(a, shift, axis=0), tree)


def pipelined_loss(build: Callable, head_loss: Callable, schedule: Schedule, params: dict,
                   batch: dict) -> tuple[jax.Array, dict]:
    """(loss, metrics) of ``batch`` whose gradient with respect to ``params`` is the 1F1B schedule's: a
    custom VJP whose forward computes every gradient and whose backward scales them by the loss's
    cotangent. ``batch`` is closed over (never differentiated)."""

    @jax.custom_vjp
    def f(p):
        loss, metrics, _ = loss_and_grads(build, head_loss, schedule, p, batch)
        return loss, metrics

    def f_fwd(p):
        loss, metrics, grads = loss_and_grads(build, head_loss, schedule, p, batch)
        return (loss, metrics), jax.tree_util.tree_map(lambda g, x: g.astype(x.dtype), grads, p)

    def f_bwd(grads, cotangents):
        g_loss = cotangents[0]
        return (jax.tree_util.tree_map(lambda g: (g * g_loss).astype(g.dtype), grads),)

    f.defvjp(f_fwd, f_bwd)
    return f(params)


def stash_bytes(schedule: Schedule, microbatch_activation_bytes: int) -> int:
    """The activation memory a 1F1B stage keeps: 2S - 1 stashed stage inputs (bytes per device)."""
    return (2 * schedule.stages - 1) * microbatch_activation_bytes


