"""Byte- and char-level tokenizers, saved as JSON in the run directory (never pickle)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Union

import numpy as np

TOKENIZER_FILE = "tokenizer.json"


class DataError(ValueError):
    """Bad input data: a missing path, a corpus too short, a tokenizer mismatch."""


class ByteTokenizer:
    """UTF-8 bytes, vocabulary 256. Any byte string round-trips."""

    kind = "byte"
    vocab_size = 256

    def encode(self, data: Union[str, bytes]) -> np.ndarray:
        raw = data.encode("utf-8") if isinstance(data, str) else data
        return np.frombuffer(raw, dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def to_json(self) -> dict:
        return {"type": "byte"}


class CharTokenizer:
    """Character vocabulary (sorted) built from the training text, plus a final <unk> id.

    Characters unseen in training (e.g. only in the validation split) map to <unk>.
    """

    kind = "char"

    def __init__(self, chars: list[str]):
        self.chars = list(chars)
        self.unk = len(self.chars)
        self.vocab_size = len(self.chars) + 1
        self._index = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def build(cls, text: str) -> "CharTokenizer":
        return cls(sorted(set(text)))

    def encode(self, text: str) -> np.ndarray:
        index, unk = self._index, self.unk
        return np.fromiter((index.get(c, unk) for c in text), dtype=np.int32, count=len(text))

    def decode(self, ids) -> str:
        return "".join(self.chars[i] if 0 <= i < len(self.chars) else "\ufffd" for i in map(int, ids))

    def to_json(self) -> dict:
        return {"type": "char", "chars": self.chars}


Tokenizer = Union[ByteTokenizer, CharTokenizer]


def from_json(obj: dict) -> Tokenizer:
    kind = obj.get("type")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "char" and isinstance(obj.get("chars"), list):
        return CharTokenizer(obj["chars"])
    raise DataError(f"tokenizer file: unknown or malformed tokenizer {str(obj)[:80]!r}")


def save(tok: Tokenizer, run_dir: Path) -> None:
    (run_dir / TOKENIZER_FILE).write_text(json.dumps(tok.to_json(), ensure_ascii=False))


def load(run_dir: Path) -> Tokenizer | None:
    path = run_dir / TOKENIZER_FILE
    if not path.exists():
        return None
    try:
        return from_json(json.loads(path.read_text()))
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: not valid JSON: {err}") from None
