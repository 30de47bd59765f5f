"""Loading a config: YAML file + dotted ``key=value`` overrides -> a validated :class:`Config`.

Order: YAML (duplicate keys rejected) -> overrides (values parsed as YAML scalars, string
fields kept as written) -> unknown-key check with a "did you mean" suggestion -> pydantic
(strict types) -> cross-field checks. Every failure is a ConfigError naming the key.
"""
from __future__ import annotations

import difflib
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ValidationError

from jaxtrain.config.schema import DEFAULT_FAMILY, Config, CustomModelConfig, ModelConfig, family_config
from jaxtrain.errors import ConfigError


def _section_class(annotation: Any, subtree: Any) -> Any:
    """The schema class of a section: a ``model:`` mapping is checked against its family's class."""
    if annotation is ModelConfig:
        family = subtree.get("family", DEFAULT_FAMILY) if isinstance(subtree, dict) else DEFAULT_FAMILY
        return family_config(family) if isinstance(family, str) else ModelConfig
    return annotation


def _check_keys(tree: Any, model_cls: type[BaseModel], prefix: str = "") -> None:
    if not isinstance(tree, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {tree!r}")
    fields = model_cls.model_fields
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            valid = [f"{prefix}{k}" for k in fields]
            close = difflib.get_close_matches(dotted, valid, n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(valid)}"
            if model_cls is CustomModelConfig:  # a custom model's own settings have a place of their own
                hint = f"; a custom model's settings go under {prefix}options (e.g. {prefix}options.{key})"
            elif isinstance(key, str) and key.split(".")[0] in fields:  # 'train.steps: 5' in a file
                head, rest = key.split(".", 1)
                hint = (f"; dotted keys are for key=value overrides: in a YAML file, nest it ('{head}:' with "
                        f"'{rest}:' indented below it)")
            raise ConfigError(f"unknown config key '{dotted}'{hint}")
        sub = _section_class(fields[key].annotation, value)
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            if value is None:  # a section whose keys are all commented out: its defaults
                tree[key] = value = {}
            _check_keys(value, sub, dotted + ".")


def _section(annotation: Any) -> Any:
    """``Optional[Section]`` -> ``Section`` (e.g. ``model.rope_scaling``), so that its keys are typed too."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if (typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1
            and isinstance(args[0], type) and issubclass(args[0], BaseModel)):
        return args[0]
    return annotation


def _annotation(path: list[str], family: str = DEFAULT_FAMILY) -> Any:
    """The schema annotation of a dotted path (``model.*`` in ``family``'s schema), or None."""
    cls: Any = Config
    for part in path:
        cls = _section(cls)
        if cls is ModelConfig:
            cls = family_config(family)
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or part not in cls.model_fields:
            return None
        cls = cls.model_fields[part].annotation
    return cls


def _is_string_field(annotation: Any) -> bool:
    if annotation is str:
        return True
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Literal:
        return all(isinstance(a, str) for a in args)
    return typing.get_origin(annotation) in (typing.Union, types.UnionType) and str in args  # Optional[str]


def _quoted(raw: str) -> str:
    """A string field's text: a whole quoted YAML string (``"a\\tb"``, ``'it''s'``) as YAML reads it,
    escapes included; anything else as written."""
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "\"'":
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            return raw
        if isinstance(value, str):
            return value
    return raw


def parse_override(item: str, family: str = DEFAULT_FAMILY) -> tuple[list[str], Any]:
    """``'train.steps=10'`` -> (['train', 'steps'], 10).

    Values are parsed as YAML scalars, except for string fields, which take the
    text as written (``data.path=2024`` stays '2024'; ``null`` still means None), unless it is a
    quoted YAML string: ``data.separator="\\n\\n"`` is two newlines, as in a YAML file.
    ``model.*`` keys are typed by the schema of ``family``.
    """
    if "=" not in item:
        raise ConfigError(f"override '{item}': expected dotted key=value, e.g. train.steps=100")
    key, raw = item.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{item}': empty key")
    path = key.split(".")
    annotation = str if path == ["model", "family"] else _annotation(path, family)
    if _is_string_field(annotation) and raw not in ("null", "~"):
        return path, _quoted(raw)
    try:
        value = yaml.load(raw, Loader=UniqueKeyLoader) if raw != "" else ""
    except yaml.YAMLError as err:  # not YAML: the text itself (a string field's type check names it)
        if (getattr(err, "problem", None) or "").startswith("duplicate key"):
            raise ConfigError(f"override '{item}': {err.problem}") from None
        value = raw
    if isinstance(value, str) and float in (annotation, *typing.get_args(annotation)):
        try:
            value = float(raw)  # 'nan', 'inf' (checked later with a named error)
        except ValueError:
            pass
    return path, value


def _set(tree: dict, path: list[str], value: Any, family: str = DEFAULT_FAMILY) -> None:
    """Sets ``path`` in ``tree``; a mapping given for a whole section (``'train={steps: 5}'``) is merged
    into it key by key, as dotted overrides would be (not put in place of the file's section)."""
    section = _annotation(path, family)
    if isinstance(value, dict) and isinstance(section, type) and issubclass(section, BaseModel):
        for key, sub in value.items():
            _set(tree, [*path, str(key)], sub, family)
        return
    node = tree
    for part in path[:-1]:
        if node.get(part) is None:  # absent, or an empty section in the file (its keys commented out)
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise ConfigError(f"override '{'.'.join(path)}': '{part}' is not a section")
    node[path[-1]] = value


def _validation_error(err: ValidationError) -> ConfigError:
    """The first problem of a pydantic ValidationError as a ConfigError naming the dotted key."""
    first = err.errors()[0]
    # A value of a union (e.g. model.options.*) is tried against each member type, which pydantic
    # appends to the location ('...hidden.bool'): name the key only.
    loc = [str(p) for p in first["loc"] if str(p) not in ("bool", "int", "float", "str")]
    key = ".".join(loc) or "config"
    got = first.get("input")
    if first["type"] == "value_error" and isinstance(first.get("ctx", {}).get("error"), ConfigError):
        return first["ctx"]["error"]
    if first["type"] == "finite_number":  # NaN or an infinity, refused for every float key (config.base.Section)
        return ConfigError(f"{key}: must be a finite number, got {got}")
    msg = first["msg"] if len(loc) == len(first["loc"]) else "Input should be a bool, int, float or string"
    if got is None and loc and ":" in loc[-1]:  # '{a.jsonl:3}': YAML reads one key 'a.jsonl:3' with no value
        head, _, tail = loc[-1].rpartition(":")
        msg += f"; YAML reads '{loc[-1]}' as one key without a value: write '{head}: {tail}', with a space"
    return ConfigError(f"{key}: {msg} (got {got!r})")


def yaml_error(where: str, err: yaml.YAMLError) -> str:
    """One line for a YAML file that does not parse: ``<where>, line L, column C: invalid YAML: <problem>``
    (the parser's position and problem; its whole message where it marked none)."""
    mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None)
    if mark is None or not problem:
        return f"{where}: invalid YAML: " + " ".join(str(err).split())
    context = getattr(err, "context", None)
    if context and problem.startswith("but "):  # 'but found another document': half a sentence alone
        problem = f"{context}, {problem}"
    return f"{where}, line {mark.line + 1}, column {mark.column + 1}: invalid YAML: {problem}"


def from_dict(tree: dict) -> Config:
    """Validates a plain nested dict. Raises ConfigError naming the key."""
    _check_keys(tree, Config)
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise _validation_error(err) from None


def load(path: Optional[str] = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Loads ``path`` (YAML, or None for the built-in default) and applies overrides.

    Args:
      path: a YAML file, or a config name found in ``configs/`` (e.g. 'shakespeare_char').
      overrides: dotted ``key=value`` strings, applied in order after the file.

    Raises:
      ConfigError: missing file, bad YAML, unknown key, wrong type or inconsistent value.
    """
    tree: dict = {}
    if path is not None:
        file = resolve_resource(path, "configs", "--config")
        try:
            loaded = yaml.load(file.read_text(), Loader=UniqueKeyLoader)
        except yaml.YAMLError as err:
            raise ConfigError(yaml_error(f"config file {file}", err)) from None
        except UnicodeDecodeError as err:
            raise ConfigError(f"config file {file}: not UTF-8 text (byte {err.start}: {err.reason})") from None
        if loaded is None:  # a truncated or unsaved file would otherwise train the built-in default job
            raise ConfigError(f"config file {file}: empty (no keys); leave out --config for the built-in "
                              f"default job, or write '{{}}' for the defaults")
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {file}: top level must be a mapping")
        tree = loaded
    family = tree.get("model", {}).get("family", DEFAULT_FAMILY) if isinstance(tree.get("model"), dict) \
        else DEFAULT_FAMILY
    for item in overrides:  # the family named last decides how model.* values are typed
        if item.startswith("model.family="):
            family = item.split("=", 1)[1]
    for item in overrides:
        key, value = parse_override(item, family)
        _set(tree, key, value, family)
    return from_dict(tree)


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that rejects a key given twice in one mapping (instead of last-wins)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *defaults': merged by SafeLoader below
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key '{key}' (YAML alone would silently keep the last)",
                    key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


# YAML 1.1 reads '3e-4' (no dot) as a string; read it as the float everyone means.
UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def resource_roots(folder: str) -> list[Path]:
    """Where ``configs/`` or ``sharding_rules/`` live: the source checkout, then the installed package."""
    here = Path(__file__).resolve()
    return [here.parents[2] / folder, here.parents[1] / folder]


def resolve_resource(name: str, folder: str, key: str) -> Path:
    """Finds a YAML file given as a path, or by name in ``configs/`` / ``sharding_rules/``.

    Looks in the source checkout first, then in the installed package data.
    Raises ConfigError if nothing matches.
    """
    candidate = Path(os.path.expanduser(name))
    if candidate.is_file():
        return candidate
    stem = name if name.endswith((".yaml", ".yml")) else name + ".yaml"
    roots = resource_roots(folder)
    for root in roots:
        if (root / stem).is_file():
            return root / stem
    known = sorted({p.stem for r in roots if r.is_dir() for p in r.glob("*.yaml")})
    what = "a folder, not a YAML file" if candidate.is_dir() else "no such file"
    raise ConfigError(f"{key}: '{name}' is {what}, and no name in {folder}/ (known names: "
                      f"{', '.join(known) or 'none'})")
