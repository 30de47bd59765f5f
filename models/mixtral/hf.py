"""Hugging Face ``MixtralForCausalLM`` names, layouts and config.json for the mixtral family.

Everything but the feed-forward block is the llama family's (``models/llama/hf.py``, whose
:class:`DecoderHF` this subclasses). Each layer's ``moe`` sub-tree, torch ``Linear`` weights
being ``[out, in]``, in the per-expert layout (what transformers 5.24's ``save_pretrained``
writes by default, and what transformers 4 reads and writes):

    model.layers.i.block_sparse_moe.gate.weight         [E, d]     = router [d, E] transposed
    model.layers.i.block_sparse_moe.experts.e.w1.weight [d_ff, d]  = w_gate[e] [d, d_ff] transposed
    model.layers.i.block_sparse_moe.experts.e.w3.weight [d_ff, d]  = w_up[e]   (the "up" projection)
    model.layers.i.block_sparse_moe.experts.e.w2.weight [d, d_ff]  = w_down[e] [d_ff, d] transposed

or in transformers 5's fused layout (its in-memory ``MixtralExperts``, which
``save_pretrained(..., save_original_format=False)`` writes; note: no ``.weight`` on the experts):

    model.layers.i.mlp.gate.weight                      [E, d]       = router transposed
    model.layers.i.mlp.experts.gate_up_proj             [E, 2*d_ff, d]: rows [:d_ff] are w1 (gate),
                                                                     rows [d_ff:] are w3 (up)
    model.layers.i.mlp.experts.down_proj                [E, d, d_ff] = w_down transposed per expert

Import reads either (each layer's names say which; both give the same params). Export always
writes the per-expert layout, which every transformers version loads.

config.json adds ``num_local_experts`` (= model.n_experts) and ``num_experts_per_tok``
(= model.top_k). HF's router is the mixtral family's (softmax over the experts, top-k,
renormalised), so the routing keys (routing, capacity_factor) and the router-loss weights are
training choices the user's config makes: an import notes config.json's ``router_aux_loss_coef``
(it is not read), and export writes it as ``aux_loss_weight / top_k`` (HF's load-balancing loss
is ``top_k`` times ours).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from jaxtrain.errors import ConfigError
from jaxtrain.models.llama.hf import ConfigReader, DecoderHF


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
        """Layer ``pre``'s experts in the per-expert layout, whichever layout they were imported from."""
        pre = pre + "block_sparse_moe."
        out = {pre + "gate.weight": m["router"].T}
        for e in range(cfg.n_experts):
            out[f"{pre}experts.{e}.w1.weight"] = m["w_gate"][e].T
            out[f"{pre}experts.{e}.w2.weight"] = m["w_down"][e].T
            out[f"{pre}experts.{e}.w3.weight"] = m["w_up"][e].T
        return out

    def ffn_shapes(self, pre: str, cfg, tensors: Optional[dict] = None) -> dict[str, tuple]:
        """Names and shapes of layer ``pre``'s experts: the fused layout when ``tensors`` hold any name
        under ``pre + 'mlp.'`` (transformers 5's), else the per-expert one."""
        d, f, e = cfg.d_model, cfg.d_ff, cfg.n_experts
        if tensors is not None and _fused(tensors, pre):
            return {pre + "mlp.gate.weight": (e, d), pre + "mlp.experts.gate_up_proj": (e, 2 * f, d),
                    pre + "mlp.experts.down_proj": (e, d, f)}
        pre = pre + "block_sparse_moe."
        out = {pre + "gate.weight": (e, d)}
        for i in range(e):
            out.update({f"{pre}experts.{i}.w1.weight": (f, d), f"{pre}experts.{i}.w2.weight": (d, f),
                        f"{pre}experts.{i}.w3.weight": (f, d)})
        return out

    def ffn_from_hf(self, t: dict, pre: str, cfg) -> dict:
        """Layer ``pre``'s ``moe`` params ([E, d, d_ff] gate/up, [E, d_ff, d] down, [d, E] router) from
        either layout (shapes already checked by :meth:`ffn_shapes`)."""
        if _fused(t, pre):
            gate_up = t[pre + "mlp.experts.gate_up_proj"]  # [E, 2*d_ff, d]: gate rows first (HF's chunk(2))
            f = cfg.d_ff
            return {"router": t[pre + "mlp.gate.weight"].T, "w_gate": gate_up[:, :f].transpose(0, 2, 1),
                    "w_up": gate_up[:, f:].transpose(0, 2, 1),
                    "w_down": t[pre + "mlp.experts.down_proj"].transpose(0, 2, 1)}
        pre = pre + "block_sparse_moe."

        def experts(w: str):  # [E, in, out] from E tensors of [out, in]
            return np.stack([t[f"{pre}experts.{e}.{w}.weight"].T for e in range(cfg.n_experts)])

        return {"router": t[pre + "gate.weight"].T, "w_gate": experts("w1"), "w_up": experts("w3"),
                "w_down": experts("w2")}

    def extra_hf_config(self, cfg) -> dict:
        return {"num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k, "sliding_window": None,
                "router_jitter_noise": 0.0, "output_router_logits": False,
                "router_aux_loss_coef": cfg.aux_loss_weight / cfg.top_k}

    def extra_model_keys(self, r: ConfigReader, notes: list[str]) -> dict:
        """n_experts and top_k; a note for ``router_aux_loss_coef`` (a training choice of the user's config).

        Raises:
          ConfigError: router noise, or a size or coefficient that is not a number."""
        jitter = r.number("router_jitter_noise", default=0.0)
        if jitter:
            raise ConfigError(f"config.json router_jitter_noise: {r.hf['router_jitter_noise']!r} is not supported "
                              f"(jaxtrain's router adds no noise)")
        keys = {"n_experts": r.int("num_local_experts"), "top_k": r.int("num_experts_per_tok")}
        coef = r.get("router_aux_loss_coef", default=None)
        if coef is not None:
            coef = r.number("router_aux_loss_coef")
            notes.append(f"config.json router_aux_loss_coef={coef:g} is not read: jaxtrain weights its load-balancing "
                         f"loss by model.aux_loss_weight from the run's config; HF's loss is num_experts_per_tok="
                         f"{keys['top_k']} times jaxtrain's, so the same weight is model.aux_loss_weight="
                         f"{coef * keys['top_k']:g} (an export writes router_aux_loss_coef = aux_loss_weight / top_k)")
        return keys


def _fused(tensors: dict, pre: str) -> bool:
    """Whether layer ``pre`` (e.g. 'model.layers.3.') is stored in transformers 5's fused layout: any
    tensor under ``pre + 'mlp.'`` (the per-expert layout keeps them under 'block_sparse_moe.')."""
    return any(n.startswith(pre + "mlp.") for n in tensors)
