"""Pipeline parallelism over the ``stage`` mesh axis: the stacked decoder layers split across stages,
microbatches flowing through them, in SPMD form (one program; XLA moves the activations).

The stacked layers ``[layers, ...]`` are sharded over ``stage`` by the rule ``layers: [stage, ...]``,
so stage s holds a contiguous run of ``layers / stage`` layers: viewed as ``[stage, per_stage, ...]``,
nothing moves. Every iteration each stage runs its layers on its current microbatch (a ``vmap``
over the stage dimension with ``spmd_axis_name='stage'``, so each device computes its own stage and
the activation constraints inside keep their other axes), then the outputs shift one stage on (a
roll along the sharded stage dimension: XLA's collective permute).

Schedules (``pipeline.schedule``), S stages, M microbatches:

* ``gpipe`` (GPipe, Huang et al. 2019): M + S - 1 iterations, every forward, then (by autodiff of
  the loop) every backward. Bubble (S - 1) / (M + S - 1); activations of all M microbatches live
  until the backward.
* ``circular`` (interleaved; Narayanan et al. 2021, MaxText's "repeats"): each stage holds R
  (``pipeline.repeats``) non-adjacent chunks of layers and each microbatch goes round the ring R
  times: R*M + S - 1 iterations, bubble (S - 1) / (R*M + S - 1). The chunks are a strided view of
  the stored layers, so the stacked weights are resharded once per step (an all-to-all over
  ``stage``), never per microbatch. Needs M >= S.
* ``1f1b`` (PipeDream-flush, Narayanan et al. 2021): see :mod:`jaxtrain.parallel.pipeline_1f1b`.

The model code does not change: ``models/decoder.py`` runs its blocks through :func:`run` when a
pipeline is active (:func:`pipelined`, entered by the train step), with the per-example inputs
(positions, segment ids, masks) microbatched beside the activations.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.parallel.activations import active_sharding, constrain

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("jaxtrain_pipeline", default=None)

# (block, x [mb, length, embed], extras {name: [mb, length]}) -> (x, aux): one block applied.
BlockCall = Callable[[nnx.Module, jax.Array, dict], tuple[jax.Array, Any]]


@dataclass(frozen=True)
class Schedule:
    """What the active pipeline does: ``stages`` (mesh.stage), ``microbatches``, ``schedule``, ``repeats``."""

    stages: int
    microbatches: int
    schedule: str = "gpipe"
    repeats: int = 1

    @property
    def iterations(self) -> int:
        """Loop iterations of the forward pass (1f1b: forward and backward together)."""
        if self.schedule == "1f1b":
            return self.microbatches + 2 * self.stages - 2
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """The idle fraction of each stage: (S - 1) / (R*M + S - 1); for the lockstep 1F1B, whose
        every iteration holds a forward and a backward, (2S - 2) / (M + 2S - 2)."""
        if self.schedule == "1f1b":
            return (2 * self.stages - 2) / (self.microbatches + 2 * self.stages - 2)
        return (self.stages - 1) / (self.repeats * self.microbatches + self.stages - 1)

    @property
    def bubble_formula(self) -> str:
        S, M, R = self.stages, self.microbatches, self.repeats
        if self.schedule == "1f1b":
            return f"(2S-2)/(M+2S-2) = {2 * S - 2}/{M + 2 * S - 2}"
        return f"(S-1)/(R*M+S-1) = {S - 1}/{R * M + S - 1}"


@contextlib.contextmanager
def pipelined(schedule: Optional[Schedule]):
    """While tracing inside this context, the decoder's layers run as the pipeline ``schedule``
    (None, or one stage: as usual)."""
    token = _ACTIVE.set(schedule if schedule is not None and schedule.stages > 1 else None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_schedule() -> Optional[Schedule]:
    """The :class:`Schedule` of the enclosing :func:`pipelined` context, or None."""
    return _ACTIVE.get()


def schedule_of(cfg: Any, stages: int) -> Schedule:
    """The Schedule of a run config on ``stages`` stages."""
    return Schedule(stages, cfg.microbatches, cfg.pipeline.schedule, cfg.pipeline.repeats)


def run(layers: nnx.Module, x: jax.Array, extras: dict, call: BlockCall, remat_fn: Callable,
        schedule: Schedule) -> tuple[jax.Array, Any]:
    """x [batch, length, embed] through the stacked ``layers`` as ``schedule`` -> (x, each layer's aux
    stacked on a leading [layers] dim, averaged over the microbatches).

    ``extras``: per-example arrays [batch, ...] every block gets, microbatched with x (None
    values are left out). ``remat_fn(fn)``: the model's rematerialisation of one layer's call.
    """
    S, M, R = schedule.stages, schedule.microbatches, schedule.repeats
    graphdef, state = nnx.split(layers)
    n_layers = jax.tree_util.tree_leaves(state)[0].shape[0]
    chunk = n_layers // (S * R)
    circular = schedule.schedule == "circular"
    stage_state = jax.tree_util.tree_map(lambda w: _by_stage(w, S, R if circular else None, chunk), state)
    xs = _microbatches(x, M)
    ex = {k: _microbatches(v, M) for k, v in extras.items() if v is not None}

    def one_layer(h, layer_state, e):
        return call(nnx.merge(graphdef, layer_state), h, e)

    layer_fn = remat_fn(one_layer)

    def stage_fn(chunk_state, h, e):  # one stage's chunk of layers, scanned
        return jax.lax.scan(lambda c, st: layer_fn(c, st, e), h, chunk_state)

    if circular:
        ys, aux = _circular(stage_fn, stage_state, xs, ex, S, M, R)
    else:
        ys, aux = _gpipe(stage_fn, stage_state, xs, ex, S, M)
    y = ys.reshape(x.shape)
    lead = 3 if circular else 2  # [S, chunk] or [R, S, chunk] -> [layers]
    aux = None if aux is None else jax.tree_util.tree_map(lambda a: a.reshape(n_layers, *a.shape[lead:]), aux)
    return constrain(y, "batch", "residual_length", "embed"), aux


def _by_stage(w: jax.Array, S: int, R: Optional[int], chunk: int) -> jax.Array:
    """[layers, ...] -> [S, chunk, ...] (``R`` None) or [S, R, chunk, ...] (circular: layer
    (r*S + s)*chunk + c held by stage s), the stage dim on the ``stage`` axis."""
    if R is None:
        out = w.reshape(S, chunk, *w.shape[1:])
    else:
        out = w.reshape(R, S, chunk, *w.shape[1:]).swapaxes(0, 1)
    return _on_stage(out)


def _on_stage(w: jax.Array) -> jax.Array:
    """Constrains dim 0 of ``w`` to the ``stage`` axis, the other dims left to propagation."""
    active = active_sharding()
    if active is None:
        return w
    _, mesh = active
    spec = P("stage", *([P.UNCONSTRAINED] * (w.ndim - 1)))
    return jax.lax.with_sharding_constraint(w, NamedSharding(mesh, spec))


def _microbatches(v: jax.Array, M: int) -> jax.Array:
    """[batch, ...] -> [M, batch / M, ...] (microbatch m holds rows m*b..(m+1)*b-1)."""
    return v.reshape(M, v.shape[0] // M, *v.shape[1:])


def _pick(tree: Any, index: jax.Array) -> Any:
    """Each leaf [M, ...] at ``index`` [S] -> [S, ...] (stage s's microbatch)."""
    return jax.tree_util.tree_map(lambda a: jnp.take(a, index, axis=0), tree)


def _stage_vmap(stage_fn: Callable) -> Callable:
    return jax.vmap(stage_fn, spmd_axis_name="stage")


def _gpipe(stage_fn, stage_state, xs, ex, S: int, M: int):
    """The GPipe loop: returns (outputs [M, mb, ...], aux [S, chunk, ...] summed over microbatches / M)."""
    stages = jnp.arange(S)
    run_stages = _stage_vmap(stage_fn)

    def body(carry, t):
        state, outputs, aux_sum = carry
        mb = jnp.clip(t - stages, 0, M - 1)  # each stage's microbatch at iteration t
        valid = (t - stages >= 0) & (t - stages < M)
        inputs = state.at[0].set(xs[jnp.minimum(t, M - 1)])
        out, aux = run_stages(stage_state, _on_stage(inputs), _pick(ex, mb))
        out = _on_stage(out)
        done = t - (S - 1)  # the microbatch the last stage finished
        outputs = jnp.where(done >= 0, jax.lax.dynamic_update_index_in_dim(outputs, out[S - 1], jnp.maximum(done, 0),
                                                                          0), outputs)
        aux_sum = _add_valid(aux_sum, aux, valid)
        return (jnp.roll(out, 1, axis=0), outputs, aux_sum), None

    aux0 = _zeros_aux(stage_fn, stage_state, xs, ex, S)
    init = (_on_stage(jnp.zeros((S, *xs.shape[1:]), xs.dtype)), jnp.zeros_like(xs), aux0)
    (_, outputs, aux_sum), _ = jax.lax.scan(body, init, jnp.arange(M + S - 1))
    return outputs, _mean_aux(aux_sum, M)


def _circular(stage_fn, stage_state, xs, ex, S: int, M: int, R: int):
    """The circular loop: slot k = t - s of stage s is microbatch k % M at repeat k // M."""
    stages = jnp.arange(S)

    def stage_at(chunks, h, e, r):  # the stage's chunk for repeat r
        return stage_fn(jax.tree_util.tree_map(lambda a: a[r], chunks), h, e)

    run_stages = _stage_vmap(stage_at)

    def body(carry, t):
        state, loop, outputs, aux_sum = carry
        slot = t - stages
        valid = (slot >= 0) & (slot < R * M)
        slot = jnp.clip(slot, 0, R * M - 1)
        mb, rep = slot % M, slot // M
        first = jnp.where(rep[0] == 0, xs[mb[0]], loop[mb[0]])  # stage 0: a new microbatch, or one coming round
        inputs = state.at[0].set(first)
        out, aux = run_stages(stage_state, _on_stage(inputs), _pick(ex, mb), rep)
        out = _on_stage(out)
        last_ok, last_mb, last_rep = valid[S - 1], mb[S - 1], rep[S - 1]
        back = jnp.where(last_ok, jax.lax.dynamic_update_index_in_dim(loop, out[S - 1], last_mb, 0), loop)
        finished = last_ok & (last_rep == R - 1)
        outputs = jnp.where(finished, jax.lax.dynamic_update_index_in_dim(outputs, out[S - 1], last_mb, 0), outputs)
        aux_sum = _add_valid(aux_sum, aux, valid, rep, R)
        return (jnp.roll(out, 1, axis=0), back, outputs, aux_sum), None

    aux0 = _zeros_aux(stage_at, stage_state, xs, ex, S, R)
    zeros = jnp.zeros((S, *xs.shape[1:]), xs.dtype)
    init = (_on_stage(zeros), jnp.zeros_like(xs), jnp.zeros_like(xs), aux0)
    (_, _, outputs, aux_sum), _ = jax.lax.scan(body, init, jnp.arange(R * M + S - 1))
    # [S, R, chunk, ...] -> [R, S, chunk, ...]: layer (r*S + s)*chunk + c in order
    aux = None if aux_sum is None else jax.tree_util.tree_map(lambda a: a.swapaxes(0, 1), aux_sum)
    return outputs, _mean_aux(aux, M)


def _zeros_aux(fn, stage_state, xs, ex, S: int, R: Optional[int] = None):
    """Zeros shaped like the vmapped stage's aux (None when the blocks return none); with ``R``,
    one per repeat: [S, R, chunk, ...]."""
    args = (stage_state, jnp.zeros((S, *xs.shape[1:]), xs.dtype), _pick(ex, jnp.zeros((S,), jnp.int32)))
    if R is not None:
        args = (*args, jnp.zeros((S,), jnp.int32))
    _, aux = jax.eval_shape(_stage_vmap(fn), *args)
    if aux is None:
        return None
    if R is not None:
        return jax.tree_util.tree_map(lambda a: jnp.zeros((a.shape[0], R, *a.shape[1:]), a.dtype), aux)
    return jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), aux)


def _add_valid(acc, aux, valid, rep=None, R: Optional[int] = None):
    """acc + aux where the stage's slot was a real microbatch (by repeat when ``R``)."""
    if acc is None:
        return None

    def add(a, x):
        keep = valid.reshape(-1, *([1] * (x.ndim - 1)))
        x = jnp.where(keep, x, 0).astype(a.dtype)
        if R is None:
            return a + x
        onehot = jax.nn.one_hot(rep, R, dtype=a.dtype).reshape(-1, R, *([1] * (x.ndim - 1)))
        return a + onehot * x[:, None]
    return jax.tree_util.tree_map(add, acc, aux)


def _mean_aux(aux, M: int):
    return None if aux is None else jax.tree_util.tree_map(lambda a: a / M, aux)
