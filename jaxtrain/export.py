"""Weights out and in as Hugging Face Llama safetensors (params only, no pickle).

    python -m jaxtrain.export RUN_DIR [--step N] --format safetensors OUT_DIR
    python -m jaxtrain.export --import HF_DIR [--config FILE] [key=value ...]

Export writes ``OUT_DIR/model.safetensors`` and ``OUT_DIR/config.json`` (the
fields of HF ``LlamaConfig``). Tensor names and layouts follow HF
``LlamaForCausalLM`` (torch ``Linear`` weights are ``[out, in]``):

  model.embed_tokens.weight                    [vocab, d]        = embed.embedding
  model.layers.i.self_attn.q_proj.weight       [heads*hd, d]     = wq [d, heads, hd] reshaped, transposed
  model.layers.i.self_attn.{k,v}_proj.weight   [kv_heads*hd, d]  = wk / wv likewise
  model.layers.i.self_attn.o_proj.weight       [d, heads*hd]     = wo [heads, hd, d] reshaped, transposed
  model.layers.i.mlp.{gate,up}_proj.weight     [d_ff, d]         = w_gate / w_up transposed
  model.layers.i.mlp.down_proj.weight          [d, d_ff]         = w_down transposed
  model.layers.i.input_layernorm.weight        [d]               = attn_norm.scale
  model.layers.i.post_attention_layernorm.weight [d]             = mlp_norm.scale
  model.norm.weight                            [d]               = final_norm.scale
  lm_head.weight                               [vocab, d]        = lm_head transposed (absent when tied)

Rotary embeddings already use HF's rotate_half convention, so q/k need no
permutation. With ``model.scan_layers`` our blocks are stacked on a leading layer dim
(``layers.attn.wq [layers, d, heads, hd]``); they are unstacked on export and stacked on
import, so both layouts give the same files. Dtypes are kept (bf16 stays bf16). Import is the exact inverse:
it writes a run directory whose step-0 checkpoint holds the imported params
and a fresh optimizer state, so ``python -m jaxtrain.train`` with the same
config continues from them.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

import jax
import numpy as np
from safetensors.flax import load_file, save_file

from jaxtrain import checkpoint as ckptlib
from jaxtrain import rundir, step as steplib, tokenizer as toklib
from jaxtrain.config import Config, ConfigError, from_dict, load
from jaxtrain.mesh import build_mesh
from jaxtrain.partitioning import Rules

WEIGHTS_FILE = "model.safetensors"


def to_hf(params: dict, n_layers: int, scanned: bool = False) -> dict[str, jax.Array]:
    """Our param tree (``nnx.to_pure_dict`` layout; ``scanned``: blocks stacked on a leading
    layer dim) -> HF Llama tensors (see module docstring)."""
    out = {"model.embed_tokens.weight": params["embed"]["embedding"],
           "model.norm.weight": params["final_norm"]["scale"]}
    for i in range(n_layers):
        layer = jax.tree_util.tree_map(lambda x: x[i], params["layers"]) if scanned else params["layers"][i]
        pre = f"model.layers.{i}."
        a, m = layer["attn"], layer["mlp"]
        d = a["wq"].shape[0]
        for name in ("q", "k", "v"):
            out[f"{pre}self_attn.{name}_proj.weight"] = a[f"w{name}"].reshape(d, -1).T
        out[f"{pre}self_attn.o_proj.weight"] = a["wo"].reshape(-1, d).T
        out[f"{pre}mlp.gate_proj.weight"] = m["w_gate"].T
        out[f"{pre}mlp.up_proj.weight"] = m["w_up"].T
        out[f"{pre}mlp.down_proj.weight"] = m["w_down"].T
        out[f"{pre}input_layernorm.weight"] = layer["attn_norm"]["scale"]
        out[f"{pre}post_attention_layernorm.weight"] = layer["mlp_norm"]["scale"]
    if "lm_head" in params:
        out["lm_head.weight"] = params["lm_head"].T
    return {k: jax.numpy.asarray(v) for k, v in out.items()}


def hf_shapes(cfg: Config, vocab: int) -> dict[str, tuple]:
    """The HF tensor names and shapes that ``cfg.model`` implies."""
    m = cfg.model
    d, f, q, kv = m.d_model, m.d_ff, m.d_model, m.n_kv_heads * (m.d_model // m.n_heads)
    out = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,)}
    for i in range(m.n_layers):
        pre = f"model.layers.{i}."
        out.update({pre + "self_attn.q_proj.weight": (q, d), pre + "self_attn.k_proj.weight": (kv, d),
                    pre + "self_attn.v_proj.weight": (kv, d), pre + "self_attn.o_proj.weight": (d, q),
                    pre + "mlp.gate_proj.weight": (f, d), pre + "mlp.up_proj.weight": (f, d),
                    pre + "mlp.down_proj.weight": (d, f), pre + "input_layernorm.weight": (d,),
                    pre + "post_attention_layernorm.weight": (d,)})
    if not m.tie_embeddings:
        out["lm_head.weight"] = (vocab, d)
    return out


def from_hf(tensors: dict, cfg: Config) -> dict:
    """HF Llama tensors -> our param tree for ``cfg.model`` (exact inverse of :func:`to_hf`).

    Raises:
      ConfigError: a tensor is missing, unexpected, or has the wrong shape (all listed).
    """
    m = cfg.model
    d, h, kvh, hd = m.d_model, m.n_heads, m.n_kv_heads, m.d_model // m.n_heads
    expected = hf_shapes(cfg, cfg.model.vocab_size or tuple(tensors.get("model.embed_tokens.weight",
                                                                         np.zeros((0, 0))).shape)[0])
    problems = [f"{n}: missing (expected {expected[n]})" for n in expected if n not in tensors]
    problems += [f"{n}: not a tensor of this model" for n in tensors if n not in expected]
    problems += [f"{n}: shape {tuple(tensors[n].shape)}, expected {expected[n]}" for n in expected
                 if n in tensors and tuple(tensors[n].shape) != expected[n]]
    if problems:
        raise ConfigError("model: the safetensors do not fit this model config:\n  " + "\n  ".join(sorted(problems)))
    t = tensors
    layers = {}
    for i in range(m.n_layers):
        pre = f"model.layers.{i}."
        layers[i] = {
            "attn": {"wq": t[pre + "self_attn.q_proj.weight"].T.reshape(d, h, hd),
                     "wk": t[pre + "self_attn.k_proj.weight"].T.reshape(d, kvh, hd),
                     "wv": t[pre + "self_attn.v_proj.weight"].T.reshape(d, kvh, hd),
                     "wo": t[pre + "self_attn.o_proj.weight"].T.reshape(h, hd, d)},
            "mlp": {"w_gate": t[pre + "mlp.gate_proj.weight"].T, "w_up": t[pre + "mlp.up_proj.weight"].T,
                    "w_down": t[pre + "mlp.down_proj.weight"].T},
            "attn_norm": {"scale": t[pre + "input_layernorm.weight"]},
            "mlp_norm": {"scale": t[pre + "post_attention_layernorm.weight"]},
        }
    if m.scan_layers:  # one block whose leaves carry a leading layer dim
        layers = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *(layers[i] for i in range(m.n_layers)))
    params = {"embed": {"embedding": t["model.embed_tokens.weight"]}, "layers": layers,
              "final_norm": {"scale": t["model.norm.weight"]}}
    if not m.tie_embeddings:
        params["lm_head"] = t["lm_head.weight"].T
    return params


def hf_config(cfg: Config, vocab: int) -> dict:
    """``config.json`` in HF ``LlamaConfig`` form."""
    m = cfg.model
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
            "hidden_size": m.d_model, "intermediate_size": m.d_ff, "num_hidden_layers": m.n_layers,
            "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads,
            "head_dim": m.d_model // m.n_heads, "hidden_act": "silu", "max_position_embeddings": cfg.data.seq_len,
            "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta, "tie_word_embeddings": m.tie_embeddings,
            "attention_bias": False, "mlp_bias": False, "initializer_range": m.init_std,
            "torch_dtype": m.param_dtype}


def _single_device(cfg: Config) -> Config:
    tree = cfg.to_dict()
    tree["mesh"] = {"data": 1, "fsdp": 1, "tensor": 1, "sequence": 1, "expert": 1}
    return from_dict(tree)


def _run_vocab(cfg: Config, run_dir: Path) -> int:
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    tok = toklib.load(run_dir)
    if tok is None:
        raise ConfigError(f"run dir '{run_dir}': no tokenizer.json and model.vocab_size is 0")
    return tok.vocab_size


def export(run_dir: Path, out_dir: Path, step: Optional[int] = None) -> Path:
    """Writes the params of ``step`` (default: latest committed) of ``run_dir`` to ``out_dir``.

    Raises:
      ConfigError: no config.yaml in ``run_dir``. CheckpointError: no committed checkpoint / bad step.
    """
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"export: '{run_dir}' is not a run directory (no config.yaml)")
    cfg = _single_device(load(str(run_dir / "config.yaml")))
    vocab = _run_vocab(cfg, run_dir)
    trainer = steplib.build(cfg, build_mesh(cfg.mesh, jax.devices()[:1]), Rules.load(cfg.sharding.rules), vocab)
    ckpt = ckptlib.Checkpointer(cfg, run_dir)
    try:
        step = ckpt.latest_step() if step is None else step
        if step is None:
            raise ckptlib.CheckpointError(f"export: no committed checkpoint in {ckpt.store.url}")
        state, _ = ckpt.restore(step, ckptlib.abstract_like(jax.eval_shape(trainer.init), trainer.state_shardings))
    finally:
        ckpt.close()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(to_hf(state["params"], cfg.model.n_layers, cfg.model.scan_layers), str(out_dir / WEIGHTS_FILE),
              metadata={"format": "pt", "jaxtrain_step": str(step)})
    (out_dir / "config.json").write_text(json.dumps(hf_config(cfg, vocab), indent=2) + "\n")
    return out_dir


def import_hf(hf_dir: Path, cfg: Config, devices=None) -> Path:
    """Writes ``cfg.run.dir`` with a step-0 checkpoint holding the params in ``hf_dir``.

    Raises:
      ConfigError: ``hf_dir`` lacks the files, the run dir already has checkpoints, or the
        tensors do not fit ``cfg.model`` (every problem listed).
    """
    hf_dir = Path(hf_dir)
    if not (hf_dir / WEIGHTS_FILE).is_file():
        raise ConfigError(f"import: no {WEIGHTS_FILE} in '{hf_dir}'")
    tensors = load_file(str(hf_dir / WEIGHTS_FILE))
    vocab = cfg.model.vocab_size or tensors["model.embed_tokens.weight"].shape[0]
    params = from_hf(tensors, cfg)
    devices = list(devices) if devices is not None else jax.devices()
    trainer = steplib.build(cfg, build_mesh(cfg.mesh, devices), Rules.load(cfg.sharding.rules), vocab)
    run_dir = rundir.prepare(cfg)
    ckpt = ckptlib.Checkpointer(cfg, run_dir)
    try:
        if ckpt.latest_step() is not None:
            raise ConfigError(f"run.dir: '{run_dir}' already has checkpoints; import into a new run.dir")
        state = trainer.init()
        expected = jax.tree_util.tree_map(lambda x: x.dtype, state["params"])
        state["params"] = jax.device_put(jax.tree_util.tree_map(lambda x, dt: x.astype(dt), params, expected),
                                         trainer.state_shardings["params"])
        ckpt.save(0, state, {})
        ckpt.finish()
    finally:
        ckpt.close()
    return run_dir


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxtrain.export", description=__doc__.split("\n")[0])
    parser.add_argument("--import", dest="import_dir", help="HF_DIR to import into run.dir (from the config)")
    parser.add_argument("--config", help="with --import: YAML config or a name in configs/")
    parser.add_argument("--step", type=int, help="checkpoint step to export (default: latest committed)")
    parser.add_argument("--format", default="safetensors", choices=["safetensors"])
    parser.add_argument("args", nargs="*", help="RUN_DIR OUT_DIR (export) or key=value overrides (--import)")
    a = parser.parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    try:
        if a.import_dir:
            run_dir = import_hf(Path(a.import_dir), load(a.config, a.args))
            print(f"imported {a.import_dir} into {run_dir} (step 0)")
        else:
            if len(a.args) != 2:
                parser.error("export needs RUN_DIR and OUT_DIR")
            out = export(Path(a.args[0]), Path(a.args[1]), a.step)
            print(f"wrote {out / WEIGHTS_FILE} and {out / 'config.json'}")
    except (ConfigError, ckptlib.CheckpointError, toklib.DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
