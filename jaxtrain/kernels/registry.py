"""The kernel registry: the operations jaxtrain runs through kernels, the providers that implement them,
and how ``auto`` picks one.

Operations, and the config key that names an implementation of each:

==============  ============================  ======================================================
op              key                           what
==============  ============================  ======================================================
attention       ``model.attention``           softmax attention, q [batch, q_len, heads, head_dim]
matmul          ``model.matmul``              the projections' 2-D matmuls, the SwiGLU MLP, RMSNorm
grouped_matmul  ``model.grouped_matmul``      the MoE experts' SwiGLU over rows grouped by expert
optimizer       ``optimizer.implementation``  the step's guarded AdamW update
==============  ============================  ======================================================

A provider (:class:`KernelProvider`) offers :class:`Implementation` s: the name a config value selects,
the backends it runs on, why it cannot take a run (``problem``, from :class:`Facts` known before
anything is traced) or a call (``refuses``, from the call's shapes and dtypes), where ``auto`` may pick
it and its functions. Built in: ``xla`` (always there), ``pallas_gpu``, ``pallas_tpu`` and ``cpu`` (the
C++ XLA:CPU kernels). Another package adds one with an entry point in the ``jaxtrain.kernels`` group
(``name = "package.module"``, a module defining ``PROVIDER``), or :func:`register` from Python.

``auto`` is resolved once per run (:func:`plan`, called by ``jaxtrain.train.assembly.setup``): the
candidates whose ``auto`` ranks name the backend, in rank order, the first with no ``problem`` wins; a
call it refuses (say, a length its kernel does not take) goes to the next candidate that takes it. An
explicit choice that cannot run is a named error (:func:`check`), never a silent fallback.

This module imports no provider and nothing heavy: providers are loaded by name on first use (so the
config layer can ask for the allowed values, and nothing here depends on what a provider imports).
"""
from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

from jaxtrain.errors import AttentionBackendError, ConfigError

KEYS: dict[str, str] = {"attention": "model.attention", "matmul": "model.matmul",
                        "grouped_matmul": "model.grouped_matmul", "optimizer": "optimizer.implementation"}
# provider name -> the module defining PROVIDER (one line per built-in provider)
PROVIDERS: dict[str, str] = {"xla": "jaxtrain.kernels.xla", "pallas_gpu": "jaxtrain.kernels.pallas.gpu",
                             "pallas_tpu": "jaxtrain.kernels.pallas.tpu", "cpu": "jaxtrain.kernels.cpu"}
ENTRY_POINTS = "jaxtrain.kernels"  # the entry-point group of providers in other packages


@dataclass(frozen=True)
class Facts:
    """What decides which implementation may run, known before anything is traced (None: unknown, then
    each call's own shapes decide).

    backend: 'cpu', 'gpu' or 'tpu'. devices: the mesh's device count (a custom call is opaque to XLA's
    partitioner: a one-device kernel on a mesh would have its operands gathered). dtype: the model's
    compute dtype. state_dtypes: the dtypes the train state stores its params in. host_state: the
    optimizer state or params live in host memory (``offload.*``). offloaded_activations: named
    activations go to host memory (a kernel's are its own). length_split: the rules split the
    attention's 'length' over devices (None: unknown, each call says). sharded: inside the trainer's
    sharding context, where the MoE experts run per device under ``shard_map``. seq_len, head_dim,
    heads, kv_heads: the attention's sizes. segment_ids: the batches carry segment ids (packed or
    padded documents). window: a sliding window in keys.
    """

    backend: str
    devices: int = 1
    dtype: Optional[str] = None
    state_dtypes: tuple[str, ...] = ()
    host_state: bool = False
    offloaded_activations: bool = False
    length_split: Optional[bool] = False
    sharded: bool = False
    seq_len: Optional[int] = None
    head_dim: Optional[int] = None
    heads: Optional[int] = None
    kv_heads: Optional[int] = None
    segment_ids: Optional[bool] = None
    window: Optional[int] = None


def _no_problem(*_args, **_kwargs) -> Optional[str]:
    return None


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: one object per registered implementation
class Implementation:
    """One way to run one operation.

    Attributes:
      op: a key of :data:`KEYS`. name: the config value that selects it (several providers may offer one
        name for different backends, e.g. ``pallas``).
      backends: where it can run at all ('cpu', 'gpu', 'tpu'; Pallas's GPU kernels run on CPU in
        interpret mode, for tests).
      functions: its entry points, by name (what :mod:`jaxtrain.kernels.ops` calls; see each op there).
      problem: ``(facts) -> reason or None``: why it cannot take this run.
      auto_problem: ``(facts) -> reason or None``: why ``auto`` passes it over for this run although it
        could run it (an explicit choice runs it, with this as a warning).
      refuses: ``(call, auto, facts) -> reason or None``: why it does not take this call (``call``: the
        op's arguments as :mod:`jaxtrain.kernels.ops` passes them); with ``auto``, also calls it takes
        but is not the best at (an explicit choice then runs it all the same).
      auto: backend -> rank: where ``auto`` may pick it, lower ranks first.
      reason: what ``auto`` says when it picks it.
      available: ``() -> reason or None``: None once it can run in this process (a library built and
        registered); asked only by :func:`plan`, after the backend is up.
      rope_inside: an attention that applies the rotary tables itself (``ops.attention``'s ``rope``).
      provider: the provider's name (set by the registry).
    """

    op: str
    name: str
    backends: tuple[str, ...]
    functions: Mapping[str, Callable] = field(default_factory=dict)
    problem: Callable[[Facts], Optional[str]] = _no_problem
    auto_problem: Callable[[Facts], Optional[str]] = _no_problem
    refuses: Callable[..., Optional[str]] = _no_problem
    auto: Mapping[str, int] = field(default_factory=dict)
    reason: str = ""
    available: Callable[[], Optional[str]] = _no_problem
    rope_inside: bool = False
    provider: str = ""


class KernelProvider(Protocol):
    """What a provider module's ``PROVIDER`` is: a name, its implementations and, optionally,
    ``hooks``, an object whose methods the run calls at fixed points
    (:class:`jaxtrain.kernels.hooks.RuntimeHooks`)."""

    name: str

    def implementations(self) -> Sequence[Implementation]: ...


_lock = threading.Lock()
_loaded: dict[str, Any] = {}  # provider name -> its PROVIDER


def register(name: str, module: str) -> None:
    """Adds the provider defined as ``PROVIDER`` in ``module`` under ``name`` (a provider of your own)."""
    with _lock:
        PROVIDERS[name] = module
        _loaded.pop(name, None)
        _impls.clear()


def providers(plugins: bool = True) -> dict[str, Any]:
    """Every provider, loaded: the built-in ones and those :func:`register` added, then (``plugins``) the
    entry points' (a built-in name wins over a plugin's). Built-in provider modules import nothing heavy;
    the entry points are read on the first call that asks for them (a scan of the installed packages:
    ~60 ms cold, a few once JAX's backend has looked for its own plugins).

    Raises:
      ConfigError: a provider's module defines no ``PROVIDER`` of its name.
    """
    with _lock:
        named = {**(_entry_points() if plugins else {}), **PROVIDERS}
        for name, module in named.items():
            if name not in _loaded:
                provider = getattr(importlib.import_module(module), "PROVIDER", None)
                if provider is None or getattr(provider, "name", None) != name:
                    raise ConfigError(f"kernel provider '{name}': module {module} defines no PROVIDER named '{name}'")
                _loaded[name] = provider
        return {name: _loaded[name] for name in named}


_entry_cache: dict[str, str] = {}


def _entry_points() -> dict[str, str]:
    """The ``jaxtrain.kernels`` entry points, read once per process."""
    if not _entry_cache:
        from importlib import metadata
        _entry_cache.update({e.name: e.value for e in metadata.entry_points(group=ENTRY_POINTS)} or {"": ""})
    return {k: v for k, v in _entry_cache.items() if k}


_impls: dict[str, list[Implementation]] = {}  # op -> every provider's implementations of it


def implementations(op: str) -> list[Implementation]:
    """Every implementation of ``op``, each with its provider's name."""
    if op not in _impls:
        from dataclasses import replace
        out = []
        for name, provider in providers().items():
            out += [replace(impl, provider=name) for impl in provider.implementations() if impl.op == op]
        _impls[op] = out
    return _impls[op]


def names(op: str) -> list[str]:
    """The values ``op``'s key takes: ``auto`` and every implementation's name, in registration order."""
    return list(dict.fromkeys(["auto", *(impl.name for impl in implementations(op))]))


def known(op: str, name: str) -> bool:
    """Whether ``name`` is a value of ``op``'s key: a built-in name is known without reading the installed
    packages' entry points (the config is validated before JAX starts)."""
    if name == "auto" or any(impl.name == name and impl.op == op for p in providers(plugins=False).values()
                             for impl in p.implementations()):
        return True
    return name in names(op)


def _error(op: str):
    return AttentionBackendError if op == "attention" else ConfigError


def lookup(op: str, name: str, backend: str) -> Implementation:
    """The implementation ``name`` of ``op`` for ``backend``.

    Raises:
      ConfigError: an unknown name (``AttentionBackendError`` for one that exists, but not for
        ``backend``; for attention, else ``ConfigError``).
    """
    found = [impl for impl in implementations(op) if impl.name == name]
    if not found:
        raise ConfigError(f"{KEYS[op]}: unknown implementation '{name}' (known: {', '.join(names(op))})")
    for impl in found:
        if backend in impl.backends:
            return impl
    where = " or ".join(sorted({b for impl in found for b in impl.backends}))
    here = [impl.name for impl in implementations(op) if backend in impl.backends]
    choices = list(dict.fromkeys(["auto", *here]))
    alternatives = ", ".join(choices[:-1]) + f" or {choices[-1]}" if len(choices) > 1 else choices[0]
    raise _error(op)(f"{KEYS[op]}: {name} runs on {where}; the backend is '{backend}' (use {alternatives})")


def check(op: str, name: str, facts: Facts) -> None:
    """An explicit choice that cannot run on this run's facts is a named error; ``auto`` always passes.

    Raises:
      ConfigError (AttentionBackendError for attention): naming the key and why.
    """
    if op not in KEYS:
        raise ValueError(f"unknown kernel operation '{op}' (known: {', '.join(KEYS)})")
    if name == "auto":
        return
    impl = lookup(op, name, facts.backend)
    why = impl.problem(facts)
    if why:
        raise cannot_run(op, name, why, facts.backend)


def cannot_run(op: str, name: str, why: str, backend: str) -> Exception:
    """The named error of an explicit choice that cannot run: ``<key>=<name> cannot run here: <why>
    (use auto or <the next of auto's candidates>)``; AttentionBackendError for attention, else
    ConfigError."""
    return _error(op)(f"{KEYS[op]}={name} cannot run here: {why} (use auto or {alternative(op, name, backend)})")


def _candidates(op: str, backend: str) -> list[Implementation]:
    ranked = [impl for impl in implementations(op) if backend in impl.auto and backend in impl.backends]
    return sorted(ranked, key=lambda impl: impl.auto[backend])


def alternative(op: str, name: str, backend: str) -> str:
    """What an error suggests besides auto: the candidate auto tries after ``name`` here, else its last."""
    ranked = [impl.name for impl in _candidates(op, backend)]
    after = ranked[ranked.index(name) + 1:] if name in ranked else ranked[-1:]
    return after[0] if after else (ranked[-2] if len(ranked) > 1 else "xla")


@dataclass(frozen=True)
class Choice:
    """How one key resolved: ``value`` as configured, the implementation picked, why, the candidates auto
    passed over and why (``{name: reason}``), and the ones a call it refuses goes to (auto only)."""

    op: str
    value: str
    impl: Implementation
    reason: str
    passed_over: tuple[tuple[str, str], ...] = ()
    fallbacks: tuple[Implementation, ...] = ()
    warning: Optional[str] = None  # an explicit choice that runs, but not well here (why auto would not)

    @property
    def auto(self) -> bool:
        return self.value == "auto"

    @property
    def key(self) -> str:
        return KEYS[self.op]

    def line(self) -> str:
        """One log line: ``model.attention=auto -> blockwise (cpu: runs on one device, here 8)``."""
        said = "; ".join([*(f"{n}: {why}" for n, why in self.passed_over), self.reason])
        return f"{self.key}={self.value} -> {self.impl.name} ({said})"

    def as_json(self) -> dict:
        out = {"choice": self.impl.name, "provider": self.impl.provider, "reason": self.reason}
        if self.passed_over:
            out["passed_over"] = dict(self.passed_over)
        if self.fallbacks and self.impl.refuses is not _no_problem:  # calls it refuses go to these
            out["fallbacks"] = [f.name for f in self.fallbacks]
        if self.warning:
            out["warning"] = self.warning
        return out


def choose(op: str, value: str, facts: Facts, available: bool = True) -> Choice:
    """``value`` of ``op``'s key resolved for ``facts`` (``available``: also ask each candidate whether
    it can run in this process, e.g. its library built; an explicit choice that cannot is an error).

    Raises:
      ConfigError (AttentionBackendError for attention): as :func:`check`, or an explicit choice that
        is not available here.
    """
    if value != "auto":
        check(op, value, facts)
        impl = lookup(op, value, facts.backend)
        why = impl.available() if available else None
        if why:
            raise cannot_run(op, value, why, facts.backend)
        return Choice(op, value, impl, "set in the config", warning=impl.auto_problem(facts))
    passed: list[tuple[str, str]] = []
    ranked = _candidates(op, facts.backend)
    for i, impl in enumerate(ranked):
        why = impl.problem(facts) or impl.auto_problem(facts) or (impl.available() if available else None)
        if why:
            passed.append((impl.name, why))
            continue
        rest = tuple(alt for alt in ranked[i + 1:] if alt.problem(facts) is None)
        return Choice(op, value, impl, impl.reason or f"backend {facts.backend}", tuple(passed), rest)
    raise ConfigError(f"{KEYS[op]}=auto: no implementation runs on backend '{facts.backend}' "
                      f"({'; '.join(f'{n}: {w}' for n, w in passed) or 'none registered'})")


@dataclass(frozen=True)
class KernelPlan:
    """Every kernel op of a run resolved once: ``choices`` by op, the facts they were resolved from, and the
    ops whose key the run's config has (``configured``: the ones said and written; a model without
    experts has no ``model.grouped_matmul``, though a custom model may still call the op)."""

    facts: Facts
    choices: Mapping[str, Choice]
    configured: tuple[str, ...] = tuple(KEYS)

    def choice(self, op: str) -> Choice:
        return self.choices[op]

    def _shown(self) -> list[Choice]:
        return [c for op, c in self.choices.items() if op in self.configured]

    def lines(self) -> list[str]:
        """The log lines of the choices ``auto`` made (explicit ones are the config's own)."""
        return [c.line() for c in self._shown() if c.auto]

    def warnings(self) -> list[str]:
        """An explicit choice's warning each: it runs, but auto would not pick it here, and why."""
        return [f"{c.key}={c.value}: {c.warning}" for c in self._shown() if c.warning]

    def as_json(self) -> dict:
        return {c.key: c.as_json() for c in self._shown()}


def plan(values: Mapping[str, str], facts: Facts) -> KernelPlan:
    """Resolves every op for ``facts``: those in ``values`` (op -> the configured value) as configured, the
    others as ``auto``.

    Raises: as :func:`choose`.
    """
    return KernelPlan(facts, {op: choose(op, values.get(op, "auto"), facts) for op in KEYS}, tuple(values))
