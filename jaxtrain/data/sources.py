"""Random-access document sources: text files, JSONL, Parquet and ArrayRecord, local or remote.

A source has ``len()`` and ``source[i] -> bytes | str`` (one document), which
is the Grain ``RandomAccessDataSource`` protocol, and ``where(i)`` naming the
file and line/row of document ``i`` for error messages. Reads are thread-safe
(Grain reads from a thread pool): JSONL reads by offset with ``os.pread``
rather than through a shared file handle.

Remote paths (``gs://``, ``s3://``) are listed and copied once into a local
cache (``JAXTRAIN_DATA_CACHE`` or ``~/.cache/jaxtrain/remote``) through
``etils.epath``, then read like local files.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
import threading
from pathlib import Path
from typing import Optional, Protocol, Union, runtime_checkable

from jaxtrain.errors import DataError

REMOTE = ("gs://", "s3://")
FORMATS = ("text", "jsonl", "parquet", "arrayrecord")
Doc = Union[bytes, str]


@runtime_checkable
class DataSource(Protocol):
    """A random-access document source: what ``open_source`` returns and what the data pipeline
    (``jaxtrain.data.pipeline``) tokenizes, packs and windows. Grain's ``RandomAccessDataSource``
    plus ``where``. ``__getitem__`` is called from Grain's reader threads: it must be thread-safe."""

    def __len__(self) -> int:
        """The number of documents."""

    def __getitem__(self, i: int) -> Doc:
        """Document ``i`` (0 <= i < len), as UTF-8 bytes or str."""

    def where(self, i: int) -> str:
        """Where document ``i`` comes from (file and line, row or byte), for error messages."""


def is_remote(path: str) -> bool:
    return path.startswith(REMOTE)


def _epath(path: str):
    try:
        from etils import epath
        return epath.Path(path)
    except Exception as err:  # missing gcsfs / s3fs backends raise ImportError or ValueError
        raise DataError(f"data.path: cannot open '{path}': {err} (gs:// needs gcsfs, s3:// needs s3fs)") from None


def localize(path: str) -> str:
    """A local copy of a remote file (copied once, keyed by its URL); local paths pass through."""
    if not is_remote(path):
        return path
    root = Path(os.environ.get("JAXTRAIN_DATA_CACHE", "~/.cache/jaxtrain/remote")).expanduser()
    dest = root / hashlib.sha256(path.encode()).hexdigest()[:16] / Path(path).name
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_suffix(dest.suffix + ".part")
        tmp.write_bytes(_epath(path).read_bytes())
        tmp.rename(dest)
    return str(dest)


def expand(path: str) -> list[str]:
    """Files named by a path or glob (``stdlib``: this interpreter's Lib/*.py), sorted.

    Raises:
      DataError: a directory, a path that is not a regular file (a FIFO...), or a glob that matches no file.
    """
    if path == "stdlib":
        pattern = os.path.join(sysconfig.get_paths()["stdlib"], "*.py")
    elif is_remote(path):
        scheme, rest = path.split("://", 1)
        bucket, _, key = rest.partition("/")
        if not any(c in key for c in "*?["):
            return [path]
        root = _epath(f"{scheme}://{bucket}")
        files = sorted(str(p) for p in root.glob(key))
        if not files:
            raise DataError(f"data.path: no file matches '{path}'")
        return files
    else:
        pattern = os.path.expanduser(path)
    if os.path.isdir(pattern):
        raise DataError(f"data.path: '{path}' is a directory; give a file or a glob such as '{path}/*.txt'")
    matches = glob.glob(pattern)
    files = sorted(p for p in matches if os.path.isfile(p))
    if not files:
        odd = [p for p in matches if not os.path.isdir(p)]  # a FIFO, socket or device: reading it may block
        if odd:
            raise DataError(f"data.path: '{odd[0]}' is not a regular file (a pipe, socket or device); "
                            f"give a file or a glob of files")
        raise DataError(f"data.path: no file matches '{path}'")
    return files


def detect_format(files: list[str], fmt: str) -> str:
    if fmt != "auto":
        return fmt
    name = files[0].lower()
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith((".arrayrecord", ".array_record")) or ".arrayrecord-" in name:
        return "arrayrecord"
    return "text"


class TextSource:
    """Text files: one document per file, or each file split on ``separator`` (empty pieces skipped)."""

    def __init__(self, files: list[str], separator: Optional[str] = None):
        self.files = [localize(f) for f in files]
        self.names = list(files)
        self.sep = separator.encode("utf-8") if separator else None
        self._index: list[tuple[int, int, int]] = []  # (file, start, end) byte offsets
        for fi, f in enumerate(self.files):
            if self.sep is None:
                self._index.append((fi, 0, -1))
                continue
            data, pos = Path(f).read_bytes(), 0
            for piece in data.split(self.sep):
                if piece.strip():
                    self._index.append((fi, pos, pos + len(piece)))
                pos += len(piece) + len(self.sep)

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i: int) -> bytes:
        fi, start, end = self._index[i]
        if end < 0:
            return Path(self.files[fi]).read_bytes()
        with open(self.files[fi], "rb") as f:
            return os.pread(f.fileno(), end - start, start)

    def where(self, i: int) -> str:
        fi, start, _ = self._index[i]
        return self.names[fi] + (f" (byte {start})" if self.sep else "")


class JsonlSource:
    """JSON Lines with the document text in ``field``; blank lines are skipped.

    Raises (on read):
      DataError: invalid JSON, a missing field, or a non-string value, naming file and line.
    """

    def __init__(self, files: list[str], field: str = "text"):
        self.field = field
        self.names = list(files)
        self.files = [localize(f) for f in files]
        self._fds = [os.open(f, os.O_RDONLY) for f in self.files]
        self._index: list[tuple[int, int, int, int]] = []  # (file, offset, length, line number)
        for fi, f in enumerate(self.files):
            offset = 0
            with open(f, "rb") as fh:
                for lineno, line in enumerate(fh, start=1):
                    if line.strip():
                        self._index.append((fi, offset, len(line), lineno))
                    offset += len(line)

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i: int) -> str:
        fi, offset, length, lineno = self._index[i]
        raw = os.pread(self._fds[fi], length, offset)
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            try:
                obj = json.loads(raw.decode("utf-8", errors="replace"))
            except json.JSONDecodeError as err:
                raise DataError(f"{self.names[fi]}:{lineno}: invalid JSON: {err}") from None
        if not isinstance(obj, dict) or self.field not in obj:
            keys = ", ".join(list(obj)[:8]) if isinstance(obj, dict) else type(obj).__name__
            raise DataError(f"{self.names[fi]}:{lineno}: no field '{self.field}' (data.text_field); "
                            f"the record has: {keys}")
        value = obj[self.field]
        if not isinstance(value, str):
            raise DataError(f"{self.names[fi]}:{lineno}: field '{self.field}' is {type(value).__name__}, "
                            f"not a string")
        return value

    def where(self, i: int) -> str:
        fi, _, _, lineno = self._index[i]
        return f"{self.names[fi]}:{lineno}"

    def __del__(self):
        for fd in getattr(self, "_fds", []):
            os.close(fd)


class ParquetSource:
    """Parquet files with the document text in ``column``; row groups are read lazily and cached.

    Raises:
      DataError: a file without ``column`` (at construction), or a null/non-string value (on read),
        naming file and row.
    """

    def __init__(self, files: list[str], column: str = "text"):
        import pyarrow.parquet as pq
        self.column, self.names = column, list(files)
        self._files, self._groups = [], []  # per file: ParquetFile; global (file, group, first row, rows)
        self._lock = threading.Lock()
        self._cache: dict[tuple[int, int], list] = {}
        for fi, f in enumerate(files):
            try:
                pf = pq.ParquetFile(localize(f))
            except Exception as err:
                raise DataError(f"{f}: not a readable Parquet file: {err}") from None
            if column not in pf.schema_arrow.names:
                raise DataError(f"{f}: no column '{column}' (data.text_field); columns: "
                                f"{', '.join(pf.schema_arrow.names)}")
            self._files.append(pf)
            row = 0
            for g in range(pf.num_row_groups):
                n = pf.metadata.row_group(g).num_rows
                self._groups.append((fi, g, row, n))
                row += n
        self._starts = [0]
        for _, _, _, n in self._groups:
            self._starts.append(self._starts[-1] + n)

    def __len__(self) -> int:
        return self._starts[-1]

    def _locate(self, i: int) -> tuple[int, int, int, int]:
        import bisect
        gi = bisect.bisect_right(self._starts, i) - 1
        fi, g, first, _ = self._groups[gi]
        return fi, g, first + i - self._starts[gi], i - self._starts[gi]

    def __getitem__(self, i: int) -> str:
        fi, g, row, k = self._locate(i)
        with self._lock:
            values = self._cache.get((fi, g))
            if values is None:
                values = self._files[fi].read_row_group(g, columns=[self.column]).column(0).to_pylist()
                if len(self._cache) >= 4:
                    self._cache.pop(next(iter(self._cache)))
                self._cache[(fi, g)] = values
        value = values[k]
        if not isinstance(value, (str, bytes)):
            raise DataError(f"{self.names[fi]}: row {row}: column '{self.column}' is "
                            f"{'null' if value is None else type(value).__name__}, not a string")
        return value

    def where(self, i: int) -> str:
        fi, _, row, _ = self._locate(i)
        return f"{self.names[fi]}: row {row}"


class ArrayRecordSource:
    """ArrayRecord files whose records are UTF-8 documents (bytes)."""

    def __init__(self, files: list[str]):
        from array_record.python.array_record_data_source import ArrayRecordDataSource
        self.names = list(files)
        self._src = ArrayRecordDataSource([localize(f) for f in files])

    def __len__(self) -> int:
        return len(self._src)

    def __getitem__(self, i: int) -> bytes:
        return self._src[i]

    def where(self, i: int) -> str:
        return f"{', '.join(self.names[:2])}{'...' if len(self.names) > 2 else ''}: record {i}"


def open_source(path: str, fmt: str = "auto", text_field: str = "text",
                separator: Optional[str] = None) -> DataSource:
    """The document source for ``path`` (a file or glob) in format ``fmt`` ('auto': by extension).

    Raises:
      DataError: no file matches, or a format that cannot be read.
    """
    files = expand(path)
    kind = detect_format(files, fmt)
    if kind == "jsonl":
        return JsonlSource(files, text_field)
    if kind == "parquet":
        return ParquetSource(files, text_field)
    if kind == "arrayrecord":
        return ArrayRecordSource(files)
    return TextSource(files, separator)
