"""Training FLOPs per token of a Mixtral: 6 N_active + 12*L*H*Q*T.

As for the llama family (PaLM, Chowdhery et al. 2022, appendix B: 6N per token for the
matmuls, plus the attention's QK^T and AV), but N counts only the parameters a token
meets: attention, the router, and ``top_k`` of the ``n_experts`` SwiGLU experts per layer,
plus the LM head. This is the "active parameters" count of Mixtral (Jiang et al. 2024,
13B active of 47B) and of MaxText's MoE TFLOPs. Capacity padding and dropped copies
are not credited or debited: MFU counts the useful work of top-k routing.
"""
from __future__ import annotations

from jaxtrain.models.llama.flops import attention_flops_per_token
from jaxtrain.models.mixtral.config import MixtralConfig


def active_matmul_params(cfg: MixtralConfig) -> int:
    """Parameters one token multiplies with (``cfg.vocab_size`` resolved)."""
    attn = cfg.d_model * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    router = cfg.d_model * cfg.n_experts
    experts = cfg.top_k * 3 * cfg.d_model * cfg.d_ff
    return cfg.n_layers * (attn + router + experts) + cfg.d_model * cfg.vocab_size


def flops_per_token(cfg: MixtralConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 N_active + 12*L*H*Q*T."""
    return 6.0 * active_matmul_params(cfg) + attention_flops_per_token(cfg, seq_len)
