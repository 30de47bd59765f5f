"""Training: the one run setup (``setup``), the step (``step``, ``optimizer``), the loop and its
hooks (``loop``, ``hooks``), ``fit`` (``fit``), which ties them together, and Hugging Face
safetensors out of a run and into a new one (``hf``).

``python -m jaxtrain.train`` is the command line (``jaxtrain.cli.train``). The names below are
imported on first use, so that command installs its signal handlers (``jaxtrain.train.preempt``)
before jax is imported.
"""
import importlib
import sys
import types

_API = {"fit": "jaxtrain.train.fit", "NonFiniteError": "jaxtrain.train.loop", "Hook": "jaxtrain.train.loop",
        "RunResult": "jaxtrain.train.loop", "Setup": "jaxtrain.train.setup", "setup": "jaxtrain.train.setup",
        "ModelSpec": "jaxtrain.train.spec"}
__all__ = sorted(_API)


def __getattr__(name: str):
    if name in _API:
        value = globals()[name] = getattr(importlib.import_module(_API[name]), name)
        return value
    raise AttributeError(f"module 'jaxtrain.train' has no attribute '{name}'")


class _Package(types.ModuleType):
    """``jaxtrain.train.fit`` and ``.setup`` stay the functions: importing the submodules of the same
    names would otherwise make the package attributes those modules."""

    def __setattr__(self, name, value):
        if name in _API and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
