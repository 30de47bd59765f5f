"""Training: the one run setup (``assembly.setup``), the jitted step (``step``, ``optimizer``), the
loop and its hooks (``loop``, ``hooks``), and ``trainer.fit``, which ties them together.

``python -m jaxtrain.train`` is the command line (``jaxtrain.cli.train``). The names below are
imported on first use, so that command installs its signal handlers (``jaxtrain.runtime.signals``)
before jax is imported. No submodule shares a name with them, so importing one never replaces them.
"""
import importlib

from jaxtrain.errors import NonFiniteError

_API = {"fit": "jaxtrain.train.trainer", "Hook": "jaxtrain.train.loop", "RunResult": "jaxtrain.train.loop",
        "Setup": "jaxtrain.train.assembly", "setup": "jaxtrain.train.assembly",
        "ModelSpec": "jaxtrain.train.model_spec"}
__all__ = ["Hook", "ModelSpec", "NonFiniteError", "RunResult", "Setup", "fit", "setup"]


def __getattr__(name: str):
    if name in _API:
        value = globals()[name] = getattr(importlib.import_module(_API[name]), name)
        return value
    raise AttributeError(f"module 'jaxtrain.train' has no attribute '{name}'")
