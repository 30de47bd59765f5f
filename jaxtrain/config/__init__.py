"""Typed run configuration (``schema``) and its loading from YAML + overrides (``loading``)."""
from jaxtrain.config.loading import UniqueKeyLoader, from_dict, load, parse_override, resolve_resource
from jaxtrain.config.schema import (MESH_AXES, CheckpointConfig, Config, ConfigError, DataConfig, MeshConfig,
                                    ModelConfig, OptimizerConfig, ProfileConfig, RunConfig, ShardingConfig,
                                    TrainConfig, check_against_mesh, check_consistency)

__all__ = [
    "MESH_AXES", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "MeshConfig", "ModelConfig",
    "OptimizerConfig", "ProfileConfig", "RunConfig", "ShardingConfig", "TrainConfig", "UniqueKeyLoader",
    "check_against_mesh", "check_consistency", "from_dict", "load", "parse_override", "resolve_resource",
]
