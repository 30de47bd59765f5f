"""jaxtrain's XLA:CPU kernels (XLA FFI, C++): causal self-attention (``cpu_attention.cc``), the
projections' matmul (``cpu_matmul.cc``, :mod:`jaxtrain.kernels.cpu_matmul`), the SwiGLU MLP, RMSNorm, the
AdamW update and the MoE experts' grouped SwiGLU (``cpu_mlp.cc``, ``cpu_norm.cc``, ``cpu_adamw.cc``,
``cpu_grouped.cc``), built together on first use with the machine's C++ compiler and kept in a cache.

Why the attention: a short sequence's attention on a CPU is many tiny matmuls (one per batch element
and head) that XLA runs at a fraction of the matmul rate. The kernel does one (batch, kv head) pair
per task, with its keys and values in cache, its score tiles in vector registers and its rows'
softmax in between; the backward recomputes the probabilities from the forward's log-sum-exp, as in
FlashAttention (Dao et al. 2022). Tasks run on XLA's intra-op threads and the calling one
(``cpu_parallel.h``). Each task writes only its own outputs, so results do not depend on the thread
count or on the other rows of the batch.

The library is compiled with ``$CXX`` (default ``c++``) for this CPU (``-march=native``) into
``$JAXTRAIN_KERNEL_CACHE_DIR`` (default ``~/.cache/jaxtrain/kernels``), named by a hash of the
sources, the compiler, jaxlib and the CPU, so a change of any of them builds anew (~6 s). Without a
compiler, :func:`problem` says why, ``model.attention=auto`` uses ``blockwise`` and
``model.matmul=auto`` XLA's dots.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger("jaxtrain")

SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_attention.cc", "cpu_matmul.cc", "cpu_mlp.cc",
                                                                "cpu_norm.cc", "cpu_adamw.cc",
                                                                "cpu_grouped.cc"))
HEADERS = tuple(Path(__file__).with_name(name) for name in ("cpu_parallel.h", "cpu_gemm.h", "cpu_math.h",
                                                            "cpu_tiles.h"))
FORWARD, BACKWARD = "jaxtrain_cpu_attention_fwd", "jaxtrain_cpu_attention_bwd"
ROPE_FORWARD, ROPE_BACKWARD = "jaxtrain_cpu_attention_rope_fwd", "jaxtrain_cpu_attention_rope_bwd"
MATMUL = "jaxtrain_cpu_matmul"
SWIGLU_FORWARD, SWIGLU_BACKWARD = "jaxtrain_cpu_swiglu_fwd", "jaxtrain_cpu_swiglu_bwd"  # cpu_mlp.cc
MATMUL_SUM = "jaxtrain_cpu_matmul_sum"  # cpu_mlp.cc
RMSNORM_FORWARD, RMSNORM_BACKWARD = "jaxtrain_cpu_rms_norm_fwd", "jaxtrain_cpu_rms_norm_bwd"  # cpu_norm.cc
ADAMW = "jaxtrain_cpu_adamw"  # cpu_adamw.cc
# cpu_grouped.cc
GROUPED_FORWARD, GROUPED_BACKWARD = "jaxtrain_cpu_grouped_swiglu_fwd", "jaxtrain_cpu_grouped_swiglu_bwd"
GROUPED_MATMUL_SUM, GROUPED_WEIGHT_GRAD = "jaxtrain_cpu_grouped_matmul_sum", "jaxtrain_cpu_grouped_weight_grad"
TARGETS = (FORWARD, BACKWARD, ROPE_FORWARD, ROPE_BACKWARD, MATMUL, SWIGLU_FORWARD, SWIGLU_BACKWARD, MATMUL_SUM,
           RMSNORM_FORWARD, RMSNORM_BACKWARD, ADAMW, GROUPED_FORWARD, GROUPED_BACKWARD, GROUPED_MATMUL_SUM,
           GROUPED_WEIGHT_GRAD)
MAX_LENGTH = 1024  # two [length, length] float32 tiles per thread: 8 MiB at 1024
STALE_S = 600  # a temporary library this old is a killed build's leftover (a build takes seconds)
FLAGS = ("-std=c++20", "-O3", "-march=native", "-fno-math-errno", "-fPIC", "-shared", "-w")
# GCC keeps to 256-bit vectors on Intel CPUs with AVX-512 unless told otherwise; the kernel's 8 x 32
# register tiles then take 32 registers and spill. With 512: one layer's forward and backward at the
# shakespeare-char shape 1.19 against 1.44 ms, the 25M shape's backward at length 256 11.8 against
# 21.3 ms (2-core Intel Xeon, AVX-512). x86 only: other compilers' targets reject the option.
if platform.machine().lower() in ("x86_64", "amd64"):
    FLAGS += ("-mprefer-vector-width=512",)

_state: dict = {"lock": threading.Lock(), "done": False, "problem": None, "library": ""}


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


def _library(compiler: list[str]) -> Path:
    """Where the shared library for these sources, compiler (its command line, flags in ``$CXX``
    included, and its version), jaxlib and CPU is (or would be) cached."""
    import jaxlib
    version = _version(tuple(compiler))
    texts = [path.read_text() for path in (*SOURCES, *HEADERS)]
    digest = hashlib.sha256("\0".join([*texts, " ".join(compiler), version, jaxlib.__version__, " ".join(FLAGS),
                                       _cpu_signature()]).encode()).hexdigest()[:16]
    return cache_dir() / f"cpu_kernels-{digest}.so"


@functools.lru_cache(maxsize=None)
def _version(compiler: tuple[str, ...]) -> str:
    """``compiler --version``, once per process (the program cache's key, the prefetch thread and the
    registration each ask for the library's name on a warm start)."""
    return subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=60).stdout


def _build(compiler: list[str]) -> Path:
    """The shared library for this source, compiler, jaxlib and CPU: built unless already cached.

    Raises:
      RuntimeError: the compiler failed (its message included).
    """
    target = _library(compiler)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob("*.so.tmp"):  # a build whose process was killed (its compiler ran on)
        try:
            if time.time() - stale.stat().st_mtime > STALE_S:
                stale.unlink()
        except OSError:
            pass
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run([*compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", tmp],
                              capture_output=True, text=True, timeout=600)
        name = " ".join(compiler)
        if done.returncode:
            said = (done.stderr.strip() or done.stdout.strip())[-1500:] or "no output"
            raise RuntimeError(f"{name} failed ({done.returncode}): {said}")
        if os.path.getsize(tmp) == 0:
            raise RuntimeError(f"{name} exited 0 but wrote no library")
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


def availability() -> str:
    """The kernel's library (its cache file name) once built and registered, else ``unavailable``: part of
    the program cache's key, since ``model.attention=auto`` traces another attention without it."""
    return _state["library"] if problem() is None else "unavailable"


def register_if_built() -> None:
    """Registers the kernel when its library is already cached, and builds nothing: for a warm start's
    prefetch thread (``jaxtrain.train.prefetch``), which deserializes compiled programs that may call
    it before anything has traced the model."""
    compiler = _compiler()
    try:
        built = shutil.which(compiler[0]) is not None and _library(compiler).exists()
    except (OSError, subprocess.SubprocessError):
        return
    if built:
        problem()


def _compiler() -> list[str]:
    """``$CXX`` (default ``c++``) as a command line: ``ccache g++`` works too."""
    return shlex.split(os.environ.get("CXX") or "c++") or ["c++"]


def _register() -> Optional[str]:
    compiler = _compiler()
    if shutil.which(compiler[0]) is None:
        return f"no C++ compiler: '{compiler[0]}' cannot be run (set CXX to one)"
    try:
        path = _build(compiler)
        try:
            library = ctypes.cdll.LoadLibrary(str(path))
        except OSError:  # a damaged cache entry (ours alone): removed, so the next run builds it again
            path.unlink(missing_ok=True)
            raise
        jax.ffi.register_ffi_target(FORWARD, jax.ffi.pycapsule(library.JaxtrainCpuAttentionForward), platform="cpu")
        jax.ffi.register_ffi_target(BACKWARD, jax.ffi.pycapsule(library.JaxtrainCpuAttentionBackward),
                                    platform="cpu")
        for target, symbol in ((ROPE_FORWARD, library.JaxtrainCpuAttentionRopeForward),
                               (ROPE_BACKWARD, library.JaxtrainCpuAttentionRopeBackward),
                               (MATMUL, library.JaxtrainCpuMatmul), (SWIGLU_FORWARD, library.JaxtrainCpuSwigluForward),
                               (SWIGLU_BACKWARD, library.JaxtrainCpuSwigluBackward),
                               (MATMUL_SUM, library.JaxtrainCpuMatmulSum),
                               (RMSNORM_FORWARD, library.JaxtrainCpuRmsNormForward),
                               (RMSNORM_BACKWARD, library.JaxtrainCpuRmsNormBackward),
                               (ADAMW, library.JaxtrainCpuAdamW),
                               (GROUPED_FORWARD, library.JaxtrainCpuGroupedSwigluForward),
                               (GROUPED_BACKWARD, library.JaxtrainCpuGroupedSwigluBackward),
                               (GROUPED_MATMUL_SUM, library.JaxtrainCpuGroupedMatmulSum),
                               (GROUPED_WEIGHT_GRAD, library.JaxtrainCpuGroupedWeightGrad)):
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), platform="cpu")
        _state["library"] = path.name
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as err:
        log.warning("the XLA:CPU kernels (model.attention and model.matmul cpu_fused) could not be built (%s)", err)
        return f"the kernel did not build: {err}"
    return None


def shape_problem(q_shape, k_shape, causal: bool, segment_ids, window) -> Optional[str]:
    """Why the kernel cannot run attention of these shapes and options, or None."""
    b, t, h, d = q_shape
    if not causal or k_shape[1] != t:
        return "not causal self-attention"
    if segment_ids is not None or window is not None:
        return "segment ids (packed or padded documents) or a sliding window"
    if t % 16:
        return f"length {t} is not a multiple of 16"
    if d % 16:
        return f"head_dim {d} is not a multiple of 16"
    if h % k_shape[2]:
        return f"{h} heads are not a multiple of {k_shape[2]} kv heads"
    if t > MAX_LENGTH:
        return f"length {t} > {MAX_LENGTH}"
    return None


def _forward(q, k, v, rope):
    b, t, h, d = q.shape
    call = jax.ffi.ffi_call(FORWARD if rope is None else ROPE_FORWARD,
                            (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct((b, h, t), jnp.float32)),
                            vmap_method="sequential")
    return call(q, k, v, *(rope or ()), scale=np.float32(1 / math.sqrt(d)))


@jax.custom_vjp
def _attention(q, k, v, rope):
    return _forward(q, k, v, rope)[0]


def _attention_fwd(q, k, v, rope):
    o, lse = _forward(q, k, v, rope)
    return o, (q, k, v, o, lse, rope)


def _attention_bwd(res, do):
    q, k, v, o, lse, rope = res
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, k, v))
    grads = jax.ffi.ffi_call(BACKWARD if rope is None else ROPE_BACKWARD, shapes, vmap_method="sequential")(
        q, k, v, o, lse, do, *(rope or ()), scale=np.float32(1 / math.sqrt(q.shape[-1])))
    return (*grads, None if rope is None else tuple(jnp.zeros_like(x) for x in rope))  # the tables: constants


_attention.defvjp(_attention_fwd, _attention_bwd)


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array, rope=None) -> jax.Array:
    """Causal softmax(q k^T / sqrt(head_dim)) v on the CPU, computed in float32.

    Args:
      q: [batch, length, heads, head_dim]; k, v: [batch, length, kv_heads, head_dim], heads a
        multiple of kv_heads (grouped-query attention without repeating K/V); length and head_dim
        multiples of 16, length at most :data:`MAX_LENGTH`.
      rope: None, or ``(cos, sin)`` [length, head_dim / 2] float32: q and k are rotated by them first
        (rotary embedding, HF's rotate_half; ``jaxtrain.models.attention.rotate``) inside the kernel,
        which saves XLA a pass over each in the forward and another in the backward.
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
    if rope is not None:
        rope = tuple(jnp.asarray(x, jnp.float32) for x in rope)
        if any(x.shape != (q.shape[1], q.shape[3] // 2) for x in rope):
            raise ValueError(f"model.attention=cpu_fused: rope tables must be [length, head_dim / 2] = "
                             f"{[q.shape[1], q.shape[3] // 2]}, got {[list(x.shape) for x in rope]}")
    return _attention(*f32, rope).astype(q.dtype)
