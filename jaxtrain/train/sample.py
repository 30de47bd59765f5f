"""Autoregressive sampling from a trained model (no KV cache: small models, short samples)."""
from __future__ import annotations

from typing import Optional

import jax
import numpy as np


def generate(logits_fn, params, prompt_ids: np.ndarray, n_tokens: int, seq_len: int,
             temperature: float, seed: int, banned: tuple[int, ...] = (),
             vocab_limit: Optional[int] = None) -> np.ndarray:
    """Samples ``n_tokens`` after ``prompt_ids`` with temperature sampling (0 = greedy).

    ``banned`` ids (e.g. <unk>) and ids >= ``vocab_limit`` (padding of model.vocab_size
    beyond the tokenizer) are never sampled.

    The context is a fixed [1, seq_len] buffer so ``logits_fn`` compiles once;
    while the buffer is not full the trailing slots are ignored thanks to the
    causal mask, and afterwards the last ``seq_len`` tokens are kept.

    Returns:
      [len(prompt_ids) + n_tokens] int32 token ids.
    """
    out = [int(t) for t in prompt_ids] or [0]
    rng = np.random.default_rng(seed)
    buf = np.zeros((1, seq_len), np.int32)
    for _ in range(n_tokens):
        ctx = out[-seq_len:]
        buf[0, :len(ctx)] = ctx
        logits = np.asarray(jax.device_get(logits_fn(params, buf)))[0, len(ctx) - 1].astype(np.float64)
        logits[list(banned)] = -np.inf
        if vocab_limit is not None:
            logits[vocab_limit:] = -np.inf
        if temperature <= 0:
            nxt = int(np.argmax(logits))
        else:
            p = np.exp((logits - logits.max()) / temperature)
            nxt = int(rng.choice(len(p), p=p / p.sum()))
        out.append(nxt)
    return np.asarray(out, np.int32)
