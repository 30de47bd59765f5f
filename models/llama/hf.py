"""Hugging Face ``LlamaForCausalLM`` names and layouts for the llama family's parameters.

Torch ``Linear`` weights are ``[out, in]``:

  model.embed_tokens.weight                      [vocab, d]        = embed.embedding
  model.layers.i.self_attn.q_proj.weight         [heads*hd, d]     = wq [d, heads, hd] reshaped, transposed
  model.layers.i.self_attn.{k,v}_proj.weight     [kv_heads*hd, d]  = wk / wv likewise
  model.layers.i.self_attn.o_proj.weight         [d, heads*hd]     = wo [heads, hd, d] reshaped, transposed
  model.layers.i.mlp.{gate,up}_proj.weight       [d_ff, d]         = w_gate / w_up transposed
  model.layers.i.mlp.down_proj.weight            [d, d_ff]         = w_down transposed
  model.layers.i.input_layernorm.weight          [d]               = attn_norm.scale
  model.layers.i.post_attention_layernorm.weight [d]               = mlp_norm.scale
  model.norm.weight                              [d]               = final_norm.scale
  lm_head.weight                                 [vocab, d]        = lm_head transposed (absent when tied)

Rotary embeddings already use HF's rotate_half convention, so q/k need no permutation.
With ``scan_layers`` the blocks are stacked on a leading layer dim; they are unstacked
on export and stacked on import, so both layouts give the same tensors.
"""
from __future__ import annotations

import jax
import numpy as np

from jaxtrain.config.schema import ConfigError
from jaxtrain.models.llama.config import LlamaConfig


class LlamaHF:
    """The converter of :data:`jaxtrain.models.llama.FAMILY` (see the module docstring)."""

    architecture = "LlamaForCausalLM"

    def vocab_size(self, tensors: dict) -> int:
        """The vocabulary the tensors were saved with (rows of the embedding table)."""
        table = tensors.get("model.embed_tokens.weight")
        if table is None:
            raise ConfigError("model: the safetensors hold no model.embed_tokens.weight")
        return int(table.shape[0])

    def to_hf(self, params: dict, cfg: LlamaConfig) -> dict[str, jax.Array]:
        """Our param tree (``nnx.to_pure_dict`` layout) -> HF tensors."""
        out = {"model.embed_tokens.weight": params["embed"]["embedding"],
               "model.norm.weight": params["final_norm"]["scale"]}
        for i in range(cfg.n_layers):
            layer = jax.tree_util.tree_map(lambda x: x[i], params["layers"]) if cfg.scan_layers \
                else params["layers"][i]
            pre = f"model.layers.{i}."
            a, m, d = layer["attn"], layer["mlp"], cfg.d_model
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

    def shapes(self, cfg: LlamaConfig) -> dict[str, tuple]:
        """The HF tensor names and shapes that ``cfg`` (vocab resolved) implies."""
        d, f, q, kv, v = cfg.d_model, cfg.d_ff, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, \
            cfg.vocab_size
        out = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
        for i in range(cfg.n_layers):
            pre = f"model.layers.{i}."
            out.update({pre + "self_attn.q_proj.weight": (q, d), pre + "self_attn.k_proj.weight": (kv, d),
                        pre + "self_attn.v_proj.weight": (kv, d), pre + "self_attn.o_proj.weight": (d, q),
                        pre + "mlp.gate_proj.weight": (f, d), pre + "mlp.up_proj.weight": (f, d),
                        pre + "mlp.down_proj.weight": (d, f), pre + "input_layernorm.weight": (d,),
                        pre + "post_attention_layernorm.weight": (d,)})
        if not cfg.tie_embeddings:
            out["lm_head.weight"] = (v, d)
        return out

    def from_hf(self, tensors: dict, cfg: LlamaConfig) -> dict:
        """HF tensors -> our param tree for ``cfg`` (the exact inverse of :meth:`to_hf`).

        Raises:
          ConfigError: a tensor is missing, unexpected, or has the wrong shape (all listed).
        """
        expected = self.shapes(cfg)
        problems = [f"{n}: missing (expected {expected[n]})" for n in expected if n not in tensors]
        problems += [f"{n}: not a tensor of this model" for n in tensors if n not in expected]
        problems += [f"{n}: shape {tuple(tensors[n].shape)}, expected {expected[n]}" for n in expected
                     if n in tensors and tuple(tensors[n].shape) != expected[n]]
        if problems:
            raise ConfigError("model: the safetensors do not fit this model config:\n  "
                              + "\n  ".join(sorted(problems)))
        t, d, h, kvh, hd = tensors, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        layers = {}
        for i in range(cfg.n_layers):
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
        if cfg.scan_layers:  # one block whose leaves carry a leading layer dim
            layers = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *(layers[i] for i in range(cfg.n_layers)))
        params = {"embed": {"embedding": t["model.embed_tokens.weight"]}, "layers": layers,
                  "final_norm": {"scale": t["model.norm.weight"]}}
        if not cfg.tie_embeddings:
            params["lm_head"] = t["lm_head.weight"].T
        return params

    def hf_config(self, cfg: LlamaConfig, seq_len: int) -> dict:
        """``config.json`` in HF ``LlamaConfig`` form."""
        return {"architectures": [self.architecture], "model_type": "llama", "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
                "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
                "head_dim": cfg.head_dim, "hidden_act": "silu", "max_position_embeddings": seq_len,
                "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
                "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
                "initializer_range": cfg.init_std, "torch_dtype": cfg.param_dtype}
