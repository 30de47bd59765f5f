"""The run's init, train-step and evaluation programs kept across runs as exported StableHLO, so a
warm start loads them instead of tracing the model again.

Tracing and lowering is Python work under one interpreter lock: on ``configs/shakespeare_char.yaml``
(one device, 2-core AMD EPYC) ~0.65 s for the train step, where loading its exported form takes
~0.05 s. JAX's persistent compilation cache then finds the compiled program as before.

Format: :func:`jax.export.export` of a function of the arguments' flattened leaves, serialized with
``Exported.serialize`` (a flatbuffer holding the StableHLO bytecode; nothing is unpickled), plus a
JSON file with the output's tree structure (:mod:`.program_files`). Entries live in
``JAXTRAIN_PROGRAM_CACHE_DIR`` (default ``~/.cache/jaxtrain/programs``), one directory per key; the
newest :data:`KEEP` are kept.

The key is a SHA-256 of everything a traced program depends on: the Python source of jaxtrain and
its model families, the resolved config without the keys that only steer the loop (``run``,
``checkpoint``, ``metrics``, ``profile``, ``train`` except ``global_batch``, ``grad_accum`` and
``seed``, ``data`` except ``seq_len`` and ``mode``), the resolved model config (its vocabulary),
the rule tables, the run plan's kernel choices (an ``auto`` that resolved otherwise traces other
kernels), the devices, JAX's configuration, the ``XLA_FLAGS`` and the versions of Python, JAX, jaxlib,
Flax and Optax. An entry is used only when its argument shapes and dtypes equal the
call's; one that cannot be read is traced again and replaced.

Used where tracing is a visible share of start-up and the exported program is the same as jit's:
the command line (:func:`enable`), one process on one CPU device, a registered model family, nothing
offloaded to host memory. ``JAXTRAIN_PROGRAM_CACHE=0`` turns it off. Part of the ``cpu`` kernel
provider (its runtime hooks, :mod:`.hooks`): the trainer asks the registry for a compiled program.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Optional

import jax

from jaxtrain.errors import JaxtrainError
from jaxtrain.kernels.cpu import library
from jaxtrain.kernels.cpu import program_files as files
from jaxtrain.runtime.env import cache_folder_usable, switch

log = logging.getLogger("jaxtrain")

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
    off = s.plan.offload
    return (_enabled and s.family is not None and _ours(s.family) and len(s.devices) == 1
            and s.devices[0].platform == "cpu" and jax.process_count() == 1 and not off.state
            and not off.activations)


def _ours(family: Any) -> bool:
    """A family whose code the key hashes: jaxtrain's own, not a plugin package's."""
    parts = (family.model, family.loss, family.head_loss, family.flops_per_token)
    return all(getattr(p, "__module__", "").startswith("jaxtrain.") for p in parts if p is not None)


def sources() -> list[tuple[str, Path]]:
    """(name inside its package, path) of every Python and C++ source of jaxtrain and its model families."""
    models = importlib.util.find_spec("jaxtrain.models").submodule_search_locations[0]  # installed from models/
    roots = {"jaxtrain": Path(__file__).resolve().parents[2], "jaxtrain.models": Path(models)}
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
    # what auto resolved to: a run without the kernels (no compiler) traces others, and is its own entry
    kernels = s.plan.kernels.as_json()
    h = hashlib.sha256()
    for part in (files.FORMAT, cfg, model, repr(s.rules.table), repr(s.rules.optimizer_table), devices,
                 dict(s.mesh.shape), config, os.environ.get("XLA_FLAGS", ""), versions, kernels):
        h.update(json.dumps(part, sort_keys=True, default=repr).encode() + b"\0")
    for name, path in sources():
        h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


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
    exp, out = files.load(entry, name, leaves, refs)
    loaded = exp is not None
    if not loaded:
        try:
            exp, out = _export(fn, args, leaves, refs)
        except JaxtrainError:  # bad input (a config the model refuses while traced): the run's error, not the cache's
            raise
        except Exception as err:  # noqa: BLE001 - e.g. a custom call jax.export refuses: jit compiles it
            files.unexportable(entry, name, err)
            return None
        files.store(entry, name, exp, out, refs)
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
            files.drop(entry, name, err)
        else:  # this run's own export fails to compile: it would again
            files.unexportable(entry, name, err)
        return None


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
    """(Exported, output pytree) of ``fn`` for ``args``."""
    from jax import export
    treedef = jax.tree_util.tree_structure(args)
    outs: list = []

    def flat(*xs):
        out = fn(*jax.tree_util.tree_unflatten(treedef, xs))
        outs.append(out)
        return tuple(jax.tree_util.tree_leaves(out))

    ours = [export.DisabledSafetyCheck.custom_call(name) for name in library.TARGETS]  # see files.load
    exp = export.export(jax.jit(flat), disabled_checks=ours)(*leaves)
    files.encode(outs[0], refs)  # a structure that cannot be recorded is not exported
    return exp, outs[0]


