"""What a model family provides, and the causal-LM loss the decoder families share.

A family folder (``models/<name>/``) holds its config class, its NNX module, its
Hugging Face converter, its FLOPs-per-token formula and its logical axis names, and
exposes them as ``FAMILY = Family(...)`` in its ``__init__``. A family is a language
model trained on ``cfg.data``: its config class has a ``vocab_size`` field (0 = the
tokenizer's), and the trainer builds the model as ``family.model(cfg, rngs)`` with that
field resolved. The module maps ``tokens [batch, length] int32`` (and optional
``positions`` and ``segment_ids``, same shape) to ``logits [batch, length, vocab]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxtrain.config.base import ModelConfig

# (model, batch) -> (loss, aux): the mean loss of one micro-batch, and a dict of scalars.
# aux["weight"] (optional) is the count that mean is over (e.g. loss-mask tokens), so micro-
# batches with different counts accumulate to the full-batch mean; every other aux entry is
# a metric (auxiliary losses such as MoE load balancing are added to the loss and reported here).
LossFn = Callable[[nnx.Module, dict], tuple[jax.Array, dict]]


class HFConverter(Protocol):
    """A family's Hugging Face ``safetensors`` converter (names and layouts of its HF class)."""

    architecture: str  # e.g. "LlamaForCausalLM": what export writes
    # Every HF architecture import reads with this converter (e.g. Llama and Mistral), each
    # with its HF config class's defaults; optional (default: ``{architecture: {}}``).
    architectures: dict[str, dict[str, Any]]

    def vocab_size(self, tensors: dict) -> int: ...

    def to_hf(self, params: dict, cfg: Any) -> dict[str, jax.Array]: ...
    def from_hf(self, tensors: dict, cfg: Any) -> dict: ...
    def shapes(self, cfg: Any) -> dict[str, tuple]: ...
    def hf_config(self, cfg: Any, seq_len: int) -> dict: ...

    def model_keys(self, hf: dict, seq_len: int) -> tuple[dict, list[str]]:
        """config.json -> (this family's ``model:`` keys, notes); ConfigError names what it cannot
        represent. Without it a family cannot be imported from Hugging Face."""
        ...


def masked_cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum(cross-entropy * mask) / max(sum(mask), 1), sum(mask)).

    logits [batch, length, vocab] float32; targets, mask [batch, length] int32.
    """
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    weight = mask.sum().astype(jnp.float32)
    return (ce * mask.astype(ce.dtype)).sum() / jnp.maximum(weight, 1.0), weight


def causal_lm_loss(model: nnx.Module, batch: dict) -> tuple[jax.Array, dict]:
    """Next-token cross-entropy over ``loss_mask`` of a batch dict of [batch, length] int32 arrays.

    ``positions`` and ``segment_ids`` are passed to the model when the batch has them
    (packed documents); windows batches leave them out (one segment at positions 0..T-1).
    """
    logits = model(batch["inputs"], positions=batch.get("positions"), segment_ids=batch.get("segment_ids"))
    return causal_lm_head_loss(model, logits, None, batch)


def causal_lm_head_loss(model: nnx.Module, logits: jax.Array, aux: Any, batch: dict) -> tuple[jax.Array, dict]:
    """:func:`causal_lm_loss` from the decoder's outputs (logits [batch, length, vocab]; the blocks'
    aux unused): what a pipeline computes at its last stage."""
    loss, weight = masked_cross_entropy(logits, batch["targets"], batch["loss_mask"])
    return loss, {"weight": weight}


@dataclass(frozen=True)
class Family:
    """A model family: see the module docstring. ``hf`` is None when it has no HF converter."""

    name: str
    config: type[ModelConfig]
    model: Callable[[Any, nnx.Rngs], nnx.Module]  # (config with vocab_size resolved, rngs) -> module
    flops_per_token: Callable[[Any, int], float]  # (config, seq_len) -> training FLOPs per token
    logical_axes: tuple[str, ...]  # every logical name its parameters and activations use
    loss: LossFn = causal_lm_loss
    # (model, logits, the blocks' aux [layers, ...], batch) -> (loss, aux): the loss from the decoder's
    # outputs, which a 1F1B pipeline computes microbatch by microbatch at its last stage.
    head_loss: Optional[Callable[[nnx.Module, jax.Array, Any, dict], tuple[jax.Array, dict]]] = causal_lm_head_loss
    hf: Optional[HFConverter] = None
    eval_loss: Optional[str] = None  # the aux metric validation reports as its loss (see ModelSpec)
