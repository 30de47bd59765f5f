"""Tokenize once: the token cache ``python -m jaxtrain.data.prepare [--config FILE] [key=value ...] --out DIR``
writes (its command line: :mod:`jaxtrain.cli.prepare`).

Reads ``data.path`` (text/JSONL/Parquet/ArrayRecord, as training would),
tokenizes it with the configured tokenizer and BOS/EOS, and writes

- ``tokens-NNNNN-of-MMMMM.arrayrecord``: one record per kept document, little-endian int32 ids;
- ``lengths.u32``: the token count of every document (little-endian uint32), so a trainer can
  lay out rows without reading the documents;
- ``cache.json``: format, tokenizer identity (SHA-256 for file tokenizers), BOS/EOS ids, counts.

``DIR`` may be local, ``gs://`` or ``s3://`` (written locally, then copied with ``etils.epath``).
Point ``data.path`` (or a ``data.mixture`` entry) at ``DIR`` to train from it; a run with a
different tokenizer is refused. A progress bar shows documents and tokens/s.
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxtrain.config import Config
from jaxtrain.data import sources, store
from jaxtrain.data.corpus import read_texts
from jaxtrain.data.tokenizers import identity, make_tokenizer, special_ids
from jaxtrain.errors import DataError


def prepare(cfg: Config, out: str, docs_per_shard: int = 100_000, progress: bool = True) -> dict:
    """Tokenizes ``cfg.data.path`` into a cache at ``out``; returns the cache index (cache.json).

    Raises:
      DataError: unreadable source, malformed record, or a source with no usable document.
    """
    from array_record.python.array_record_module import ArrayRecordWriter
    d = cfg.data
    src = sources.open_source(d.path, d.format, d.text_field, d.separator)
    stats = store.new_stats()
    keep_bytes = d.tokenizer == "byte"
    char_text = lambda: "".join(  # noqa: E731  (char vocabularies need one pass over the text first)
        t if isinstance(t, str) else t.decode("utf-8", "replace")
        for t in read_texts(src, range(len(src)), keep_bytes, store.new_stats()))
    tok = make_tokenizer(cfg.data, char_text)
    bos, eos = special_ids(tok, d.add_bos, d.add_eos, d.bos_token, d.eos_token)

    remote = sources.is_remote(out)
    local = Path(tempfile.mkdtemp(prefix="jaxtrain-prepare-")) if remote else Path(out).expanduser()
    local.mkdir(parents=True, exist_ok=True)
    n_shards = max(1, -(-len(src) // docs_per_shard))
    shards, lengths = [], []
    writer, shard_docs, shard_tokens = None, 0, 0

    def close_shard():
        nonlocal writer
        if writer is not None:
            writer.close()
            shards[-1].update(documents=shard_docs, tokens=shard_tokens)
            writer = None

    bar = _Progress(len(src), progress)
    t0 = time.perf_counter()
    texts = (store.as_text(src[i], keep_bytes, stats) for i in range(len(src)))
    for ids in store.tokenize_all(texts, tok, bos, eos, stats, on_batch=bar.update):
        if writer is None or shard_docs >= docs_per_shard:
            close_shard()
            name = f"tokens-{len(shards):05d}-of-{n_shards:05d}.arrayrecord"
            shards.append({"file": name})
            writer = ArrayRecordWriter(str(local / name), "group_size:1")
            shard_docs = shard_tokens = 0
        writer.write(np.asarray(ids, "<i4").tobytes())
        lengths.append(len(ids))
        shard_docs += 1
        shard_tokens += len(ids)
    close_shard()
    bar.close()
    if not lengths:
        raise DataError(f"data.path: '{d.path}' has no document with at least 2 tokens")
    seconds = time.perf_counter() - t0
    (local / "lengths.u32").write_bytes(np.asarray(lengths, "<u4").tobytes())
    meta = {"format": store.CACHE_FORMAT, "version": 1, "source": d.path, "tokenizer": identity(tok),
            "bos_id": bos, "eos_id": eos, "vocab_size": tok.vocab_size, "documents": len(lengths),
            "tokens": int(sum(lengths)), "lengths_file": "lengths.u32", "shards": shards, "stats": stats,
            "seconds": round(seconds, 3)}
    (local / store.CACHE_META).write_text(json.dumps(meta, indent=1))
    if remote:
        _upload(local, out)
    return meta


def _upload(local: Path, out: str) -> None:
    """Copies the cache written in ``local`` to the remote ``out``, the index last (a reader never sees a
    partial cache), then removes ``local``."""
    dest = sources._epath(out)
    dest.mkdir(parents=True, exist_ok=True)
    for f in sorted(local.iterdir()):
        if f.name != store.CACHE_META:
            (dest / f.name).write_bytes(f.read_bytes())
    (dest / store.CACHE_META).write_text((local / store.CACHE_META).read_text())
    shutil.rmtree(local)


class _Progress:
    """A rich progress bar of documents with a tokens/s figure (or nothing when disabled)."""

    def __init__(self, total: int, enabled: bool):
        self.tokens, self.t0, self.bar = 0, time.perf_counter(), None
        if enabled:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
            self.bar = Progress(TextColumn("tokenizing"), BarColumn(), TextColumn("{task.completed}/{task.total} docs"),
                                TextColumn("{task.fields[tps]}"), TimeRemainingColumn())
            self.bar.start()
            self.task = self.bar.add_task("prepare", total=total, tps="")

    def update(self, docs: int, tokens: int) -> None:
        self.tokens += tokens
        if self.bar is not None:
            rate = self.tokens / max(1e-9, time.perf_counter() - self.t0)
            self.bar.update(self.task, advance=docs, tps=f"{rate:,.0f} tokens/s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def check_out(out: str) -> None:
    """A local ``--out`` must be a folder that is new, empty or an earlier cache (it has ``cache.json``):
    the cache's files would otherwise be mixed into a folder of other files.

    Raises:
      ConfigError: naming the folder (or the file in its way).
    """
    if sources.is_remote(out):
        return
    from jaxtrain.config.paths import check_folder
    from jaxtrain.errors import ConfigError
    check_folder("--out", out)
    folder = Path(out).expanduser()
    if folder.is_dir() and any(folder.iterdir()) and not (folder / store.CACHE_META).is_file():
        raise ConfigError(f"--out: '{out}' holds other files and is not a token cache (no cache.json); name a new "
                          f"or empty folder")


if __name__ == "__main__":  # python -m jaxtrain.data.prepare: the command line lives in jaxtrain/cli/prepare.py
    from jaxtrain.cli.prepare import main
    sys.exit(main())
