"""Saying a decision once per process (``model.attention``, ``model.matmul`` and
``optimizer.implementation`` resolving ``auto``). The main thread and the precompile thread
(``jaxtrain.train.precompile``) trace programs at the same time; with a check of the set and then an
add in each, both logged the same line (seen on warm starts)."""
from __future__ import annotations

import threading
from typing import Hashable

_lock = threading.Lock()


def first(seen: set, item: Hashable) -> bool:
    """True the first time ``item`` goes into ``seen`` (the caller's set), atomically across threads."""
    with _lock:
        if item in seen:
            return False
        seen.add(item)
        return True
