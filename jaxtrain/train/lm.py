"""A registered model family (``model.family``) as a ModelSpec: a language model over tokens.

The family gives the module, its FLOPs per token and its loss (by default the causal-LM
cross-entropy of ``jaxtrain.models.family``); this module adds what every language model
shares: the vocabulary from the tokenizer when ``model.vocab_size`` is 0, tokens as the
throughput unit, and one example's fields (``data.mode`` decides whether packed positions
and segment ids come with it).
"""
from __future__ import annotations

from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp

from jaxtrain.config import Config
from jaxtrain.errors import ConfigError
from jaxtrain.models import registry
from jaxtrain.models.family import Family
from jaxtrain.train.model_spec import ModelSpec


def family_of(cfg: Config) -> Family:
    """The registered family of ``model.family``. Raises ConfigError (unknown, or ``custom``)."""
    if cfg.model.family == "custom":
        raise ConfigError(f"model.family: 'custom' is a model built in Python and given to jaxtrain.fit "
                          f"with a ModelSpec; from a config alone these families can be trained: "
                          f"{', '.join(registry.names())}")
    family = registry.get(cfg.model.family)
    if "vocab_size" not in family.config.model_fields:
        raise ConfigError(f"model.family: '{family.name}' is trained on text, so its config needs a vocab_size "
                          f"field (0 = the tokenizer's); {family.config.__name__} has none")
    return family


def resolve_vocab(cfg: Config, vocab: Optional[int], tokenizer_vocab: Optional[int]) -> int:
    """``model.vocab_size``, else ``vocab``, else the tokenizer's.

    Raises:
      ConfigError: ``model.vocab_size`` is smaller than the tokenizer's vocabulary.
    """
    configured = cfg.model.vocab_size
    if configured and tokenizer_vocab and configured < tokenizer_vocab:
        raise ConfigError(f"model.vocab_size: {configured} is smaller than the tokenizer's vocabulary "
                          f"({tokenizer_vocab})")
    out = configured or vocab or tokenizer_vocab
    if not out:
        raise ConfigError("model.vocab_size: 0 and no tokenizer to take the vocabulary from")
    return out


def model_config(cfg: Config, vocab: int):
    """``cfg.model`` with ``vocab_size`` set to ``vocab`` (what the family's module is built from).

    With ``mesh.stage > 1`` the layers are stacked (``scan_layers`` implied): the pipeline splits the
    stacked layers over the stages. Checkpoints do not depend on it (``jaxtrain.checkpoint.layouts``).
    """
    update = {"vocab_size": vocab}
    if cfg.mesh.stage > 1 and getattr(cfg.model, "scan_layers", None) is False:
        update["scan_layers"] = True
    return cfg.model.model_copy(update=update)


def model_spec(cfg: Config, family: Family, mcfg) -> ModelSpec:
    """The ModelSpec of ``mcfg`` (``cfg.model`` with its vocabulary resolved)."""
    seq_len = cfg.data.seq_len
    fields = ("inputs", "targets", "loss_mask") + (() if cfg.data.mode == "windows" else ("positions", "segment_ids"))
    example = {f: jax.ShapeDtypeStruct((seq_len,), jnp.int32) for f in fields}
    return ModelSpec(make=partial(family.model, mcfg), loss=family.loss, name=family.name, unit="tokens",
                     units_per_example=seq_len, flops_per_unit=family.flops_per_token(mcfg, seq_len),
                     example=example, logical_axes=family.logical_axes, eval_loss=family.eval_loss,
                     head_loss=family.head_loss)
