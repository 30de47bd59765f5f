"""The one run setup: config -> devices -> mesh -> rules -> model -> step functions, checked once.

Every entry point (train, export, plan, explain, the benchmarks, the tests) calls
:func:`setup`, so every one applies the same checks in the same order, all before
anything is compiled:

1. the config against the resolved mesh sizes and the devices' platform (batch and
   heads divisibility, an attention that cannot run here: ConfigError);
2. the rule set (``sharding.rules`` + ``sharding.extra_rules``): every mesh axis of
   size > 1 must be used, and every logical name of the model must have a rule
   (ShardingError);
3. the data (when asked to load it) and the vocabulary (DataError, ConfigError);
4. the mesh, and the run plan (:mod:`jaxtrain.train.plan`): the sharding of every parameter and
   optimizer-state leaf (ShardingError; activation shardings are checked when the step is traced),
   what is offloaded, the pipeline schedule, and every kernel choice (``auto`` resolved once).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import jax
from jax.sharding import Mesh

from jaxtrain import data as datalib
from jaxtrain.checkpoint.checkpointer import abstract_like
from jaxtrain.config import Config, check_against_mesh
from jaxtrain.data import tokenizers
from jaxtrain.errors import ConfigError
from jaxtrain.metrics import sinks
from jaxtrain.models.family import Family
from jaxtrain.parallel.mesh import build_mesh, resolve_sizes
from jaxtrain.parallel.rules import Rules, check_mesh_used
from jaxtrain.train import lm, plan, step
from jaxtrain.train.model_spec import ModelSpec


@dataclass
class Setup:
    """Everything one run is built from; see :func:`setup`."""

    cfg: Config
    devices: list
    mesh: Mesh
    rules: Rules
    model_spec: ModelSpec
    fns: step.StepFunctions
    plan: plan.RunPlan  # every auto resolved, the shardings, offload, pipeline, kernels: resolved.json
    data: Any = None  # the data source (jaxtrain.data.Data, ArrayData, ...), when loaded or given
    family: Optional[Family] = None  # the registered family (None for a ModelSpec given in Python)
    model_config: Any = None  # cfg.model, its vocabulary resolved for a family

    def abstract_state(self) -> dict:
        """The train state as ShapeDtypeStructs with their shardings (nothing allocated)."""
        return abstract_like(jax.eval_shape(self.fns.init), self.fns.state_shardings)

    def abstract_batch(self) -> dict:
        """One training batch as ShapeDtypeStructs: ``{field: [grad_accum, micro_batch, ...]}``."""
        if self.model_spec.example is not None:
            example = self.model_spec.example
        else:
            example = {k: jax.ShapeDtypeStruct(v.shape[2:], v.dtype) for k, v in self.data.val.items()}
        lead = (self.cfg.train.grad_accum, self.cfg.micro_batch)
        return {k: jax.ShapeDtypeStruct(lead + tuple(x.shape), x.dtype, sharding=self.fns.batch_sharding)
                for k, x in example.items()}

    def check_loss(self) -> None:
        """Traces the loss on one abstract micro-batch (nothing runs): its output's shapes and names
        are checked before anything is written. Raises ConfigError."""
        micro = {k: jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for k, x in self.abstract_batch().items()}
        jax.eval_shape(self.fns.eval_step, self.abstract_state()["params"], micro)

    def compile_abstract(self):
        """(compiled train step, abstract state): AOT-compiled from shapes alone."""
        state = self.abstract_state()
        return self.fns.train_step.lower(state, self.abstract_batch()).compile(), state


def setup(cfg: Config, devices: Optional[Sequence[jax.Device]] = None, *, model_spec: Optional[ModelSpec] = None,
          data: Any = None, load_data: bool = False, vocab: Optional[int] = None,
          run_dir: Optional[Path] = None) -> Setup:
    """Validates ``cfg`` on ``devices`` (default: all) and builds the run, in the order of the module docstring.

    Args:
      model_spec: the model to train; None builds ``model.family`` from the registry.
      data: a data source; with ``load_data`` and none given, ``cfg.data`` is loaded (a
        tokenizer saved in ``run_dir`` must match the one the data builds).
      vocab: the vocabulary when ``model.vocab_size`` is 0 and no data is loaded (else the
        configured tokenizer's is computed).

    Raises:
      ConfigError, ShardingError, DataError: bad input, named.
    """
    devices = list(devices) if devices is not None else jax.devices()
    sizes = resolve_sizes(cfg.mesh, len(devices))
    check_against_mesh(cfg, sizes, devices[0].platform)
    sinks.check(cfg)
    rules = Rules.from_config(cfg.sharding)
    check_mesh_used(rules, sizes)
    if model_spec is not None and cfg.model.family != "custom":
        raise ConfigError(f"model.family: a ModelSpec given in Python is a custom model; set model.family: custom "
                          f"(its own settings go under model.options), not '{cfg.model.family}'")
    family = lm.family_of(cfg) if model_spec is None else None
    if family is not None:
        rules.check_names(family.logical_axes, f"model family '{family.name}'")
    if data is None and load_data:
        saved = tokenizers.load_json(Path(run_dir)) if run_dir is not None and Path(run_dir).is_dir() else None
        data = datalib.load(cfg, saved)
    model_cfg = cfg.model
    if family is not None:
        tokenizer = getattr(data, "tokenizer", None)
        if tokenizer is None and not vocab:
            vocab = vocab_for(cfg)
        model_cfg = lm.model_config(cfg, lm.resolve_vocab(cfg, vocab, tokenizer and tokenizer.vocab_size))
        model_spec = lm.model_spec(cfg, family, model_cfg)
    mesh = build_mesh(cfg.mesh, devices)
    run_plan = plan.make(cfg, mesh, rules, model_spec)
    fns = step.build(run_plan, model_spec)
    s = Setup(cfg, devices, mesh, rules, model_spec, fns, run_plan, data, family, model_cfg)
    if family is None and data is not None:  # a model given in Python: its loss is checked before any run
        s.check_loss()
    return s


def vocab_for(cfg: Config) -> int:
    """A family's vocabulary without loading the data for training: ``model.vocab_size``, else the
    configured tokenizer's (a char vocabulary reads the corpus). Raises DataError like the data."""
    return getattr(cfg.model, "vocab_size", 0) or datalib.vocab_size(cfg)
