"""The train state, its sharded initialisation, and the one pure, jitted train step, for any ModelSpec.

State is a plain pytree ``{'params', 'opt_state', 'step', 'rng'}``. Parameters
are created directly in their sharded layout (the init is jitted with
``out_shardings``), so no device ever holds the whole model. The step is
jitted once with explicit in/out shardings and donated state. The optimizer's
hyperparameters are a traced third argument (``jaxtrain.train.optimizer``), so a
new learning rate, schedule, betas, weight decay or clip never recompiles.

Mixed precision: when the model declares low-precision floating parameters (e.g.
``model.param_dtype=bfloat16``) and ``optimizer.master_weights`` is true (the default), the
state holds float32 master copies and float32 Adam moments, and the model sees the params
cast to its declared dtypes inside the step (MaxText's weight_dtype/dtype split; apex's
master weights). Otherwise bf16 rounding swallows updates smaller than the weight's ulp.
"""
from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.config import Config
from jaxtrain.errors import ConfigError, ShardingError
from jaxtrain.kernels import cpu_adamw
from jaxtrain.parallel import offload
from jaxtrain.parallel.activations import activation_sharding
from jaxtrain.parallel.pipeline import pipelined, schedule_of
from jaxtrain.parallel.pipeline_1f1b import pipelined_loss
from jaxtrain.parallel.rules import Rules, path_str, tree_shardings
from jaxtrain.runtime.xla_flags import train_step_options
from jaxtrain.train.model_spec import ModelSpec
from jaxtrain.train.optimizer import (
    applied_count,
    decay_mask,
    fused_problem,
    hyperparameters,
    implementation,
    learning_rate,
    optimizer,
)


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


def param_tree(abstract_params: nnx.State, fn: Callable[[nnx.Variable], Any]) -> dict:
    """Nested pure dict (the layout of ``nnx.to_pure_dict``) of ``fn(variable)`` per parameter."""
    out: dict = {}
    for path, var in nnx.to_flat_state(abstract_params):
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = fn(var)
    return out


def count_params(params: Any) -> int:
    """Number of parameter elements in a pytree of arrays (or ShapeDtypeStructs)."""
    return sum(x.size for x in jax.tree_util.tree_leaves(params))


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


def _split(model_spec: ModelSpec):
    """(graphdef, abstract params, their logical axes); named errors for what cannot be trained."""
    model = nnx.eval_shape(lambda: model_spec.make(nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    other = [path_str(p) for p, _ in nnx.to_flat_state(rest)]
    if other:
        raise ShardingError(f"model '{model_spec.name}': state that is not an nnx.Param cannot be trained here "
                            f"({', '.join(other[:5])}{', ...' if len(other) > 5 else ''})")

    missing = [f"{path_str(p)} {tuple(v.get_value().shape)}" for p, v in nnx.to_flat_state(params)
               if v.get_metadata().get("axes") is None]
    if missing:
        raise ShardingError(f"model '{model_spec.name}': parameter(s) without logical axis names: "
                            f"{', '.join(missing)}; create them as nnx.Param(value, axes=(...)), one name per "
                            f"dimension")
    return graphdef, params, param_tree(params, lambda v: tuple(v.get_metadata()["axes"]))


def build(cfg: Config, mesh: Mesh, rules: Rules, model_spec: ModelSpec) -> StepFunctions:
    """Resolves every sharding (raising ShardingError before any compile) and jits the functions."""
    graphdef, abstract_params, axes = _split(model_spec)
    leaves = jax.tree_util.tree_leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    used = dict.fromkeys([n for a in leaves for n in a if n] + list(model_spec.logical_axes))
    rules.check_names(used, f"model '{model_spec.name}'")
    unknown = [n for n in cfg.sharding.extra_rules if n not in used]
    if unknown:  # a mistyped name would otherwise add a rule nothing reads, and shard nothing
        near = difflib.get_close_matches(unknown[0], list(used), n=1)
        raise ConfigError(f"sharding.extra_rules: '{unknown[0]}' is not a logical name of model '{model_spec.name}'"
                          f"{f' (did you mean {near[0]!r}?)' if near else ''}; its names: {', '.join(used)}")
    shapes = param_tree(abstract_params, lambda v: v.get_value())
    param_sh = tree_shardings(rules, mesh, shapes, axes)
    model_dtypes = param_tree(abstract_params, lambda v: v.get_value().dtype)
    master = cfg.optimizer.master_weights
    stored = jax.tree_util.tree_map(lambda dt: jnp.dtype(jnp.float32) if master and _low(dt) else dt, model_dtypes)
    low_precision = [path_str(p) for p, dt in jax.tree_util.tree_flatten_with_path(model_dtypes)[0]
                     if _low(dt) and not master]
    h0 = hyperparameters(cfg)
    schedule = schedule_of(cfg, mesh.shape["stage"])  # one stage: no pipeline
    tx = optimizer(h0, axes)  # for the state's structure and init; the step builds it from traced values
    replicated = NamedSharding(mesh, P())
    micro_spec = rules.partition_spec("batch", ("batch",), (cfg.micro_batch,), mesh)  # the batch dim of every field
    batch_sh = NamedSharding(mesh, P(None, *micro_spec))
    eval_sh = NamedSharding(mesh, micro_spec)

    def make_params(key):
        model = model_spec.make(nnx.Rngs(params=key, default=jax.random.fold_in(key, 2)))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        return jax.tree_util.tree_map(lambda x, dt: x.astype(dt), params, stored)  # float32 masters

    # make_params's output shapes, without tracing the model's construction once more (~0.1 s)
    abstract_stored = jax.tree_util.tree_map(lambda x, dt: jax.ShapeDtypeStruct(x.shape, dt), shapes, stored)
    abstract_opt = jax.eval_shape(tx.init, abstract_stored)
    opt_rules = rules.for_optimizer()  # e.g. zero1: params replicated, moments sharded
    opt_param_sh = param_sh if opt_rules is rules else tree_shardings(opt_rules, mesh, shapes, axes)
    off = offload.Plan.from_config(cfg)  # what lives in host memory (jaxtrain.parallel.offload)
    opt_sh = optax.tree_map_params(tx, lambda _, s: s, abstract_opt, offload.with_kind(opt_param_sh, off.optimizer),
                                   transform_non_params=lambda _: replicated)
    stored_sh = offload.with_kind(param_sh, offload.host_mask(off, stored, model_dtypes))  # param_sh: device
    state_sh = {"params": stored_sh, "opt_state": opt_sh, "step": replicated, "rng": replicated}
    state_structure = jax.tree_util.tree_structure({"params": abstract_stored, "opt_state": abstract_opt,
                                                    "step": 0, "rng": 0})
    offloading = lambda: offload.active(off, model_dtypes.get("layers") if off.streamed else None)  # noqa: E731
    fused_update = implementation(cfg.optimizer.implementation, fused_problem(
        mesh.devices.flat[0].platform, mesh.size, stored, bool(off.state))) == "cpu_fused"
    decay = decay_mask(axes)

    def init_fn():
        key = jax.random.key(cfg.train.seed)
        params = make_params(key)
        return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32),
                "rng": jax.random.key_data(jax.random.fold_in(key, 1))}

    def model_of(params):
        params = jax.tree_util.tree_map(offload.cast, params, model_dtypes)  # masters -> bf16 (streamed: later)
        state = jax.tree_util.tree_map(lambda x: x, abstract_params)  # fresh Variables
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(graphdef, state)

    def loss_of(params, micro_batch):
        loss, aux = model_spec.loss(model_of(params), micro_batch)
        check_loss_output(model_spec.name, loss, aux)  # at trace time: shapes and names are static
        return loss, dict(aux)

    def loss_1f1b(params, micro_batch):  # the 1F1B schedule's gradient (jaxtrain.parallel.pipeline_1f1b)
        return pipelined_loss(model_of, model_spec.head_loss, schedule, params, micro_batch)

    one_f_one_b = schedule.stages > 1 and schedule.schedule == "1f1b"
    value_and_grad = jax.value_and_grad(loss_1f1b if one_f_one_b else loss_of, has_aux=True)

    def grad_fn(params, micro_batch):  # streamed layers' gradients come out typed host: to the device at once
        out, grads = value_and_grad(params, micro_batch)
        return out, offload.to_device(grads)

    def check_names(micro: dict) -> None:  # offload.activations: names the model tags (ConfigError)
        offload.check_names(off.activations, offload.model_names(model_spec, micro), model_spec.name)

    check_batch = None
    if off.activations and model_spec.example is not None:
        check_names({k: jax.ShapeDtypeStruct((cfg.micro_batch, *x.shape), x.dtype)
                     for k, x in model_spec.example.items()})
    elif off.activations:  # a custom model without an example: before the step first runs (its batch's shapes)
        check_batch = lambda batch: check_names({k: jax.ShapeDtypeStruct(x.shape[1:], x.dtype)  # noqa: E731
                                                 for k, x in batch.items()})

    def gradients(params, batch):
        """(loss, aux metrics, grads) of a [accum, micro, ...] batch: micro-batch means weighted by
        aux['weight'], so accumulation equals the full batch."""
        if cfg.train.grad_accum == 1:  # no loop: lets XLA fuse across the step
            (loss, aux), grads = grad_fn(params, jax.tree_util.tree_map(lambda x: x[0], batch))
            aux.pop("weight", None)
            return loss, aux, grads

        def micro(grad_sum, b):
            (loss, aux), grads = grad_fn(params, b)
            w = aux.pop("weight", jnp.ones((), jnp.float32)).astype(jnp.float32)
            return jax.tree_util.tree_map(lambda s, g: s + w * g, grad_sum, grads), (w, loss, aux)

        zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        grad_sum, (w, losses, aux) = jax.lax.scan(micro, zeros, batch)
        total = jnp.maximum(w.sum(), 1e-30)
        mean = lambda x: (w * x).sum() / total  # noqa: E731
        return mean(losses), jax.tree_util.tree_map(mean, aux), jax.tree_util.tree_map(lambda g: g / total, grad_sum)

    def step_fn(state, batch, h):
        count = applied_count(state["opt_state"])  # updates applied so far: a skipped step is not one
        with activation_sharding(rules, mesh), pipelined(schedule), offloading():
            loss, aux, grads = gradients(offload.for_forward(state["params"], off), batch)
            grads = jax.tree_util.tree_map(lambda g, p: g.astype(p.dtype), grads, state["params"])
            grads = jax.lax.with_sharding_constraint(grads, param_sh)
            # Non-finite guard: a step with a NaN/inf loss or gradient keeps params and optimizer
            # state as they were (the step counter and data still advance) and is counted. A cond,
            # not a select over the whole state: the update runs only when taken, and no extra pass
            # over params and moments is made (a per-leaf where cost ~3% of the 25M CPU step).
            lr = learning_rate(h, count)
            if fused_update:  # the same in one XLA:CPU kernel (optimizer.implementation)
                params, opt_state, grad_norm, finite = cpu_adamw.guarded_update(
                    h, decay, count, loss, grads, state["params"], state["opt_state"], lr)
            else:
                grad_norm = optax.tree.norm(grads)
                finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

                def update(params, opt_state):
                    updates, opt_state = optimizer(h, axes, count, grad_norm).update(grads, opt_state, params)
                    return optax.apply_updates(params, updates), opt_state

                if off.state:  # host-resident state: fetched, updated and kept per leaf (jaxtrain.parallel.offload)
                    params, opt_state = offload.guarded_update(update, finite, state["params"], state["opt_state"],
                                                               state_sh)
                else:
                    params, opt_state = jax.lax.cond(finite, update, lambda p, o: (p, o),
                                                     state["params"], state["opt_state"])
        # lr: the rate this step applied (or would have, if skipped): the optimizer's own count, which a
        # skipped step does not advance, not the step counter.
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr,
                   "nonfinite": (~finite).astype(jnp.int32), **aux}
        new_state = {"params": params, "opt_state": opt_state, "step": state["step"] + 1, "rng": state["rng"]}
        return new_state, metrics

    def eval_fn(params, batch):
        with activation_sharding(rules, mesh), pipelined(schedule), offloading():
            loss, aux = loss_of(offload.for_forward(params, off), batch)
        if model_spec.eval_loss is not None:  # e.g. a MoE's cross-entropy; the router losses keep their columns
            loss = aux.pop(model_spec.eval_loss)
        aux.setdefault("weight", jnp.ones((), jnp.float32))
        return {"loss": loss, **aux}

    side_by_side = mesh.size == 1 and schedule.stages == 1 and not (off.state or off.activations)

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
        with offloading():
            return model_of(offload.for_forward(params, off))(inputs)

    def grads_fn(params, batch):
        with activation_sharding(rules, mesh), pipelined(schedule), offloading():
            loss, aux, grads = gradients(offload.for_forward(params, off), batch)
        return loss, aux, jax.lax.with_sharding_constraint(grads, param_sh)

    options = train_step_options(mesh.devices.flat[0].platform, processes=jax.process_count())
    jit_step = functools.partial(jax.jit, step_fn, in_shardings=(state_sh, batch_sh, replicated),
                                 out_shardings=(state_sh, replicated), donate_argnums=(0,))
    return StepFunctions(
        state_shardings=state_sh, state_structure=state_structure, batch_sharding=batch_sh, param_axes=axes,
        init=jax.jit(init_fn, out_shardings=state_sh),
        train_step=TrainStep(jit_step(compiler_options=options or None), jax.device_put(h0, replicated),
                             check_batch, plain=jit_step() if options else None),
        grads=jax.jit(grads_fn, in_shardings=(stored_sh, batch_sh)),
        eval_step=jax.jit(eval_fn, in_shardings=(stored_sh, eval_sh), out_shardings=replicated),
        evaluate=jax.jit(evaluate, in_shardings=(stored_sh, batch_sh), out_shardings=replicated),
        # replicated output: every process can read the logits, also when a model axis spans processes
        apply=jax.jit(apply, in_shardings=(stored_sh, None), out_shardings=replicated),
        model_dtypes=model_dtypes, low_precision=low_precision, train_step_options=options,
    )


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


def _low(dtype) -> bool:
    """A floating dtype narrower than float32 (bfloat16, float16, float8...)."""
    return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize < 4
