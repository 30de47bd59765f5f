"""Compatibility alias: the tokenizers live in ``jaxtrain.data.tokenizers``."""
from jaxtrain.data.tokenizers import *  # noqa: F401,F403
from jaxtrain.data.tokenizers import DataError, Tokenizer, from_json, load, load_json, save  # noqa: F401
