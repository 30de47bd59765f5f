"""Checkpoint storage: local disk and ``gs://`` (Orbax writes there directly), and ``s3://``.

Orbax 0.12 cannot write ``s3://`` (it rewrites the URL to ``s3:/...``, fails,
and leaves a ``./s3:`` folder), TensorStore's S3 driver ignores
``AWS_ENDPOINT_URL``, and S3 has no atomic rename. So for ``s3://`` Orbax
writes each step to a local staging directory, every process then uploads
the files it wrote itself (nothing is gathered) with ``s3fs``, and the
commit marker is written last, as one PUT (atomic on S3). A restore
downloads the step into staging and reads it from there. Only public
``s3fs``/``etils`` APIs are used; nothing in Orbax is patched.

A :class:`Store` addresses names relative to the checkpoint root (``'12'``,
``'12/COMMIT.json'``).
"""
from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path
from typing import Optional

from etils import epath

from jaxtrain.checkpoint import integrity
from jaxtrain.config import paths
from jaxtrain.errors import StorageError


def is_s3(path) -> bool:
    return str(path).startswith("s3://")


class Store:
    """A local or ``gs://`` checkpoint root, through ``etils.epath``."""

    def __init__(self, root: epath.Path):
        self.root = root
        self.url = str(root)

    def names(self) -> list[str]:
        return [p.name for p in self.root.iterdir()] if self.root.exists() else []

    def read_text(self, rel: str) -> str:
        return (self.root / rel).read_text()

    def write_text(self, rel: str, text: str) -> None:
        """Readers see all of ``text`` or nothing: temporary file + rename locally, one PUT on GCS."""
        path = self.root / rel
        if "://" in str(path):
            path.write_text(text)
            return
        tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def unlink(self, rel: str) -> None:
        path = self.root / rel
        if path.exists():
            path.unlink()

    def rmtree(self, rel: str) -> None:
        path = self.root / rel
        if path.exists():
            path.rmtree()

    def rename(self, rel: str, new_rel: str) -> None:
        """Moves ``rel`` (a step directory) to ``new_rel``: a rename locally, copy + delete on GCS."""
        if self.url.startswith("gs://"):
            self._gcs().mv(self._gcs_key(rel), self._gcs_key(new_rel), recursive=True)
        else:
            os.replace(self.root / rel, self.root / new_rel)

    def manifest(self, rel: str) -> dict[str, list]:
        """``{path under rel: [bytes, crc32c hex]}`` (``jaxtrain.checkpoint.integrity``): local files are
        read; GCS objects are listed with the CRC32C the server keeps (nothing is downloaded)."""
        if not self.url.startswith("gs://"):
            return integrity.local_manifest(Path(self.root / rel))
        fs, base = self._gcs(), self._gcs_key(rel)
        fs.invalidate_cache(base)  # objects written by TensorStore bypass gcsfs's listing cache
        return {key[len(base) + 1:]: [int(info["size"]), integrity.gcs_crc32c(info.get("crc32c"))]
                for key, info in sorted(fs.find(base, detail=True).items())}

    def _gcs(self):
        import fsspec
        return fsspec.filesystem("gs")

    def _gcs_key(self, rel: str) -> str:
        return f"{self.url[len('gs://'):].rstrip('/')}/{rel}"


class S3Store(Store):
    """An ``s3://bucket/prefix`` root through ``s3fs`` (any S3-compatible server via ``endpoint``).

    Raises:
      StorageError: s3fs is not installed, the URL has no bucket, or the bucket does not exist.
    """

    def __init__(self, url: str, endpoint: Optional[str] = None):
        try:
            import s3fs
        except ImportError:
            raise StorageError(f"checkpoint.dir: '{url}' needs s3fs (pip install s3fs)") from None
        self.url = url.rstrip("/")
        self.prefix = self.url[len("s3://"):]
        bucket = self.prefix.split("/")[0]
        if not bucket:
            raise StorageError(f"checkpoint.dir: '{url}' has no bucket name")
        self.fs = s3fs.S3FileSystem(endpoint_url=endpoint, use_listings_cache=False)
        try:
            self.fs.ls(bucket, detail=False)
        except FileNotFoundError:
            raise StorageError(f"checkpoint.dir: bucket '{bucket}' does not exist"
                               + (f" at {endpoint}" if endpoint else "")) from None
        except Exception as err:  # noqa: BLE001 - network/credential errors, named
            raise StorageError(f"checkpoint.dir: cannot list '{url}': {type(err).__name__}: {err}") from None

    def _key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if rel else self.prefix

    def names(self) -> list[str]:
        try:
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.prefix, detail=False, refresh=True)]
        except FileNotFoundError:
            return []

    def read_text(self, rel: str) -> str:
        return self.fs.cat_file(self._key(rel)).decode()

    def write_text(self, rel: str, text: str) -> None:
        self.fs.pipe_file(self._key(rel), text.encode())  # one PUT: atomic

    def unlink(self, rel: str) -> None:
        if self.fs.exists(self._key(rel)):
            self.fs.rm_file(self._key(rel))

    def rmtree(self, rel: str) -> None:
        keys = self.fs.find(self._key(rel))
        if keys:
            self.fs.rm(keys)

    def rename(self, rel: str, new_rel: str) -> None:
        self.fs.mv(self._key(rel), self._key(new_rel), recursive=True)

    def upload(self, local_dir: Path, rel: str) -> int:
        """Uploads every file under ``local_dir`` to ``rel/``; returns the bytes sent."""
        total = 0
        for path in sorted(Path(local_dir).rglob("*")):
            if path.is_file():
                self.fs.put_file(str(path), self._key(f"{rel}/{path.relative_to(local_dir).as_posix()}"))
                total += path.stat().st_size
        return total

    def download(self, rel: str, local_dir: Path) -> int:
        """Downloads every object under ``rel/`` into ``local_dir``; returns the bytes received."""
        base, total = self._key(rel) + "/", 0
        for key in self.fs.find(self._key(rel)):
            dest = Path(local_dir) / key[len(base):]
            dest.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(key, str(dest))
            total += dest.stat().st_size
        return total


def _check_bucket(url: str) -> None:
    """Raises StorageError unless gcsfs is installed and the bucket of ``gs://bucket/...`` exists."""
    try:
        import fsspec
        fs = fsspec.filesystem("gs")
    except ImportError:
        raise StorageError(f"checkpoint.dir: '{url}' needs gcsfs (pip install 'jaxtrain[gcs]')") from None
    bucket = url[len("gs://"):].split("/")[0]
    quiet = logging.getLogger("gcsfs")  # its retries log whole tracebacks; the error below says it once
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        found = fs.exists(bucket)
    except Exception as err:  # noqa: BLE001 - network/credential errors, named
        raise StorageError(f"checkpoint.dir: cannot reach '{url}': {type(err).__name__}: {err}") from None
    finally:
        quiet.setLevel(level)
    if not found:
        raise StorageError(f"checkpoint.dir: bucket '{bucket}' does not exist")


def open_store(spec: str, s3_endpoint: Optional[str] = None) -> Store:
    """The store for ``checkpoint.dir`` (a local path, ``gs://...`` or ``s3://...``)."""
    if is_s3(spec):
        return S3Store(spec, s3_endpoint or os.environ.get("AWS_ENDPOINT_URL"))
    if spec.startswith("gs://"):
        _check_bucket(spec)
        return Store(epath.Path(spec))
    if "://" in spec:
        return Store(epath.Path(spec))
    paths.check_folder("checkpoint.dir", spec)
    return Store(epath.Path(os.path.abspath(os.path.expanduser(spec))))
