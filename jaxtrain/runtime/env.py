"""Reading jaxtrain's on/off environment variables the same way everywhere."""
from __future__ import annotations

import os


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
