"""Data: sources, tokenizers, packing, the Grain pipeline, the token cache and multi-host batches.

``load(cfg)`` (corpus.py) is what the trainer calls. The windows-mode names
(``load_corpus``, ``train_dataset``, ``val_batches``, ``BatchIterator``) are
re-exported for existing callers.
"""
from jaxtrain.data.corpus import Data, load
from jaxtrain.data.tokenizers import DataError
from jaxtrain.data.windows import BatchIterator, Corpus, corpus_files, load_corpus, train_dataset, val_batches

__all__ = ["Data", "load", "DataError", "BatchIterator", "Corpus", "corpus_files", "load_corpus",
           "train_dataset", "val_batches"]
