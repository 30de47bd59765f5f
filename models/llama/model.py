"""Llama-style decoder in Flax NNX (Touvron et al. 2023, "LLaMA"; HF ``LlamaForCausalLM``).

RMSNorm (Zhang & Sennrich 2019), rotary position embeddings (Su et al. 2021,
HF "rotate_half" convention), grouped-query attention (Ainslie et al. 2023)
and a SwiGLU MLP (Shazeer 2020). Every parameter carries its logical axis
names in the ``axes`` metadata; activations are constrained by logical name at
block boundaries: the residual stream is [batch, residual_length, embed], keys and
values [batch, kv_length, kv_heads, kv], other activations use 'length' (distinct names
let a rule set split the residual stream by length, as sequence parallelism does, while
attention sees the whole sequence). There is no mesh here: the trainer maps logical names to
mesh axes through a rule set.

Parameter layout (logical names):
  embed.embedding        [vocab, embed]
  layers.i.attn.wq       [embed, heads, kv]        wk/wv: [embed, kv_heads, kv]
  layers.i.attn.wo       [heads, kv, embed]
  layers.i.mlp.w_gate    [embed, mlp]   w_up: [embed, mlp]   w_down: [mlp, embed]
  layers.i.attn_norm / mlp_norm.scale, final_norm.scale   [embed]
  lm_head                [embed, vocab]  (absent when tie_embeddings)

The embedding, the (scanned or unrolled, rematerialised) block stack, the final norm and the
head are the shared :class:`jaxtrain.models.decoder.Decoder`'s (``model.scan_layers`` stacks
every ``layers.i.x`` into ``layers.x [layers, ...]``); this module supplies the block.
"""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.kernels import ops
from jaxtrain.models.attention import attention, rotate, rotates_inside
from jaxtrain.models.decoder import Decoder
from jaxtrain.models.layers import MATMUL_NAME, RMSNorm, param, project, projections
from jaxtrain.models.llama.config import LlamaConfig, RopeScaling
from jaxtrain.parallel.activations import constrain

# Every logical name the parameters and activations below use (each rule set must name them all).
LOGICAL_AXES = ("batch", "length", "residual_length", "kv_length", "embed", "vocab", "heads", "kv_heads",
                "kv", "mlp", "layers")


def rope_frequencies(head_dim: int, theta: float, scaling: Optional[RopeScaling] = None) -> jax.Array:
    """The rotary angular frequencies, [head_dim // 2] float32: theta^(-2i/head_dim), i < head_dim/2.

    With ``scaling`` (type llama3: Llama 3.1's frequency scaling, as in Meta's reference
    ``apply_scaling`` and HF's ``_compute_llama3_parameters``) each frequency f, of wavelength
    w = 2*pi/f, becomes, with L = original_max_position_embeddings:
      f                                     if w < L / high_freq_factor   (high frequencies kept)
      f / factor                            if w > L / low_freq_factor    (low frequencies stretched)
      (1 - s) * f / factor + s * f          otherwise, s = (L / w - low_freq_factor)
                                                             / (high_freq_factor - low_freq_factor)
    Without it the result is exactly the plain RoPE frequencies (the same ops as before).
    """
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
    if scaling is None:
        return inv_freq
    if scaling.type != "llama3":  # the config schema admits only llama3; a new type must be added here
        raise ValueError(f"model.rope_scaling.type: unknown type '{scaling.type}'")
    old_len, lo, hi = float(scaling.original_max_position_embeddings), scaling.low_freq_factor, \
        scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - lo) / (hi - lo)
    mid = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    out = jnp.where(wavelen > old_len / lo, inv_freq / scaling.factor, mid)
    return jnp.where(wavelen < old_len / hi, inv_freq, out).astype(jnp.float32)


def rotary_tables(length: int, head_dim: int, theta: float,
                  scaling: Optional[RopeScaling] = None) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) [length, head_dim // 2] float32 of positions 0..length-1: constants of the program
    (computed in its fusions, XLA evaluated sin and cos once per element of every q and k, ~4% of a
    small model's CPU step)."""
    with jax.ensure_compile_time_eval():
        inv_freq = np.asarray(rope_frequencies(head_dim, theta, scaling))
    angles = np.arange(length, dtype=np.float32)[:, None] * inv_freq  # [t, half]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rotary(x: jax.Array, positions: Optional[jax.Array], theta: float,
           scaling: Optional[RopeScaling] = None) -> jax.Array:
    """Rotary embedding, HF rotate_half convention (:func:`jaxtrain.models.attention.rotate`).
    x: [batch, length, heads, kv]; positions: [batch, length] int, or None for 0..length-1
    (:func:`rotary_tables`). ``scaling``: the frequency scaling of :func:`rope_frequencies` (None:
    plain RoPE)."""
    if positions is None:
        cos, sin = (t[:, None, :] for t in rotary_tables(x.shape[1], x.shape[-1], theta, scaling))  # [t, 1, half]
    else:
        angles = positions.astype(jnp.float32)[..., None, None] * rope_frequencies(x.shape[-1], theta, scaling)
        cos, sin = jnp.cos(angles), jnp.sin(angles)  # [b, t, 1, half]
    return rotate(x, cos, sin)


class Attention(nnx.Module):
    """Causal grouped-query self-attention. [batch, length, embed] -> same."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        d, h, kvh, hd, pd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.param_dtype
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)  # GPT-2 residual scaling
        self.wq = param(rngs, (d, h, hd), ("embed", "heads", "kv"), cfg.init_std, pd)
        self.wk = param(rngs, (d, kvh, hd), ("embed", "kv_heads", "kv"), cfg.init_std, pd)
        self.wv = param(rngs, (d, kvh, hd), ("embed", "kv_heads", "kv"), cfg.init_std, pd)
        self.wo = param(rngs, (h, hd, d), ("heads", "kv", "embed"), out_std, pd)

    def __call__(self, x: jax.Array, positions: Optional[jax.Array],
                 segment_ids: Optional[jax.Array] = None) -> jax.Array:
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        # [b, t, heads, kv], [b, t, kv_heads, kv] twice
        q, k, v = projections(x, tuple(w[...].astype(dt) for w in (self.wq, self.wk, self.wv)), cfg.matmul)
        # An attention kernel that rotates q and k itself (a pass over each fewer, both ways) does so where
        # the positions are 0..length-1 (the qkv names below then mark q and k before the rotation).
        rope = None
        if positions is None and rotates_inside(cfg.attention, q, k, segment_ids):
            rope = rotary_tables(q.shape[1], q.shape[-1], cfg.rope_theta, cfg.rope_scaling)
        else:
            q, k = (rotary(a, positions, cfg.rope_theta, cfg.rope_scaling) for a in (q, k))
        q = constrain(q, "batch", "length", "heads", "kv")
        # K/V get their own length name: sequence parallelism gathers them over the full length.
        # Ring attention keeps K/V split like the queries (it rotates them), so no gather.
        kv_len = "length" if cfg.attention == "ring" else "kv_length"
        k = constrain(k, "batch", kv_len, "kv_heads", "kv")
        v = constrain(v, "batch", kv_len, "kv_heads", "kv")
        q, k, v = (checkpoint_name(a, "qkv") for a in (q, k, v))  # offload.activations names (see Block)
        out = attention(q, k, v, segment_ids=segment_ids, implementation=cfg.attention, rope=rope)
        out = checkpoint_name(constrain(out, "batch", "length", "heads", "kv"), "attn_out")
        return project(out, self.wo[...].astype(dt), n_in=2, implementation=cfg.matmul)


class MLP(nnx.Module):
    """SwiGLU: w_down(silu(x w_gate) * (x w_up)). [batch, length, embed] -> same."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.dtype, self.matmul = jnp.dtype(cfg.dtype), cfg.matmul
        d, f, pd = cfg.d_model, cfg.d_ff, cfg.param_dtype
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.w_gate = param(rngs, (d, f), ("embed", "mlp"), cfg.init_std, pd)
        self.w_up = param(rngs, (d, f), ("embed", "mlp"), cfg.init_std, pd)
        self.w_down = param(rngs, (f, d), ("mlp", "embed"), out_std, pd)

    def __call__(self, x: jax.Array) -> jax.Array:
        dt, mm = self.dtype, self.matmul
        w_gate, w_up, w_down = (w[...].astype(dt) for w in (self.w_gate, self.w_up, self.w_down))
        fused = ops.swiglu_mlp(x, w_gate, w_up, w_down, mm, (MATMUL_NAME, "mlp_hidden"))  # a kernel's, if one takes it
        if fused is not None:
            return fused
        gate = jax.nn.silu(project(x, w_gate, implementation=mm))
        hidden = constrain(gate * project(x, w_up, implementation=mm), "batch", "length", "mlp")
        return project(checkpoint_name(hidden, "mlp_hidden"), w_down, implementation=mm)


class Block(nnx.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then + mlp(norm(.)). x [batch, length, embed] -> same.

    Named activations (``jax.ad_checkpoint.checkpoint_name``; ``offload.activations`` saves them to host
    memory instead of recomputing them): ``attn_in`` (the normed attention input), ``qkv`` (queries, keys
    and values after rotary, or before it where the attention kernel rotates them), ``attn_out``
    (attention's output before ``wo``), ``mlp_in`` (the normed MLP input), ``mlp_hidden`` (the SwiGLU
    product, ``w_down``'s input): each one a value the block's backward pass reads (its output is not:
    the residual add needs no value, and the scan keeps each block's input).
    """

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x: jax.Array, positions: Optional[jax.Array],
                 segment_ids: Optional[jax.Array] = None) -> jax.Array:
        x = x + self.attn(checkpoint_name(self.attn_norm(x), "attn_in"), positions, segment_ids)
        x = x + self.mlp(checkpoint_name(self.mlp_norm(x), "mlp_in"))
        return constrain(x, "batch", "residual_length", "embed")


class Llama(Decoder):
    """Decoder-only LM. tokens [batch, length] int32 -> logits [batch, length, vocab] float32.

    The shared decoder (``models/decoder.py``: embedding, block stack, final norm, head) around
    :class:`Block`.
    """

    block_type = Block

    def __call__(self, tokens: jax.Array, positions: Optional[jax.Array] = None,
                 segment_ids: Optional[jax.Array] = None) -> jax.Array:
        """tokens, positions, segment_ids: [batch, length] int32 (positions default to 0..length-1;
        segment_ids restrict attention to tokens of the same packed document)."""
        return self.decode(tokens, positions, segment_ids)[0]
