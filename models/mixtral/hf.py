"""Hugging Face ``MixtralForCausalLM`` names, layouts and config.json for the mixtral family.

Everything but the feed-forward block is the llama family's (``models/llama/hf.py``, whose
:class:`DecoderHF` this subclasses). Each layer's ``moe`` sub-tree, torch ``Linear`` weights
being ``[out, in]`` (the names transformers 5.24's ``save_pretrained`` writes and loads):

  model.layers.i.block_sparse_moe.gate.weight         [E, d]     = router [d, E] transposed
  model.layers.i.block_sparse_moe.experts.e.w1.weight [d_ff, d]  = w_gate[e] [d, d_ff] transposed
  model.layers.i.block_sparse_moe.experts.e.w3.weight [d_ff, d]  = w_up[e]   (the "up" projection)
  model.layers.i.block_sparse_moe.experts.e.w2.weight [d, d_ff]  = w_down[e] [d_ff, d] transposed

config.json adds ``num_local_experts`` (= model.n_experts) and ``num_experts_per_tok``
(= model.top_k). HF's router is the mixtral family's (softmax over the experts, top-k,
renormalised), so the routing keys (routing, capacity_factor) and the router-loss weights are
training choices the user's config makes; export writes ``router_aux_loss_coef`` as
``aux_loss_weight / top_k`` (HF's load-balancing loss is ``top_k`` times ours).
"""
from __future__ import annotations

import numpy as np

from jaxtrain.config.schema import ConfigError
from jaxtrain.models.llama.hf import DecoderHF, _Reader


class MixtralHF(DecoderHF):
    """The converter of :data:`jaxtrain.models.mixtral.FAMILY` (see the module docstring)."""

    architecture = "MixtralForCausalLM"
    model_type = "mixtral"
    ffn = "moe"
    # transformers 5.24 MixtralConfig defaults for keys a config.json may leave out.
    architectures = {"MixtralForCausalLM": {
        "rope_theta": 1e6, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "max_position_embeddings": 131072,
        "sliding_window": None, "num_local_experts": 8, "num_experts_per_tok": 2}}

    def ffn_to_hf(self, m: dict, pre: str, cfg) -> dict:
        pre = pre + "block_sparse_moe."
        out = {pre + "gate.weight": m["router"].T}
        for e in range(cfg.n_experts):
            out[f"{pre}experts.{e}.w1.weight"] = m["w_gate"][e].T
            out[f"{pre}experts.{e}.w2.weight"] = m["w_down"][e].T
            out[f"{pre}experts.{e}.w3.weight"] = m["w_up"][e].T
        return out

    def ffn_shapes(self, pre: str, cfg) -> dict[str, tuple]:
        pre, d, f = pre + "block_sparse_moe.", cfg.d_model, cfg.d_ff
        out = {pre + "gate.weight": (cfg.n_experts, d)}
        for e in range(cfg.n_experts):
            out.update({f"{pre}experts.{e}.w1.weight": (f, d), f"{pre}experts.{e}.w2.weight": (d, f),
                        f"{pre}experts.{e}.w3.weight": (f, d)})
        return out

    def ffn_from_hf(self, t: dict, pre: str, cfg) -> dict:
        pre = pre + "block_sparse_moe."

        def experts(w: str):  # [E, in, out] from E tensors of [out, in]
            return np.stack([t[f"{pre}experts.{e}.{w}.weight"].T for e in range(cfg.n_experts)])

        return {"router": t[pre + "gate.weight"].T, "w_gate": experts("w1"), "w_up": experts("w3"),
                "w_down": experts("w2")}

    def extra_hf_config(self, cfg) -> dict:
        return {"num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k, "sliding_window": None,
                "router_jitter_noise": 0.0, "output_router_logits": False,
                "router_aux_loss_coef": cfg.aux_loss_weight / cfg.top_k}

    def extra_model_keys(self, r: _Reader) -> dict:
        jitter = r.number("router_jitter_noise", default=0.0)
        if jitter:
            raise ConfigError(f"config.json router_jitter_noise: {r.hf['router_jitter_noise']!r} is not supported "
                              f"(jaxtrain's router adds no noise)")
        return {"n_experts": r.int("num_local_experts"), "top_k": r.int("num_experts_per_tok")}
