"""The files of a Hugging Face model directory: config.json, and safetensors weights, single or sharded.

HF's layouts (as ``transformers``' ``save_pretrained`` writes them):

  config.json                          the model class (``architectures``) and its hyper-parameters
  model.safetensors                    every tensor, when they fit in one file; or
  model-00001-of-0000N.safetensors     shards of at most ``max_shard_size`` bytes each (a larger
  ...                                  tensor alone in its shard), and
  model.safetensors.index.json         {"metadata": {"total_size": bytes, ...},
                                        "weight_map": {tensor name: shard file name}}

Only safetensors are read: a directory holding only ``pytorch_model*.bin`` (a pickle, whose loading
runs code) is refused by name. Every problem is a :class:`ConfigError` (exit 2) raised before
anything is loaded into a run. The index decides which shard a tensor is read from: a copy held by
another shard, or a tensor the index does not name, is not read (a warning among the notes).

Writes are reproducible: exporting the same params twice gives byte-identical files (the
safetensors header's metadata is put in sorted order, see :func:`_sort_header`).
"""
from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path
from typing import Optional

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxtrain.errors import ConfigError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"  # HF's save_pretrained default of transformers 4
SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


def parse_size(size: int | str) -> int:
    """Bytes of a shard size: an int, or text like '5GB' (10^9, as HF), '2GiB' (2^30), '200KB', '123'.

    Raises:
      ConfigError: not a size, or < 1 byte.
    """
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(size))
        if not m or m.group(2).upper() not in _UNITS:
            raise ConfigError(f"--max-shard-size: {size!r} is not a size (e.g. 5GB, 500MB, 2GiB or bytes)")
        value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value < 1:
        raise ConfigError(f"--max-shard-size: must be at least 1 byte, got {size!r}")
    return value


def read_hf_config(hf_dir: Path) -> dict:
    """``hf_dir/config.json`` parsed. Raises ConfigError: missing, not JSON, or not a JSON object."""
    path = Path(hf_dir) / CONFIG_FILE
    if not Path(hf_dir).is_dir():
        raise ConfigError(f"import: '{hf_dir}' is not a directory")
    if not path.is_file():
        raise ConfigError(f"import: no {CONFIG_FILE} in '{hf_dir}' (it names the architecture and its "
                          f"hyper-parameters; a Hugging Face model directory has one)")
    try:
        hf = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"import: {path} is not valid JSON ({err})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"import: {path} is not a JSON object")
    return hf


def weight_files(hf_dir: Path) -> dict[str, Optional[list[str]]]:
    """{safetensors file name in ``hf_dir``: the tensor names to read from it (None: all)}.

    The index (``model.safetensors.index.json``) when there is one, else ``model.safetensors``.

    Raises:
      ConfigError: neither exists (a ``pytorch_model*.bin``-only directory named), the index is not
        valid JSON, has no weight_map, names a file that is not a safetensors file beside it, or
        names shard files that are missing (all listed, each with a count and the first few names of
        the tensors the index puts in it).
    """
    hf_dir = Path(hf_dir)
    index = hf_dir / INDEX_FILE
    if index.is_file():
        try:
            data = json.loads(index.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ConfigError(f"import: {index} is not valid JSON ({err})") from None
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict) or not wm or not all(isinstance(v, str) for v in wm.values()):
            raise ConfigError(f"import: {index} has no weight_map (tensor name -> shard file)")
        bad = sorted({f for f in wm.values() if Path(f).name != f or not f.endswith(".safetensors")})
        if bad:
            raise ConfigError(f"import: {index}: weight_map names {bad[0]!r}, which is not a .safetensors file "
                              f"beside it")
        files: dict[str, Optional[list[str]]] = {}
        for name, f in wm.items():
            files.setdefault(f, []).append(name)
        missing = sorted(f for f in files if not (hf_dir / f).is_file())
        if missing:  # name what each held: the user can tell which part of the model is gone
            held = "; ".join(f"{f} (the index puts {_count(files[f])} in it: {_some(sorted(files[f]))})"
                             for f in missing)
            raise ConfigError(f"import: {index} names shard files missing from '{hf_dir}': {held}")
        return files
    if (hf_dir / WEIGHTS_FILE).is_file():
        return {WEIGHTS_FILE: None}
    pickles = sorted(p.name for p in hf_dir.glob("pytorch_model*.bin*"))
    if pickles:
        raise ConfigError(f"import: '{hf_dir}' holds {pickles[0]} (a PyTorch pickle) but no {WEIGHTS_FILE} or "
                          f"{INDEX_FILE}; jaxtrain reads safetensors only (loading a pickle runs code). Save the "
                          f"model with transformers' save_pretrained, which writes safetensors, and import that")
    raise ConfigError(f"import: no {WEIGHTS_FILE} or {INDEX_FILE} in '{hf_dir}'")


def load_tensors(hf_dir: Path, files: dict[str, Optional[list[str]]], notes: Optional[list[str]] = None) -> dict:
    """The tensors of :func:`weight_files`' answer, as host numpy arrays (dtypes kept; bfloat16 as
    ml_dtypes'). Read through safetensors' flax loader (its numpy one has no bfloat16), then copied
    to the host, so the layout changes after it are numpy's, never a compiled op per shape.

    ``notes`` (if given) gets a warning for each shard holding tensors the index does not read from
    it: ones it maps to another shard (that copy is read) and ones it does not name (not read).

    Raises:
      ConfigError: a file is not readable safetensors, or the index puts a tensor in a shard that does
        not hold it (all such tensors listed).
    """
    indexed = {t: f for f, names in files.items() for t in names or ()}
    tensors, absent = {}, []
    for name, wanted in files.items():
        path = Path(hf_dir) / name
        try:
            with safe_open(str(path), framework="flax") as f:
                held = set(f.keys())
                absent += [f"{t} (in {name})" for t in (wanted or ()) if t not in held]
                for t in held if wanted is None else [t for t in wanted if t in held]:
                    tensors[t] = np.asarray(f.get_tensor(t))
        except (SafetensorError, OSError) as err:
            raise ConfigError(f"import: {path} is not a readable safetensors file ({err})") from None
        if wanted is not None and notes is not None:
            notes += _unread(name, sorted(held - set(wanted)), indexed)
    if absent:
        raise ConfigError(f"import: {INDEX_FILE} names tensors its shards do not hold: {', '.join(sorted(absent))}")
    return tensors


def _unread(shard: str, extra: list[str], indexed: dict[str, str]) -> list[str]:
    """Warnings for the tensors ``extra`` that ``shard`` holds but the index does not read from it
    (``indexed``: tensor -> the shard the index names)."""
    elsewhere = [f"{t} (index: {indexed[t]})" for t in extra if t in indexed]
    unnamed = [t for t in extra if t not in indexed]
    out = []
    if elsewhere:
        out.append(f"warning: {shard} holds {_count(elsewhere)} that {INDEX_FILE} maps to another shard, whose "
                   f"copy is read: {_some(elsewhere)}")
    if unnamed:
        out.append(f"warning: {shard} holds {_count(unnamed)} that {INDEX_FILE} does not name, not read: "
                   f"{_some(unnamed)}")
    return out


def _count(names: list) -> str:
    return f"{len(names)} tensor{'s' if len(names) != 1 else ''}"


def _some(names: list[str], limit: int = 5) -> str:
    """'a, b, c' for at most ``limit`` names, then 'and N more' (messages stay short for 1000s of tensors)."""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def write_weights(tensors: dict, out_dir: Path, max_shard_bytes: int, metadata: dict[str, str]) -> list[str]:
    """Writes ``tensors`` (name -> numpy array, in file order) to ``out_dir``; returns the file names.

    One ``model.safetensors`` when they fit in ``max_shard_bytes``; else shards filled in order, a new
    one started when the next tensor would overflow the current one, and the index. Each file is
    written under a temporary name and renamed; weight files of an earlier export (another layout or
    shard count) are then removed, so the directory never mixes two exports' weights (the caller
    checks first that no other weight files are there: :func:`check_no_foreign_weights`). The same
    tensors and metadata always give the same bytes.
    """
    shards: list[list[str]] = [[]]
    size = 0
    for name, x in tensors.items():
        n = int(x.size) * x.dtype.itemsize
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    if len(shards) == 1:
        layout = {WEIGHTS_FILE: shards[0]}
    else:
        layout = {f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors": s for i, s in enumerate(shards)}
    out_dir = Path(out_dir)
    written = []
    for file, names in layout.items():
        tmp = out_dir / f".{file}.tmp"
        save_file({n: tensors[n] for n in names}, str(tmp), metadata=metadata)
        _sort_header(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # safetensors writes 0600; exports are meant to be shared like any file
        os.replace(tmp, out_dir / file)
        written.append(file)
    if len(layout) > 1:
        index = {"metadata": {"total_size": sum(int(x.size) * x.dtype.itemsize for x in tensors.values()),
                              "total_parameters": sum(int(x.size) for x in tensors.values())},
                 "weight_map": {n: f for f, names in layout.items() for n in sorted(names)}}
        index["weight_map"] = dict(sorted(index["weight_map"].items()))
        tmp = out_dir / f".{INDEX_FILE}.tmp"
        tmp.write_text(json.dumps(index, indent=2) + "\n")
        os.replace(tmp, out_dir / INDEX_FILE)
        written.append(INDEX_FILE)
    for old in out_dir.iterdir():
        if old.name not in written and (old.name in (WEIGHTS_FILE, INDEX_FILE) or SHARD_NAME.match(old.name)):
            old.unlink()
    return written


EXPORT_MARK = "jaxtrain_step"  # the safetensors metadata key every export writes


def check_no_foreign_weights(out_dir: Path) -> None:
    """Refuses an export into a folder holding HF weight files that no jaxtrain export wrote (the
    export replaces an earlier export's weight files, and would replace or delete these too).

    Raises:
      ConfigError: naming them; nothing is written.
    """
    if not out_dir.is_dir():
        return
    weights = sorted(p for p in out_dir.iterdir() if p.name == WEIGHTS_FILE or SHARD_NAME.match(p.name))
    ours = [p for p in weights if _exported(p)]
    foreign = [p.name for p in weights if p not in ours]
    if (out_dir / INDEX_FILE).exists() and not ours:
        foreign.append(INDEX_FILE)
    if foreign:
        raise ConfigError(f"export: OUT_DIR '{out_dir}' holds {', '.join(foreign)}, not written by a jaxtrain "
                          f"export, which this export would replace or delete; nothing was written (name "
                          f"another folder, or move them)")


def _exported(path: Path) -> bool:
    """Whether a safetensors file carries the mark of a jaxtrain export (unreadable: no)."""
    try:
        with safe_open(str(path), framework="np") as f:
            return EXPORT_MARK in (f.metadata() or {})
    except (SafetensorError, OSError, ValueError):
        return False


def _sort_header(path: Path) -> None:
    """Puts the ``__metadata__`` of safetensors file ``path``'s JSON header in sorted key order, in place.

    safetensors 0.8 holds the metadata in a Rust HashMap, whose order is random per call (two exports
    of one step differed in bytes); the tensors' entries it already writes in a fixed order. The
    header keeps its length (the same compact JSON with keys permuted, space-padded as safetensors
    pads it), so the tensor data does not move.

    Raises:
      RuntimeError: the rewritten header would be longer (a safetensors whose JSON is not compact).
    """
    with open(path, "r+b") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
        meta = header.pop("__metadata__", None)
        if not meta:
            return
        text = json.dumps({"__metadata__": dict(sorted(meta.items())), **header}, separators=(",", ":"),
                          ensure_ascii=False).encode()
        if len(text) > size:
            raise RuntimeError(f"{path}: the sorted safetensors header is {len(text)} bytes, the written one {size}")
        f.seek(8)
        f.write(text.ljust(size, b" "))
