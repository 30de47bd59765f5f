"""Hugging Face safetensors out of a run and into a new one (params only; no pickle on any path).

    python -m jaxtrain.export RUN_DIR [--step N] --format safetensors OUT_DIR
    python -m jaxtrain.export --import HF_DIR [--config FILE] [key=value ...]

Export writes ``OUT_DIR/model.safetensors`` and ``OUT_DIR/config.json`` through the
converter of the run's model family (``models/<family>/hf.py``: tensor names, layouts and
the HF config class). Import is the exact inverse: it writes a run directory whose
step-0 checkpoint holds the imported params and a fresh optimizer state, so
``python -m jaxtrain.train`` with the same config continues from them. Dtypes are kept.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import jax
from safetensors.flax import load_file, save_file

from jaxtrain.checkpoint.checkpointer import Checkpointer, CheckpointError, CorruptCheckpointError
from jaxtrain.config import Config, ConfigError, from_dict, load
from jaxtrain.data import tokenizers
from jaxtrain.models.family import HFConverter
from jaxtrain.train import lm, rundir
from jaxtrain.train.setup import setup

WEIGHTS_FILE = "model.safetensors"


def converter(cfg: Config) -> HFConverter:
    """The converter of ``cfg``'s family. Raises ConfigError when there is none."""
    if cfg.model.family == "custom":
        raise ConfigError("model.family: a custom model (jaxtrain.fit with a ModelSpec) has no Hugging Face converter")
    family = lm.family_of(cfg)
    if family.hf is None:
        raise ConfigError(f"model.family: '{family.name}' has no Hugging Face converter (its Family has no hf)")
    return family.hf


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


def export(run_dir: Path, out_dir: Path, step: Optional[int] = None) -> Path:
    """Writes the params of ``step`` (default: latest committed) of ``run_dir`` to ``out_dir``.

    Raises:
      ConfigError: no config.yaml in ``run_dir``, or a family without converter.
      CheckpointError: no committed checkpoint, or no such step.
    """
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"export: '{run_dir}' is not a run directory (no config.yaml)")
    cfg = _single_device(load(str(run_dir / "config.yaml")))
    conv = converter(cfg)
    s = setup(cfg, jax.devices()[:1], vocab=_run_vocab(cfg, run_dir))
    ckpt = Checkpointer(cfg, run_dir)
    try:
        steps = ckpt.restorable()
        step = (steps[-1] if steps else None) if step is None else step
        if step is None:
            raise CheckpointError(f"export: no committed checkpoint in {ckpt.store.url}")
        try:
            state, _ = ckpt.restore(step, s.abstract_state())
        except CorruptCheckpointError as err:
            raise CorruptCheckpointError(f"{err.detail}. Export another step with --step N") from None
    finally:
        ckpt.close()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    params = s.fns.model_params(state["params"])  # float32 masters -> the model's param_dtype
    save_file(conv.to_hf(params, s.model_config), str(out_dir / WEIGHTS_FILE),
              metadata={"format": "pt", "jaxtrain_step": str(step)})
    hf_config = conv.hf_config(s.model_config, cfg.data.seq_len)
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    return out_dir


def import_hf(hf_dir: Path, cfg: Config, devices=None) -> Path:
    """Writes ``cfg.run.dir`` with a step-0 checkpoint holding the params in ``hf_dir``.

    Raises:
      ConfigError: ``hf_dir`` lacks the files, ``run.dir`` is not new or empty (or in use), or the
        tensors do not fit ``cfg.model`` (every problem listed).
    """
    hf_dir = Path(hf_dir)
    if not (hf_dir / WEIGHTS_FILE).is_file():
        raise ConfigError(f"import: no {WEIGHTS_FILE} in '{hf_dir}'")
    conv = converter(cfg)
    tensors = load_file(str(hf_dir / WEIGHTS_FILE))
    vocab = cfg.model.vocab_size or conv.vocab_size(tensors)
    params = conv.from_hf(tensors, lm.model_config(cfg, vocab))  # every mismatch listed before building
    s = setup(cfg, devices, vocab=vocab)
    with rundir.opened(cfg, new=True) as run_dir:  # a new run: nothing of an existing one is touched
        rundir.write_config_file(cfg, run_dir)
        ckpt = Checkpointer(cfg, run_dir)
        try:
            state = s.fns.init()
            expected = jax.tree_util.tree_map(lambda x: x.dtype, state["params"])
            state["params"] = jax.device_put(jax.tree_util.tree_map(lambda x, dt: x.astype(dt), params, expected),
                                             s.fns.state_shardings["params"])
            ckpt.save(0, state, {})
            ckpt.finish()
        finally:
            ckpt.close()
    return run_dir
