"""Flax NNX model code (installed as ``jaxtrain.models``). No mesh code here."""
from jaxtrain.models.llama import Llama, LlamaConfig, count_params

__all__ = ["Llama", "LlamaConfig", "count_params"]
