"""What the trainer trains: any Flax NNX model with its loss (``ModelSpec``).

``jaxtrain.fit(cfg, spec, data)`` trains a ModelSpec with the same mesh, rules,
checkpoints, preemption, metrics and resume as the language models; the registered
families become one through :func:`jaxtrain.train.lm.model_spec`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import jax
from flax import nnx

from jaxtrain.models.family import LossFn


@dataclass(frozen=True)
class ModelSpec:
    """A model and its loss.

    Attributes:
      make: ``rngs -> nnx.Module``. Every ``nnx.Param`` carries its logical axis names as
        metadata, one per dimension: ``nnx.Param(value, axes=('embed', 'mlp'))``; the
        rule set maps them onto the mesh. Other variable kinds (batch stats, RNG state)
        are not trained.
      loss: ``(model, batch) -> (loss, aux)`` for one micro-batch dict of ``[micro, ...]``
        arrays: the mean loss and a dict of scalar metrics; ``aux['weight']`` (optional) is
        the count the mean is over, so uneven micro-batches accumulate to the full-batch mean.
      name: shown in logs and the run directory.
      unit, units_per_example: what throughput counts (``tokens``, seq_len per example for
        a language model; ``examples``, 1 otherwise): rows report ``<unit>_per_sec``.
      flops_per_unit: training FLOPs per unit (forward + backward) for MFU, or None (MFU n/a).
      example: one example's fields as ShapeDtypeStructs (no batch dims), for compiling from
        shapes alone (plan, explain); None: taken from the data's validation batches.
      logical_axes: logical names the model's activations use (the params' are read from it).
      eval_loss: the aux metric that validation reports as its loss (``val_loss``) instead of the
        training objective, e.g. a MoE's ``ce_loss`` without the router losses, the number to
        compare with a dense model; None: the loss itself.
      head_loss: ``(model, logits, blocks' aux, batch) -> (loss, aux)``, the loss from a decoder's
        outputs, for the 1F1B pipeline schedule (the shared decoder's families); None: no 1F1B.
    """

    make: Callable[[nnx.Rngs], nnx.Module]
    loss: LossFn
    name: str = "custom"
    unit: str = "examples"
    units_per_example: int = 1
    flops_per_unit: Optional[float] = None
    example: Optional[dict[str, jax.ShapeDtypeStruct]] = None
    logical_axes: tuple[str, ...] = field(default=())
    eval_loss: Optional[str] = None
    head_loss: Optional[Callable] = None
