"""The model families ``model.family`` can name, and how to add one.

A family is a folder (a package) whose ``__init__`` defines ``FAMILY``, a
:class:`jaxtrain.models.family.Family`: its config class, its NNX module, its FLOPs
per token, its logical axis names and, optionally, its Hugging Face converter and
its own loss. Adding a family is adding its folder and one line to :data:`FAMILIES`
(or, outside this package, one :func:`register` call). Nothing outside ``models/``
imports a family by name; everything asks this registry.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from jaxtrain.config.schema import ConfigError

if TYPE_CHECKING:
    from jaxtrain.models.family import Family

# model.family -> the package holding FAMILY (one line per family).
FAMILIES: dict[str, str] = {
    "llama": "jaxtrain.models.llama",
}


def register(name: str, package: str) -> None:
    """Makes ``model.family: <name>`` build the family defined in ``package`` (e.g. a family of your own)."""
    FAMILIES[name] = package


def names() -> list[str]:
    return sorted(FAMILIES)


def get(name: str) -> "Family":
    """The family registered as ``name``.

    Raises:
      ConfigError: no such family, or its package does not define a matching ``FAMILY``.
    """
    if name not in FAMILIES:
        raise ConfigError(f"model.family: unknown family '{name}' (known: {', '.join(names())}, and custom "
                          f"for a model given to jaxtrain.fit in Python)")
    family = getattr(importlib.import_module(FAMILIES[name]), "FAMILY", None)
    if family is None or family.name != name:
        raise ConfigError(f"model.family: package {FAMILIES[name]} defines no FAMILY named '{name}'")
    return family


def config_class(name: str) -> type:
    """The pydantic config class of family ``name`` (its ``model:`` section schema)."""
    return get(name).config
