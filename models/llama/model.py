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

With ``scan_layers`` the blocks are one module whose parameters are stacked on a
leading 'layers' dim (``layers.attn.wq [layers, embed, heads, kv]``, ...), run
by ``jax.lax.scan``: the compiled step holds one block, so compile time stays
flat as depth grows. The initial values equal the unstacked layout's. ``remat``
recomputes each block's activations in the backward pass: 'full' saves only
the block input, 'save_matmuls' also keeps the weight-matmul outputs (JAX's
``dots_with_no_batch_dims_saveable``, MaxText's "minimal" policy).
"""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.models.attention import attention
from jaxtrain.models.llama.config import LlamaConfig, RopeScaling
from jaxtrain.parallel.activations import constrain, devices_along

# Every logical name the parameters and activations below use (each rule set must name them all).
LOGICAL_AXES = ("batch", "length", "residual_length", "kv_length", "embed", "vocab", "heads", "kv_heads",
                "kv", "mlp", "layers")


def project(x: jax.Array, w: jax.Array, n_in: int = 1) -> jax.Array:
    """Contracts x's last ``n_in`` dims with w's first ``n_in``: [*lead, *in] x [*in, *out] -> [*lead, *out].

    Done as one 2-D matmul on [prod(lead), prod(in)] (row-major reshapes are free): XLA:CPU
    lowers a 3-D dot_general's weight gradient (contracting batch and length) with a
    transposing copy fused into the producer, which made the 25M benchmark step ~1.8x
    slower. When the rules split the logical 'length' over devices (sp), a plain tensordot
    instead: merging a split length into the batch made GSPMD all-gather ~10x more. (tp splits
    'residual_length' instead; the projection gathers it either way, with the same collectives.)
    """
    lead, dims_in, dims_out = x.shape[:x.ndim - n_in], w.shape[:n_in], w.shape[n_in:]
    if len(lead) == 2 and devices_along(lead, ("batch", "length"), 1) > 1:
        # The length is split over devices (sequence parallelism): merging it into the batch
        # would make GSPMD gather it, so contract the 3-D layout directly.
        return jnp.tensordot(x, w, axes=n_in)
    k = math.prod(dims_in)
    return (x.reshape(-1, k) @ w.reshape(k, -1)).reshape(*lead, *dims_out)


def _param(rngs: nnx.Rngs, shape, axes, std, dtype) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.dtype(dtype)), axes=axes)


class RMSNorm(nnx.Module):
    """y = x / sqrt(mean(x^2) + eps) * scale, computed in float32. x: [..., embed]."""

    def __init__(self, cfg: LlamaConfig):
        self.eps = cfg.norm_eps
        self.scale = nnx.Param(jnp.ones((cfg.d_model,), jnp.dtype(cfg.param_dtype)), axes=("embed",))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


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


def rotary(x: jax.Array, positions: Optional[jax.Array], theta: float,
           scaling: Optional[RopeScaling] = None) -> jax.Array:
    """Rotary embedding, HF rotate_half convention. x: [batch, length, heads, kv]; positions: [batch, length]
    int, or None for 0..length-1.

    out = x * cos + rotate_half(x) * sin, written per half (one concatenate, no rotated copy of x).
    ``scaling``: the frequency scaling of :func:`rope_frequencies` (None: plain RoPE).
    Without positions the cos/sin tables are constants of the program: computed in its fusions, XLA
    evaluated sin and cos once per element of every q and k (~4% of a small model's CPU step).
    """
    half = x.shape[-1] // 2
    if positions is None:
        with jax.ensure_compile_time_eval():
            inv_freq = np.asarray(rope_frequencies(x.shape[-1], theta, scaling))
        angles = np.arange(x.shape[1], dtype=np.float32)[:, None, None] * inv_freq  # [t, 1, half]
        cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    else:
        angles = positions.astype(jnp.float32)[..., None, None] * rope_frequencies(x.shape[-1], theta, scaling)
        cos, sin = jnp.cos(angles), jnp.sin(angles)  # [b, t, 1, half]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    """Causal grouped-query self-attention. [batch, length, embed] -> same."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        d, h, kvh, hd, pd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.param_dtype
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)  # GPT-2 residual scaling
        self.wq = _param(rngs, (d, h, hd), ("embed", "heads", "kv"), cfg.init_std, pd)
        self.wk = _param(rngs, (d, kvh, hd), ("embed", "kv_heads", "kv"), cfg.init_std, pd)
        self.wv = _param(rngs, (d, kvh, hd), ("embed", "kv_heads", "kv"), cfg.init_std, pd)
        self.wo = _param(rngs, (h, hd, d), ("heads", "kv", "embed"), out_std, pd)

    def __call__(self, x: jax.Array, positions: Optional[jax.Array],
                 segment_ids: Optional[jax.Array] = None) -> jax.Array:
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        q = project(x, self.wq[...].astype(dt))  # [b, t, heads, kv]
        k = project(x, self.wk[...].astype(dt))
        v = project(x, self.wv[...].astype(dt))
        q = constrain(rotary(q, positions, cfg.rope_theta, cfg.rope_scaling), "batch", "length", "heads", "kv")
        # K/V get their own length name: sequence parallelism gathers them over the full length.
        # Ring attention keeps K/V split like the queries (it rotates them), so no gather.
        kv_len = "length" if cfg.attention == "ring" else "kv_length"
        k = constrain(rotary(k, positions, cfg.rope_theta, cfg.rope_scaling), "batch", kv_len, "kv_heads", "kv")
        v = constrain(v, "batch", kv_len, "kv_heads", "kv")
        out = attention(q, k, v, segment_ids=segment_ids, implementation=cfg.attention)
        out = constrain(out, "batch", "length", "heads", "kv")
        return project(out, self.wo[...].astype(dt), n_in=2)


class MLP(nnx.Module):
    """SwiGLU: w_down(silu(x w_gate) * (x w_up)). [batch, length, embed] -> same."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.dtype = jnp.dtype(cfg.dtype)
        d, f, pd = cfg.d_model, cfg.d_ff, cfg.param_dtype
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.w_gate = _param(rngs, (d, f), ("embed", "mlp"), cfg.init_std, pd)
        self.w_up = _param(rngs, (d, f), ("embed", "mlp"), cfg.init_std, pd)
        self.w_down = _param(rngs, (f, d), ("mlp", "embed"), out_std, pd)

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = self.dtype
        gate = jax.nn.silu(project(x, self.w_gate[...].astype(dt)))
        hidden = constrain(gate * project(x, self.w_up[...].astype(dt)), "batch", "length", "mlp")
        return project(hidden, self.w_down[...].astype(dt))


class Block(nnx.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x: jax.Array, positions: Optional[jax.Array],
                 segment_ids: Optional[jax.Array] = None) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), positions, segment_ids)
        x = x + self.mlp(self.mlp_norm(x))
        return constrain(x, "batch", "residual_length", "embed")


class Llama(nnx.Module):
    """Decoder-only LM. tokens [batch, length] int32 -> logits [batch, length, vocab] float32."""

    block_type = Block  # the decoder block (the mixtral family swaps in its MoE block)

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        if cfg.vocab_size < 1:
            raise ValueError(f"{type(self).__name__} needs a resolved vocab_size, got {cfg.vocab_size}")
        self.cfg = cfg
        pd = cfg.param_dtype
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, param_dtype=jnp.dtype(pd), rngs=rngs,
                               embedding_init=nnx.initializers.normal(cfg.init_std))
        self.embed.embedding.set_metadata(axes=("vocab", "embed"))
        blocks = [self.block_type(cfg, rngs) for _ in range(cfg.n_layers)]
        self.layers = stack_blocks(blocks) if cfg.scan_layers else nnx.List(blocks)
        self.final_norm = RMSNorm(cfg)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std, pd)

    def __call__(self, tokens: jax.Array, positions: Optional[jax.Array] = None,
                 segment_ids: Optional[jax.Array] = None) -> jax.Array:
        """tokens, positions, segment_ids: [batch, length] int32 (positions default to 0..length-1;
        segment_ids restrict attention to tokens of the same packed document)."""
        dt = jnp.dtype(self.cfg.dtype)
        # Gather the FSDP shards of the table before the lookup (as FSDP does for every
        # weight); a lookup into an fsdp-sharded embed dim forces a full rematerialisation.
        table = constrain(self.embed.embedding[...], "vocab", None)
        x = constrain(table[tokens].astype(dt), "batch", "residual_length", "embed")
        if self.cfg.scan_layers:
            x = scan_blocks(self.layers, x, positions, segment_ids, self.cfg.remat)
        else:
            for block in self.layers:
                x = remat_block(block, x, positions, segment_ids, self.cfg.remat)
        x = self.final_norm(x)
        head = self.embed.embedding[...].T if self.cfg.tie_embeddings else self.lm_head[...]
        logits = project(x, head.astype(dt)).astype(jnp.float32)
        return constrain(logits, "batch", "length", "vocab")


REMAT_POLICIES = {"full": None, "save_matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def _checkpoint(fn, remat: str, prevent_cse: bool = True):
    if remat == "none":
        return fn
    if remat not in REMAT_POLICIES:
        raise ValueError(f"model.remat: unknown policy '{remat}' (known: none, {', '.join(REMAT_POLICIES)})")
    return jax.checkpoint(fn, policy=REMAT_POLICIES[remat], prevent_cse=prevent_cse)


def remat_block(block: Block, x: jax.Array, positions, segment_ids, remat: str) -> jax.Array:
    """One block, its activations recomputed in the backward pass under ``remat``."""
    if remat == "none":
        return block(x, positions, segment_ids)
    graphdef, state = nnx.split(block)
    run = lambda h, st: nnx.merge(graphdef, st)(h, positions, segment_ids)  # noqa: E731
    return _checkpoint(run, remat)(x, state)


def stack_blocks(blocks: list[Block]) -> Block:
    """One Block whose parameters are the blocks' stacked on a leading 'layers' dim."""
    graphdef, _ = nnx.split(blocks[0])
    stacked = nnx.merge(graphdef, jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *map(nnx.state, blocks)))
    for _, node in nnx.iter_graph(stacked):
        if isinstance(node, nnx.Param):
            node.set_metadata(axes=("layers", *node.get_metadata()["axes"]))
    return stacked


def scan_blocks(stacked: Block, x: jax.Array, positions, segment_ids, remat: str) -> jax.Array:
    """x [batch, length, embed] through every layer of a stacked Block with ``jax.lax.scan``."""
    graphdef, state = nnx.split(stacked)

    def body(h, layer_state):
        return nnx.merge(graphdef, layer_state)(h, positions, segment_ids), None

    x, _ = jax.lax.scan(_checkpoint(body, remat, prevent_cse=False), x, state)
    return x
