"""Imports of the JAX stack for a command-line process: two import-time scans it does not need.

``lean()`` wraps the command line's first import of JAX and Flax:

- JAX's ``jax.numpy`` looks for a ROCm plugin by reading the metadata (``METADATA``, parsed as an
  e-mail message) of every installed distribution: ~0.1-0.14 s for the ~250 of the test environment
  (2-core AMD EPYC). Under ``lean()`` that one caller is shown only the distributions whose
  ``.dist-info``/``.egg-info`` folder on ``sys.path`` is named like a ROCm plugin (``jax_rocm*``,
  the normalized name every such wheel installs under), so an installed plugin is still found.
  Every other caller of ``importlib.metadata.distributions`` gets the full list.
- Flax imports IPython (~0.06 s where it is installed) only to ask whether the process runs inside
  IPython. A command-line process does not (a ``main()`` called from a notebook finds IPython
  already imported, and then nothing changes), so ``import IPython`` fails for the duration and
  Flax records "not in IPython".

Both end with the block: later imports of IPython, and later metadata scans, are untouched.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import os
import sys
from pathlib import Path
from typing import Iterator

# The one module whose scan is narrowed (jax/_src/numpy/array_constructors.py in jax 0.10).
_ROCM_SCANNER = "jax._src.numpy.array_constructors"
_ROCM_PREFIXES = ("jax_rocm", "jax-rocm")


def rocm_candidates() -> list[importlib.metadata.Distribution]:
    """Distributions on ``sys.path`` whose metadata folder is named like a JAX ROCm plugin."""
    found = []
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:  # a zip file, a missing folder
            continue
        for name in names:
            if name.lower().startswith(_ROCM_PREFIXES) and name.endswith((".dist-info", ".egg-info")):
                found.append(importlib.metadata.PathDistribution(Path(entry or ".", name)))
    return found


@contextlib.contextmanager
def lean() -> Iterator[None]:
    """During the block: JAX's ROCm-plugin scan sees only ROCm-named distributions, and ``import
    IPython`` fails unless IPython is already imported (see the module docstring)."""
    full = importlib.metadata.distributions

    def distributions(**kwargs):
        caller = sys._getframe(1).f_globals.get("__name__")
        if caller == _ROCM_SCANNER and not kwargs:
            return iter(rocm_candidates())
        return full(**kwargs)

    block_ipython = "IPython" not in sys.modules
    importlib.metadata.distributions = distributions
    if block_ipython:
        sys.modules["IPython"] = None  # an ImportError for `import IPython` / `from IPython import ...`
    try:
        yield
    finally:
        importlib.metadata.distributions = full
        if block_ipython and sys.modules.get("IPython", 0) is None:
            del sys.modules["IPython"]
