"""Checkpoint storage paths: local disk, ``gs://`` (Orbax native) and ``s3://``.

Local and ``gs://`` paths are plain ``etils.epath`` paths. ``s3://`` needs work
(see jax-stack-facts "Checkpoints (Orbax)"): Orbax 0.12 mangles the URL, and
TensorStore ignores ``AWS_ENDPOINT_URL``; that part lives in
:mod:`jaxtrain.ckpt_s3_orbax`, the one module that touches Orbax internals.
"""
from __future__ import annotations

import os
import uuid
from typing import Optional

from etils import epath


def is_s3(path) -> bool:
    return str(path).startswith("s3://")


def resolve(spec: str, s3_endpoint: Optional[str] = None) -> epath.Path:
    """The checkpoint directory for ``checkpoint.dir`` (local path, ``gs://...`` or ``s3://...``).

    Raises:
      CheckpointError: an ``s3://`` path whose support libraries are missing.
    """
    if is_s3(spec):
        from jaxtrain import ckpt_s3_orbax
        return ckpt_s3_orbax.s3_path(spec, s3_endpoint or os.environ.get("AWS_ENDPOINT_URL"))
    if "://" in spec:
        return epath.Path(spec)
    return epath.Path(os.path.abspath(os.path.expanduser(spec)))


def handler_registry(directory: epath.Path):
    """None (Orbax's defaults) except for S3, whose array handler carries the endpoint."""
    if is_s3(directory):
        from jaxtrain import ckpt_s3_orbax
        return ckpt_s3_orbax.handler_registry(directory)
    return None


def write_atomic(path: epath.Path, text: str) -> None:
    """Writes a small file so that readers see all of it or nothing.

    Local: temporary file + rename. Object stores: one PUT is atomic already.
    """
    if "://" in str(path):
        path.write_text(text)
        return
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def unlink(path: epath.Path) -> None:
    try:
        path.unlink()
    except (FileNotFoundError, OSError):
        if path.exists():
            raise


def rmtree(path: epath.Path) -> None:
    if path.exists():
        path.rmtree()
