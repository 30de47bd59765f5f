"""Host memory reuse: glibc malloc keeps large freed buffers instead of returning them to the OS.

XLA:CPU allocates each executable's temporaries (tens of MiB for a small model's train step) on
every call. glibc serves an allocation that large with a fresh ``mmap`` and gives it back with
``munmap`` when it is freed, so every step faults in and zeroes every page again: on the
shakespeare-char config that was ~30% of the step (97 -> 67 ms median, 2-core AMD EPYC,
``benchmarks/step.py``), most of it kernel time. Raising glibc's mmap and trim thresholds
(``mallopt(3)`` ``M_MMAP_THRESHOLD``, ``M_TRIM_THRESHOLD``; the same as the environment variables
``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_``) makes those buffers come from the heap
and stay there for the next step (an allocator such as tcmalloc keeps freed memory the same way).

The cost: up to ``threshold`` bytes of freed memory stay in the process instead of going back to
the OS. ``run.reuse_host_memory: false`` keeps glibc's defaults.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from typing import Optional

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
THRESHOLD = 1 << 30  # bytes: buffers up to 1 GiB come from (and return to) the heap
_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def reuse_freed_memory(threshold: int = THRESHOLD) -> Optional[str]:
    """Sets glibc's mmap and trim thresholds to ``threshold`` bytes (for this whole process).

    Returns why nothing was changed (not Linux with glibc, or the user set either threshold in the
    environment, or in ``GLIBC_TUNABLES``), else None. Never raises.
    """
    if sys.platform != "linux":
        return "not Linux"
    if any(k in os.environ for k in _ENV) or "malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return "malloc thresholds set in the environment"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return "no glibc mallopt"
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if not (mallopt(M_MMAP_THRESHOLD, threshold) and mallopt(M_TRIM_THRESHOLD, threshold)):
        return "mallopt refused"
    return None
