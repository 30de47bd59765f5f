"""A model that is not a language model, trained by ``jaxtrain.fit``: an MLP on scikit-learn's digits.

    python -m jaxtrain.examples.digits [--config digits_mlp] [key=value ...]

The data set ships inside the scikit-learn wheel (``sklearn.datasets.load_digits``: 1,797
8x8 grey images of handwritten digits, pixel values 0..16), so this runs offline. Features
are the 64 pixels scaled to [0, 1] (float32), labels are 0..9 (int32); a seeded shuffle
holds out the last ``data.val_fraction`` for validation. The model, its loss and its data
are plain Python; the config (``configs/digits_mlp.yaml``, ``model.family: custom``)
chooses the mesh, rules, optimizer, steps and checkpoints exactly as for a language model,
so the same command runs on one CPU or, with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``
and ``mesh.fsdp=8``, on eight simulated devices. Needs ``pip install -e ".[examples]"``.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxtrain.config import Config
from jaxtrain.data import ArrayData
from jaxtrain.errors import ConfigError
from jaxtrain.parallel.activations import constrain
from jaxtrain.train.model_spec import ModelSpec

N_FEATURES, N_CLASSES = 64, 10


class DigitsMLP(nnx.Module):
    """x [batch, 64] float32 -> logits [batch, 10] float32: Linear, GELU, Linear.

    Logical axes: the input features are the model width ('embed', sharded by FSDP rule
    sets), the hidden units 'mlp' (tensor-parallel rule sets split them), the classes
    'classes' (named by the config's ``sharding.extra_rules``).
    """

    def __init__(self, hidden: int, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.w1 = nnx.Param(init(rngs.params(), (N_FEATURES, hidden)), axes=("embed", "mlp"))
        self.b1 = nnx.Param(jnp.zeros((hidden,)), axes=("mlp",))
        self.w2 = nnx.Param(init(rngs.params(), (hidden, N_CLASSES)), axes=("mlp", "classes"))
        self.b2 = nnx.Param(jnp.zeros((N_CLASSES,)), axes=("classes",))

    def __call__(self, x: jax.Array) -> jax.Array:
        h = constrain(jax.nn.gelu(x @ self.w1[...] + self.b1[...]), "batch", "mlp")
        return h @ self.w2[...] + self.b2[...]


def loss(model: DigitsMLP, batch: dict) -> tuple[jax.Array, dict]:
    """Mean cross-entropy of a micro-batch ``{'x': [b, 64] f32, 'y': [b] int32}``, and its accuracy."""
    logits = model(batch["x"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return ce, {"accuracy": (logits.argmax(-1) == batch["y"]).mean()}


OPTIONS = {"hidden": 128}  # model.options of this example, with their defaults


def model_spec(cfg: Config) -> ModelSpec:
    """The ModelSpec of ``model.options.hidden`` (hidden units).

    Raises:
      ConfigError: not ``model.family: custom`` (see configs/digits_mlp.yaml), an unknown option,
        or a hidden size that is not a positive int.
    """
    if cfg.model.family != "custom":
        raise ConfigError(f"model.family: the digits example is a custom model (model.family: custom, as in "
                          f"configs/digits_mlp.yaml), not '{cfg.model.family}'")
    unknown = sorted(set(cfg.model.options) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"model.options.{unknown[0]}: not an option of the digits example "
                          f"(known: {', '.join(OPTIONS)})")
    hidden = cfg.model.options.get("hidden", OPTIONS["hidden"])
    if type(hidden) is not int or hidden < 1:
        raise ConfigError(f"model.options.hidden: must be a positive int, got {hidden!r}")
    matmul_params = N_FEATURES * hidden + hidden * N_CLASSES
    return ModelSpec(make=lambda rngs: DigitsMLP(hidden, rngs), loss=loss, name="digits_mlp",
                     flops_per_unit=6.0 * matmul_params, logical_axes=("batch", "mlp"))


def data(cfg: Config) -> ArrayData:
    """scikit-learn's digits as ArrayData: a seeded shuffle (``data.seed``), the last ``data.val_fraction`` held out."""
    from sklearn.datasets import load_digits  # the examples extra

    digits = load_digits()
    x, y = (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int32)
    order = np.random.default_rng(cfg.data.seed).permutation(len(y))
    n_val = int(round(len(y) * cfg.data.val_fraction))
    train, val = order[:-n_val], order[-n_val:]
    return ArrayData({"x": x[train], "y": y[train]}, {"x": x[val], "y": y[val]}, cfg)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from jaxtrain.cli.common import add_config_args, cli, config_args, enable_compilation_cache, prog
    parser = argparse.ArgumentParser(prog=prog("jaxtrain.examples.digits"),
                                     description="Train an MLP classifier on scikit-learn's bundled digits.")
    add_config_args(parser, default="configs/digits_mlp.yaml")
    args = config_args(parser, sys.argv[1:] if argv is None else argv)

    def body() -> None:
        import jax
        enable_compilation_cache(jax.devices())
        from jaxtrain.config import load
        from jaxtrain.train import fit
        cfg = load(args.config or "digits_mlp", args.overrides)
        result = fit(cfg, model_spec(cfg), data(cfg))
        evals = [r for r in result.rows if "val_accuracy" in r]
        if evals:
            print(f"validation accuracy {evals[-1]['val_accuracy']:.4f} at step {evals[-1]['step']}")
    return cli(body)


if __name__ == "__main__":
    sys.exit(main())
