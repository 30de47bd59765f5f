"""The peak FLOP/s a CPU run's MFU divides by: the host's float32 FMA throughput, measured.

MFU on a GPU or TPU divides by the chip's published dense peak (``jaxtrain.metrics.flops``). A CPU has
no such figure a program can read: its clock under turbo, its FMA units and what else runs on it vary.
A matmul timed with XLA's dots is no peak either, since jaxtrain's own kernels beat it (a run on a
2-core AMD EPYC printed MFU 133-153% against one). So the peak is what the cores do at most:

- :func:`fma_peak`: every CPU this process may use running independent chains of vector FMAs
  (``peak.cc``, ~15 ms), which no program exceeds at the present clock; where the kernels' library did
  not build, the best of a few 1024^3 matmuls with XLA's dots (:func:`xla_matmul_peak`).
- The figure is measured before the run starts anything else (the trainer's first step; a measurement
  beside a compile halves it) and kept per host for :data:`MAX_AGE_S` (``~/.cache/jaxtrain/peak.json``,
  the command line's :func:`enable`): a run reports the highest figure measured on its host that day, so
  one measured while another process held a core does not lower it.
- :func:`theoretical` is the cores x vector lanes x 2 FMA units x 2 FLOPs x the maximum clock, where the
  kernel reports that clock (``cpufreq``; not in most VMs): an upper bound, said beside the peak.
"""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Optional

MAX_AGE_S = 24 * 3600.0  # a day: CPU throughput on shared machines drifts, so re-measure daily
FMA_SECONDS = 0.015  # one FMA measurement (20 ms and 200 ms agreed within 2% on a 2-core AMD EPYC)
_path: Optional[Path] = None
_memo: dict[str, tuple[float, str]] = {}  # dtype -> this process's (FLOP/s, what)


def enable(path: Optional[Path] = None) -> None:
    """Keeps measurements in ``path`` (default ``~/.cache/jaxtrain/peak.json``) from now on."""
    global _path
    _path = Path(path) if path is not None else Path(os.path.expanduser("~/.cache/jaxtrain/peak.json"))


def disable() -> None:
    """Nothing is kept across processes (the library's default), and this process measures again."""
    global _path
    _path = None
    forget()


def cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def host_key(kind: str) -> str:
    """What a kept figure depends on, as one string: the host, its CPU model, the CPUs this process may
    use, the jax and jaxlib versions, ``XLA_FLAGS`` and the kind of measurement."""
    import jax
    import jaxlib
    return "|".join([platform.node(), _cpu_model(), f"{cpus()} cpus", f"jax {jax.__version__}",
                     f"jaxlib {jaxlib.__version__}", os.environ.get("XLA_FLAGS", ""), kind])


def fma_peak() -> Optional[float]:
    """float32 FLOP/s of every usable CPU running FMA chains (``peak.cc``), or None without the library."""
    from jaxtrain.kernels.cpu import library
    if library.problem() is not None:
        return None
    value = library.fma_peak(cpus(), FMA_SECONDS)
    return value if value > 0 else None


def xla_matmul_peak(n: int = 1024, repeats: int = 5, dtype: str = "float32") -> float:
    """Measured matmul FLOP/s of this host with XLA's dots: the best of ``repeats`` n x n x n matmuls in
    ``dtype``. All XLA CPU devices of a process share one thread pool, so this is the host's rate."""
    import jax
    import jax.numpy as jnp
    cpu = jax.local_devices(backend="cpu")[0]  # this process's own: another's would time a collective
    a = jax.device_put(jnp.ones((n, n), jnp.dtype(dtype)), cpu)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * n ** 3 / best


def theoretical() -> Optional[tuple[float, str]]:
    """(FLOP/s, how) from the CPU's flags, its usable CPUs and the maximum clock ``cpufreq`` reports:
    float32 lanes (16 with AVX-512, 8 with AVX2 and FMA, else 4) x 2 FMA units x 2 FLOPs; None where the
    clock is unknown (most VMs) or the CPU is not x86."""
    try:
        khz = int(Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text())
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, ValueError, StopIteration):
        return None
    flags = set(flags.split(":", 1)[1].split())
    lanes = 16 if "avx512f" in flags else 8 if {"avx2", "fma"} <= flags else 4
    per_cycle = lanes * 2 * 2
    return cpus() * per_cycle * khz * 1e3, f"{cpus()} CPUs x {khz / 1e6:.2f} GHz x {per_cycle} FLOPs"


def host_peak(dtype: str = "float32") -> tuple[float, str]:
    """(FLOP/s of this host, where it came from): see the module docstring. Measured once per process
    (a later run in the same process reuses it: it was measured before that process started anything);
    :func:`disable` and :func:`forget` drop it."""
    if dtype in _memo:
        return _memo[dtype]
    value = fma_peak()
    kind, what = "fma float32", f"float32 FMA throughput of {cpus()} CPUs, measured"
    if value is None:
        value, kind = xla_matmul_peak(dtype=dtype), f"xla matmul {dtype}"
        what = f"calibrated host {dtype} matmul (XLA's dots; the kernels' library did not build)"
    best, at = _kept(kind, value)
    if best > value:
        what += f"; the best today, {(time.time() - at) / 60:.0f} min ago (now {value / 1e9:.1f} GFLOP/s)"
    bound = theoretical()
    if bound is not None:
        what += f"; theoretical {bound[0] / 1e9:.0f} GFLOP/s ({bound[1]})"
    _memo[dtype] = best, what
    return _memo[dtype]


def forget() -> None:
    """The next :func:`host_peak` measures again."""
    _memo.clear()


def _kept(kind: str, value: float) -> tuple[float, float]:
    """(the highest figure of ``kind`` measured on this host within :data:`MAX_AGE_S`, ``value`` included;
    when it was measured), keeping ``value`` when it is that figure (with :func:`enable` only)."""
    now = time.time()
    if _path is None:
        return value, now
    key, entries = host_key(kind), _read(_path)
    entries = {k: v for k, v in entries.items() if isinstance(v, dict) and isinstance(v.get("at"), (int, float))
               and 0 <= now - v["at"] < MAX_AGE_S and isinstance(v.get("flops"), (int, float)) and v["flops"] > 0}
    hit = entries.get(key)
    if hit is not None and hit["flops"] >= value:
        _write(_path, entries)  # the stale ones dropped
        return float(hit["flops"]), float(hit["at"])
    entries[key] = {"flops": value, "at": now}
    _write(_path, entries)
    return value, now


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, entries: dict) -> None:
    """Atomically (a rename), so a concurrent run reads the old file or the new one, never half."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(entries, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass
