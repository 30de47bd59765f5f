"""What the trainer calls: ``load(cfg)`` -> tokenizer, a batch-iterator factory and validation batches.

``data.mode=windows`` (the default) is the original recipe: random windows over
the concatenated files (windows.py). ``packed`` and ``padded`` read documents
from ``data.path`` or a weighted ``data.mixture`` of paths, each a text file/glob,
JSONL, Parquet, ArrayRecord or a token cache made by ``jaxtrain.data.prepare``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Optional

from jax.sharding import NamedSharding

from jaxtrain.config import Config
from jaxtrain.data import arrays, packing, pipeline, sources, store, windows
from jaxtrain.data.tokenizers import Tokenizer, from_json, identity, make_tokenizer, special_ids
from jaxtrain.errors import DataError


@dataclass
class Data:
    """A text data set for a language model; ``jaxtrain.fit`` reads any object with these fields."""

    tokenizer: Optional[Tokenizer]
    val: dict  # field -> [eval_batches, micro_batch, seq_len] int32 (packing.FIELDS; windows: 3 of them)
    iterator: Callable[[NamedSharding], object]  # sharding -> iterator with get_state/set_state
    info: list[str] = field(default_factory=list)  # lines for the log
    schedule: Optional[pipeline.Schedule] = None
    bos_id: Optional[int] = None  # prepended to sampling prompts when documents start with it


def read_texts(src, ids, keep_bytes: bool, stats: dict) -> list:
    out = []
    for i in ids:
        try:
            out.append(store.as_text(src[int(i)], keep_bytes, stats))
        except DataError:
            raise
        except Exception as err:  # a reader failing on one record: name it
            raise DataError(f"{src.where(int(i))}: cannot read document: {err}") from None
    return out


def load(cfg: Config, saved: Optional[dict] = None) -> Data:
    """Reads, tokenizes and lays out ``cfg.data`` (before any compile).

    Args:
      saved: the tokenizer identity saved in the run directory by an earlier run, if any.

    Raises:
      DataError: a missing path, malformed record, too-small source, or a tokenizer mismatch.
    """
    d, t = cfg.data, cfg.train
    if d.mode == "windows":
        corpus = windows.load_corpus(cfg, from_json(saved) if saved and saved.get("type") in ("byte", "char")
                                     else None)
        if saved is not None and identity(corpus.tokenizer) != {k: v for k, v in saved.items() if k != "source"}:
            raise DataError(f"data.path: the tokenizer built from '{d.path}' differs from the one saved in the "
                            f"run directory; use a new run.dir or the original corpus")
        val = windows.val_batches(corpus.val, d.seq_len, cfg.micro_batch, t.eval_batches, d.seed)

        def make(sharding):
            ds = windows.train_dataset(corpus.train, d.seq_len, t.global_batch, d.seed)
            return arrays.BatchIterator(ds.map(packing.from_windows), t.grad_accum, sharding)
        info = [f"data: replaced {corpus.invalid_utf8} invalid UTF-8 sequence(s) in '{d.path}' with U+FFFD"
                ] if corpus.invalid_utf8 else []
        return Data(corpus.tokenizer, packing.from_windows(val), make, info)

    specs = dict(d.mixture) if d.mixture else {d.path: None}
    with _mixture_entries(d.mixture):
        return _load_documents(cfg, specs, saved)


@contextlib.contextmanager
def _mixture_entries(mixture: dict):
    """A source's error in a mixture names ``data.mixture``, the key that gave the source."""
    try:
        yield
    except DataError as err:
        text = str(err)
        if not mixture or not text.startswith("data.path: "):
            raise
        raise DataError("data.mixture: " + text[len("data.path: "):]) from None


def _load_documents(cfg: Config, specs: dict, saved: Optional[dict]) -> Data:
    """The document modes (packed, padded) of :func:`load`: ``specs`` is ``{path: weight or None}``."""
    d, t = cfg.data, cfg.train
    caches = {p: store.is_cache(p) for p in specs}
    raw = {p: sources.open_source(p, d.format, d.text_field, d.separator) for p in specs if not caches[p]}
    keep_bytes = d.tokenizer == "byte"
    stats = store.new_stats()
    texts = {p: read_texts(src, range(len(src)), keep_bytes, stats) for p, src in raw.items()}

    if d.tokenizer == "char" and any(caches.values()):
        tok = from_json(store.read_meta(next(p for p, c in caches.items() if c))["tokenizer"])
    else:  # a char vocabulary covers every document of the sources (as jaxtrain.data.prepare builds it)
        tok = make_tokenizer(d, lambda: "".join(x if isinstance(x, str) else x.decode("utf-8", "replace")
                                                  for txt in texts.values() for x in txt))
    if saved is not None and identity(tok) != {k: v for k, v in saved.items() if k != "source"}:
        raise DataError(f"data.path: the tokenizer for '{d.path}' differs from the one saved in the run "
                        f"directory; use a new run.dir or the original corpus and tokenizer")
    bos, eos = special_ids(tok, d.add_bos, d.add_eos, d.bos_token, d.eos_token)

    train_parts, val_parts = [], []
    for p, w in specs.items():
        if caches[p]:
            st = store.open_cache(p, tok, bos, eos)
            for k, v in st.stats.items():
                stats[k] = stats.get(k, 0) + v
        else:
            st = store.MemoryStore(list(store.tokenize_all(texts.pop(p), tok, bos, eos, stats)), stats)
        # Same split for a cache and its source: the last val_fraction of the kept documents.
        tr, va = pipeline.split(len(st.lengths), d.val_fraction, p)
        train_parts.append((st, tr, w))
        val_parts.append((st, va, None))
    sched = pipeline.Schedule(train_parts, d.seq_len, d.mode, d.seed)
    name = d.path if not d.mixture else "data.mixture"
    pipeline.check_size(sched, t.global_batch, name)
    val = pipeline.val_rows(val_parts, d.seq_len, d.mode, cfg.micro_batch, t.eval_batches, name)

    def make(sharding):
        return pipeline.DocBatchIterator(sched, t.global_batch, t.grad_accum, sharding, d.prefetch)
    info = [pipeline.describe(sched, stats)]
    if d.mixture and d.path != type(d).model_fields["path"].default:  # both given: say which one is read
        info.append(f"[yellow]note:[/] data.mixture replaces data.path: '{d.path}' is not read")
    return Data(tok, val, make, info, sched, bos)


def vocab_size(cfg: Config) -> int:
    """The vocabulary of the configured tokenizer (a char vocabulary is built from the corpus).

    Raises:
      DataError: as :func:`load` (a char vocabulary needs the data).
    """
    if cfg.data.tokenizer == "char":
        return load(cfg).tokenizer.vocab_size
    return make_tokenizer(cfg.data).vocab_size
