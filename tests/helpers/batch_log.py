"""Which batches a run trains on: every global batch the windows/array iterator draws
(``jaxtrain.data.arrays.BatchIterator``) appended to a file as a digest of its rows, before they are
cut into micro-batches, so runs with another process count or gradient accumulation compare equal.
Process 0 writes (every process draws the same global batch). Put on a subprocess's path with
``batch_probe/`` (its ``sitecustomize``), or :func:`install` in this process."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

ENV = "JAXTRAIN_TEST_BATCH_LOG"


class _Logged:
    """An iterator of global batches that appends each one's digest to ``path``."""

    def __init__(self, inner, path: str):
        self._inner, self._path = inner, path

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self._inner)
        import jax
        if jax.process_index() == 0:
            digest = hashlib.sha1(b"".join(np.ascontiguousarray(batch[k]).tobytes() for k in sorted(batch)))
            with open(self._path, "a") as f:
                f.write(digest.hexdigest()[:16] + "\n")
        return batch

    def get_state(self):
        return self._inner.get_state()

    def set_state(self, state):
        self._inner.set_state(state)


def logging_init(path: str):
    """A ``BatchIterator.__init__`` that wraps the iterator's draws in :class:`_Logged`."""
    from jaxtrain.data import arrays
    original = arrays.BatchIterator.__init__

    def logged_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self._iter = _Logged(self._iter, path)
    return logged_init


def install(path: str) -> None:
    """Every BatchIterator made from now on in this process logs its draws to ``path``."""
    from jaxtrain.data import arrays
    arrays.BatchIterator.__init__ = logging_init(path)


def read(path: Path) -> list[str]:
    return Path(path).read_text().split() if Path(path).exists() else []
