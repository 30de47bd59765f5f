"""Keys that only a feature reads, refused when set while that feature is off.

A key set to something other than its default while nothing reads it would be silently ignored
(the run does something else than the config says): instead it is a :class:`ConfigError` naming
the key, the feature that is off and how to turn it on. Switching a feature off is not such a
case: ``checkpoint.enabled=false``, ``train.sample_tokens=0`` and ``profile.steps=0`` are the
off switches of sections a shipped config fills in, and the rest of those sections then has
nothing to act on, as asked. The pipeline keys are checked with the resolved mesh
(``jaxtrain.config.checks.check_pipeline_against_mesh``: ``mesh.stage`` may be -1).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple

from jaxtrain.errors import ConfigError

if TYPE_CHECKING:
    from jaxtrain.config.schema import Config


class Gated(NamedTuple):
    """``key`` (dotted) is read only when ``on(cfg)``; ``needs`` says what turns it on."""

    key: str
    on: Callable[["Config"], bool]
    needs: str


def _documents(cfg: "Config") -> bool:
    return cfg.data.mode != "windows"


def _multi(cfg: "Config") -> bool:
    return cfg.distributed.mode != "off"


def _wandb(cfg: "Config") -> bool:
    return "wandb" in cfg.metrics.sinks


WANDB = "the wandb sink (metrics.sinks: [..., wandb])"
GATED = (
    Gated("metrics.wandb_project", _wandb, WANDB),
    Gated("metrics.wandb_mode", _wandb, WANDB),
    Gated("profile.start_step", lambda c: c.profile.steps > 0, "a trace (profile.steps > 0)"),
    Gated("data.text_field", _documents, "a document mode (data.mode=packed or padded: JSONL and Parquet)"),
    Gated("data.separator", _documents, "a document mode (data.mode=packed or padded)"),
    Gated("data.prefetch", _documents, "a document mode (data.mode=packed or padded: Grain's threads)"),
    Gated("data.bos_token", lambda c: c.data.add_bos, "data.add_bos=true"),
    Gated("data.eos_token", lambda c: c.data.add_eos, "data.add_eos=true"),
    Gated("checkpoint.s3_endpoint", lambda c: (c.checkpoint.dir or "").startswith("s3://"),
          "an S3 checkpoint.dir (s3://BUCKET/PATH)"),
    Gated("checkpoint.best_metric", lambda c: c.checkpoint.keep_best > 0, "checkpoint.keep_best > 0"),
    Gated("checkpoint.best_mode", lambda c: c.checkpoint.keep_best > 0, "checkpoint.keep_best > 0"),
    Gated("distributed.coordinator_address", _multi, "distributed.mode=auto or on"),
    Gated("distributed.num_processes", _multi, "distributed.mode=auto or on"),
    Gated("distributed.process_id", _multi, "distributed.mode=auto or on"),
    Gated("distributed.init_timeout_s", _multi, "distributed.mode=auto or on"),
    Gated("distributed.peer_timeout_s", _multi, "distributed.mode=auto or on"),
    Gated("distributed.stop_check_every", _multi, "distributed.mode=auto or on"),
)


def _value(cfg: "Config", key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _default(cfg: "Config", key: str):
    section, name = key.split(".")
    return type(getattr(cfg, section)).model_fields[name].default


def check_gated(cfg: "Config") -> None:
    """Raises ConfigError for the first key of :data:`GATED` set (not its default) while its feature is off."""
    for gated in GATED:
        value, default = _value(cfg, gated.key), _default(cfg, gated.key)
        if value != default and not gated.on(cfg):
            raise ConfigError(f"{gated.key}: {value!r} is read only with {gated.needs}, which this config does not "
                              f"have; turn that on, or leave {gated.key} at its default ({default!r})")
