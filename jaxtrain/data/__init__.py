"""Data: sources, tokenizers, packing, the Grain pipelines, the token cache and multi-host batches.

``load(cfg)`` (corpus.py) is what the trainer calls for a language model; ``ArrayData``
(arrays.py) holds the in-memory examples of any other model.
"""
from jaxtrain.data.arrays import ArrayData
from jaxtrain.data.corpus import Data, load, vocab_size
from jaxtrain.errors import DataError

__all__ = ["ArrayData", "Data", "DataError", "load", "vocab_size"]
