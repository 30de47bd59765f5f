"""Document modes: sources -> tokenized stores -> per-epoch shuffled rows -> global batches.

The row stream is a pure function of (data.seed, sources, seq_len, mode):

- Epoch ``e`` takes from each source ``c_i`` documents (``c_i`` = its size,
  or ``weight_i / sum(weights) * total`` for a weighted mixture) from that
  source's own cycle of permutations, then shuffles the union with
  ``rng(seed, e)``. With natural weights every document appears exactly once
  per epoch.
- The epoch is laid out in rows (packing.Layout) and epochs follow each other
  without a gap, so the data position is one integer: the next global row.

A step consumes rows ``[next_row, next_row + global_batch)`` as
[grad_accum, micro_batch] and each process builds only the rows its devices
hold (multihost.local_rows). Because the position is global, a run resumes on
any number of processes, or with another batch size, exactly where it stopped.
Rows are assembled ahead of use by a Grain ``MapDataset`` read with threads.
"""
from __future__ import annotations

import threading
from typing import Iterator

import grain
import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxtrain.data import multihost, packing
from jaxtrain.errors import DataError


class Schedule:
    """Global row index -> row arrays, over the training documents of one or more stores.

    Args:
      parts: [(store, doc ids used for training, weight or None)] per source.
      seq_len, mode: see packing.Layout.
      seed: data.seed.
    """

    def __init__(self, parts: list, seq_len: int, mode: str, seed: int):
        self.parts, self.seq_len, self.mode, self.seed = parts, seq_len, mode, seed
        sizes = np.asarray([len(ids) for _, ids, _ in parts], np.int64)
        weights = [w for _, _, w in parts]
        if any(w is not None for w in weights):
            w = np.asarray([1.0 if x is None else x for x in weights], np.float64)
            self.counts = np.maximum(1, np.round(w / w.sum() * sizes.sum())).astype(np.int64)
        else:
            self.counts = sizes
        self.base = np.concatenate([[0], np.cumsum(sizes)])  # global doc id = base[i] + index in ids
        self.pairs = np.concatenate([store.lengths[ids] - 1 for store, ids, _ in parts]).astype(np.int64)
        self._epochs: dict[int, packing.Layout] = {}
        self._starts = [0]  # first global row of epochs 0, 1, ...
        self._lock = threading.RLock()  # Grain assembles rows from several threads

    def get_doc(self, gid: int) -> np.ndarray:
        i = int(np.searchsorted(self.base, gid, side="right")) - 1
        store, ids, _ = self.parts[i]
        return store.get(int(ids[gid - self.base[i]]))

    def _source_docs(self, i: int, e: int) -> np.ndarray:
        n, c = int(self.base[i + 1] - self.base[i]), int(self.counts[i])
        q = np.arange(e * c, (e + 1) * c, dtype=np.int64)
        out = np.empty_like(q)
        for cycle in np.unique(q // n):
            perm = np.random.default_rng([self.seed, i, int(cycle)]).permutation(n)
            sel = q // n == cycle
            out[sel] = perm[q[sel] % n]
        return self.base[i] + out

    def layout(self, e: int) -> packing.Layout:
        with self._lock:
            return self._layout(e)

    def _layout(self, e: int) -> packing.Layout:
        if e not in self._epochs:
            docs = np.concatenate([self._source_docs(i, e) for i in range(len(self.parts))])
            order = docs[np.random.default_rng([self.seed, 1 << 20, e]).permutation(len(docs))]
            if len(self._epochs) > 2:
                self._epochs.pop(min(self._epochs))
            self._epochs[e] = packing.Layout(order, self.pairs[order], self.seq_len, self.mode)
        return self._epochs[e]

    def locate(self, g: int) -> tuple[int, int]:
        """Global row -> (epoch, row within the epoch)."""
        with self._lock:
            while self._starts[-1] <= g:
                self._starts.append(self._starts[-1] + self._layout(len(self._starts) - 1).rows)
            e = int(np.searchsorted(self._starts, g, side="right")) - 1
            return e, g - self._starts[e]

    def row(self, g: int) -> dict[str, np.ndarray]:
        e, r = self.locate(g)
        with self._lock:
            segments = self._layout(e).segments(r)
        return packing.assemble(segments, self.get_doc, self.seq_len)

    def rows_per_epoch(self) -> int:
        return self.layout(0).rows


class DocBatchIterator:
    """Yields {'inputs','targets','positions','segment_ids','loss_mask'}, each [grad_accum, micro, seq_len]
    int32 jax.Arrays on ``sharding``; state is ``{'next_row': int, ...}`` (JSON, saved in checkpoints)."""

    def __init__(self, schedule: Schedule, global_batch: int, grad_accum: int, sharding: NamedSharding,
                 prefetch: int = 4):
        self.schedule, self.batch, self.accum = schedule, global_batch, grad_accum
        self.micro = global_batch // grad_accum
        self.sharding, self.prefetch = sharding, prefetch
        self.shape = (grad_accum, self.micro, schedule.seq_len)
        self.lo, self.hi = multihost.local_rows(sharding, self.shape)
        self._start(0)

    def _local_batch(self, first: int) -> dict[str, np.ndarray]:
        rows = [self.schedule.row(first + a * self.micro + j)
                for a in range(self.accum) for j in range(self.lo, self.hi)]
        return {k: v.reshape(self.accum, self.hi - self.lo, -1) for k, v in packing.stack(rows).items()}

    def _start(self, next_row: int) -> None:
        self.next_row = next_row
        ds = grain.MapDataset.range(0, 1 << 40).map(lambda k: self._local_batch(next_row + k * self.batch))
        opts = grain.ReadOptions(num_threads=max(1, self.prefetch), prefetch_buffer_size=max(1, self.prefetch))
        self._iter = iter(ds.to_iter_dataset(opts))

    def get_state(self) -> dict:
        s = self.schedule
        return {"next_row": self.next_row, "mode": s.mode, "seq_len": s.seq_len, "seed": s.seed}

    def set_state(self, state: dict) -> None:
        s = self.schedule
        if "next_row" not in state:
            raise DataError(f"data position {state}: saved by data.mode=windows; resume with that mode")
        saved = {k: state.get(k) for k in ("mode", "seq_len", "seed")}
        if saved != {"mode": s.mode, "seq_len": s.seq_len, "seed": s.seed}:
            raise DataError(f"data position: saved with {saved}; this run has mode={s.mode}, "
                            f"seq_len={s.seq_len}, seed={s.seed}, so the rows would differ")
        self._start(int(state["next_row"]))

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict[str, jax.Array]:
        local = next(self._iter)
        self.next_row += self.batch
        return multihost.to_global(local, self.sharding, self.micro)


def val_rows(parts: list, seq_len: int, mode: str, micro: int, n_batches: int,
             name: str) -> dict[str, np.ndarray]:
    """Fixed validation rows (documents in order, no shuffle) as [n, micro, seq_len] arrays.

    Raises:
      DataError: fewer than one micro-batch of validation rows.
    """
    sched = Schedule([(store, ids, None) for store, ids, _ in parts], seq_len, mode, seed=0)
    lay = packing.Layout(np.arange(len(sched.pairs)), sched.pairs, seq_len, mode)
    n = min(n_batches, lay.rows // micro)
    if n < 1:
        raise DataError(f"data.path: the validation split of '{name}' gives {lay.rows} rows of data.seq_len="
                        f"{seq_len}, fewer than one micro-batch ({micro}); lower data.seq_len or the batch, "
                        f"or raise data.val_fraction")
    rows = [packing.assemble(lay.segments(r), sched.get_doc, seq_len) for r in range(n * micro)]
    return {k: v.reshape(n, micro, seq_len) for k, v in packing.stack(rows).items()}


def split(n_docs: int, val_fraction: float, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(train ids, val ids): the last ``val_fraction`` of the documents (at least one) are held out."""
    n_val = max(1, int(round(n_docs * val_fraction)))
    if n_docs - n_val < 1:  # a plain text file is one document unless data.separator splits it
        raise DataError(f"data.path: '{name}' has {n_docs} usable document(s): too few to hold out "
                        f"a validation split (data.val_fraction={val_fraction}; a text file is one document "
                        f"unless data.separator splits it)")
    return np.arange(n_docs - n_val), np.arange(n_docs - n_val, n_docs)


def check_size(sched: Schedule, global_batch: int, name: str) -> None:
    rows = sched.rows_per_epoch()
    if rows < global_batch:
        raise DataError(f"data.path: '{name}' gives {rows} training rows of data.seq_len={sched.seq_len} "
                        f"per epoch, fewer than one batch (train.global_batch={global_batch})")


def describe(sched: Schedule, stats: dict) -> str:
    lay = sched.layout(0)
    skipped = stats["skipped_empty"] + stats["skipped_short"]
    return (f"data: {stats['documents']} documents, {stats['tokens']} tokens, mode {sched.mode}: "
            f"{lay.rows} rows/epoch, packing efficiency {lay.efficiency():.1%}; skipped {skipped} "
            f"empty/one-token documents, replaced invalid UTF-8 in {stats['invalid_utf8']}")
