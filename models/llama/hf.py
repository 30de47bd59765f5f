"""Hugging Face ``LlamaForCausalLM`` (and ``MistralForCausalLM``) names, layouts and config.json.

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

A tied model's files may still hold ``lm_head.weight`` (some savers write the shared table twice):
an exact copy of ``model.embed_tokens.weight`` is accepted with a note, any other is refused.

Rotary embeddings already use HF's rotate_half convention, so q/k need no permutation.
With ``scan_layers`` the blocks are stacked on a leading layer dim; they are unstacked
on export and stacked on import, so both layouts give the same tensors.

:class:`DecoderHF` holds what every Llama-like decoder shares (attention, norms, embeddings,
config.json); a family with another feed-forward block (``models/mixtral/hf.py``) subclasses it
and overrides the ``ffn_*`` hooks. ``model_keys`` reads config.json into ``model.*`` keys and
refuses, naming the field and its value, anything that would change the math and that the
family does not compute (biases, another activation, a RoPE type other than default/llama3,
a smaller sliding window than the sequence, a head size other than hidden/heads).
"""
from __future__ import annotations

import math
from typing import Any, ClassVar, Optional

import jax
import numpy as np

from jaxtrain.errors import ConfigError
from jaxtrain.models.llama.config import LlamaConfig, RopeScaling

# config.json keys that change nothing jaxtrain computes (ids, caching, init, bookkeeping).
INERT_KEYS = frozenset({
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "bos_token_id", "eos_token_id",
    "pad_token_id", "use_cache", "initializer_range", "pretraining_tp", "_name_or_path", "output_attentions",
    "output_hidden_states", "return_dict", "id2label", "label2id", "problem_type", "chunk_size_feed_forward",
    "is_encoder_decoder", "output_router_logits", "tokenizer_class"})
# Not inert, so not above: router_aux_loss_coef (a MoE's loss weight: the mixtral converter notes it).
ROPE_TYPES = ("default", "llama3")
IGNORED_TENSORS = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry; recomputed, never read


class DecoderHF:
    """Names, layouts and config.json of a Llama-like HF decoder (see the module docstring).

    ``architectures`` maps each HF architecture this converter reads to its HF config class's
    defaults for the keys a config.json may leave out; ``architecture`` is the one export writes.
    """

    architecture: ClassVar[str]
    model_type: ClassVar[str]
    architectures: ClassVar[dict[str, dict[str, Any]]]
    ffn: ClassVar[str] = "mlp"  # the feed-forward sub-tree of a layer in our params

    # ---- tensors -------------------------------------------------------------------------------------------

    def vocab_size(self, tensors: dict) -> int:
        """The vocabulary the tensors were saved with (rows of the embedding table)."""
        table = tensors.get("model.embed_tokens.weight")
        if table is None:
            raise ConfigError("model: the safetensors hold no model.embed_tokens.weight")
        return int(table.shape[0])

    def to_hf(self, params: dict, cfg: LlamaConfig) -> dict[str, np.ndarray]:
        """Our param tree (``nnx.to_pure_dict`` layout, host arrays) -> HF tensors (numpy, C order), in
        HF's order (layer by layer)."""
        out = {"model.embed_tokens.weight": params["embed"]["embedding"]}
        for i in range(cfg.n_layers):
            layer = jax.tree_util.tree_map(lambda x: x[i], params["layers"]) if cfg.scan_layers \
                else params["layers"][i]
            pre = f"model.layers.{i}."
            a, d = layer["attn"], cfg.d_model
            for name in ("q", "k", "v"):
                out[f"{pre}self_attn.{name}_proj.weight"] = a[f"w{name}"].reshape(d, -1).T
            out[f"{pre}self_attn.o_proj.weight"] = a["wo"].reshape(-1, d).T
            out.update(self.ffn_to_hf(layer[self.ffn], pre, cfg))
            out[f"{pre}input_layernorm.weight"] = layer["attn_norm"]["scale"]
            out[f"{pre}post_attention_layernorm.weight"] = layer["mlp_norm"]["scale"]
        out["model.norm.weight"] = params["final_norm"]["scale"]
        if "lm_head" in params:
            out["lm_head.weight"] = params["lm_head"].T
        return {k: np.ascontiguousarray(v) for k, v in out.items()}

    def shapes(self, cfg: LlamaConfig, tensors: Optional[dict] = None) -> dict[str, tuple]:
        """The HF tensor names and shapes that ``cfg`` (vocab resolved) implies.

        With ``tensors`` (an import's), a feed-forward block that HF can store in more than one layout
        gets the names of the layout those tensors use (see :meth:`ffn_shapes`)."""
        d, q, kv, v = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.vocab_size
        out = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
        for i in range(cfg.n_layers):
            pre = f"model.layers.{i}."
            out.update({pre + "self_attn.q_proj.weight": (q, d), pre + "self_attn.k_proj.weight": (kv, d),
                        pre + "self_attn.v_proj.weight": (kv, d), pre + "self_attn.o_proj.weight": (d, q),
                        pre + "input_layernorm.weight": (d,), pre + "post_attention_layernorm.weight": (d,)})
            out.update(self.ffn_shapes(pre, cfg, tensors))
        if not cfg.tie_embeddings:
            out["lm_head.weight"] = (v, d)
        return out

    def from_hf(self, tensors: dict, cfg: LlamaConfig, notes: Optional[list[str]] = None) -> dict:
        """HF tensors (numpy) -> our param tree for ``cfg`` (the exact inverse of :meth:`to_hf`).

        ``notes`` (if given) gets a line for each thing read differently than it is stored: buffers
        recomputed instead of read, a tied model's copy of the embedding table as ``lm_head.weight``.

        Raises:
          ConfigError: a tensor is missing, unexpected, or has the wrong shape, or a tied model's
            ``lm_head.weight`` is not an exact copy of the embedding table (all listed).
        """
        notes = [] if notes is None else notes
        expected = self.shapes(cfg, tensors)
        buffers = sorted(n for n in tensors if n.endswith(IGNORED_TENSORS))
        if buffers:
            notes.append(f"model: buffers jaxtrain recomputes from config.json are not read: {_some(buffers)}")
        tensors = {n: x for n, x in tensors.items() if n not in buffers}
        problems = []
        if cfg.tie_embeddings and "lm_head.weight" in tensors:  # the shared table saved a second time
            problem = _tied_copy_problem(tensors)
            problems += [problem] if problem else []
            if not problem:
                notes.append("model: lm_head.weight is an exact copy of model.embed_tokens.weight and config.json "
                             "ties them (tie_word_embeddings true): read once, as the embedding table")
            tensors = {n: x for n, x in tensors.items() if n != "lm_head.weight"}
        problems += [f"{n}: missing (expected {expected[n]})" for n in expected if n not in tensors]
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
                self.ffn: self.ffn_from_hf(t, pre, cfg),
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

    # Feed-forward hooks: a SwiGLU MLP here; a mixture of experts in models/mixtral/hf.py.
    def ffn_to_hf(self, m: dict, pre: str, cfg: LlamaConfig) -> dict:
        return {f"{pre}mlp.gate_proj.weight": m["w_gate"].T, f"{pre}mlp.up_proj.weight": m["w_up"].T,
                f"{pre}mlp.down_proj.weight": m["w_down"].T}

    def ffn_shapes(self, pre: str, cfg: LlamaConfig, tensors: Optional[dict] = None) -> dict[str, tuple]:
        d, f = cfg.d_model, cfg.d_ff
        return {pre + "mlp.gate_proj.weight": (f, d), pre + "mlp.up_proj.weight": (f, d),
                pre + "mlp.down_proj.weight": (d, f)}

    def ffn_from_hf(self, t: dict, pre: str, cfg: LlamaConfig) -> dict:
        return {"w_gate": t[pre + "mlp.gate_proj.weight"].T, "w_up": t[pre + "mlp.up_proj.weight"].T,
                "w_down": t[pre + "mlp.down_proj.weight"].T}

    # ---- config.json ---------------------------------------------------------------------------------------

    def hf_config(self, cfg: LlamaConfig, seq_len: int) -> dict:
        """``config.json`` of :attr:`architecture` for ``cfg`` (vocab resolved).

        RoPE is written the way transformers 4 and 5 both read (``rope_theta`` and ``rope_scaling``
        with ``rope_type``); ``max_position_embeddings`` is ``model.max_positions``, else ``seq_len``.
        """
        s = cfg.rope_scaling
        scaling = None if s is None else {
            "rope_type": s.type, "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings}
        return {"architectures": [self.architecture], "model_type": self.model_type, "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
                "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
                "head_dim": cfg.head_dim, "hidden_act": "silu",
                "max_position_embeddings": cfg.max_positions or seq_len, "rms_norm_eps": cfg.norm_eps,
                "rope_theta": cfg.rope_theta, "rope_scaling": scaling, "tie_word_embeddings": cfg.tie_embeddings,
                "attention_dropout": 0.0, "initializer_range": cfg.init_std, "torch_dtype": cfg.param_dtype,
                "dtype": cfg.param_dtype, **self.extra_hf_config(cfg)}

    def extra_hf_config(self, cfg: LlamaConfig) -> dict:
        return {"attention_bias": False, "mlp_bias": False}

    def model_keys(self, hf: dict, seq_len: int) -> tuple[dict, list[str]]:
        """config.json (a parsed dict whose ``architectures[0]`` is one of :attr:`architectures`) ->
        (the ``model.*`` keys it fixes, notes for the user), for a run of sequence length ``seq_len``.

        A key config.json leaves out (or sets to null) takes its HF config class's default.

        Raises:
          ConfigError: a missing or mistyped size, or a field that would change the math and that this
            family does not compute, naming the field and its value.
        """
        r = ConfigReader(hf, self.architectures[hf["architectures"][0]])
        d_model, n_heads = r.int("hidden_size"), r.int("num_attention_heads")
        keys = {"vocab_size": r.int("vocab_size"), "d_model": d_model, "n_layers": r.int("num_hidden_layers"),
                "n_heads": n_heads, "n_kv_heads": r.int("num_key_value_heads", default=n_heads),
                "d_ff": r.int("intermediate_size"), "norm_eps": r.number("rms_norm_eps"),
                "tie_embeddings": r.flag("tie_word_embeddings"), "max_positions": r.int("max_position_embeddings")}
        head_dim = r.get("head_dim", default=None)
        if head_dim is not None and (d_model % n_heads or head_dim != d_model // n_heads):
            raise ConfigError(f"config.json head_dim: {head_dim!r} is not hidden_size / num_attention_heads = "
                              f"{d_model} / {n_heads} (jaxtrain's head size is model.d_model / model.n_heads)")
        act = r.get("hidden_act", default="silu")
        if act not in ("silu", "swish"):
            raise ConfigError(f"config.json hidden_act: {act!r} is not supported (jaxtrain computes silu)")
        for key in ("attention_bias", "mlp_bias"):
            if key in r.defaults and r.get(key):
                raise ConfigError(f"config.json {key}: {r.get(key)!r} is not supported (jaxtrain's layers have no "
                                  f"biases)")
        if r.number("attention_dropout", default=0.0):
            raise ConfigError(f"config.json attention_dropout: {hf['attention_dropout']!r} is not supported "
                              f"(jaxtrain has no dropout)")
        notes = []
        if "sliding_window" in r.defaults:
            r.read.add("sliding_window")
            window = r.defaults["sliding_window"] if "sliding_window" not in hf else hf["sliding_window"]
            if window is not None:
                if isinstance(window, bool) or not isinstance(window, int) or window < seq_len:
                    raise ConfigError(
                        f"config.json sliding_window: {window!r} is less than data.seq_len={seq_len} (jaxtrain's "
                        f"attention is fully causal: it equals sliding-window attention only on sequences no "
                        f"longer than the window)")
                notes.append(f"config.json sliding_window={window}: attention over at most data.seq_len={seq_len} "
                             f"tokens equals it; keep data.seq_len <= {window} when training this model")
        keys["rope_theta"], keys["rope_scaling"] = _rope(r, keys["max_positions"])
        keys.update(self.extra_model_keys(r, notes))
        unread = sorted(set(hf) - r.read - INERT_KEYS)
        if unread:
            notes.append(f"config.json keys not read (they change nothing jaxtrain computes, or are unknown to "
                         f"it): {', '.join(unread)}")
        return keys, notes

    def extra_model_keys(self, r: "ConfigReader", notes: list[str]) -> dict:
        """The family's own ``model.*`` keys from config.json (appending notes for the user to ``notes``)."""
        return {}


def _some(names: list[str], limit: int = 5) -> str:
    """'a, b, c' for at most ``limit`` names, then 'and N more' (messages stay short for 1000s of tensors)."""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _tied_copy_problem(tensors: dict) -> Optional[str]:
    """None when ``lm_head.weight`` equals ``model.embed_tokens.weight`` exactly (values, not dtype), else
    why not (shape, or the max abs difference). A missing embedding table is reported elsewhere."""
    head, table = tensors["lm_head.weight"], tensors.get("model.embed_tokens.weight")
    if table is None:
        return None
    tied = "config.json ties them (tie_word_embeddings true), so a tied model has one table; set " \
           "tie_word_embeddings to false to import both"
    if head.shape != table.shape:
        return f"lm_head.weight: shape {tuple(head.shape)} differs from model.embed_tokens.weight's " \
               f"{tuple(table.shape)}, but {tied}"
    # In float32 (exact for bf16/f16/f32; float64 only when stored so): a 128k-row table stays cheap.
    wide = np.float64 if np.dtype(np.float64) in (head.dtype, table.dtype) else np.float32
    a, b = np.asarray(head, wide), np.asarray(table, wide)
    if np.array_equal(a, b):
        return None
    diff = float(np.max(np.abs(a - b)))
    return f"lm_head.weight: differs from model.embed_tokens.weight (max abs difference {diff:.3g}), but {tied}"


class LlamaHF(DecoderHF):
    """The converter of :data:`jaxtrain.models.llama.FAMILY`: HF Llama, and Mistral read as Llama with GQA."""

    architecture = "LlamaForCausalLM"
    model_type = "llama"
    # The HF config classes' defaults (transformers 5.24) for keys a config.json may leave out.
    architectures = {
        "LlamaForCausalLM": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                             "max_position_embeddings": 2048, "attention_bias": False, "mlp_bias": False},
        "MistralForCausalLM": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                               "max_position_embeddings": 131072, "sliding_window": 4096},
    }


class ConfigReader:
    """Typed reads of config.json values; every problem is a ConfigError naming the field and value."""

    REQUIRED = object()

    def __init__(self, hf: dict, defaults: dict):
        self.hf, self.defaults, self.read = hf, defaults, {"architectures"}

    def get(self, key: str, default: Any = REQUIRED) -> Any:
        self.read.add(key)
        value = self.hf.get(key)
        if value is not None:
            return value
        if key in self.defaults:
            return self.defaults[key]
        if default is self.REQUIRED:
            raise ConfigError(f"config.json {key}: missing (needed for {self.hf['architectures'][0]})")
        return default

    def int(self, key: str, default: Any = REQUIRED) -> int:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"config.json {key}: expected an integer >= 1, got {value!r}")
        return value

    def number(self, key: str, default: Any = REQUIRED) -> float:
        return _number(f"config.json {key}", self.get(key, default))

    def flag(self, key: str, default: Any = REQUIRED) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"config.json {key}: expected true or false, got {value!r}")
        return value


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name}: expected a finite number, got {value!r}")
    return float(value)


def _rope(r: ConfigReader, max_positions: int) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling as ``model.rope_scaling`` keys or None) from config.json.

    transformers 4 writes ``rope_theta`` and ``rope_scaling`` (``type`` or ``rope_type``);
    transformers 5 writes ``rope_parameters`` holding ``rope_theta`` and ``rope_type``. Both are
    read; a value given twice must agree. Types: default (or none) and llama3.
    """
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for name in ("rope_scaling", "rope_parameters"):
        block = r.get(name, default=None)
        if block is None:
            continue
        if not isinstance(block, dict) or any(isinstance(v, dict) for v in block.values()):
            raise ConfigError(f"config.json {name}: {block!r} is not supported (one mapping of RoPE parameters "
                              f"for every layer is)")
        for k, v in block.items():
            key = "rope_type" if k == "type" else k
            if v is None:
                continue
            if key in merged and merged[key] != v:
                raise ConfigError(f"config.json {name}.{k}: {v!r} contradicts {origin[key]}={merged[key]!r}")
            merged[key], origin[key] = v, f"{name}.{k}"
    top = r.hf.get("rope_theta")
    r.read.add("rope_theta")
    if top is not None and "rope_theta" in merged and _number("config.json rope_theta", top) != \
            _number(f"config.json {origin['rope_theta']}", merged["rope_theta"]):
        raise ConfigError(f"config.json rope_theta: {top!r} contradicts {origin['rope_theta']}="
                          f"{merged['rope_theta']!r}")
    if "rope_theta" in merged:
        theta = _number(f"config.json {origin['rope_theta']}", merged["rope_theta"])
    else:
        theta = r.number("rope_theta")
    if theta <= 0:
        raise ConfigError(f"config.json rope_theta: must be > 0, got {theta!r}")
    for name, value in (("partial_rotary_factor", r.get("partial_rotary_factor", default=None)),
                        (origin.get("partial_rotary_factor"), merged.get("partial_rotary_factor"))):
        if value is not None and value != 1:
            raise ConfigError(f"config.json {name}: {value!r} is not supported (jaxtrain rotates the whole head)")
    kind = merged.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        where = origin.get("rope_type", "rope_scaling.rope_type")
        raise ConfigError(f"config.json {where}: {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    if kind == "default":
        return theta, None
    values: dict[str, Any] = {}
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        if key not in merged:
            raise ConfigError(f"config.json {origin['rope_type'].split('.')[0]}.{key}: missing (needed by "
                              f"rope_type llama3)")
        values[key] = _number(f"config.json {origin[key]}", merged[key])
    orig = merged.get("original_max_position_embeddings", max_positions)  # HF's fallback too
    if isinstance(orig, bool) or not isinstance(orig, int):
        raise ConfigError(f"config.json {origin['original_max_position_embeddings']}: expected an integer, "
                          f"got {orig!r}")
    values["original_max_position_embeddings"] = orig
    scaling = RopeScaling(type="llama3", **values)
    try:
        scaling.check()
    except ConfigError as err:  # named after our key: say which config.json field it came from
        key = str(err).split(":")[0].rsplit(".", 1)[-1]
        raise ConfigError(f"config.json {origin.get(key, key)}: {str(err).split(': ', 1)[1]}") from None
    return theta, scaling.model_dump()
