"""Tokenized documents: built in memory from a source, or read lazily from a prepared cache.

A store has ``lengths`` ([n] int64 tokens per document, BOS/EOS included),
``get(i) -> [lengths[i]] int32`` and ``stats`` (counts of what was kept,
skipped and repaired). Bad documents are counted, never fatal: empty and
one-token documents are skipped (they give no training pair), invalid UTF-8
is kept as bytes by the byte tokenizer and replaced (U+FFFD) by the others.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from jaxtrain.data.tokenizers import HFTokenizer, Tokenizer, identity
from jaxtrain.errors import DataError

CACHE_META = "cache.json"
CACHE_FORMAT = "jaxtrain-token-cache"


def new_stats() -> dict:
    return {"documents": 0, "tokens": 0, "skipped_empty": 0, "skipped_short": 0, "invalid_utf8": 0}


def as_text(doc, keep_bytes: bool, stats: dict):
    """bytes -> str (errors replaced and counted) unless the tokenizer keeps raw bytes."""
    if isinstance(doc, str) or keep_bytes:
        return doc
    try:
        return doc.decode("utf-8")
    except UnicodeDecodeError:
        stats["invalid_utf8"] += 1
        return doc.decode("utf-8", errors="replace")


def with_specials(ids: np.ndarray, bos: Optional[int], eos: Optional[int]) -> np.ndarray:
    parts = ([np.asarray([bos], np.int32)] if bos is not None else []) + [ids] + (
        [np.asarray([eos], np.int32)] if eos is not None else [])
    return np.concatenate(parts) if len(parts) > 1 else ids


def tokenize_all(texts, tok: Tokenizer, bos: Optional[int], eos: Optional[int], stats: dict,
                 on_batch: Optional[Callable[[int, int], None]] = None, chunk: int = 256):
    """Yields the kept documents' int32 token arrays; ``on_batch(docs, tokens)`` reports progress."""
    buf: list = []

    def flush():
        encoded = tok.encode_batch(buf) if isinstance(tok, HFTokenizer) else [tok.encode(t) for t in buf]
        n_tok = 0
        for ids in encoded:
            if len(ids) == 0:
                stats["skipped_empty"] += 1
                continue
            ids = with_specials(ids, bos, eos)
            if len(ids) < 2:
                stats["skipped_short"] += 1
                continue
            stats["documents"] += 1
            stats["tokens"] += len(ids)
            n_tok += len(ids)
            yield ids
        if on_batch:
            on_batch(len(buf), n_tok)
        buf.clear()

    for text in texts:
        buf.append(text)
        if len(buf) >= chunk:
            yield from flush()
    if buf:
        yield from flush()


class MemoryStore:
    """Documents concatenated into one int32 buffer with offsets."""

    def __init__(self, docs: list[np.ndarray], stats: dict):
        self.lengths = np.asarray([len(d) for d in docs], np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])
        self.tokens = np.concatenate(docs).astype(np.int32) if docs else np.zeros(0, np.int32)
        self.stats = stats

    def get(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]


class CacheStore:
    """A cache written by ``python -m jaxtrain.data.prepare``: ArrayRecord shards of int32 documents.

    Records are read on demand, so a process reads only the documents of its own rows.
    """

    def __init__(self, directory: str, meta: dict):
        from array_record.python.array_record_data_source import ArrayRecordDataSource
        self.directory, self.meta = directory, meta
        self.stats = dict(meta.get("stats", {}))
        root = Path(directory)
        raw = (root / meta["lengths_file"]).read_bytes()
        self.lengths = np.frombuffer(raw, "<u4").astype(np.int64)
        if len(self.lengths) != meta["documents"]:
            raise DataError(f"{directory}: {meta['lengths_file']} lists {len(self.lengths)} documents, "
                            f"{CACHE_META} says {meta['documents']}; re-run jaxtrain.data.prepare")
        self._src = ArrayRecordDataSource([str(root / s["file"]) for s in meta["shards"]])

    def get(self, i: int) -> np.ndarray:
        ids = np.frombuffer(self._src[int(i)], "<i4")
        if len(ids) != self.lengths[i]:
            raise DataError(f"{self.directory}: document {i} has {len(ids)} tokens, the index says "
                            f"{self.lengths[i]}; the cache is damaged, re-run jaxtrain.data.prepare")
        return ids


def is_cache(path: str) -> bool:
    from jaxtrain.data.sources import _epath, is_remote
    if is_remote(path):
        return _epath(path.rstrip("/") + "/" + CACHE_META).exists()
    return (Path(path).expanduser() / CACHE_META).is_file()


def read_meta(path: str) -> dict:
    """The cache index of a local cache directory. Raises DataError if unreadable or not a cache."""
    from jaxtrain.data.sources import _epath, is_remote
    try:
        index = _epath(path.rstrip("/") + "/" + CACHE_META) if is_remote(path) else Path(path).expanduser() / CACHE_META
        meta = json.loads(index.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: cannot read {CACHE_META}: {err}") from None
    if not isinstance(meta, dict) or meta.get("format") != CACHE_FORMAT:
        raise DataError(f"{path}: {CACHE_META} is not a jaxtrain token cache")
    return meta


def open_cache(path: str, tok: Tokenizer, bos: Optional[int], eos: Optional[int]) -> CacheStore:
    """Opens a prepared cache after checking that it was made with this tokenizer and BOS/EOS.

    Raises:
      DataError: not a jaxtrain cache, or made with another tokenizer or other special tokens.
    """
    from jaxtrain.data.sources import is_remote, localize
    if is_remote(path):  # copy the (small) index and the shards locally once
        base = path.rstrip("/")
        meta = read_meta(base)
        local = Path(localize(base + "/" + CACHE_META)).parent
        for name in [meta["lengths_file"]] + [s["file"] for s in meta["shards"]]:
            dest = local / name
            if not dest.exists():
                dest.write_bytes(Path(localize(base + "/" + name)).read_bytes())
        path = str(local)
    root = Path(path).expanduser()
    meta = read_meta(str(root))
    want = {"tokenizer": identity(tok), "bos_id": bos, "eos_id": eos}
    have = {k: meta.get(k) for k in want}
    if have != want:
        raise DataError(f"{path}: the cache was tokenized with {json.dumps(have)} but this run uses "
                        f"{json.dumps(want)}; re-run jaxtrain.data.prepare with this tokenizer")
    return CacheStore(str(root), meta)
