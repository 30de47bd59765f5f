"""Tokenizers: byte, char, Hugging Face ``tokenizers`` (tokenizer.json) and SentencePiece (.model).

Every tokenizer has ``vocab_size``, ``encode(text|bytes) -> int32 ids``,
``decode(ids) -> str``, optional ``bos_id``/``eos_id`` and ``to_json()``, its
identity saved as JSON in the run directory and in token caches (never
pickle). File-backed tokenizers are identified by the SHA-256 of the file, so
a run or a cache refuses a different tokenizer even under the same path.
Nothing is ever downloaded: a name that is not a local file is a DataError.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np

from jaxtrain.config.schema import DataConfig
from jaxtrain.errors import DataError

TOKENIZER_FILE = "tokenizer.json"


class ByteTokenizer:
    """UTF-8 bytes, ids 0..255, then optional special tokens (e.g. <bos>, <eos>) at 256, 257, ...

    Any byte string round-trips, including invalid UTF-8 (kept as bytes).
    """

    kind = "byte"

    def __init__(self, specials: tuple[str, ...] = ()):
        self.specials = tuple(specials)
        self.vocab_size = 256 + len(self.specials)

    def special_id(self, name: str) -> Optional[int]:
        return 256 + self.specials.index(name) if name in self.specials else None

    def encode(self, data: Union[str, bytes]) -> np.ndarray:
        raw = data.encode("utf-8") if isinstance(data, str) else data
        return np.frombuffer(raw, dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def to_json(self) -> dict:
        return {"type": "byte", **({"specials": list(self.specials)} if self.specials else {})}


class CharTokenizer:
    """Character vocabulary (sorted) built from the training text, then <unk>, then special tokens.

    Characters unseen in training (e.g. only in the validation split) map to <unk>.
    """

    kind = "char"

    def __init__(self, chars: list[str], specials: tuple[str, ...] = ()):
        self.chars = list(chars)
        self.unk = len(self.chars)
        self.specials = tuple(specials)
        self.vocab_size = len(self.chars) + 1 + len(self.specials)
        self._index = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def build(cls, text: str, specials: tuple[str, ...] = ()) -> "CharTokenizer":
        return cls(sorted(set(text)), specials)

    def special_id(self, name: str) -> Optional[int]:
        return self.unk + 1 + self.specials.index(name) if name in self.specials else None

    def encode(self, text: Union[str, bytes]) -> np.ndarray:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        # One table lookup per code point (a Python loop over the characters took 0.3 s per MB).
        codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        if not codes.size:
            return np.zeros(0, np.int32)
        table = np.full(int(codes.max()) + 1, self.unk, np.int32)
        for c, i in self._index.items():
            if len(c) == 1 and ord(c) < table.size:
                table[ord(c)] = i
        return table[codes]

    def decode(self, ids) -> str:
        return "".join(self.chars[i] if 0 <= i < len(self.chars) else "\ufffd" for i in map(int, ids))

    def to_json(self) -> dict:
        return {"type": "char", "chars": self.chars, **({"specials": list(self.specials)} if self.specials else {})}


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _local_file(path: str, what: str) -> str:
    """``path`` if it is a local file, else a DataError that says we never download."""
    full = os.path.expanduser(path)
    if not path:
        raise DataError(f"data.tokenizer_path: data.tokenizer={what} needs the path of a local {what} file")
    if not os.path.isfile(full):
        raise DataError(f"data.tokenizer_path: '{path}' is not a local file; jaxtrain never downloads "
                        f"tokenizers (no hub access): save the {what} file locally and pass its path")
    return full


class HFTokenizer:
    """A Hugging Face ``tokenizers`` model loaded from a local ``tokenizer.json``."""

    kind = "hf"

    def __init__(self, path: str):
        from tokenizers import Tokenizer as _HF
        self.path = _local_file(path, "tokenizer.json")
        try:
            self._tok = _HF.from_file(self.path)
        except Exception as err:  # the Rust side raises a bare Exception
            raise DataError(f"data.tokenizer_path: '{path}' is not a valid tokenizer.json: {err}") from None
        self.sha256 = file_sha256(self.path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def special_id(self, name: str) -> Optional[int]:
        return self._tok.token_to_id(name)

    def encode(self, text: Union[str, bytes]) -> np.ndarray:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, np.int32) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_json(self) -> dict:
        return {"type": "hf", "sha256": self.sha256, "source": self.path}


class SentencePieceTokenizer:
    """A SentencePiece model (Kudo & Richardson 2018) loaded from a local ``.model`` file."""

    kind = "sentencepiece"

    def __init__(self, path: str):
        import sentencepiece as spm
        self.path = _local_file(path, "SentencePiece .model")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=self.path)
        except Exception as err:
            raise DataError(f"data.tokenizer_path: '{path}' is not a valid SentencePiece model: {err}") from None
        self.sha256 = file_sha256(self.path)
        self.vocab_size = self._sp.get_piece_size()

    def special_id(self, name: str) -> Optional[int]:
        i = self._sp.piece_to_id(name)
        return None if i == self._sp.unk_id() and name != self._sp.id_to_piece(i) else i

    def encode(self, text: Union[str, bytes]) -> np.ndarray:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return np.asarray(self._sp.encode(text), np.int32)

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])

    def to_json(self) -> dict:
        return {"type": "sentencepiece", "sha256": self.sha256, "source": self.path}


Tokenizer = Union[ByteTokenizer, CharTokenizer, HFTokenizer, SentencePieceTokenizer]

def make_tokenizer(d: DataConfig, char_text: Callable[[], str] = lambda: "") -> "Tokenizer":
    """The tokenizer ``data.tokenizer`` names. BOS/EOS of the byte and char tokenizers are extra ids
    after their vocabulary; a char vocabulary is built from ``char_text()`` (read only when needed).

    Raises:
      DataError: a tokenizer file that is missing or invalid (nothing is ever downloaded).
    """
    specials = tuple(n for n, on in (("<bos>", d.add_bos), ("<eos>", d.add_eos)) if on)
    if d.tokenizer == "byte":
        return ByteTokenizer(specials)
    if d.tokenizer == "char":
        return CharTokenizer.build(char_text(), specials)
    return (HFTokenizer if d.tokenizer == "hf" else SentencePieceTokenizer)(d.tokenizer_path)


# Default special-token names tried when data.bos_token / data.eos_token are empty.
DEFAULT_BOS = ("<bos>", "<s>", "<|begin_of_text|>", "<|startoftext|>", "[CLS]")
DEFAULT_EOS = ("<eos>", "</s>", "<|end_of_text|>", "<|endoftext|>", "[SEP]")


def special_ids(tok: Tokenizer, add_bos: bool, add_eos: bool, bos_token: str = "",
                eos_token: str = "") -> tuple[Optional[int], Optional[int]]:
    """(bos_id, eos_id) to add around each document (None: not added).

    Raises:
      DataError: a requested special token is not in the vocabulary.
    """
    out = []
    for want, name, defaults, key in ((add_bos, bos_token, DEFAULT_BOS, "bos_token"),
                                      (add_eos, eos_token, DEFAULT_EOS, "eos_token")):
        if not want:
            out.append(None)
            continue
        for cand in ([name] if name else defaults):
            i = tok.special_id(cand)
            if i is not None:
                out.append(int(i))
                break
        else:
            raise DataError(f"data.{key}: tokenizer '{tok.kind}' has no token "
                            f"{name or ' / '.join(defaults)!r}; set data.{key} to one it has")
    return out[0], out[1]


def identity(tok: Tokenizer) -> dict:
    """What must match between a run, its checkpoints and a token cache (the file path may move)."""
    return {k: v for k, v in tok.to_json().items() if k != "source"}


def from_json(obj: dict) -> Tokenizer:
    kind = obj.get("type")
    specials = tuple(obj.get("specials", ()))
    if kind == "byte":
        return ByteTokenizer(specials)
    if kind == "char" and isinstance(obj.get("chars"), list):
        return CharTokenizer(obj["chars"], specials)
    if kind in ("hf", "sentencepiece") and isinstance(obj.get("source"), str):
        tok = (HFTokenizer if kind == "hf" else SentencePieceTokenizer)(obj["source"])
        if tok.sha256 != obj.get("sha256"):
            raise DataError(f"tokenizer file: {obj['source']} changed since it was saved (sha256 differs)")
        return tok
    raise DataError(f"tokenizer file: unknown or malformed tokenizer {str(obj)[:80]!r}")


def save(tok: Tokenizer, run_dir: Path) -> None:
    (run_dir / TOKENIZER_FILE).write_text(json.dumps(tok.to_json(), ensure_ascii=False))


def load_json(run_dir: Path) -> dict | None:
    """The saved tokenizer identity of a run directory, or None."""
    path = run_dir / TOKENIZER_FILE
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: not valid JSON: {err}") from None


def load(run_dir: Path) -> Tokenizer | None:
    obj = load_json(run_dir)
    return None if obj is None else from_json(obj)
