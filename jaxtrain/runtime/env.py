"""Reading jaxtrain's environment variables (on/off switches, cache folders) the same way everywhere."""
from __future__ import annotations

import logging
import os
from pathlib import Path


def switch(name: str, default: bool, on: str, off: str, env: os._Environ | dict = os.environ) -> bool:
    """Whether the variable ``name`` is on: ``1`` on, ``0`` off, unset or empty ``default``.

    Args:
      on, off: what ``1`` and ``0`` mean, for the error message.

    Raises:
      InputError: any other value (e.g. ``false``, which a truthiness test would read as on), as
        ``NAME='value': expected 1 (on) or 0 (off)``.
    """
    value = env.get(name) or ("1" if default else "0")
    if value not in ("0", "1"):
        from jaxtrain.errors import InputError
        raise InputError(f"{name}={value!r}: expected 1 ({on}) or 0 ({off})")
    return value == "1"


def cache_folder_usable(path: Path, what: str) -> bool:
    """Whether ``path`` is a folder this process can write, made now if it is missing.

    A cache is an optimisation, so a folder it cannot have is not an error: one warning naming ``what``
    (e.g. ``JAX_COMPILATION_CACHE_DIR=/x``) and the reason goes to the ``jaxtrain`` logger, and the
    caller runs without that cache rather than failing on each entry.
    """
    problem = ""
    for p in (path, *path.parents):
        if p.exists() and not p.is_dir():
            problem = f"'{p}' is a file, not a folder"
            break
        if p.exists():
            break
    if not problem:
        try:
            path.mkdir(parents=True, exist_ok=True)
            if not os.access(path, os.W_OK | os.X_OK):
                problem = f"'{path}' is not writable"
        except OSError as err:
            problem = f"'{path}' cannot be made ({err.strerror or err})"
    if problem:
        logging.getLogger("jaxtrain").warning(f"warning: {what}: {problem}, so that cache is off for this run")
    return not problem
