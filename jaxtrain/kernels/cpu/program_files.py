"""The files of the program cache's entries (:mod:`.program_cache`): each program's serialized
``Exported`` (``<name>.jaxexp``: a flatbuffer, nothing unpickled) and its output's tree structure
(``<name>.json``), written atomically, read back only when they fit the call, pruned to the newest
:data:`KEEP` keys; a program that cannot go through the cache is recorded as ``<name>.unexportable``."""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import jax

from jaxtrain.kernels.cpu import library

log = logging.getLogger("jaxtrain")

FORMAT = 2  # of an entry; part of the key (2: no log lines or auto decisions kept: the run plan has them)
KEEP = 16  # newest key directories kept


# --- output tree structures as JSON: dicts with string keys, tuples, lists, None and leaves; a subtree
# equal to one of the caller's named structures (e.g. the train state, with optax's nodes) by name.

def encode(tree: Any, refs: dict) -> Any:
    structure = jax.tree_util.tree_structure(tree)
    for name, ref in refs.items():
        if structure == ref:
            return {"ref": name}
    if tree is None:
        return None
    if isinstance(tree, dict) and all(isinstance(k, str) for k in tree):
        return {"dict": {k: encode(v, refs) for k, v in tree.items()}}
    if type(tree) in (tuple, list):
        return {type(tree).__name__: [encode(v, refs) for v in tree]}
    if structure.num_nodes == 1 and structure.num_leaves == 1:
        return "leaf"
    raise TypeError(f"cannot record a {type(tree).__name__} node")


def decode(obj: Any, refs: dict) -> Any:
    """A pytree of the recorded structure (its leaves are 0)."""
    if obj is None:
        return None
    if obj == "leaf":
        return 0
    if "ref" in obj:
        ref = refs[obj["ref"]]
        return jax.tree_util.tree_unflatten(ref, [0] * ref.num_leaves)
    if "dict" in obj:
        return {k: decode(v, refs) for k, v in obj["dict"].items()}
    kind, items = next(iter(obj.items()))
    return {"tuple": tuple, "list": list}[kind](decode(v, refs) for v in items)


def drop(entry: Path, name: str, err: Exception) -> None:
    """Removes a stored program that loaded but did not compile, so that the next run exports it again."""
    log.debug("the cached %s in %s does not compile: %s", name, entry, err)
    for suffix in (".jaxexp", ".json"):
        try:
            (entry / f"{name}{suffix}").unlink()
        except OSError:
            pass


def unexportable(entry: Path, name: str, err: Exception) -> None:
    """Records that ``name`` cannot go through the cache under this key (the reason, for a reader), so
    later runs trace it once, for jit, instead of twice."""
    log.debug("the exported %s cannot be used: %s", name, err)
    try:
        entry.mkdir(parents=True, exist_ok=True)
        (entry / f"{name}.unexportable").write_text(f"{type(err).__name__}: {err}\n")
    except OSError:
        pass


def uses_fused_kernel(exp: Any) -> bool:
    """Whether an Exported calls jaxtrain's XLA:CPU kernels (:mod:`.library`), custom calls jax.export does
    not vouch for: exported with that check disabled, and registered with XLA before an entry that calls
    them is compiled."""
    return any(name.encode() in exp.mlir_module_serialized for name in library.TARGETS)


_store_failed: list = []  # a failed store was reported (once per process)


def store(entry: Path, name: str, exp: Any, out: Any, refs: dict) -> None:
    """Writes the entry atomically (each file under a temporary name, then renamed); a failed write
    leaves the run as it was."""
    try:
        entry.mkdir(parents=True, exist_ok=True)
        meta = json.dumps({"format": FORMAT, "out": encode(out, refs)})
        for suffix, data in ((".jaxexp", bytes(exp.serialize())), (".json", meta.encode())):
            tmp = entry / f".{name}{suffix}.{os.getpid()}"
            tmp.write_bytes(data)
            os.replace(tmp, entry / f"{name}{suffix}")
        prune(entry.parent)
    except OSError as err:  # a full disk, a file in the entry's place: said once, the run goes on
        if not _store_failed:
            _store_failed.append(name)
            log.warning(f"warning: jaxtrain's program cache: storing the traced {name} in {entry} failed "
                        f"({err.strerror or err}); later runs trace it again")


def load(entry: Path, name: str, leaves: list, refs: dict):
    """(Exported, output pytree of placeholders) from the entry, or (None, None) when it is missing,
    unreadable or made for other argument shapes."""
    from jax import export
    try:
        meta = json.loads((entry / f"{name}.json").read_text())
        exp = export.deserialize(bytearray((entry / f"{name}.jaxexp").read_bytes()))
        out = decode(meta["out"], refs)
    except FileNotFoundError:
        return None, None
    except Exception as err:  # noqa: BLE001 - a damaged or foreign entry: traced again and replaced
        log.debug("the cached %s in %s cannot be read: %s", name, entry, err)
        return None, None
    given = [(tuple(x.shape), str(x.dtype)) for x in leaves]
    if ([(tuple(a.shape), str(a.dtype)) for a in exp.in_avals] != given
            or len(exp.out_avals) != jax.tree_util.tree_structure(out).num_leaves):
        return None, None
    if uses_fused_kernel(exp) and library.problem() is not None:  # its custom calls must be registered first
        return None, None  # gone (no compiler now): traced again, for XLA's ops instead
    os.utime(entry)  # recently used: kept by _prune
    return exp, out


def prune(folder: Path) -> None:
    entries = sorted((p for p in folder.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[KEEP:]:
        shutil.rmtree(old, ignore_errors=True)
