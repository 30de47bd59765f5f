"""The run's init, train-step and evaluation programs kept across runs as exported StableHLO, so a
warm start loads them instead of tracing the model again.

Tracing and lowering is Python work under one interpreter lock: on ``configs/shakespeare_char.yaml``
(one device, 2-core AMD EPYC) ~0.65 s for the train step, where loading its exported form takes
~0.05 s. JAX's persistent compilation cache then finds the compiled program as before.

Format: :func:`jax.export.export` of a function of the arguments' flattened leaves, serialized with
``Exported.serialize`` (a flatbuffer holding the StableHLO bytecode; nothing is unpickled), plus a
JSON file with the output's tree structure and the jaxtrain log lines the tracing printed (said again
when the entry is loaded). Entries live in ``JAXTRAIN_PROGRAM_CACHE_DIR``
(default ``~/.cache/jaxtrain/programs``), one directory per key; the newest :data:`KEEP` are kept.

The key is a SHA-256 of everything a traced program depends on: the Python source of jaxtrain and
its model families, the resolved config without the keys that only steer the loop (``run``,
``checkpoint``, ``metrics``, ``profile``, ``train`` except ``global_batch``, ``grad_accum`` and
``seed``, ``data`` except ``seq_len`` and ``mode``), the resolved model config (its vocabulary),
the rule tables, the devices, JAX's configuration, the ``XLA_FLAGS`` and the versions of Python,
JAX, jaxlib, Flax and Optax. An entry is used only when its argument shapes and dtypes equal the
call's; one that cannot be read is traced again and replaced.

Used where tracing is a visible share of start-up and the exported program is the same as jit's:
the command line (:func:`enable`), one process on one device, a registered model family, nothing
offloaded to host memory. ``JAXTRAIN_PROGRAM_CACHE=0`` turns it off.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Optional

import jax

from jaxtrain.errors import JaxtrainError
from jaxtrain.runtime import once
from jaxtrain.runtime.env import cache_folder_usable, switch

log = logging.getLogger("jaxtrain")

FORMAT = 1  # of an entry; part of the key
KEEP = 16  # newest key directories kept
SWITCH = "JAXTRAIN_PROGRAM_CACHE"
DIR_VAR = "JAXTRAIN_PROGRAM_CACHE_DIR"
LOOP_ONLY = ("run", "checkpoint", "metrics", "profile")  # config sections no traced program reads
TRAIN_KEYS = ("global_batch", "grad_accum", "seed")  # the train keys that shape a program
DATA_KEYS = ("seq_len", "mode")  # the data keys that do (the vocabulary: in the resolved model config)

_enabled = False


def enable(env: os._Environ | dict = os.environ) -> bool:
    """Turns the cache on for this process (the command line does), unless ``JAXTRAIN_PROGRAM_CACHE=0``
    or a file is where its folder would be (then one warning). Returns whether it is on. Raises
    InputError for a value other than 0 or 1."""
    global _enabled
    _enabled = switch(SWITCH, True, "keep exported programs across runs, the default", "trace every run", env)
    if _enabled and not cache_folder_usable(root(env), f"{DIR_VAR}={env.get(DIR_VAR)}" if env.get(DIR_VAR)
                                            else "jaxtrain's program cache"):
        _enabled = False
    return _enabled


def disable() -> None:
    global _enabled
    _enabled = False


def enabled() -> bool:
    """Whether :func:`enable` turned the cache on in this process."""
    return _enabled


def root(env: os._Environ | dict = os.environ) -> Path:
    return Path(env.get(DIR_VAR) or "~/.cache/jaxtrain/programs").expanduser()


def applies(s: Any) -> bool:
    """Whether the run ``s`` (a :class:`jaxtrain.train.assembly.Setup`) uses the cache; see the module
    docstring."""
    from jaxtrain.parallel.offload import Plan
    plan = Plan.from_config(s.cfg)
    return (_enabled and s.family is not None and _ours(s.family) and len(s.devices) == 1
            and jax.process_count() == 1 and not plan.state and not plan.activations)


def _ours(family: Any) -> bool:
    """A family whose code the key hashes: jaxtrain's own, not a plugin package's."""
    parts = (family.model, family.loss, family.head_loss, family.flops_per_token)
    return all(getattr(p, "__module__", "").startswith("jaxtrain.") for p in parts if p is not None)


def sources() -> list[tuple[str, Path]]:
    """(name inside its package, path) of every Python and C++ source of jaxtrain and its model families."""
    import jaxtrain
    import jaxtrain.models
    roots = {"jaxtrain": Path(jaxtrain.__file__).parent, "jaxtrain.models": Path(jaxtrain.models.__file__).parent}
    return sorted((f"{name}/{p.relative_to(r).as_posix()}", p) for name, r in roots.items()
                  for pattern in ("*.py", "*.cc") for p in r.rglob(pattern))


def key(s: Any) -> str:
    """The hex SHA-256 naming ``s``'s entries (see the module docstring)."""
    import flax
    import jaxlib
    import optax
    cfg = s.cfg.model_dump(mode="json")
    for section in LOOP_ONLY:
        cfg.pop(section, None)
    cfg["train"] = {k: cfg["train"][k] for k in TRAIN_KEYS}
    cfg["data"] = {k: cfg["data"][k] for k in DATA_KEYS}
    model = s.model_config.model_dump(mode="json") if hasattr(s.model_config, "model_dump") else repr(s.model_config)
    devices = [(d.platform, d.device_kind, d.id) for d in s.devices]
    config = {k: repr(v) for k, v in sorted(jax.config.values.items()) if "cache" not in k and "log" not in k}
    versions = [sys.version, jax.__version__, jaxlib.__version__, flax.__version__, optax.__version__]
    # model.attention/matmul and optimizer.implementation=auto trace the fused CPU kernels only where they
    # built: a fallback is its own entry
    kernel = ""
    fused = [getattr(s.model_config, key, None) in ("auto", "cpu_fused") for key in ("attention", "matmul")]
    fused.append(s.cfg.optimizer.implementation in ("auto", "cpu_fused"))  # the update's kernel likewise
    if any(fused) and s.devices[0].platform == "cpu":
        from jaxtrain.kernels import cpu_fused
        kernel = cpu_fused.availability()
    h = hashlib.sha256()
    for part in (FORMAT, cfg, model, repr(s.rules.table), repr(s.rules.optimizer_table), devices,
                 dict(s.mesh.shape), config, os.environ.get("XLA_FLAGS", ""), versions, kernel):
        h.update(json.dumps(part, sort_keys=True, default=repr).encode() + b"\0")
    for name, path in sources():
        h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


# --- output tree structures as JSON: dicts with string keys, tuples, lists, None and leaves; a subtree
# equal to one of the caller's named structures (e.g. the train state, with optax's nodes) by name.

def _encode(tree: Any, refs: dict) -> Any:
    structure = jax.tree_util.tree_structure(tree)
    for name, ref in refs.items():
        if structure == ref:
            return {"ref": name}
    if tree is None:
        return None
    if isinstance(tree, dict) and all(isinstance(k, str) for k in tree):
        return {"dict": {k: _encode(v, refs) for k, v in tree.items()}}
    if type(tree) in (tuple, list):
        return {type(tree).__name__: [_encode(v, refs) for v in tree]}
    if structure.num_nodes == 1 and structure.num_leaves == 1:
        return "leaf"
    raise TypeError(f"cannot record a {type(tree).__name__} node")


def _decode(obj: Any, refs: dict) -> Any:
    """A pytree of the recorded structure (its leaves are 0)."""
    if obj is None:
        return None
    if obj == "leaf":
        return 0
    if "ref" in obj:
        ref = refs[obj["ref"]]
        return jax.tree_util.tree_unflatten(ref, [0] * ref.num_leaves)
    if "dict" in obj:
        return {k: _decode(v, refs) for k, v in obj["dict"].items()}
    kind, items = next(iter(obj.items()))
    return {"tuple": tuple, "list": list}[kind](_decode(v, refs) for v in items)


class Program:
    """A compiled program called with pytrees: flattens the arguments, runs the flat program and
    rebuilds the output. Attributes it does not have (``memory_analysis``, ``cost_analysis``) are
    the compiled program's."""

    def __init__(self, compiled: Any, out_tree: Any, loaded: bool):
        self.compiled, self.out_tree = compiled, out_tree
        self.loaded = loaded  # read from the cache (else exported, and stored, by this run)

    def __call__(self, *args):
        return jax.tree_util.tree_unflatten(self.out_tree, self.compiled(*jax.tree_util.tree_leaves(args)))

    def __getattr__(self, name: str):
        return getattr(self.compiled, name)


def compiled(s: Any, name: str, fn: Callable, args: tuple, out_shardings: Callable[[Any], Any], *,
             donate: int = 0, refs: Optional[dict] = None, options: Optional[dict] = None) -> Optional[Program]:
    """``fn`` (a jitted function) compiled for ``args`` (ShapeDtypeStructs with shardings) through
    its cached exported form, exported and stored first when there is none; None when the cache does
    not apply to ``s`` or the program cannot be exported (the caller compiles ``fn`` itself).

    Args:
      out_shardings: the output pytree of ShapeDtypeStructs -> its shardings (a matching pytree).
      donate: how many leading argument leaves are donated (the jit's donated arguments).
      refs: named tree structures the output may contain (``{'state': treedef}``).
      options: XLA compiler options to compile with (``fn`` itself has none: ``jax.export`` traces it
        inside another jit, where JAX refuses them).
    """
    if not applies(s):
        return None
    if importlib.util.find_spec("flatbuffers") is None:  # pragma: no cover - Exported.serialize needs it
        return None
    refs = refs or {}
    leaves = jax.tree_util.tree_leaves(args)
    if getattr(s, "_program_key", None) is None:
        s._program_key = key(s)  # once per run: hashing the sources takes a few milliseconds
    entry = root() / s._program_key
    if (entry / f"{name}.unexportable").exists():  # found before: tracing it twice per run would be all it did
        return None
    exp, out = _load(entry, name, leaves, refs)
    loaded = exp is not None
    if not loaded:
        try:
            exp, out, lines = _export(fn, args, leaves, refs)
        except JaxtrainError:  # bad input (a config the model refuses while traced): the run's error, not the cache's
            raise
        except Exception as err:  # noqa: BLE001 - e.g. a custom call jax.export refuses: jit compiles it
            _unexportable(entry, name, err)
            return None
        once.mark_said(m for _, m in lines)  # printed while it was traced
        _store(entry, name, exp, out, refs, lines)
    shaped = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out),
                                          [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in exp.out_avals])
    call = jax.jit(exp.call, in_shardings=tuple(x.sharding for x in leaves),
                   out_shardings=tuple(jax.tree_util.tree_leaves(out_shardings(shaped))),
                   donate_argnums=tuple(range(donate)), compiler_options=options or None)
    try:
        with _without_lapack(not calls_lapack(exp)):
            lowered = call.lower(*leaves)
        return Program(lowered.compile(), jax.tree_util.tree_structure(out), loaded)
    except Exception as err:  # noqa: BLE001 - e.g. an entry XLA rejects: jit compiles it as before
        if loaded:  # a stored entry (written by another jaxlib build, say): dropped, the next run exports anew
            _drop(entry, name, err)
        else:  # this run's own export fails to compile: it would again
            _unexportable(entry, name, err)
        return None


def _drop(entry: Path, name: str, err: Exception) -> None:
    """Removes a stored program that loaded but did not compile, so that the next run exports it again."""
    log.debug("the cached %s in %s does not compile: %s", name, entry, err)
    for suffix in (".jaxexp", ".json"):
        try:
            (entry / f"{name}{suffix}").unlink()
        except OSError:
            pass


def _unexportable(entry: Path, name: str, err: Exception) -> None:
    """Records that ``name`` cannot go through the cache under this key (the reason, for a reader), so
    later runs trace it once, for jit, instead of twice."""
    log.debug("the exported %s cannot be used: %s", name, err)
    try:
        entry.mkdir(parents=True, exist_ok=True)
        (entry / f"{name}.unexportable").write_text(f"{type(err).__name__}: {err}\n")
    except OSError:
        pass


def evaluate(s: Any, params: Any, batches: Any) -> Optional[Program]:
    """``s``'s evaluation program (``(params, {field: [n_batches, micro, ...]}) -> {metric: [n_batches]}``)
    compiled for the abstract ``params`` and ``batches``; None where the cache does not apply."""
    from jax.sharding import NamedSharding, PartitionSpec
    replicated = NamedSharding(s.mesh, PartitionSpec())
    return compiled(s, "evaluate", s.fns.evaluate, (params, batches),
                    lambda out: jax.tree_util.tree_map(lambda _: replicated, out))


def calls_lapack(exp: Any) -> bool:
    """Whether an Exported's StableHLO may call a LAPACK kernel (JAX's CPU targets are named
    ``lapack_<routine>``, e.g. ``lapack_spotrf_ffi``; a name in the source locations errs on the
    safe side)."""
    return b"lapack_" in exp.mlir_module_serialized


def uses_fused_kernel(exp: Any) -> bool:
    """Whether an Exported calls jaxtrain's fused CPU kernels (``jaxtrain.kernels.cpu_fused``: the
    attention, the matmul), custom calls jax.export does not vouch for: exported with that check
    disabled, and registered with XLA before an entry that calls them is compiled."""
    from jaxtrain.kernels import cpu_fused
    return any(name.encode() in exp.mlir_module_serialized for name in cpu_fused.TARGETS)


_skip_lapack = threading.local()
_patch_lock = threading.Lock()


@contextlib.contextmanager
def _without_lapack(skip: bool):
    """Lowering an exported CPU program registers JAX's LAPACK kernels first, which imports SciPy
    (~140 modules, 0.1-0.25 s on a 2-core AMD EPYC) whether or not the program calls LAPACK; with
    ``skip`` (its StableHLO names no LAPACK target) this thread's lowering leaves that out. JAX's
    hook is private: where it is missing, lowering is as JAX does it."""
    from jax._src.export import _export
    with _patch_lock:
        ensure = getattr(_export, "_ensure_backends_initialized", None)
        if ensure is not None and not getattr(ensure, "jaxtrain", False):
            def ensure_unless_skipped(platforms, _ensure=ensure):
                if not getattr(_skip_lapack, "on", False):
                    _ensure(platforms)
            ensure_unless_skipped.jaxtrain = True
            _export._ensure_backends_initialized = ensure_unless_skipped
    _skip_lapack.on = skip
    try:
        yield
    finally:
        _skip_lapack.on = False


def train_step(s: Any, state: Any, batch: Any) -> Any:
    """``s``'s train step (a :class:`jaxtrain.train.step.TrainStep`, its hyperparameters bound)
    compiled for the abstract ``state`` and ``batch``; None where the cache does not apply."""
    from jax.sharding import NamedSharding, PartitionSpec
    step = s.fns.train_step
    replicated = NamedSharding(s.mesh, PartitionSpec())
    program = compiled(s, "train_step", step.plain, (state, batch, step.hparams),
                       lambda out: (s.fns.state_shardings, jax.tree_util.tree_map(lambda _: replicated, out[1])),
                       donate=len(jax.tree_util.tree_leaves(state)), refs={"state": s.fns.state_structure},
                       options=s.fns.train_step_options)
    return None if program is None else type(step)(program, step.hparams)


def init(s: Any) -> Optional[Program]:
    """``s``'s init program (``() -> state``); None where the cache does not apply."""
    return compiled(s, "init", s.fns.init, (), lambda _: s.fns.state_shardings,
                    refs={"state": s.fns.state_structure})


def _export(fn: Callable, args: tuple, leaves: list, refs: dict):
    """(Exported, output pytree, the jaxtrain log lines its tracing printed: ``[[level, message], ...]``)."""
    from jax import export
    treedef = jax.tree_util.tree_structure(args)
    outs: list = []

    def flat(*xs):
        out = fn(*jax.tree_util.tree_unflatten(treedef, xs))
        outs.append(out)
        return tuple(jax.tree_util.tree_leaves(out))

    from jaxtrain.kernels import cpu_fused
    ours = [export.DisabledSafetyCheck.custom_call(name) for name in cpu_fused.TARGETS]  # see _load
    with _traced_lines() as lines:
        exp = export.export(jax.jit(flat), disabled_checks=ours)(*leaves)
    _encode(outs[0], refs)  # a structure that cannot be recorded is not exported
    return exp, outs[0], lines


@contextlib.contextmanager
def _traced_lines():
    """Collects the INFO and higher lines jaxtrain's loggers print on this thread (e.g. which attention
    ``model.attention=auto`` picked), so that a run loading the program says them too."""
    lines: list = []
    me = threading.get_ident()
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda r: lines.append([r.levelno, r.getMessage()]) if r.thread == me else None
    log.addHandler(handler)
    try:
        yield lines
    finally:
        log.removeHandler(handler)


_store_failed: list = []  # a failed store was reported (once per process)


def _say(lines: Any) -> None:
    """Says the lines a loaded program's tracing said, each once per process (:func:`once.say`: also not
    where this process's own tracing said it)."""
    for item in lines if isinstance(lines, list) else ():
        level, message = item if isinstance(item, list) and len(item) == 2 else (0, None)
        if isinstance(level, int) and isinstance(message, str):
            once.say(log, level, message)


def _store(entry: Path, name: str, exp: Any, out: Any, refs: dict, lines: list) -> None:
    """Writes the entry atomically (each file under a temporary name, then renamed); a failed write
    leaves the run as it was."""
    try:
        entry.mkdir(parents=True, exist_ok=True)
        meta = json.dumps({"format": FORMAT, "out": _encode(out, refs), "log": lines,
                           "resolved": once.decisions()})  # what auto resolved to while it was traced
        for suffix, data in ((".jaxexp", bytes(exp.serialize())), (".json", meta.encode())):
            tmp = entry / f".{name}{suffix}.{os.getpid()}"
            tmp.write_bytes(data)
            os.replace(tmp, entry / f"{name}{suffix}")
        _prune(entry.parent)
    except OSError as err:  # a full disk, a file in the entry's place: said once, the run goes on
        if not _store_failed:
            _store_failed.append(name)
            log.warning(f"warning: jaxtrain's program cache: storing the traced {name} in {entry} failed "
                        f"({err.strerror or err}); later runs trace it again")


def _load(entry: Path, name: str, leaves: list, refs: dict):
    """(Exported, output pytree of placeholders) from the entry, or (None, None) when it is missing,
    unreadable or made for other argument shapes."""
    from jax import export
    try:
        meta = json.loads((entry / f"{name}.json").read_text())
        exp = export.deserialize(bytearray((entry / f"{name}.jaxexp").read_bytes()))
        out = _decode(meta["out"], refs)
    except FileNotFoundError:
        return None, None
    except Exception as err:  # noqa: BLE001 - a damaged or foreign entry: traced again and replaced
        log.debug("the cached %s in %s cannot be read: %s", name, entry, err)
        return None, None
    given = [(tuple(x.shape), str(x.dtype)) for x in leaves]
    if ([(tuple(a.shape), str(a.dtype)) for a in exp.in_avals] != given
            or len(exp.out_avals) != jax.tree_util.tree_structure(out).num_leaves):
        return None, None
    if uses_fused_kernel(exp):  # its custom calls must be registered before it compiles
        from jaxtrain.kernels import cpu_fused
        if cpu_fused.problem() is not None:  # gone (no compiler now): traced again, for XLA's ops instead
            return None, None
    os.utime(entry)  # recently used: kept by _prune
    _say(meta.get("log", []))
    once.merge(meta.get("resolved", {}))  # for the run directory's resolved.json
    return exp, out


def _prune(folder: Path) -> None:
    entries = sorted((p for p in folder.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[KEEP:]:
        shutil.rmtree(old, ignore_errors=True)
