"""The sharded initialisation and the one pure, jitted train step of a run plan, for any ModelSpec.

:func:`build` turns a :class:`jaxtrain.train.plan.RunPlan` (the state layout, shardings, offload,
pipeline schedule and kernel choices, all resolved) into jitted functions. Parameters are created
directly in their sharded layout (the init is jitted with ``out_shardings``), so no device ever holds
the whole model. The step is jitted once with explicit in/out shardings and donated state. The
optimizer's hyperparameters are a traced third argument (``jaxtrain.train.optimizer``), so a new
learning rate, schedule, betas, weight decay or clip never recompiles. The evaluation and sampling
programs are :mod:`jaxtrain.train.evaluation`'s.

Mixed precision: when the model declares low-precision floating parameters (e.g.
``model.param_dtype=bfloat16``) and ``optimizer.master_weights`` is true (the default), the
state holds float32 master copies and float32 Adam moments, and the model sees the params
cast to its declared dtypes inside the step (MaxText's weight_dtype/dtype split; apex's
master weights). Otherwise bf16 rounding swallows updates smaller than the weight's ulp.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.errors import ConfigError
from jaxtrain.kernels import context, ops
from jaxtrain.parallel import offload
from jaxtrain.parallel.activations import activation_sharding
from jaxtrain.parallel.pipeline import pipelined
from jaxtrain.parallel.pipeline_1f1b import pipelined_loss
from jaxtrain.train import evaluation
from jaxtrain.train.model_spec import ModelSpec
from jaxtrain.train.optimizer import applied_count, decay_mask, hyperparameters, learning_rate, optimizer
from jaxtrain.train.plan import RunPlan
from jaxtrain.train.state import count_params, param_tree  # noqa: F401 (the step's public names before)


@dataclass
class StepFunctions:
    """The jitted functions and shardings of one (config, mesh, rules, model)."""

    state_shardings: Any
    state_structure: Any  # the train state's PyTreeDef (its leaves: the init program's outputs, in order)
    batch_sharding: NamedSharding  # of every [grad_accum, micro_batch, ...] field of a batch dict
    param_axes: Any  # the params' pytree of logical-name tuples
    init: Callable  # () -> state
    train_step: "TrainStep"  # (state, {field: [accum, micro, ...]}[, hparams]) -> (state, metrics)
    grads: Callable  # (params, batch) -> (loss, aux metrics, grads): the step's gradient, without the update
    eval_step: Callable  # (params, {field: [micro, ...]}) -> {'loss', 'weight', <aux metrics>}
    evaluate: Callable  # (params, {field: [n_batches, micro, ...]}) -> {'loss', 'weight', ...: [n_batches]}
    eval_piece: Callable  # n_batches -> the batches each evaluation program holds (evaluation.eval_piece)
    apply: Callable  # (params, inputs) -> model(inputs), e.g. logits [batch, length, vocab] for sampling
    model_dtypes: Any  # the params' pytree of the dtypes the model declares (the stored ones may be float32)
    low_precision: list  # paths of low-precision parameters trained without float32 masters (a warning)
    train_step_options: dict  # the train step's own XLA compiler options (runtime.xla_flags.train_step_options)

    def model_params(self, params: Any) -> Any:
        """``params`` in the dtypes the model declares (e.g. bf16 for export), from float32 masters."""
        return jax.tree_util.tree_map(lambda x, dt: x.astype(dt), params, self.model_dtypes)


class TrainStep:
    """A jitted (or lowered, or compiled) train step with the config's hyperparameters bound as its
    third argument: ``step(state, batch)`` uses them, ``step(state, batch, hparams)`` others (a
    dict like ``optimizer.hyperparameters(cfg)``: the same compiled code). ``lower(...).compile()``
    keeps them bound; anything else (``as_text``, ``memory_analysis``) is the wrapped object's.
    ``plain``: the same jitted step without its XLA compiler options, for ``jax.export`` (the program
    cache), which traces it inside another jit, where JAX refuses them.
    ``check(batch)``: run once, before the first call or lowering, outside any trace (a named error
    that needs the batch's shapes)."""

    def __init__(self, inner: Any, hparams: dict, check: Optional[Callable] = None, plain: Any = None):
        self.inner, self.hparams, self.check = inner, hparams, check
        self.plain = inner if plain is None else plain  # without its compiler options (jax.export nests it)

    def __call__(self, state, batch, hparams=None):
        if self.check is not None:
            self.check(batch)
            self.check = None
        return self.inner(state, batch, self.hparams if hparams is None else hparams)

    def lower(self, state, batch, hparams=None) -> "TrainStep":
        if self.check is not None:
            self.check(batch)
        return TrainStep(self.inner.lower(state, batch, self.hparams if hparams is None else hparams), self.hparams)

    def compile(self) -> "TrainStep":
        return TrainStep(self.inner.compile(), self.hparams)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


RESERVED_METRICS = ("loss", "grad_norm", "lr", "nonfinite")  # what the step itself reports


def check_loss_output(name: str, loss: Any, aux: Any) -> None:
    """A loss must return (scalar, {metric name: scalar}), its metrics not named like the step's own.

    Raises:
      ConfigError: naming the model and what is wrong.
    """
    if jnp.ndim(loss) != 0:
        raise ConfigError(f"model '{name}': the loss must return a scalar first, got shape {jnp.shape(loss)}")
    if not isinstance(aux, dict):
        raise ConfigError(f"model '{name}': the loss must return (loss, dict of metrics), got {type(aux).__name__}")
    reserved = sorted(set(aux) & set(RESERVED_METRICS))
    if reserved:
        raise ConfigError(f"model '{name}': the loss's metrics may not be named {', '.join(reserved)} "
                          f"(the step reports {', '.join(RESERVED_METRICS)} itself)")
    shaped = {k: jnp.shape(v) for k, v in aux.items() if jnp.ndim(v) != 0}
    if shaped:
        raise ConfigError(f"model '{name}': the loss's metrics must be scalars, got shapes {shaped}")


@contextlib.contextmanager
def tracing(plan: RunPlan, sharded: bool = True):
    """What a run's programs are traced under: its activation sharding (unless ``sharded`` is false),
    pipeline schedule, offload plan and kernel choices."""
    off, layout = plan.offload, plan.layout
    with contextlib.ExitStack() as stack:
        if sharded:
            stack.enter_context(activation_sharding(plan.rules, plan.mesh))
            stack.enter_context(pipelined(plan.schedule))
            stack.enter_context(context.planned(plan.kernels))
        stack.enter_context(offload.active(off, layout.model_dtypes.get("layers") if off.streamed else None))
        yield


class Model:
    """The model's functions under a plan: its params made and cast, the model rebuilt from them, its loss
    and the loss's gradient (the 1F1B schedule's own where the plan pipelines with it)."""

    def __init__(self, plan: RunPlan, model_spec: ModelSpec):
        self.plan, self.spec = plan, model_spec
        one_f_one_b = plan.schedule.stages > 1 and plan.schedule.schedule == "1f1b"
        self._value_and_grad = jax.value_and_grad(self._loss_1f1b if one_f_one_b else self.loss, has_aux=True)

    def make_params(self, key):
        model = self.spec.make(nnx.Rngs(params=key, default=jax.random.fold_in(key, 2)))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        return jax.tree_util.tree_map(lambda x, dt: x.astype(dt), params, self.plan.layout.stored_dtypes)

    def of(self, params):
        """The module with ``params`` (float32 masters cast to the declared dtypes; streamed: later)."""
        layout = self.plan.layout
        params = jax.tree_util.tree_map(offload.cast, params, layout.model_dtypes)
        state = jax.tree_util.tree_map(lambda x: x, layout.abstract_params)  # fresh Variables
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(layout.graphdef, state)

    def loss(self, params, micro_batch):
        loss, aux = self.spec.loss(self.of(params), micro_batch)
        check_loss_output(self.spec.name, loss, aux)  # at trace time: shapes and names are static
        return loss, dict(aux)

    def _loss_1f1b(self, params, micro_batch):  # the 1F1B schedule's gradient (jaxtrain.parallel.pipeline_1f1b)
        return pipelined_loss(self.of, self.spec.head_loss, self.plan.schedule, params, micro_batch)

    def grad(self, params, micro_batch):
        """((loss, aux), grads); streamed layers' gradients come out typed host: to the device at once."""
        out, grads = self._value_and_grad(params, micro_batch)
        return out, offload.to_device(grads)

    def batch_check(self) -> Optional[Callable]:
        """``offload.activations`` must name activations the model tags: checked now from the model's example,
        or returned as a check of the first batch's shapes (a custom model without one). Raises ConfigError."""
        wanted = self.plan.offload.activations
        if not wanted:
            return None
        check = lambda micro: offload.check_names(wanted, offload.model_names(self.spec, micro), self.spec.name)  # noqa: E731
        if self.spec.example is not None:
            check({k: jax.ShapeDtypeStruct((self.plan.cfg.micro_batch, *x.shape), x.dtype)
                   for k, x in self.spec.example.items()})
            return None
        return lambda batch: check({k: jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for k, x in batch.items()})


def gradients(grad_accum: int, grad: Callable) -> Callable:
    """``(params, batch [accum, micro, ...]) -> (loss, aux metrics, grads)``: micro-batch means weighted by
    aux['weight'], so accumulation equals the full batch; one micro-batch needs no loop (XLA fuses across
    the step)."""
    def single(params, batch):
        (loss, aux), grads = grad(params, jax.tree_util.tree_map(lambda x: x[0], batch))
        aux.pop("weight", None)
        return loss, aux, grads

    def accumulated(params, batch):
        def micro(grad_sum, b):
            (loss, aux), grads = grad(params, b)
            w = aux.pop("weight", jnp.ones((), jnp.float32)).astype(jnp.float32)
            return jax.tree_util.tree_map(lambda s, g: s + w * g, grad_sum, grads), (w, loss, aux)

        zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        grad_sum, (w, losses, aux) = jax.lax.scan(micro, zeros, batch)
        total = jnp.maximum(w.sum(), 1e-30)
        mean = lambda x: (w * x).sum() / total  # noqa: E731
        return mean(losses), jax.tree_util.tree_map(mean, aux), jax.tree_util.tree_map(lambda g: g / total, grad_sum)

    return single if grad_accum == 1 else accumulated


def guarded_update(plan: RunPlan, h: dict, count, lr, loss, grads, params, opt_state):
    """The update of a step whose loss and gradients are known: ``(params, opt_state, grad_norm, finite)``.

    Non-finite guard: a step with a NaN/inf loss or gradient keeps params and optimizer state as they
    were (the step counter and data still advance). A cond, not a select over the whole state: the update
    runs only when taken, and no extra pass over params and moments is made (a per-leaf where cost ~3% of
    the 25M CPU step). Where the plan's ``optimizer.implementation`` has an update kernel, that does it all.
    """
    axes = plan.layout.axes
    fused = ops.fused_update(plan.cfg.optimizer.implementation)
    if fused is not None:
        return fused(h, decay_mask(axes), count, loss, grads, params, opt_state, lr)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def update(params, opt_state):
        updates, opt_state = optimizer(h, axes, count, grad_norm).update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    if plan.offload.state:  # host-resident state: fetched, updated and kept per leaf (jaxtrain.parallel.offload)
        new = offload.guarded_update(update, finite, params, opt_state, plan.layout.state_shardings)
    else:
        new = jax.lax.cond(finite, update, lambda p, o: (p, o), params, opt_state)
    return (*new, grad_norm, finite)


def train_step(plan: RunPlan, grads_of: Callable) -> Callable:
    """``(state, batch, hparams) -> (state, metrics)``: the one pure train step."""
    def step_fn(state, batch, h):
        count = applied_count(state["opt_state"])  # updates applied so far: a skipped step is not one
        with tracing(plan):
            loss, aux, grads = grads_of(offload.for_forward(state["params"], plan.offload), batch)
            grads = jax.tree_util.tree_map(lambda g, p: g.astype(p.dtype), grads, state["params"])
            grads = jax.lax.with_sharding_constraint(grads, plan.layout.param_shardings)
            # lr: the rate this step applies (or would have, if skipped): the optimizer's own count, which a
            # skipped step does not advance, not the step counter.
            lr = learning_rate(h, count)
            params, opt_state, grad_norm, finite = guarded_update(plan, h, count, lr, loss, grads, state["params"],
                                                                  state["opt_state"])
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr,
                   "nonfinite": (~finite).astype(jnp.int32), **aux}
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1, "rng": state["rng"]}, metrics

    return step_fn


def build(plan: RunPlan, model_spec: ModelSpec) -> StepFunctions:
    """The jitted functions of ``model_spec`` under ``plan`` (nothing is compiled here)."""
    cfg, layout, mesh = plan.cfg, plan.layout, plan.mesh
    model = Model(plan, model_spec)
    check_batch = model.batch_check()
    grads_of = gradients(cfg.train.grad_accum, model.grad)
    replicated = NamedSharding(mesh, P())
    state_sh, stored_sh, batch_sh = layout.state_shardings, layout.stored_shardings, plan.batch_sharding
    h0 = hyperparameters(cfg)
    tx = optimizer(h0, layout.axes)  # for the state's init; the step builds it from traced values

    def init_fn():
        key = jax.random.key(cfg.train.seed)
        params = model.make_params(key)
        return {"params": params, "opt_state": tx.init(params),
                "step": jnp.zeros((), jnp.int32), "rng": jax.random.key_data(jax.random.fold_in(key, 1))}

    def grads_fn(params, batch):
        with tracing(plan):
            loss, aux, grads = grads_of(offload.for_forward(params, plan.offload), batch)
        return loss, aux, jax.lax.with_sharding_constraint(grads, layout.param_shardings)

    fns = evaluation.functions(plan, model, tracing)
    options = plan.train_step_options
    jit_step = functools.partial(jax.jit, train_step(plan, grads_of), in_shardings=(state_sh, batch_sh, replicated),
                                 out_shardings=(state_sh, replicated), donate_argnums=(0,))
    return StepFunctions(
        state_shardings=state_sh, state_structure=layout.state_structure, batch_sharding=batch_sh,
        param_axes=layout.axes, init=jax.jit(init_fn, out_shardings=state_sh),
        train_step=TrainStep(jit_step(compiler_options=options or None),
                             jax.device_put(h0, replicated), check_batch,
                             plain=jit_step() if options else None),
        grads=jax.jit(grads_fn, in_shardings=(stored_sh, batch_sh)),
        eval_step=jax.jit(fns.eval_step, in_shardings=(stored_sh, plan.eval_sharding), out_shardings=replicated),
        evaluate=jax.jit(fns.evaluate, in_shardings=(stored_sh, batch_sh), out_shardings=replicated),
        eval_piece=fns.piece,
        # replicated output: every process can read the logits, also when a model axis spans processes
        apply=jax.jit(fns.apply, in_shardings=(stored_sh, None), out_shardings=replicated),
        model_dtypes=layout.model_dtypes, low_precision=list(layout.low_precision), train_step_options=options,
    )
