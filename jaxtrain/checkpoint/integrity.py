"""What a commit marker records to check a step before it is restored: every leaf's shape and
dtype (:func:`tree_summary`), and every file's size and CRC32C (:func:`local_manifest`).

CRC32C (Castagnoli) is the checksum GCS keeps for every object, so a ``gs://`` step is checked
from the listing's metadata without reading it; local files are read once in 4 MiB chunks
(``google-crc32c``'s C implementation). A manifest is ``{relative path: [bytes, crc32c hex]}``.
"""
from __future__ import annotations

import base64
from pathlib import Path
from typing import Any, Optional

import google_crc32c
import jax

from jaxtrain.errors import CorruptCheckpointError
from jaxtrain.parallel.rules import path_str

CHUNK = 4 << 20


def tree_summary(tree: Any) -> dict[str, list]:
    """``{'params.layers.0.attn.wq': [[64, 4, 16], 'float32'], ...}`` for every array leaf."""
    return {path_str(p): [list(x.shape), str(x.dtype)] for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def mismatches(saved: dict[str, list], expected: dict[str, list]) -> list[str]:
    """Human-readable differences between two :func:`tree_summary` results (empty if they match)."""
    out = []
    for path in sorted(set(saved) | set(expected)):
        s, e = saved.get(path), expected.get(path)
        if s is None:
            out.append(f"{path}: missing in checkpoint (expected shape {tuple(e[0])} {e[1]})")
        elif e is None:
            out.append(f"{path}: not in the current model (saved shape {tuple(s[0])} {s[1]})")
        elif s != e:
            out.append(f"{path}: saved shape {tuple(s[0])} {s[1]}, expected {tuple(e[0])} {e[1]}")
    return out


def file_crc32c(path: Path) -> str:
    """The CRC32C of a local file, 8 hex digits."""
    crc = google_crc32c.Checksum()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc.update(chunk)
    return crc.hexdigest().decode()


def gcs_crc32c(value: Optional[str]) -> Optional[str]:
    """GCS's object ``crc32c`` (base64 of the big-endian value) as 8 hex digits."""
    return base64.b64decode(value).hex() if value else None


def local_manifest(root: Path) -> dict[str, list]:
    """``{path relative to root: [size in bytes, crc32c hex]}`` of every file under ``root``."""
    root = Path(root)
    return {p.relative_to(root).as_posix(): [p.stat().st_size, file_crc32c(p)]
            for p in sorted(root.rglob("*")) if p.is_file()}


def problems(expected: dict[str, list], actual: dict[str, list]) -> list[str]:
    """What differs between the recorded and the present files (sizes first, then checksums).

    A present file that was not recorded is not a problem (a marker never lists itself).
    """
    out = []
    for rel, (size, crc) in sorted(expected.items()):
        got = actual.get(rel)
        if got is None:
            out.append(f"{rel}: missing")
        elif got[0] != size:
            out.append(f"{rel}: {got[0]} bytes, expected {size}")
        elif crc and got[1] and got[1] != crc:
            out.append(f"{rel}: CRC32C {got[1]}, expected {crc} (same size: the contents changed)")
    return out


def check(step: int, url: str, expected: Optional[dict], actual: dict) -> None:
    """Raises CorruptCheckpointError naming the step and its first differing files.

    ``expected`` None: a marker from before checksums were recorded; nothing to compare.
    """
    if expected is None:
        return
    bad = problems(expected, actual)
    if bad:
        raise corrupt(step, url, bad)


def corrupt(step: int, url: str, bad: list[str]) -> CorruptCheckpointError:
    """The error for ``step`` with its first problems; ``.detail`` is the message without the hint."""
    more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
    detail = f"checkpoint step {step} in {url} is corrupt: " + "; ".join(bad[:5]) + more
    err = CorruptCheckpointError(f"{detail}. Set checkpoint.fallback=true to resume from the previous good step")
    err.detail = detail
    return err
