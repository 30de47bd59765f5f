"""Training FLOPs per token of a Llama: 6N + 12*L*H*Q*T (PaLM, Chowdhery et al. 2022, appendix B).

N counts the matmul parameters (every weight matrix, the LM head included; not the
input-embedding lookup, which is a gather, nor the norm scales); L layers, H query heads,
Q head dim, T sequence length. 6 = 2 FLOPs per multiply-add x (1 forward + 2 backward
matmuls). The attention term is QK^T and AV, 2 * 2 * T * H * Q per token and layer
forward, times 3 with the backward; like PaLM (and MaxText, torchtitan) it counts the
full T x T square, not the causal half. Remat recompute is not credited.
"""
from __future__ import annotations

from jaxtrain.models.llama.config import LlamaConfig


def matmul_params(cfg: LlamaConfig) -> int:
    """Parameters that take part in matmuls (N of the 6N term); ``cfg.vocab_size`` must be resolved."""
    attn = cfg.d_model * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    mlp = 3 * cfg.d_model * cfg.d_ff
    head = cfg.d_model * cfg.vocab_size  # the LM head (tied or not, it is one matmul)
    return cfg.n_layers * (attn + mlp) + head


def attention_flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """12*L*H*Q*T: QK^T and AV, forward and backward, full T x T square (FLOPs/token)."""
    return 12.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6N + 12*L*H*Q*T."""
    return 6.0 * matmul_params(cfg) + attention_flops_per_token(cfg, seq_len)
