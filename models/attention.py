"""Attention dispatch: one signature for every implementation the model can use.

Shapes: q [batch, q_len, heads, head_dim]; k, v [batch, kv_len, kv_heads, head_dim]
(grouped-query attention when kv_heads < heads); segment_ids [batch, length] int32
(tokens attend only within their own segment: packed documents). Returns
[batch, q_len, heads, head_dim] in q's dtype. Causal masks are bottom-right aligned
when q_len != kv_len (see jaxtrain/kernels/reference.py).

Implementations (``model.attention``):
  xla     ``jax.nn.dot_product_attention(implementation='xla')``; any backend.
  blockwise  causal self-attention by query blocks in plain jnp, skipping the masked key
          blocks (jaxtrain/kernels/blockwise.py); any backend.
  cpu_fused  causal self-attention as one fused XLA:CPU kernel built on first use with the
          machine's C++ compiler (jaxtrain/kernels/cpu_fused.py); CPU, one device, length and
          head_dim multiples of 16, no packed documents or window. The fast one on CPU.
  cudnn   ``jax.nn.dot_product_attention(implementation='cudnn')``; GPU only.
  pallas  our FlashAttention-2 kernels: Triton lowering on GPU, Mosaic on TPU, the GPU
          kernels in interpret mode on CPU (slow; for tests).
  ring    ring attention over the mesh axis that shards 'length' (jaxtrain/kernels/ring.py).
  auto    GPU: cudnn when its constraints hold (bf16/fp16, head_dim <= 128 and % 8 == 0,
          q_len == kv_len, no segment ids, no window), else pallas; TPU: pallas; CPU:
          cpu_fused where it applies and builds, else blockwise for causal self-attention whose
          length the rules do not shard, else xla.
          The choice is logged once per distinct choice.
"""
from __future__ import annotations

import logging
from typing import Optional

import jax
import jax.numpy as jnp

from jaxtrain.errors import AttentionBackendError
from jaxtrain.kernels import blockwise, cpu_fused, reference, ring, target
from jaxtrain.parallel.activations import active_sharding, devices_along
from jaxtrain.runtime import once

IMPLEMENTATIONS = ("auto", "xla", "blockwise", "cpu_fused", "cudnn", "pallas", "ring")
log = logging.getLogger("jaxtrain.attention")
_logged: set = set()


def backend_problem(implementation: str, backend: str) -> Optional[str]:
    """Why ``implementation`` cannot run on ``backend`` ('cpu', 'gpu', 'tpu'), or None if it can."""
    if implementation == "cudnn" and backend != "gpu":
        return f"cudnn needs a GPU; the backend is '{backend}' (use auto, blockwise, xla or pallas)"
    if implementation == "cpu_fused" and backend != "cpu":
        return f"cpu_fused is an XLA:CPU kernel; the backend is '{backend}' (use auto)"
    return None


def rotate(x: jax.Array, cos, sin) -> jax.Array:
    """Rotary position embedding (Su et al. 2021), HF's rotate_half convention: per half of the last dim,
    ``x1 cos - x2 sin`` and ``x2 cos + x1 sin``, computed in float32 (one concatenate, no rotated copy).

    x: [batch, length, heads, head_dim]; cos, sin: broadcastable to [batch, length, heads, head_dim / 2]
    (e.g. [length, 1, head_dim / 2]). Returns x's shape and dtype.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def xla_attention(q, k, v, segment_ids=None, causal=True, window=None):
    """``jax.nn.dot_product_attention`` (XLA) with the shared mask convention."""
    mask = None
    if segment_ids is not None or window is not None or q.shape[1] != k.shape[1]:
        mask = reference.attention_mask(q.shape[1], k.shape[1], segment_ids, segment_ids, causal, window)
        return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation="xla")
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")


def blockwise_attention(q, k, v, segment_ids=None, causal=True, window=None):
    """Causal self-attention by query blocks (jaxtrain/kernels/blockwise.py)."""
    if not causal:
        raise ValueError("model.attention=blockwise: only causal attention is supported")
    return blockwise.blockwise_attention(q, k, v, segment_ids, window=window)


def cudnn_attention(q, k, v, segment_ids=None, causal=True, window=None):
    """``jax.nn.dot_product_attention`` through cuDNN (fused flash attention on GPU)."""
    mask = None
    if segment_ids is not None:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    local = (window - 1, 0 if causal else window - 1) if window is not None else None
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, local_window_size=local,
                                        implementation="cudnn")


def pallas_attention(q, k, v, segment_ids=None, causal=True, window=None):
    """Our FlashAttention-2 kernel for the current backend."""
    # Imported here: Pallas's TPU and Triton front ends take ~0.1 s to import, which a CPU run never needs.
    if target.backend() == "tpu":
        from jaxtrain.kernels import flash_tpu
        return flash_tpu.flash_attention(q, k, v, segment_ids, causal=causal, window=window)
    from jaxtrain.kernels import flash_gpu
    return flash_gpu.flash_attention(q, k, v, segment_ids, causal=causal, window=window)


def ring_attention(q, k, v, segment_ids=None, causal=True, window=None):
    if window is not None:
        raise ValueError("model.attention=ring: a sliding window is not supported by ring attention")
    return ring.ring_attention(q, k, v, segment_ids, causal=causal)


def cudnn_fits(q, k, segment_ids, window) -> Optional[str]:
    """None if cuDNN flash attention applies, else the reason it does not."""
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"dtype {q.dtype} (cuDNN needs bf16/fp16)"
    d = q.shape[-1]
    if d > 128 or d % 8:
        return f"head_dim {d} (cuDNN needs <= 128 and a multiple of 8)"
    if q.shape[1] != k.shape[1]:
        return "q_len != kv_len"
    if segment_ids is not None:
        return "segment_ids (ours masks packed documents without a dense mask)"
    if window is not None:
        return "sliding window"
    return None


def choose(implementation: str, q, k, segment_ids=None, window=None, backend: Optional[str] = None,
           causal: bool = True) -> str:
    """Resolves ``auto`` and checks that an explicit choice can run here.

    Raises:
      AttentionBackendError: cudnn off a GPU; ValueError: an unknown name.
    """
    backend = backend or target.backend()
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"model.attention: unknown implementation '{implementation}' "
                         f"(known: {', '.join(IMPLEMENTATIONS)})")
    problem = backend_problem(implementation, backend)
    if problem:
        raise AttentionBackendError(f"model.attention: {problem}")
    # Blocks cut from a length the rules split over devices would move between devices.
    length_split = devices_along(q.shape, ("batch", "length", "heads", "kv"), 1) > 1
    if implementation == "blockwise" and length_split:
        if once.first(_logged, ("blockwise", "sharded")):
            once.say(log, logging.WARNING, "model.attention=blockwise with the length split over devices: the query "
                     "blocks cut across devices and XLA moves them between devices (use ring or xla)")
    if implementation != "auto":
        return implementation
    if backend == "gpu":
        why = cudnn_fits(q, k, segment_ids, window)
        choice, reason = ("cudnn", "cuDNN constraints hold") if why is None else ("pallas", f"not cuDNN: {why}")
    elif backend == "tpu":
        choice, reason = "pallas", "TPU"
    elif not causal or q.shape[1] != k.shape[1]:
        choice, reason = "xla", f"backend {backend}, not causal self-attention"
    elif length_split:
        choice, reason = "xla", f"backend {backend}, length sharded"
    else:
        why = fused_problem(q, k, segment_ids, window)
        choice, reason = ("cpu_fused", f"backend {backend}") if why is None else ("blockwise", why)
    if once.decided(_logged, "model.attention", choice, reason):
        once.say(log, logging.INFO, f"model.attention=auto -> {choice} ({reason})")
    return choice


def fused_problem(q, k, segment_ids=None, window=None) -> Optional[str]:
    """Why the fused CPU kernel cannot take this attention here, or None: its shapes and options,
    more than one device (the trainer's mesh while it traces, else every device JAX has), or a
    kernel that did not build. A custom call is opaque to XLA's partitioner, which would gather
    its operands onto every device (and a pipeline's stages run under ``vmap``)."""
    why = cpu_fused.shape_problem(q.shape, k.shape, True, segment_ids, window)
    if why:
        return f"cpu_fused: {why}"
    active = active_sharding()
    devices = active[1].size if active is not None else jax.device_count()
    if devices > 1:
        return f"cpu_fused: runs on one device, here {devices}"
    why = cpu_fused.problem()
    return None if why is None else f"cpu_fused: {why}"


def fused_cpu_attention(q, k, v, segment_ids=None, causal=True, window=None, rope=None):
    """The fused XLA:CPU kernel (jaxtrain/kernels/cpu_fused.py); ``rope``: see :func:`attention`."""
    why = fused_problem(q, k, segment_ids, window) if causal else "cpu_fused: only causal attention"
    if why:
        raise AttentionBackendError(f"model.attention=cpu_fused cannot run here: {why.removeprefix('cpu_fused: ')} "
                                    f"(use auto or blockwise)")
    return cpu_fused.fused_attention(q, k, v, rope)


_FUNCTIONS = {"xla": xla_attention, "blockwise": blockwise_attention, "cpu_fused": fused_cpu_attention,
              "cudnn": cudnn_attention, "pallas": pallas_attention, "ring": ring_attention}


def attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: Optional[jax.Array] = None,
              implementation: str = "auto", *, causal: bool = True, window: Optional[int] = None,
              rope=None) -> jax.Array:
    """Attention through the named implementation (see the module docstring).

    Args:
      window: sliding-window size in keys (query sees keys with q_pos - k_pos < window), or None.
      rope: None, or rotary tables ``(cos, sin)`` [length, head_dim / 2] float32 for positions
        0..length-1, applied to q and k first (:func:`rotate`): inside the kernel under cpu_fused (a
        pass over each fewer, both ways), else by :func:`rotate` before the implementation runs.
    Raises:
      ValueError: unknown implementation; AttentionBackendError: cudnn off a GPU.
    """
    choice = choose(implementation, q, k, segment_ids, window, causal=causal)
    if rope is not None and choice == "cpu_fused":
        return fused_cpu_attention(q, k, v, segment_ids=segment_ids, causal=causal, window=window, rope=rope)
    if rope is not None:
        cos, sin = (x[:, None, :] for x in rope)  # [length, 1, half]: every batch element and head
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    return _FUNCTIONS[choice](q, k, v, segment_ids=segment_ids, causal=causal, window=window)
