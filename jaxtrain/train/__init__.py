"""Training: the one run setup (``setup``), the step (``step``, ``optimizer``), the loop and its
hooks (``loop``, ``hooks``), ``fit`` (``fit``), which ties them together, and Hugging Face
safetensors out of a run and into a new one (``hf``).

``python -m jaxtrain.train`` is the command line (``jaxtrain.cli.train``).
"""
from jaxtrain.train.fit import fit
from jaxtrain.train.loop import NonFiniteError
from jaxtrain.train.loop import Hook, RunResult
from jaxtrain.train.setup import Setup, setup
from jaxtrain.train.spec import ModelSpec

__all__ = ["Hook", "ModelSpec", "NonFiniteError", "RunResult", "Setup", "fit", "setup"]
