"""The named errors every entry point turns into ``error: <key>: ...`` and an exit code.

Each concern raises its own subclass (``ConfigError`` in config, ``DataError`` in data,
``ShardingError`` in parallel, ``CheckpointError`` in checkpoint, ``NonFiniteError`` in
train); the CLIs catch :class:`JaxtrainError` once (``jaxtrain.cli.common``) and exit
with the error's ``exit_code``.
"""
from __future__ import annotations


class JaxtrainError(Exception):
    """Base of the errors a run reports by name instead of a traceback."""

    exit_code = 1


class InputError(JaxtrainError):
    """Bad input (config, data, checkpoint, path, environment): nothing was trained or damaged."""

    exit_code = 2
