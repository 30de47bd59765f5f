"""Logical axis names -> mesh axes, with named errors instead of silent replication.

A rule set maps each logical name ('batch', 'embed', 'mlp', ...) to an
*ordered* list of candidates. A candidate is a mesh axis, a list of mesh axes
(sharded over their product), or ``null`` (replicate, explicitly). For each
dimension of an array, the first candidate none of whose mesh axes is already
used by an earlier dimension of the same array wins: the T5X / flax-linen
``logical_to_mesh_axes`` semantics. So with ``batch: [[data, fsdp]]`` and
``embed: [fsdp, null]`` a parameter [embed, mlp] gets fsdp on embed, while an
activation [batch, length, embed] leaves embed replicated.

A rule file may add an ``optimizer_rules:`` mapping with the same format: it
overrides ``rules`` for the optimizer state only (ZeRO-1 keeps parameters
replicated and shards the Adam moments; :meth:`Rules.for_optimizer`).

Errors (all :class:`ShardingError`, naming array, dimension, size and axis):
  * a logical name with no rule;
  * no candidate left because every one uses an axis taken by another dim
    (the "axis used twice" case) and no explicit ``null`` candidate follows;
  * a dimension not divisible by the product of its mesh axes (unless
    ``allow_fallback``, which replicates that dim and records it in a report);
  * a rules file naming a mesh axis that does not exist, or one axis twice in
    a candidate.

Rule sets are the YAML files in ``sharding_rules/`` (:func:`rule_sets` lists them);
``sharding.extra_rules`` adds or replaces entries from the config. Model code never sees
a rule set or a mesh: it names activation dimensions through
:func:`jaxtrain.parallel.activations.constrain`.
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import jax
import yaml
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.config import MESH_AXES, ShardingConfig, resolve_resource
from jaxtrain.config.loading import UniqueKeyLoader, resource_roots, yaml_error
from jaxtrain.errors import ConfigError, ShardingError

Candidate = Optional[tuple[str, ...]]  # None = replicate explicitly


@dataclass
class Rules:
    """An ordered rule set: logical name -> candidate mesh-axis tuples (None = replicate)."""

    name: str
    table: dict[str, list[Candidate]]
    allow_fallback: bool = False
    fallbacks: list[str] = field(default_factory=list)  # report of replicated dims
    optimizer_table: Optional[dict[str, list[Candidate]]] = None  # overrides for optimizer state

    @classmethod
    def from_config(cls, sharding: ShardingConfig) -> "Rules":
        """The rule set of ``sharding.rules`` with ``sharding.extra_rules`` laid over it."""
        rules = cls.load(sharding.rules, sharding.allow_fallback)
        if sharding.extra_rules:
            extra = _parse_table("sharding.extra_rules", dict(sharding.extra_rules))
            rules.table = {**rules.table, **extra}
            if rules.optimizer_table:
                rules.optimizer_table = {k: v for k, v in rules.optimizer_table.items() if k not in extra}
        return rules

    @classmethod
    def load(cls, name_or_path: str, allow_fallback: bool = False) -> "Rules":
        """Reads ``sharding_rules/<name>.yaml`` (or a path). Raises ConfigError/ShardingError."""
        path = resolve_resource(name_or_path, "sharding_rules", "sharding.rules")
        try:
            raw = yaml.load(path.read_text(), Loader=UniqueKeyLoader)  # a key given twice is an error
        except UnicodeDecodeError as err:
            raise ConfigError(f"sharding.rules: {path}: not UTF-8 text (byte {err.start}: {err.reason})") from None
        except yaml.YAMLError as err:  # one line with the position, a key given twice included
            raise ConfigError(yaml_error(f"sharding.rules: {path}", err)) from None
        if not isinstance(raw, dict) or not isinstance(raw.get("rules"), dict):
            raise ConfigError(f"sharding.rules: {path}: expected a mapping with a 'rules' mapping")
        unknown = set(raw) - {"rules", "optimizer_rules"}
        if unknown:
            raise ConfigError(f"sharding.rules: {path}: unknown section(s) {', '.join(sorted(map(str, unknown)))} "
                              f"(expected 'rules' and optionally 'optimizer_rules')")
        opt = raw.get("optimizer_rules")
        if opt is not None and not isinstance(opt, dict):
            raise ConfigError(f"sharding.rules: {path}: 'optimizer_rules' must be a mapping")
        stray = [name for name in (opt or {}) if name not in raw["rules"]]
        if stray:  # a mistyped name would leave the optimizer state sharded as the params, silently
            near = difflib.get_close_matches(str(stray[0]), list(map(str, raw["rules"])), n=1)
            raise ConfigError(f"sharding.rules: {path}: optimizer_rules: '{stray[0]}' has no rule in 'rules'"
                              f"{f' (did you mean {near[0]!r}?)' if near else ''}; an optimizer rule replaces "
                              f"the rule of the same logical name for the optimizer state")
        return cls(path.stem, _parse_table(path.stem, raw["rules"]), allow_fallback,
                   optimizer_table=_parse_table(path.stem, opt) if opt else None)

    def for_optimizer(self) -> "Rules":
        """The rules for optimizer state: ``optimizer_rules`` over ``rules`` (self if none).

        The fallback report is shared with ``self``.
        """
        if not self.optimizer_table:
            return self
        return Rules(f"{self.name}[optimizer]", {**self.table, **self.optimizer_table}, self.allow_fallback,
                     self.fallbacks)

    def check_names(self, names, owner: str) -> None:
        """Raises ShardingError listing every logical name in ``names`` this rule set has no rule for."""
        missing = [n for n in names if n not in self.table]
        if missing:
            raise ShardingError(f"rule set '{self.name}' has no rule for logical name(s) {', '.join(missing)} "
                                f"used by {owner} (add them to the rules file or to sharding.extra_rules)")

    def mesh_axes(self) -> set[str]:
        """Mesh axes that some rule other than 'batch' names (the axes this rule set shards params
        or activations over), plus those of the optimizer rules."""
        tables = [self.table] + ([self.optimizer_table] if self.optimizer_table else [])
        return {a for t in tables for name, cands in t.items() if name != "batch"
                for c in cands if c for a in c}

    def partition_spec(self, what: str, logical: Sequence[Optional[str]], shape: Sequence[int],
             mesh: Mesh) -> P:
        """PartitionSpec for one array.

        Args:
          what: the array's name for error messages (a parameter path).
          logical: one logical name (or None = replicated) per dimension.
          shape: the array's shape; each sharded dim must divide evenly.
          mesh: the device mesh (only its axis sizes are read).

        Raises:
          ShardingError: no rule, no free axis, or an indivisible dimension.
        """
        if len(logical) != len(shape):
            raise ShardingError(f"{what}: {len(logical)} logical names {tuple(logical)} for shape {tuple(shape)}")
        used: dict[str, int] = {}  # mesh axis -> the dimension that took it
        out: list[Any] = []
        for dim, (name, size) in enumerate(zip(logical, shape)):
            if name is None:
                out.append(None)
                continue
            if name not in self.table:
                raise ShardingError(
                    f"{what}: dimension {dim} ('{name}', size {size}) has no rule in rule set "
                    f"'{self.name}' (known: {', '.join(self.table)})")
            choice = _first_free(self.table[name], used)
            if choice is False:
                taken = next(a for c in self.table[name] if c for a in c if a in used)
                raise ShardingError(
                    f"{what}: dimension {dim} ('{name}', size {size}): mesh axis '{taken}' is already "
                    f"used by dimension {used[taken]} ('{logical[used[taken]]}') of this array and rule set "
                    f"'{self.name}' gives no other candidate (add null to replicate explicitly)")
            if choice is None:
                out.append(None)
                continue
            ways = math.prod(mesh.shape[a] for a in choice)
            if size % ways:
                keys = " * ".join(f"mesh.{a}" for a in choice)  # the config keys that set the axes
                msg = (f"{what}: dimension {dim} ('{name}', size {size}) is not divisible by mesh axis "
                       f"{'*'.join(choice)} = {ways}, set by {keys}")
                if not self.allow_fallback:
                    raise ShardingError(msg + " (set sharding.allow_fallback=true to replicate it)")
                if msg + " -> replicated" not in self.fallbacks:  # specs are re-derived on every trace
                    self.fallbacks.append(msg + " -> replicated")
                out.append(None)
                continue
            used.update(dict.fromkeys(choice, dim))
            out.append(choice[0] if len(choice) == 1 else choice)
        return P(*out)


def _parse_table(rules_name: str, raw: dict) -> dict[str, list[Candidate]]:
    table: dict[str, list[Candidate]] = {}
    for logical, cands in raw.items():
        if not isinstance(cands, list):
            cands = [cands]
        if not cands:
            raise ShardingError(f"rules '{rules_name}': logical name '{logical}' has no candidates "
                                f"(use [null] to replicate it explicitly)")
        parsed: list[Candidate] = []
        for cand in cands:
            if cand is None:
                parsed.append(None)
                continue
            if not (isinstance(cand, str) or (isinstance(cand, list) and cand and all(isinstance(a, str)
                                                                                      for a in cand))):
                raise ShardingError(f"rules '{rules_name}': logical name '{logical}': candidate {cand!r} is not a "
                                    f"mesh axis, a non-empty list of mesh axes, or null")
            axes = (cand,) if isinstance(cand, str) else tuple(cand)
            for ax in axes:
                if ax not in MESH_AXES:
                    raise ShardingError(
                        f"rules '{rules_name}': logical name '{logical}' maps to mesh axis '{ax}', "
                        f"which does not exist (mesh axes: {', '.join(MESH_AXES)})")
            if len(set(axes)) != len(axes):
                raise ShardingError(f"rules '{rules_name}': logical name '{logical}': candidate {list(axes)} "
                                    f"names a mesh axis twice")
            parsed.append(axes)
        table[str(logical)] = parsed
    return table


def check_mesh_used(rules: Rules, axis_sizes: dict[str, int]) -> None:
    """Every mesh axis of size > 1 must be named by some rule (the batch rule included).

    Raises:
      ShardingError: e.g. mesh.sequence=8 under a rule set that maps nothing to 'sequence':
        the devices along that axis would all repeat the same work.
    """
    used = rules.mesh_axes() | {a for c in rules.table.get("batch", []) if c for a in c}
    for axis, size in axis_sizes.items():
        if size > 1 and axis not in used:
            raise ShardingError(
                f"mesh.{axis}={size}: rule set '{rules.name}' maps no logical name to mesh axis '{axis}', so "
                f"the {size} devices along it would repeat the same work; use a rule set that shards over "
                f"'{axis}' or set mesh.{axis}=1")


def rule_sets() -> list[str]:
    """Names of the shipped rule sets: every ``*.yaml`` in ``sharding_rules/`` (checkout or package)."""
    return sorted({p.stem for root in resource_roots("sharding_rules") if root.is_dir() for p in root.glob("*.yaml")})


def _first_free(cands: list[Candidate], used: dict[str, int]):
    for cand in cands:
        if cand is None or not used.keys() & set(cand):
            return cand
    return False


def path_str(path: tuple) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def tree_shardings(rules: Rules, mesh: Mesh, shapes: Any, logical: Any) -> Any:
    """NamedShardings for a pytree of arrays given a matching pytree of logical-name tuples."""
    flat_logical = jax.tree_util.tree_leaves(logical, is_leaf=lambda x: isinstance(x, tuple))
    flat_shapes, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    if len(flat_logical) != len(flat_shapes):
        raise ShardingError(f"{len(flat_logical)} logical annotations for {len(flat_shapes)} arrays")
    out = [NamedSharding(mesh, rules.partition_spec(path_str(path), names, leaf.shape, mesh))
           for (path, leaf), names in zip(flat_shapes, flat_logical)]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes), out)
