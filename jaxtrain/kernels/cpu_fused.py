"""Causal self-attention as one fused XLA:CPU kernel (``cpu_attention.cc``, XLA FFI), built on
first use with the machine's C++ compiler and kept in a cache.

Why: a short sequence's attention on a CPU is many tiny matmuls (one per batch element and head)
that XLA runs at a fraction of the matmul rate. The kernel does one (batch, kv head) pair per task,
with its keys and values in cache, its score tiles in vector registers and its rows' softmax in
between; the backward recomputes the probabilities from the forward's log-sum-exp, as in
FlashAttention (Dao et al. 2022). Tasks run on XLA's intra-op threads and the calling one. Each task
writes only its own outputs, so results do not depend on the thread count or on the other rows of
the batch.

The library is compiled with ``$CXX`` (default ``c++``) for this CPU (``-march=native``) into
``$JAXTRAIN_KERNEL_CACHE_DIR`` (default ``~/.cache/jaxtrain/kernels``), named by a hash of the
source, the compiler, jaxlib and the CPU, so a change of any of them builds anew (~4 s). Without a
compiler, :func:`problem` says why and ``model.attention=auto`` uses ``blockwise``.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger("jaxtrain")

SOURCE = Path(__file__).with_name("cpu_attention.cc")
FORWARD, BACKWARD = "jaxtrain_cpu_attention_fwd", "jaxtrain_cpu_attention_bwd"
TARGETS = (FORWARD, BACKWARD)
MAX_LENGTH = 1024  # two [length, length] float32 tiles per thread: 8 MiB at 1024
FLAGS = ("-std=c++20", "-O3", "-march=native", "-fno-math-errno", "-fPIC", "-shared", "-w")

_state: dict = {"lock": threading.Lock(), "done": False, "problem": None}


def cache_dir() -> Path:
    return Path(os.environ.get("JAXTRAIN_KERNEL_CACHE_DIR") or Path.home() / ".cache" / "jaxtrain" / "kernels")


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU's model and instruction-set flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    keep = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _library(compiler: str) -> Path:
    """Where the shared library for this source, compiler, jaxlib and CPU is (or would be) cached."""
    import jaxlib
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    digest = hashlib.sha256("\0".join([SOURCE.read_text(), version, jaxlib.__version__, " ".join(FLAGS),
                                       _cpu_signature()]).encode()).hexdigest()[:16]
    return cache_dir() / f"cpu_attention-{digest}.so"


def _build(compiler: str) -> Path:
    """The shared library for this source, compiler, jaxlib and CPU: built unless already cached.

    Raises:
      RuntimeError: the compiler failed (its message included).
    """
    target = _library(compiler)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp],
                              capture_output=True, text=True, timeout=600)
        if done.returncode:
            raise RuntimeError(f"{compiler} failed ({done.returncode}): {done.stderr.strip()[-1500:]}")
        os.replace(tmp, target)  # atomic: a process building the same library at once loses nothing
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def problem() -> Optional[str]:
    """None once the kernel is built, loaded and registered with XLA (done once per process), else
    why it cannot be (no compiler, a failed build, not Linux)."""
    with _state["lock"]:
        if not _state["done"]:
            _state["done"] = True
            _state["problem"] = _register()
        return _state["problem"]


def register_if_built() -> None:
    """Registers the kernel when its library is already cached, and builds nothing: for a warm start's
    prefetch thread (``jaxtrain.train.prefetch``), which deserializes compiled programs that may call
    it before anything has traced the model."""
    compiler = os.environ.get("CXX") or "c++"
    try:
        built = shutil.which(compiler) is not None and _library(compiler).exists()
    except (OSError, subprocess.SubprocessError):
        return
    if built:
        problem()


def _register() -> Optional[str]:
    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None:
        return f"no C++ compiler ('{compiler}' is not on PATH; set CXX)"
    try:
        library = ctypes.cdll.LoadLibrary(str(_build(compiler)))
        jax.ffi.register_ffi_target(FORWARD, jax.ffi.pycapsule(library.JaxtrainCpuAttentionForward), platform="cpu")
        jax.ffi.register_ffi_target(BACKWARD, jax.ffi.pycapsule(library.JaxtrainCpuAttentionBackward),
                                    platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as err:
        log.warning("model.attention: the fused CPU kernel could not be built (%s); using blockwise", err)
        return f"the kernel did not build: {err}"
    return None


def shape_problem(q_shape, k_shape, causal: bool, segment_ids, window) -> Optional[str]:
    """Why the kernel cannot run attention of these shapes and options, or None."""
    b, t, h, d = q_shape
    if not causal or k_shape[1] != t:
        return "not causal self-attention"
    if segment_ids is not None or window is not None:
        return "packed documents or a sliding window"
    if t % 16 or d % 16 or h % k_shape[2]:
        return f"length {t} and head_dim {d} must be multiples of 16 (and heads of kv heads)"
    if t > MAX_LENGTH:
        return f"length {t} > {MAX_LENGTH}"
    return None


def _forward(q, k, v):
    b, t, h, d = q.shape
    return jax.ffi.ffi_call(FORWARD, (jax.ShapeDtypeStruct(q.shape, jnp.float32),
                                      jax.ShapeDtypeStruct((b, h, t), jnp.float32)),
                            vmap_method="sequential")(q, k, v, scale=np.float32(1 / math.sqrt(d)))


@jax.custom_vjp
def _attention(q, k, v):
    return _forward(q, k, v)[0]


def _attention_fwd(q, k, v):
    o, lse = _forward(q, k, v)
    return o, (q, k, v, o, lse)


def _attention_bwd(res, do):
    q, k, v, o, lse = res
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, k, v))
    return tuple(jax.ffi.ffi_call(BACKWARD, shapes, vmap_method="sequential")(
        q, k, v, o, lse, do, scale=np.float32(1 / math.sqrt(q.shape[-1]))))


_attention.defvjp(_attention_fwd, _attention_bwd)


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal softmax(q k^T / sqrt(head_dim)) v on the CPU, computed in float32.

    Args:
      q: [batch, length, heads, head_dim]; k, v: [batch, length, kv_heads, head_dim], heads a
        multiple of kv_heads (grouped-query attention without repeating K/V); length and head_dim
        multiples of 16, length at most :data:`MAX_LENGTH`.
    Returns: [batch, length, heads, head_dim] in q's dtype.
    Raises:
      RuntimeError: the kernel is not available (:func:`problem` says why).
      ValueError: shapes the kernel does not take.
    """
    why = problem()
    if why:
        raise RuntimeError(f"model.attention=cpu_fused: {why}")
    shape_why = shape_problem(q.shape, k.shape, True, None, None)
    if shape_why:
        raise ValueError(f"model.attention=cpu_fused: {shape_why}")
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    return _attention(*f32).astype(q.dtype)
