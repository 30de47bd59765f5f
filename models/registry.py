"""The model families ``model.family`` can name, and how to add one.

A family is a folder (a package) whose ``__init__`` defines ``FAMILY``, a
:class:`jaxtrain.models.family.Family`: its config class, its NNX module, its FLOPs
per token, its logical axis names and, optionally, its Hugging Face converter and
its own loss. Adding a family is adding its folder and one line to :data:`FAMILIES`.
A family in another installed package registers itself with an entry point in the
``jaxtrain.families`` group (``name = "package.path"``), which every command sees;
:func:`register` does the same from Python. Nothing outside ``models/`` imports a
family by name; everything asks this registry.
"""
from __future__ import annotations

import importlib
from importlib import metadata
from typing import TYPE_CHECKING

from jaxtrain.errors import ConfigError

if TYPE_CHECKING:
    from jaxtrain.models.family import Family

# model.family -> the package holding FAMILY (one line per family).
FAMILIES: dict[str, str] = {
    "llama": "jaxtrain.models.llama",
    "mixtral": "jaxtrain.models.mixtral",
}


ENTRY_POINTS = "jaxtrain.families"  # the entry-point group of families in other packages


def register(name: str, package: str) -> None:
    """Makes ``model.family: <name>`` build the family defined in ``package`` (e.g. a family of your own)."""
    FAMILIES[name] = package


def _all() -> dict[str, str]:
    plugins = {e.name: e.value for e in metadata.entry_points(group=ENTRY_POINTS)}
    return {**plugins, **FAMILIES}


def names() -> list[str]:
    return sorted(_all())


def get(name: str) -> "Family":
    """The family registered as ``name``.

    Raises:
      ConfigError: no such family, or its package does not define a matching ``FAMILY``.
    """
    # A built-in name wins over a plugin's, so it needs no scan of the installed packages (~10 ms each).
    known = FAMILIES if name in FAMILIES else _all()
    if name not in known:
        raise ConfigError(f"model.family: unknown family '{name}' (known: {', '.join(sorted(known))}, and custom "
                          f"for a model given to jaxtrain.fit in Python)")
    family = getattr(importlib.import_module(known[name]), "FAMILY", None)
    if family is None or family.name != name:
        raise ConfigError(f"model.family: package {known[name]} defines no FAMILY named '{name}'")
    return family


def config_class(name: str) -> type:
    """The pydantic config class of family ``name`` (its ``model:`` section schema)."""
    return get(name).config
