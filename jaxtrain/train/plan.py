"""The run plan: everything a run resolves before anything is traced, once, with the reason for each choice.

:func:`make` (called by ``jaxtrain.train.assembly.setup``) resolves, from the config, the mesh, the rule
set and the model:

- the state layout (:mod:`jaxtrain.train.state`): params, optimizer state, their dtypes and shardings;
- what lives in host memory (``offload``, :class:`jaxtrain.parallel.offload.Plan`);
- the pipeline schedule (``mesh.stage``, ``pipeline.*``);
- the batch's sharding;
- every kernel key (``model.attention``, ``model.matmul``, ``model.grouped_matmul``,
  ``optimizer.implementation``), ``auto`` resolved by the kernel registry from the backend, the dtype,
  the device count, the sharding and the data (:func:`jaxtrain.kernels.registry.plan`);
- the train step's own XLA options.

The step functions are built from it (``jaxtrain.train.step.build``), the trainer logs its choices and
writes it to the run directory as ``resolved.json`` (:meth:`RunPlan.as_json`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.config import Config
from jaxtrain.config.checks import kernel_facts, kernel_values
from jaxtrain.errors import ShardingError
from jaxtrain.kernels import registry
from jaxtrain.parallel import offload
from jaxtrain.parallel.pipeline import Schedule, schedule_of
from jaxtrain.parallel.rules import Rules
from jaxtrain.runtime.xla_flags import train_step_options
from jaxtrain.train import state
from jaxtrain.train.model_spec import ModelSpec
from jaxtrain.train.optimizer import hyperparameters, optimizer


@dataclass(frozen=True)
class RunPlan:
    """One run, resolved (see the module docstring). ``batch_sharding``: of every [grad_accum,
    micro_batch, ...] field of a batch; ``eval_sharding``: of one [micro_batch, ...] field."""

    cfg: Config
    mesh: Mesh
    rules: Rules
    layout: state.StateLayout
    offload: offload.Plan
    schedule: Schedule
    kernels: registry.KernelPlan
    batch_sharding: NamedSharding
    eval_sharding: NamedSharding
    train_step_options: dict

    @property
    def platform(self) -> str:
        return self.mesh.devices.flat[0].platform

    def lines(self) -> list[str]:
        """What ``auto`` resolved to and why, one line per key (logged by the trainer)."""
        return self.kernels.lines()

    def warnings(self) -> list[str]:
        """Explicit choices that run, but not well here (why auto would not pick them)."""
        return self.kernels.warnings()

    def as_json(self) -> dict:
        """The plan as ``resolved.json`` holds it: mesh, rules, kernels (each choice, its provider and
        reason), offload, pipeline and the shardings (PartitionSpecs as lists, one entry per dimension:
        a mesh axis, a list of axes, or null)."""
        o = self.offload
        params = {k: _spec(s) for k, s in _flat(self.layout.stored_shardings)}
        host = [k for k, s in _flat(self.layout.stored_shardings) if s.memory_kind == offload.HOST]
        s = self.schedule
        return {"mesh": dict(self.mesh.shape), "rules": self.rules.name, "kernels": self.kernels.as_json(),
                "offload": {"optimizer": o.optimizer, "params": o.params, "activations": list(o.activations),
                            "streamed_layers": o.streamed},
                "pipeline": {"stages": s.stages, "microbatches": s.microbatches, "schedule": s.schedule,
                             "repeats": s.repeats},
                "shardings": {"batch": _spec(self.batch_sharding), "params": params, "params_in_host_memory": host},
                "train_step_options": {k: str(v) for k, v in self.train_step_options.items()}}


def _flat(tree: Any) -> list[tuple[str, Any]]:
    from jaxtrain.parallel.rules import path_str
    is_sharding = lambda x: isinstance(x, jax.sharding.Sharding)  # noqa: E731
    return [(path_str(p), s) for p, s in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_sharding)[0]]


def _spec(sharding: NamedSharding) -> list:
    return [list(a) if isinstance(a, tuple) else a for a in sharding.spec]


def length_split(cfg: Config, mesh: Mesh, rules: Rules) -> Optional[bool]:
    """Whether the rules split the attention's 'length' over more than one device, for the config's
    attention shapes (None where the model's sizes are unknown, or the rules refuse them: the trace then
    says so by name)."""
    m = cfg.model
    heads, head_dim = getattr(m, "n_heads", None), getattr(m, "head_dim", None)
    if heads is None or head_dim is None:
        return None
    shape = (cfg.micro_batch, cfg.data.seq_len, heads, head_dim)
    try:
        axes = rules.partition_spec("attention queries", ("batch", "length", "heads", "kv"), shape, mesh)[1]
    except ShardingError:
        return None
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    return any(mesh.shape[a] > 1 for a in axes)


def kernel_plan(cfg: Config, mesh: Mesh, rules: Rules, layout: state.StateLayout,
                off: offload.Plan) -> registry.KernelPlan:
    """Every kernel key resolved for this run (:func:`jaxtrain.kernels.registry.plan`).

    Raises:
      ConfigError (AttentionBackendError for ``model.attention``): an explicit choice that cannot run here.
    """
    dtypes = sorted({str(jax.numpy.dtype(dt)) for dt in jax.tree_util.tree_leaves(layout.stored_dtypes)})
    facts = kernel_facts(cfg, dict(mesh.shape), mesh.devices.flat[0].platform, state_dtypes=tuple(dtypes),
                         host_state=off.state, length_split=length_split(cfg, mesh, rules), sharded=True)
    return registry.plan(kernel_values(cfg), facts)


def make(cfg: Config, mesh: Mesh, rules: Rules, model_spec: ModelSpec) -> RunPlan:
    """The run plan of ``model_spec`` under ``cfg`` on ``mesh`` and ``rules``.

    Raises:
      ShardingError, ConfigError: bad input, named, before anything is traced.
    """
    off = offload.Plan.from_config(cfg)
    h0 = hyperparameters(cfg)
    layout = state.layout(cfg, mesh, rules, model_spec, off, lambda axes: optimizer(h0, axes))
    micro_spec = rules.partition_spec("batch", ("batch",), (cfg.micro_batch,), mesh)  # every field's batch dim
    platform = mesh.devices.flat[0].platform
    return RunPlan(cfg=cfg, mesh=mesh, rules=rules, layout=layout, offload=off,
                   schedule=schedule_of(cfg, mesh.shape["stage"]), kernels=kernel_plan(cfg, mesh, rules, layout, off),
                   batch_sharding=NamedSharding(mesh, P(None, *micro_spec)),
                   eval_sharding=NamedSharding(mesh, micro_spec),
                   train_step_options=train_step_options(platform, processes=jax.process_count()))
