"""Rows of training examples from tokenized documents: packed (with document masks) or padded.

A document of n tokens gives n - 1 (input, target) pairs. A row holds
``seq_len`` pairs and is returned as five [seq_len] int32 arrays:

- ``inputs``, ``targets``: token ids (targets are inputs shifted by one within the document);
- ``segment_ids``: 1, 2, ... per document piece in the row, 0 on padding; attention is
  restricted to equal ids (models/attention.py);
- ``positions``: 0, 1, ... restarting at every piece (rotary positions);
- ``loss_mask``: 1 on real pairs, 0 on padding.

``packed`` concatenates the documents of an epoch (in their shuffled order) and
cuts the pair stream every ``seq_len`` pairs, so every pair of the epoch lands
in exactly one row and only the epoch's last row is padded (the "concatenate
and split" packing of T5/MaxText-style pipelines, with per-document masks and
positions instead of cross-document attention). A document cut by a row
boundary continues as a new piece, with positions restarting, in the next row.
``padded`` puts one piece (at most ``seq_len`` pairs of one document) per row
and pads the rest, masked out of the loss.

Both are pure index maths over document lengths (``Layout``), so row ``r`` of
an epoch is computed directly: any process can build any row, which is what
makes the data position a single global row number.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

MODES = ("packed", "padded")
FIELDS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")


class Layout:
    """Where each row of one epoch takes its pairs from.

    Args:
      order: [n] int64 document ids in epoch order.
      pairs: [n] int64 pair counts of those documents (tokens - 1, >= 1).
      seq_len: pairs per row.
      mode: 'packed' or 'padded'.
    """

    def __init__(self, order: np.ndarray, pairs: np.ndarray, seq_len: int, mode: str):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.order, self.seq_len, self.mode = order, seq_len, mode
        self.pairs = pairs.astype(np.int64)
        self.total_pairs = int(self.pairs.sum())
        if mode == "packed":
            self.ends = np.cumsum(self.pairs)  # pair stream end of each document
            self.rows = -(-self.total_pairs // seq_len)
        else:
            pieces = -(-self.pairs // seq_len)  # pieces per document
            self.piece_ends = np.cumsum(pieces)
            self.rows = int(self.piece_ends[-1]) if len(pieces) else 0

    def segments(self, r: int) -> list[tuple[int, int, int]]:
        """Row ``r`` as [(document id, first pair, end pair)] pieces."""
        L = self.seq_len
        if self.mode == "padded":
            k = int(np.searchsorted(self.piece_ends, r, side="right"))
            first_piece = int(self.piece_ends[k - 1]) if k else 0
            a = (r - first_piece) * L
            return [(int(self.order[k]), a, min(a + L, int(self.pairs[k])))]
        start, stop = r * L, min((r + 1) * L, self.total_pairs)
        k = int(np.searchsorted(self.ends, start, side="right"))
        out = []
        while start < stop:
            doc_start = int(self.ends[k] - self.pairs[k])
            a, b = start - doc_start, min(stop, int(self.ends[k])) - doc_start
            out.append((int(self.order[k]), a, b))
            start = doc_start + b
            k += 1
        return out

    def efficiency(self) -> float:
        """Fraction of non-pad slots over all rows of the epoch."""
        return self.total_pairs / max(1, self.rows * self.seq_len)


def assemble(segments: list[tuple[int, int, int]], get_doc: Callable[[int], np.ndarray],
             seq_len: int) -> dict[str, np.ndarray]:
    """The five [seq_len] int32 arrays of one row from its pieces (see module docstring)."""
    row = {k: np.zeros(seq_len, np.int32) for k in FIELDS}
    pos = 0
    for seg, (doc, a, b) in enumerate(segments, start=1):
        tokens = get_doc(doc)
        n = b - a
        row["inputs"][pos:pos + n] = tokens[a:b]
        row["targets"][pos:pos + n] = tokens[a + 1:b + 1]
        row["positions"][pos:pos + n] = np.arange(n, dtype=np.int32)
        row["segment_ids"][pos:pos + n] = seg
        row["loss_mask"][pos:pos + n] = 1
        pos += n
    return row


def stack(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.stack([r[k] for r in rows]) for k in FIELDS}


def from_windows(windows: np.ndarray) -> dict[str, np.ndarray]:
    """[..., seq_len + 1] contiguous token windows -> {inputs, targets, loss_mask}, each [..., seq_len].

    A window is one segment at positions 0..seq_len-1 with every pair in the loss, which is
    what the model assumes without ``positions`` and ``segment_ids``, so those are left out.
    """
    inputs = np.asarray(windows[..., :-1], np.int32)
    return {"inputs": inputs, "targets": np.asarray(windows[..., 1:], np.int32), "loss_mask": np.ones_like(inputs)}
