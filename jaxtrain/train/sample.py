"""Autoregressive sampling from a trained model (no KV cache: small models, short samples)."""
from __future__ import annotations

from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np


def generate(logits_fn, params, prompt_ids: np.ndarray, n_tokens: int, seq_len: int,
             temperature: float, seed: int, banned: tuple[int, ...] = (),
             vocab_limit: Optional[int] = None) -> np.ndarray:
    """Samples ``n_tokens`` after ``prompt_ids`` with temperature sampling (0 = greedy).

    ``logits_fn(params, tokens [1, seq_len] int32) -> [1, seq_len, vocab]`` float32 logits.
    ``banned`` ids (e.g. <unk>) and ids >= ``vocab_limit`` (padding of model.vocab_size
    beyond the tokenizer) are never sampled.

    The whole loop is one jitted ``lax.fori_loop`` (one dispatch, not one per token). The
    context is a fixed [1, seq_len] window so the model compiles once: while it is not full
    the trailing slots are ignored thanks to the causal mask, and afterwards it slides by one
    token per step (the last ``seq_len`` tokens are kept). Random draws use
    ``jax.random.categorical`` with ``jax.random.key(seed)``.

    Returns:
      [len(prompt_ids) + n_tokens] int32 token ids (a prompt of zero tokens becomes ``[0]``).
    """
    prompt = np.asarray(prompt_ids, np.int32).reshape(-1)
    if prompt.size == 0:
        prompt = np.zeros(1, np.int32)
    if n_tokens <= 0:
        return prompt
    ctx = prompt[-seq_len:]
    window = np.zeros((1, seq_len), np.int32)
    window[0, :len(ctx)] = ctx
    probe = jax.eval_shape(logits_fn, params, jax.ShapeDtypeStruct((1, seq_len), jnp.int32))
    allowed = np.ones(probe.shape[-1], bool)
    allowed[list(banned)] = False
    if vocab_limit is not None:
        allowed[vocab_limit:] = False
    new = _sample_loop(logits_fn, n_tokens, float(temperature), params, jnp.asarray(window),
                       jnp.int32(len(ctx)), jnp.asarray(allowed), jax.random.key(seed))
    return np.concatenate([prompt, np.asarray(jax.device_get(new), np.int32)])


def compile_ahead(logits_fn, params, n_tokens: int, seq_len: int, temperature: float) -> None:
    """Compiles the program :func:`generate` runs for these settings, from shapes alone (``params``
    may be ShapeDtypeStructs with the params' shardings), so that its call finds it cached."""
    window = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
    vocab = jax.eval_shape(logits_fn, params, window).shape[-1]
    _sample_loop.lower(logits_fn, n_tokens, float(temperature), params, window, jax.ShapeDtypeStruct((), jnp.int32),
                       jax.ShapeDtypeStruct((vocab,), jnp.bool_),
                       jax.ShapeDtypeStruct((), jax.random.key(0).dtype)).compile()


@partial(jax.jit, static_argnums=(0, 1, 2))
def _sample_loop(logits_fn, n_tokens: int, temperature: float, params, window, filled, allowed, key):
    seq_len = window.shape[1]

    def body(i, carry):
        window, filled, out = carry
        logits = jnp.asarray(logits_fn(params, window))[0, filled - 1].astype(jnp.float32)
        logits = jnp.where(allowed, logits, -jnp.inf)
        if temperature <= 0:
            nxt = jnp.argmax(logits).astype(jnp.int32)
        else:
            nxt = jax.random.categorical(jax.random.fold_in(key, i), logits / temperature).astype(jnp.int32)
        full = filled == seq_len
        window = jnp.where(full, jnp.roll(window, -1, axis=1), window)  # slide once the window is full
        window = window.at[0, jnp.where(full, seq_len - 1, filled)].set(nxt)
        return window, jnp.minimum(filled + 1, seq_len), out.at[i].set(nxt)

    _, _, out = jax.lax.fori_loop(0, n_tokens, body, (window, filled, jnp.zeros(n_tokens, jnp.int32)))
    return out
