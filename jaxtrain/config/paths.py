"""Where each path key of the config may point, checked when the config is read.

A local path is always accepted, and ``file:///abs/path`` (or ``file://localhost/abs/path``)
is the same local path. Remote storage is accepted only by the keys whose code can read and
write it (``gs://`` through TensorStore/gcsfs, ``s3://`` through s3fs); any other scheme is a
:class:`ConfigError` naming the key and the schemes it supports, before anything is built.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional
from urllib.parse import unquote

from jaxtrain.errors import ConfigError

REMOTE = ("gs", "s3")
# key -> the remote schemes it supports (none: local only)
SCHEMES: dict[str, tuple[str, ...]] = {
    "checkpoint.dir": REMOTE, "data.path": REMOTE, "data.mixture": REMOTE,
    "data.tokenizer_path": (), "run.dir": (), "sharding.rules": (),
}
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.S)


def supported(key: str, remote: Optional[tuple[str, ...]] = None) -> str:
    """``'a local path, file://, gs:// or s3://'`` for ``key``."""
    names = ["a local path", "file://", *(f"{s}://" for s in (SCHEMES[key] if remote is None else remote))]
    return ", ".join(names[:-1]) + " or " + names[-1]


def normalize(key: str, value: str, remote: Optional[tuple[str, ...]] = None) -> str:
    """``value`` as the config keeps it: a ``file://`` URL becomes its local path; a local path or a
    supported remote URL is kept as given. ``remote``: the schemes a key outside :data:`SCHEMES`
    (a command-line option) takes.

    Raises:
      ConfigError: ``'<key>: unsupported storage scheme ...'`` naming what ``key`` supports, or a
        ``file://`` URL that is not absolute.
    """
    allowed = SCHEMES[key] if remote is None else remote
    m = _URL.match(value)
    if not m:
        if value[:5].lower() == "file:":  # file:/abs would silently be a relative folder named 'file:'
            raise ConfigError(f"{key}: '{value}' is not a local file URL; write file:///absolute/path")
        return value
    scheme, rest = m.group(1).lower(), m.group(2)
    if scheme == "file":
        if rest.startswith("localhost/"):
            rest = rest[len("localhost"):]
        if not rest.startswith("/"):
            raise ConfigError(f"{key}: '{value}' is not a local file URL; write file:///absolute/path")
        return unquote(rest)
    if scheme in allowed and rest.split("/")[0]:
        return f"{scheme}://{rest}"  # GS:// -> gs://: the libraries below know the lower-case schemes only
    if scheme in allowed:
        raise ConfigError(f"{key}: '{value}' names no bucket")
    raise ConfigError(f"{key}: unsupported storage scheme '{scheme}://' in '{value}'; "
                      f"{key} takes {supported(key, remote)}")


def check_folder(key: str, path: str) -> None:
    """A local folder ``path`` can be made or used: no file stands in its place or on its way.

    Raises:
      ConfigError: ``"<key>: '<p>' exists and is not a directory"`` for the nearest existing part ``p``.
    """
    here = os.path.abspath(os.path.expanduser(path))
    for part in (here, *(str(p) for p in Path(here).parents)):
        if os.path.lexists(part):
            if not os.path.isdir(part):
                raise ConfigError(f"{key}: '{part}' exists and is not a directory")
            return
