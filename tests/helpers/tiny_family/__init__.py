"""A second model family, defined only in this folder (tests/test_families.py registers it with one line).

``tinylm``: token embedding -> residual ReLU MLP -> logits through the tied embedding, each
position on its own (a bigram model).
It shows what a family folder holds: a config class, an NNX module with logical axis names,
a FLOPs-per-token formula and its list of logical axes (no Hugging Face converter).
"""
from typing import ClassVar, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.config import ModelConfig
from jaxtrain.errors import ConfigError
from jaxtrain.models.family import Family
from jaxtrain.parallel.activations import constrain


class TinyConfig(ModelConfig):
    family: Literal["tinylm"] = "tinylm"
    vocab_size: int = 0
    width: int = 32
    hidden: int = 64
    layout_keys: ClassVar[tuple[str, ...]] = ("vocab_size", "width", "hidden")

    def check(self, cfg) -> None:
        if self.width < 1 or self.hidden < 1:
            raise ConfigError(f"model.width: width and hidden must be >= 1, got {self.width}, {self.hidden}")


class TinyLM(nnx.Module):
    """tokens [batch, length] int32 -> logits [batch, length, vocab] float32."""

    def __init__(self, cfg: TinyConfig, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.1)
        self.embed = nnx.Param(init(rngs.params(), (cfg.vocab_size, cfg.width)), axes=("vocab", "embed"))
        self.w_in = nnx.Param(init(rngs.params(), (cfg.width, cfg.hidden)), axes=("embed", "mlp"))
        self.w_out = nnx.Param(init(rngs.params(), (cfg.hidden, cfg.width)), axes=("mlp", "embed"))

    def __call__(self, tokens, positions=None, segment_ids=None):
        table = constrain(self.embed[...], "vocab", None)
        x = constrain(table[tokens], "batch", "length", "embed")
        h = constrain(jax.nn.relu(x @ self.w_in[...]), "batch", "length", "mlp")
        x = x + h @ self.w_out[...]
        return constrain((x @ table.T).astype(jnp.float32), "batch", "length", "vocab")


def flops_per_token(cfg: TinyConfig, seq_len: int) -> float:
    return 6.0 * (2 * cfg.width * cfg.hidden + cfg.width * cfg.vocab_size)  # 6N, N = the three matmuls


FAMILY = Family(name="tinylm", config=TinyConfig, model=TinyLM, flops_per_token=flops_per_token,
                logical_axes=("batch", "length", "vocab", "embed", "mlp"))
