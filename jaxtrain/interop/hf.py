"""Hugging Face safetensors out of a run and into a new one (params only; no pickle on any path).

    python -m jaxtrain.export RUN_DIR [--step N] [--max-shard-size 5GB] --format safetensors OUT_DIR
    python -m jaxtrain.export --import HF_DIR [--config FILE] [key=value ...]

Export writes ``OUT_DIR/config.json`` and the weights through the converter of the run's model
family (``models/<family>/hf.py``: tensor names, layouts and the HF config): one
``model.safetensors``, or, above ``--max-shard-size``, HF's sharded layout
(``model-00001-of-0000N.safetensors`` and ``model.safetensors.index.json``). Import is the exact
inverse: it reads ``config.json`` (its ``architectures[0]`` picks the family whose converter reads
it; the converter turns it into the ``model.*`` keys), the single file or the shards of the index,
and writes a run directory whose step-0 checkpoint holds the imported params and a fresh optimizer
state, so ``python -m jaxtrain.train`` with the run's config.yaml continues from them. The user's
config and overrides still choose everything else (dtypes, attention, remat, data, train, ...);
an override of a model key that contradicts config.json is refused by name. Every problem is
found before anything is written. See ``jaxtrain.interop.hf_files`` for the file formats.
"""
from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import jax
import numpy as np
import yaml
from pydantic import BaseModel

from jaxtrain.checkpoint.checkpointer import Checkpointer
from jaxtrain.config import Config, from_dict, load, paths
from jaxtrain.config.loading import UniqueKeyLoader, resolve_resource
from jaxtrain.data import tokenizers
from jaxtrain.errors import CheckpointError, ConfigError, CorruptCheckpointError
from jaxtrain.interop.hf_files import (
    CONFIG_FILE,
    DEFAULT_MAX_SHARD_SIZE,
    EXPORT_MARK,
    INDEX_FILE,
    WEIGHTS_FILE,
    check_no_foreign_weights,
    load_tensors,
    parse_size,
    read_hf_config,
    weight_files,
    write_weights,
)
from jaxtrain.models import registry
from jaxtrain.models.family import Family, HFConverter
from jaxtrain.parallel import host_data
from jaxtrain.train import lm, rundir
from jaxtrain.train.assembly import setup
from jaxtrain.train.optimizer import hyperparameters, optimizer

__all__ = ["CONFIG_FILE", "DEFAULT_MAX_SHARD_SIZE", "INDEX_FILE", "WEIGHTS_FILE", "converter", "export",
           "family_for", "import_config", "import_hf", "model_keys"]


def converter(cfg: Config) -> HFConverter:
    """The converter of ``cfg``'s family. Raises ConfigError when there is none."""
    if cfg.model.family == "custom":
        raise ConfigError("model.family: a custom model (jaxtrain.fit with a ModelSpec) has no Hugging Face converter")
    family = lm.family_of(cfg)
    if family.hf is None:
        raise ConfigError(f"model.family: '{family.name}' has no Hugging Face converter (its Family has no hf)")
    return family.hf


def _architectures(conv: HFConverter) -> tuple[str, ...]:
    """The HF architectures a converter reads: its ``architectures`` (if any), else its ``architecture``."""
    return tuple(getattr(conv, "architectures", None) or (conv.architecture,))


def family_for(architecture: str) -> Family:
    """The registered family whose converter reads HF ``architecture`` (e.g. 'MixtralForCausalLM').

    Raises:
      ConfigError: no registered family reads it (the message lists those that are read).
    """
    known: dict[str, str] = {}
    broken = []
    for name in registry.names():
        try:
            family = registry.get(name)
        except Exception as err:  # noqa: BLE001 - a family that fails to load cannot read it; named below
            broken.append(f"{name} ({type(err).__name__}: {err})")
            continue
        for arch in _architectures(family.hf) if family.hf is not None else ():
            known.setdefault(arch, name)
    if architecture not in known:
        failed = f"; families that failed to load: {', '.join(broken)}" if broken else ""
        raise ConfigError(f"config.json architectures: {architecture!r} is not supported (supported: "
                          f"{', '.join(sorted(known))}){failed}")
    return registry.get(known[architecture])


def model_keys(hf: dict, seq_len: int) -> tuple[Family, dict, list[str]]:
    """(family, the ``model.*`` keys config.json fixes, notes) for a parsed config.json.

    Raises:
      ConfigError: no architectures, an unsupported architecture, or a field the family's converter
        refuses (named with its value).
    """
    family = family_for(_architecture(hf))
    if not hasattr(family.hf, "model_keys"):
        raise ConfigError(f"model.family: the Hugging Face converter of '{family.name}' cannot read config.json "
                          f"(it has no model_keys)")
    keys, notes = family.hf.model_keys(hf, seq_len)
    return family, {"family": family.name, **keys}, notes


def _architecture(hf: dict) -> str:
    """config.json's ``architectures[0]``. Raises ConfigError when there is none."""
    archs = hf.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ConfigError(f"config.json architectures: expected a list naming the model class (e.g. "
                          f"[\"LlamaForCausalLM\"]), got {archs!r}")
    return archs[0]


def _walk(node: Any, parts: Sequence[str]) -> Any:
    for part in parts:
        node = getattr(node, part, None) if isinstance(node, BaseModel) else \
            node.get(part) if isinstance(node, dict) else None
    return node.model_dump() if isinstance(node, BaseModel) else node


def _differences(cfg: Config, keys: dict) -> list[tuple[str, Any, Any]]:
    """(model key, cfg's value, config.json's value) for every key of ``keys`` that ``cfg`` sets otherwise."""
    return [(k, _walk(cfg.model, [k]), v) for k, v in keys.items() if _walk(cfg.model, [k]) != v]


def import_config(hf_dir: Path, config: Optional[str] = None,
                  overrides: Sequence[str] = ()) -> tuple[Config, list[str]]:
    """The run config of an import, and notes for the user.

    The ``model.*`` keys that ``hf_dir/config.json`` fixes (the family's converter says which: sizes,
    RoPE, norm eps, tying, ...) come from it, replacing those of ``config`` (a YAML file or a name in
    configs/, with a note); everything else comes from ``config`` and ``overrides`` as for training.

    Raises:
      ConfigError: no or a malformed config.json, an unsupported architecture or field, a bad config or
        override, or an override of a model key that contradicts config.json (all of those listed).
    """
    hf_dir = Path(hf_dir)
    # A bad key or value outside model.* is named first, as every command does, before the HF files
    # are read (model.* keys are typed by the family, which config.json decides).
    load(config, [o for o in overrides if not o.startswith("model.")])
    hf = read_hf_config(hf_dir)
    family = family_for(_architecture(hf))
    user = load(config, [f"model.family={family.name}", *overrides])
    family, keys, notes = model_keys(hf, user.data.seq_len)
    tree = user.to_dict()
    tree["model"].update(keys)
    try:
        cfg = from_dict(tree)
    except ConfigError as err:
        raise ConfigError(f"{err} (with the model keys of {hf_dir / CONFIG_FILE})") from None
    explicit, problems = set(), []
    for item in overrides:
        path = item.split("=", 1)[0].split(".")
        if len(path) < 2 or path[0] != "model" or path[1] not in keys:
            continue
        explicit.add(path[1])
        mine, theirs = _walk(user.model, path[1:]), _walk(cfg.model, path[1:])
        if mine != theirs:
            problems.append(f"{'.'.join(path)}: the override {mine!r} contradicts {theirs!r} from "
                            f"{hf_dir / CONFIG_FILE} (an import takes the model keys from config.json; leave the "
                            f"override out)")
    if problems:
        raise ConfigError("\n".join(problems))
    file_keys = _file_model_keys(config)
    for key, was, now in _differences(user, keys):
        if key in file_keys and key not in explicit:
            notes.append(f"model.{key}: {now!r} from config.json replaces the config file's {was!r}")
    notes.insert(0, "model keys from config.json: " + " ".join(f"{k}={_walk(cfg.model, [k])}" for k in keys))
    return cfg, notes


def _file_model_keys(config: Optional[str]) -> set[str]:
    """The ``model:`` keys a config file sets itself (empty without a file)."""
    if config is None:
        return set()
    tree = yaml.load(resolve_resource(config, "configs", "--config").read_text(), Loader=UniqueKeyLoader) or {}
    model = tree.get("model") if isinstance(tree, dict) else None
    return set(model) if isinstance(model, dict) else set()


def import_hf(hf_dir: Path, cfg: Config, devices=None, notes: Optional[list[str]] = None) -> Path:
    """Writes ``cfg.run.dir`` with a step-0 checkpoint holding the params in ``hf_dir``.

    ``cfg``'s model keys must be those of ``hf_dir/config.json`` (:func:`import_config` makes such a
    config from the user's; an unset ``model.max_positions`` is taken from it). Reads
    ``model.safetensors``, or the shards that ``model.safetensors.index.json`` names; never a pickle.
    ``notes`` (if given; e.g. the list :func:`import_config` returned) gets, once the run is written,
    the tensor-level notes: tensors stored but not read (a copy in a shard the index does not choose,
    recomputed buffers, a tied model's copy of its embedding table); those starting with
    'warning: ' are where a stored value may be lost.

    Raises:
      ConfigError: ``cfg``'s family has no converter; ``hf_dir`` lacks config.json or the weights (a
        ``pytorch_model.bin``-only directory is named), names a missing shard or tensor, or holds
        unreadable files; ``cfg``'s model keys differ from config.json's; the tensors do not fit (every
        problem listed); ``run.dir`` is not new or empty (or in use). Nothing is written then.
    """
    hf_dir = Path(hf_dir)
    notes = [] if notes is None else notes
    conv = converter(cfg)
    hf = read_hf_config(hf_dir)
    files = weight_files(hf_dir)
    _, keys, _ = model_keys(hf, cfg.data.seq_len)
    if getattr(cfg.model, "max_positions", 0) is None:  # unset: recorded from config.json
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"max_positions": keys["max_positions"]})})
    wrong = _differences(cfg, keys)
    if wrong:
        raise ConfigError("\n".join(f"model.{k}: the config has {was!r}, {hf_dir / CONFIG_FILE} gives {now!r}"
                                    for k, was, now in wrong))
    found: list[str] = []  # added to ``notes`` only once the import succeeds
    tensors = load_tensors(hf_dir, files, found)
    vocab = cfg.model.vocab_size
    params = _from_hf(conv, tensors, lm.model_config(cfg, vocab), found)  # every mismatch listed before building
    s = setup(cfg, devices, vocab=vocab)
    with rundir.opened(cfg, new=True) as run_dir:  # a new run: nothing of an existing one is touched
        rundir.write_config_file(cfg, run_dir)
        ckpt = Checkpointer(cfg, run_dir)
        try:
            ckpt.save(0, _fresh_state(s, params), {})
            ckpt.finish()
        finally:
            ckpt.close()
    notes += found
    return run_dir


def _check_out_dir(out_dir: Path, run_dir: Path, checkpoint_dir: Optional[str]) -> None:
    """Refuses an export into the run directory itself or into its checkpoint folder, where HF's
    ``config.json`` and weight files would sit among the run's own files (a subfolder such as
    ``RUN_DIR/hf`` is fine).

    Raises:
      ConfigError: naming the folder.
    """
    out = out_dir.expanduser().resolve()
    if out == run_dir.expanduser().resolve():
        raise ConfigError(f"export: OUT_DIR '{out_dir}' is the run directory itself; name a new folder "
                          f"(e.g. {run_dir / 'hf'})")
    ckpt = checkpoint_dir or str(run_dir / "checkpoints")
    if "://" not in ckpt:
        ckpt_path = Path(ckpt).expanduser().resolve()
        if out == ckpt_path or ckpt_path in out.parents:
            raise ConfigError(f"export: OUT_DIR '{out_dir}' is inside the run's checkpoint folder {ckpt}, "
                              f"whose every entry is read as a checkpoint step; name a folder outside it")


def _from_hf(conv: HFConverter, tensors: dict, model_cfg, notes: list[str]) -> dict:
    """``conv.from_hf(tensors, model_cfg)``, passing ``notes`` to a converter whose from_hf takes them
    (a family's own converter may predate the parameter)."""
    if "notes" in inspect.signature(conv.from_hf).parameters:
        return conv.from_hf(tensors, model_cfg, notes=notes)
    return conv.from_hf(tensors, model_cfg)


def _fresh_state(s, params: dict) -> dict:
    """The step-0 train state of ``s`` holding ``params`` (host arrays in the model's layout).

    What ``s.fns.init()`` makes, with ``params`` in place of random ones, built without compiling
    the random initialisation (XLA:CPU takes seconds for it even for a tiny model): ``params`` in
    their stored dtypes (float32 masters of bf16 params), a fresh optimizer state of the run's
    optimizer, step 0 and the run's rng. Checked against ``jax.eval_shape(s.fns.init)``; should the
    two ever differ in structure, shape or dtype, ``s.fns.init()`` itself is used.
    """
    sh = s.fns.state_shardings
    abstract = jax.eval_shape(s.fns.init)
    params = jax.tree_util.tree_map(lambda x, a: np.asarray(x).astype(a.dtype), params, abstract["params"])
    params = host_data.put(params, sh["params"])
    tx = optimizer(hyperparameters(s.cfg), s.fns.param_axes)
    key = jax.random.key(s.cfg.train.seed)
    state = {"params": params, "opt_state": jax.jit(tx.init, out_shardings=sh["opt_state"])(params),
             "step": host_data.put(np.zeros((), np.int32), sh["step"]),
             "rng": host_data.put(np.asarray(jax.random.key_data(jax.random.fold_in(key, 1))), sh["rng"])}
    same = jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(abstract) and all(
        x.shape == a.shape and x.dtype == a.dtype
        for x, a in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(abstract)))
    if not same:  # the step's init changed shape: take it, and put the params in
        state = s.fns.init()
        state["params"] = params
    return jax.block_until_ready(state)  # done before any step is dispatched: see train.trainer.resume


def _single_device(cfg: Config) -> Config:
    tree = cfg.to_dict()
    tree["mesh"] = {"data": 1, "fsdp": 1, "tensor": 1, "sequence": 1, "expert": 1}
    return from_dict(tree)


def _run_vocab(cfg: Config, run_dir: Path) -> int:
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    tok = tokenizers.load(run_dir)
    if tok is None:
        raise ConfigError(f"run dir '{run_dir}': no tokenizer.json and model.vocab_size is 0")
    return tok.vocab_size


def _trained_with(cfg: Config, ckpt: Checkpointer, step: int) -> Config:
    """``cfg`` with the model section ``step`` was trained with, saved beside its state.

    ``config.yaml`` describes the run's latest launch, which may have changed keys that leave the
    parameters' shapes alone (``model.top_k``, ``routing``, ``dtype``) since ``step`` was saved;
    the HF config must say what the weights were trained for. Each changed key is a note on stderr.
    A step saved without a readable config keeps the run's.
    """
    try:
        saved = json.loads(ckpt.store.read_text(f"{step}/config/metadata"))["model"]
        trained = from_dict({**cfg.to_dict(), "model": saved})
    except (OSError, ValueError, KeyError, TypeError, ConfigError):
        return cfg
    now, then = cfg.model.model_dump(), trained.model.model_dump()
    for key in (k for k in then if now.get(k) != then[k]):
        print(f"note: exporting step {step} with model.{key}={then[key]!r}, what it was trained with "
              f"(the run's config.yaml now has {now.get(key)!r})", file=sys.stderr)
    return trained


def export(run_dir: Path, out_dir: Path, step: Optional[int] = None,
           max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Writes the params of ``step`` (default: latest committed) of ``run_dir`` to ``out_dir``.

    ``config.json`` in the HF form of the family's converter, and the weights as one
    ``model.safetensors`` or, when they exceed ``max_shard_size`` (bytes, or a text such as '5GB',
    '2GiB', '200KB'), shards of at most that size (a larger tensor alone in its shard) with
    ``model.safetensors.index.json``. Weight files of an earlier export into ``out_dir`` are replaced.

    Raises:
      ConfigError: no config.yaml in ``run_dir``, a family without converter, a bad size,
        ``out_dir`` is ``run_dir`` itself or in its checkpoint folder, or holds weight files no
        jaxtrain export wrote.
      CheckpointError: no committed checkpoint, or no such step.
    """
    limit = parse_size(max_shard_size)
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"export: '{run_dir}' is not a run directory (no config.yaml)")
    paths.check_folder("export", str(out_dir))  # before any work
    cfg = _single_device(load(str(run_dir / "config.yaml")))
    _check_out_dir(Path(out_dir), run_dir, cfg.checkpoint.dir)
    check_no_foreign_weights(Path(out_dir))
    ckpt = Checkpointer(cfg, run_dir)
    try:
        steps = ckpt.restorable()
        step = (steps[-1] if steps else None) if step is None else step
        if step is None:
            raise CheckpointError(f"export: no committed checkpoint in {ckpt.store.url}")
        cfg = _trained_with(cfg, ckpt, step)
        conv = converter(cfg)
        s = setup(cfg, jax.devices()[:1], vocab=_run_vocab(cfg, run_dir))
        try:
            state, _ = ckpt.restore(step, s.abstract_state())
        except CorruptCheckpointError as err:
            raise CorruptCheckpointError(f"{err.detail}. Export another step with --step N") from None
    finally:
        ckpt.close()
    # float32 masters -> the model's param_dtype, on the host (numpy: no compiled op per tensor shape)
    params = jax.tree_util.tree_map(lambda x, dt: np.asarray(x).astype(dt), state["params"], s.fns.model_dtypes)
    tensors = conv.to_hf(params, s.model_config)
    hf_config = conv.hf_config(s.model_config, cfg.data.seq_len)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_weights(tensors, out_dir, limit, {"format": "pt", EXPORT_MARK: str(step)})
    (out_dir / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
    return out_dir
