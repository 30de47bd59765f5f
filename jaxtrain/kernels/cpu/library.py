"""The library of jaxtrain's XLA:CPU kernels (XLA FFI, C++): causal self-attention (``attention.cc``,
:mod:`.attention`), the projections' matmul (``matmul.cc``, :mod:`.matmul`), the SwiGLU MLP, RMSNorm,
the AdamW update and the MoE experts' grouped SwiGLU (``mlp.cc``, ``norm.cc``, ``adamw.cc``,
``grouped.cc``), built together on first use with the machine's C++ compiler, kept in a cache and
registered with XLA. Tasks run on XLA's intra-op threads and the calling one (``cpu_parallel.h``).

The library is compiled with ``$CXX`` (default ``c++``) for this CPU (``-march=native``) into
``$JAXTRAIN_KERNEL_CACHE_DIR`` (default ``~/.cache/jaxtrain/kernels``), named by a hash of the
sources, the compiler, jaxlib and the CPU, so a change of any of them builds anew (~6 s). Without a
compiler, :func:`problem` says why, and ``auto`` picks another provider's implementation for each
key (the registry, :mod:`jaxtrain.kernels.registry`).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
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

log = logging.getLogger("jaxtrain")

SOURCES = tuple(Path(__file__).with_name(name) for name in ("attention.cc", "matmul.cc", "mlp.cc", "norm.cc",
                                                                "adamw.cc", "grouped.cc", "peak.cc"))
HEADERS = tuple(Path(__file__).with_name(name) for name in ("cpu_parallel.h", "cpu_gemm.h", "cpu_math.h",
                                                            "cpu_tiles.h"))
FORWARD, BACKWARD = "jaxtrain_cpu_attention_fwd", "jaxtrain_cpu_attention_bwd"
ROPE_FORWARD, ROPE_BACKWARD = "jaxtrain_cpu_attention_rope_fwd", "jaxtrain_cpu_attention_rope_bwd"
MATMUL = "jaxtrain_cpu_matmul"
SWIGLU_FORWARD, SWIGLU_BACKWARD = "jaxtrain_cpu_swiglu_fwd", "jaxtrain_cpu_swiglu_bwd"  # mlp.cc
MATMUL_SUM = "jaxtrain_cpu_matmul_sum"  # mlp.cc
RMSNORM_FORWARD, RMSNORM_BACKWARD = "jaxtrain_cpu_rms_norm_fwd", "jaxtrain_cpu_rms_norm_bwd"  # norm.cc
ADAMW = "jaxtrain_cpu_adamw"  # adamw.cc
# grouped.cc
GROUPED_FORWARD, GROUPED_BACKWARD = "jaxtrain_cpu_grouped_swiglu_fwd", "jaxtrain_cpu_grouped_swiglu_bwd"
GROUPED_MATMUL_SUM, GROUPED_WEIGHT_GRAD = "jaxtrain_cpu_grouped_matmul_sum", "jaxtrain_cpu_grouped_weight_grad"
TARGETS = (FORWARD, BACKWARD, ROPE_FORWARD, ROPE_BACKWARD, MATMUL, SWIGLU_FORWARD, SWIGLU_BACKWARD, MATMUL_SUM,
           RMSNORM_FORWARD, RMSNORM_BACKWARD, ADAMW, GROUPED_FORWARD, GROUPED_BACKWARD, GROUPED_MATMUL_SUM,
           GROUPED_WEIGHT_GRAD)
STALE_S = 600  # a temporary library this old is a killed build's leftover (a build takes seconds)
FLAGS = ("-std=c++20", "-O3", "-march=native", "-fno-math-errno", "-fPIC", "-shared", "-w")
# GCC keeps to 256-bit vectors on Intel CPUs with AVX-512 unless told otherwise; the kernel's 8 x 32
# register tiles then take 32 registers and spill. With 512: one layer's forward and backward at the
# shakespeare-char shape 1.19 against 1.44 ms, the 25M shape's backward at length 256 11.8 against
# 21.3 ms (2-core Intel Xeon, AVX-512). x86 only: other compilers' targets reject the option.
if platform.machine().lower() in ("x86_64", "amd64"):
    FLAGS += ("-mprefer-vector-width=512",)

_state: dict = {"lock": threading.Lock(), "done": False, "problem": None, "library": "", "handle": None}


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
    prefetch thread (:mod:`.prefetch`), which deserializes compiled programs that may call
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
        _state["library"], _state["handle"] = path.name, library
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as err:
        log.warning("jaxtrain's XLA:CPU kernels could not be built (%s); auto uses XLA's ops", err)
        return f"the kernel did not build: {err}"
    return None


def fma_peak(threads: int, seconds: float) -> float:
    """float32 FLOP/s of ``threads`` threads running FMA chains for ``seconds`` (``peak.cc``); 0 where the
    library is not loaded (:func:`problem` says why)."""
    import ctypes as c
    if problem() is not None:
        return 0.0
    fn = _state["handle"].JaxtrainCpuFmaPeak
    fn.restype, fn.argtypes = c.c_double, [c.c_int, c.c_double]
    return float(fn(threads, seconds))
