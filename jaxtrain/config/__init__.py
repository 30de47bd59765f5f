"""Typed run configuration: the schema (``schema``), its value checks (``checks``) and its
loading from YAML + dotted overrides (``loading``)."""
from jaxtrain.config.checks import check_against_mesh, check_consistency, positive
from jaxtrain.config.loading import from_dict, load, parse_override, resolve_resource
from jaxtrain.config.schema import (
    DEFAULT_FAMILY,
    MESH_AXES,
    CheckpointConfig,
    Config,
    CustomModelConfig,
    DataConfig,
    MeshConfig,
    MetricsConfig,
    ModelConfig,
    OptimizerConfig,
    ProfileConfig,
    RunConfig,
    ShardingConfig,
    TrainConfig,
    family_config,
)
from jaxtrain.errors import ConfigError

__all__ = [
    "DEFAULT_FAMILY", "MESH_AXES", "CheckpointConfig", "Config", "ConfigError", "CustomModelConfig", "DataConfig",
    "MeshConfig", "MetricsConfig", "ModelConfig", "OptimizerConfig", "ProfileConfig", "RunConfig",
    "ShardingConfig", "TrainConfig", "check_against_mesh", "check_consistency", "family_config", "from_dict",
    "load", "parse_override", "positive", "resolve_resource",
]
