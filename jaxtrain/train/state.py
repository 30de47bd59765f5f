"""The train state's layout, resolved once per run (part of :class:`jaxtrain.train.plan.RunPlan`).

State is a plain pytree ``{'params', 'opt_state', 'step', 'rng'}``. Its layout is what the model and
the config decide before anything is traced: the params' logical axes, the dtypes the model declares
and the ones stored (float32 masters of low-precision params, MaxText's weight_dtype/dtype split), the
shardings of params and optimizer state under the rules (``zero1``: its own for the moments), and the
memory kinds of what ``offload`` puts in host memory.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.config import Config
from jaxtrain.errors import ConfigError, ShardingError
from jaxtrain.parallel import offload
from jaxtrain.parallel.rules import Rules, path_str, tree_shardings
from jaxtrain.train.model_spec import ModelSpec


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


def split_model(model_spec: ModelSpec):
    """(graphdef, abstract params, their logical axes) of the model, built abstractly.

    Raises:
      ShardingError: state that is not an ``nnx.Param``, or a parameter without logical axis names.
    """
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


def check_names(cfg: Config, rules: Rules, model_spec: ModelSpec, axes: Any) -> None:
    """Every logical name the model uses has a rule, and every ``sharding.extra_rules`` name is one of them.

    Raises:
      ShardingError: a name without a rule. ConfigError: an extra rule no parameter or activation reads.
    """
    leaves = jax.tree_util.tree_leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    used = dict.fromkeys([n for a in leaves for n in a if n] + list(model_spec.logical_axes))
    rules.check_names(used, f"model '{model_spec.name}'")
    unknown = [n for n in cfg.sharding.extra_rules if n not in used]
    if unknown:  # a mistyped name would otherwise add a rule nothing reads, and shard nothing
        near = difflib.get_close_matches(unknown[0], list(used), n=1)
        raise ConfigError(f"sharding.extra_rules: '{unknown[0]}' is not a logical name of model '{model_spec.name}'"
                          f"{f' (did you mean {near[0]!r}?)' if near else ''}; its names: {', '.join(used)}")


def low(dtype) -> bool:
    """A floating dtype narrower than float32 (bfloat16, float16, float8...)."""
    return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize < 4


@dataclass(frozen=True)
class StateLayout:
    """The train state's structure, dtypes and shardings (see the module docstring).

    ``axes``, ``model_dtypes``, ``stored_dtypes``: the params' pytrees of logical-name tuples, declared
    dtypes and stored dtypes. ``param_shardings``: the params' device shardings (the gradients'),
    ``stored_shardings`` with their memory kinds. ``abstract_stored`` / ``abstract_opt``: the stored
    params and optimizer state as ShapeDtypeStructs. ``low_precision``: paths of low-precision params
    trained without float32 masters.
    """

    graphdef: Any
    abstract_params: Any
    axes: Any
    model_dtypes: Any
    stored_dtypes: Any
    low_precision: tuple[str, ...]
    param_shardings: Any
    stored_shardings: Any
    state_shardings: dict
    state_structure: Any
    abstract_stored: Any
    abstract_opt: Any


def layout(cfg: Config, mesh: Mesh, rules: Rules, model_spec: ModelSpec, off: offload.Plan,
           tx: Callable[[Any], optax.GradientTransformation]) -> StateLayout:
    """The state layout of ``model_spec`` under ``rules`` on ``mesh`` (``tx(axes)``: the optimizer whose
    state it holds). Raises ShardingError and ConfigError (:func:`check_names`, the rules) before any
    compile."""
    graphdef, abstract_params, axes = split_model(model_spec)
    check_names(cfg, rules, model_spec, axes)
    shapes = param_tree(abstract_params, lambda v: v.get_value())
    param_sh = tree_shardings(rules, mesh, shapes, axes)
    model_dtypes = param_tree(abstract_params, lambda v: v.get_value().dtype)
    master = cfg.optimizer.master_weights
    stored = jax.tree_util.tree_map(lambda dt: jnp.dtype(jnp.float32) if master and low(dt) else dt, model_dtypes)
    low_precision = tuple(path_str(p) for p, dt in jax.tree_util.tree_flatten_with_path(model_dtypes)[0]
                          if low(dt) and not master)
    abstract_stored = jax.tree_util.tree_map(lambda x, dt: jax.ShapeDtypeStruct(x.shape, dt), shapes, stored)
    optimizer = tx(axes)
    abstract_opt = jax.eval_shape(optimizer.init, abstract_stored)
    replicated = NamedSharding(mesh, P())
    opt_rules = rules.for_optimizer()  # e.g. zero1: params replicated, moments sharded
    opt_param_sh = param_sh if opt_rules is rules else tree_shardings(opt_rules, mesh, shapes, axes)
    opt_sh = optax.tree_map_params(optimizer, lambda _, s: s, abstract_opt,
                                   offload.with_kind(opt_param_sh, off.optimizer),
                                   transform_non_params=lambda _: replicated)
    stored_sh = offload.with_kind(param_sh, offload.host_mask(off, stored, model_dtypes))  # param_sh: device
    structure = jax.tree_util.tree_structure({"params": abstract_stored, "opt_state": abstract_opt,
                                              "step": 0, "rng": 0})
    return StateLayout(
        graphdef=graphdef, abstract_params=abstract_params, axes=axes, model_dtypes=model_dtypes,
        stored_dtypes=stored, low_precision=low_precision, param_shardings=param_sh, stored_shardings=stored_sh,
        state_shardings={"params": stored_sh, "opt_state": opt_sh, "step": replicated, "rng": replicated},
        state_structure=structure, abstract_stored=abstract_stored, abstract_opt=abstract_opt)
