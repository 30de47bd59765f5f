"""No float key of the config takes NaN or an infinity: every one, in every section and every registered
family's model section, is a named error before anything starts (exit 2 from the command line).

At 5eb7ae3 ``checkpoint.grace_period_s=.nan`` was accepted and made every SIGTERM to a healthy run exit
75 without saving, and ``distributed.peer_timeout_s=.nan`` killed both processes of a job at their join
with ``ValueError: cannot convert float NaN to integer`` (exit 1)."""
import types
import typing

import pytest
from pydantic import BaseModel

from jaxtrain import config as cfglib
from jaxtrain.cli import train as train_cli
from jaxtrain.config.schema import Config, ModelConfig
from jaxtrain.errors import ConfigError
from jaxtrain.models import registry

BAD = (".nan", ".inf", "-.inf")


def _members(annotation) -> tuple:
    """The types of a union (``Optional[float]``: float and None), else the annotation itself."""
    return typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) \
        else (annotation,)


def float_keys(cls: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key of ``cls`` whose value is (or may be) a float, nested sections included; a
    ``dict[str, float]`` as ``key.x``."""
    keys = []
    for name, field in cls.model_fields.items():
        for member in _members(field.annotation):
            if member is float:
                keys.append(prefix + name)
            elif typing.get_origin(member) is dict and typing.get_args(member)[1] is float:
                keys.append(f"{prefix}{name}.x")
            elif isinstance(member, type) and issubclass(member, BaseModel) and member is not ModelConfig:
                keys += float_keys(member, f"{prefix}{name}.")
    return sorted(set(keys))


def sweep() -> list[tuple[str, str]]:
    """(family, key) for every float key: the sections' once, each family's model keys."""
    out = [("llama", key) for key in float_keys(Config)]
    for family in registry.names():
        out += [(family, "model." + key) for key in float_keys(registry.config_class(family))]
    return out


def test_the_sweep_covers_the_keys_that_failed():
    keys = {key for _, key in sweep()}
    assert {"checkpoint.grace_period_s", "checkpoint.save_timeout_s", "distributed.peer_timeout_s",
            "distributed.init_timeout_s", "train.hang_timeout_s", "optimizer.lr", "data.mixture.x",
            "model.rope_scaling.factor", "model.capacity_factor"} <= keys


@pytest.mark.parametrize("family, key", sweep())
def test_every_float_key_refuses_nan_and_infinities_by_name(family, key):
    for value in BAD:
        override = f"data.mixture={{x: {value}}}" if key == "data.mixture.x" else f"{key}={value}"
        with pytest.raises(ConfigError) as e:
            cfglib.load(None, [f"model.family={family}", override])
        assert str(e.value) == f"{key}: must be a finite number, got {float(value.replace('.', ''))}"


def test_the_command_line_exits_2_naming_the_key(capsys):
    assert train_cli.main(["checkpoint.grace_period_s=.nan", "run.progress=false"]) == 2
    assert "checkpoint.grace_period_s: must be a finite number, got nan" in capsys.readouterr().err


# Where 0 is a meaningful setting (no momentum, no decay, greedy sampling, a loss term off, no epsilon);
# nowhere is -1 one. Every other float key refuses both by name.
ZERO_IS_VALID = {"optimizer.b1", "optimizer.b2", "optimizer.min_lr", "optimizer.weight_decay",
                 "train.sample_temperature", "model.norm_eps", "model.aux_loss_weight", "model.z_loss_weight"}


@pytest.mark.parametrize("family, key", sweep())
def test_every_float_key_refuses_zero_and_minus_one_where_they_mean_nothing(family, key):
    """At 94de100 ``train.sample_temperature=-1`` sampled greedily and ``model.init_std=0`` or ``-1`` started
    a run: both are named now."""
    for value in ("0", "-1"):
        override = f"data.mixture={{x: {value}}}" if key == "data.mixture.x" else f"{key}={value}"
        if value == "0" and key in ZERO_IS_VALID:
            cfglib.load(None, [f"model.family={family}", override])
            continue
        with pytest.raises(ConfigError) as e:
            cfglib.load(None, [f"model.family={family}", override])
        assert str(e.value).startswith(f"{key.removesuffix('.x')}: "), str(e.value)
