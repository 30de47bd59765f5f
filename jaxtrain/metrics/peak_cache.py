"""The calibrated CPU matmul peak kept per host, so a run does not spend ~0.1 s timing it again.

MFU on CPU divides by a measured peak (:func:`jaxtrain.metrics.flops.calibrate_cpu_flops`). The
command line keeps that measurement in ``~/.cache/jaxtrain/peak.json`` (beside JAX's compilation
cache) for :data:`MAX_AGE_S`, keyed by what changes the figure: the host name and CPU model (a home
directory can be shared by a cluster's different nodes), the CPUs this process may use, the jax and
jaxlib versions, ``XLA_FLAGS`` and the dtype. The library itself caches nothing unless
:func:`enable` was called; a file that cannot be read or written is ignored (it is only a cache).
"""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Callable, Optional

MAX_AGE_S = 24 * 3600.0  # a day: CPU throughput on shared machines drifts, so re-measure daily
_path: Optional[Path] = None


def enable(path: Optional[Path] = None) -> None:
    """Keeps calibrations in ``path`` (default ``~/.cache/jaxtrain/peak.json``) from now on."""
    global _path
    _path = Path(path) if path is not None else Path(os.path.expanduser("~/.cache/jaxtrain/peak.json"))


def disable() -> None:
    """Every calibration is measured again (the library's default)."""
    global _path
    _path = None


def host_key(dtype: str) -> str:
    """What the cached figure depends on, as one string."""
    import jax
    import jaxlib
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return "|".join([platform.node(), _cpu_model(), f"{cpus} cpus", f"jax {jax.__version__}",
                     f"jaxlib {jaxlib.__version__}", os.environ.get("XLA_FLAGS", ""), dtype])


def peak(dtype: str, measure: Callable[[], float]) -> tuple[float, Optional[float]]:
    """(FLOP/s, age in seconds of the cached figure, or None when ``measure()`` was just called).

    With caching enabled, a figure for this host younger than :data:`MAX_AGE_S` is returned as is;
    otherwise ``measure()`` runs and (when enabled) its result is stored.
    """
    if _path is None:
        return measure(), None
    key, now = host_key(dtype), time.time()
    entries = _read(_path)
    hit = entries.get(key)
    if isinstance(hit, dict) and isinstance(hit.get("flops"), (int, float)) and hit["flops"] > 0:
        age = now - float(hit.get("at", 0.0))
        if 0 <= age < MAX_AGE_S:
            return float(hit["flops"]), age
    value = measure()
    entries = {k: v for k, v in entries.items() if isinstance(v, dict) and now - v.get("at", 0.0) < MAX_AGE_S}
    entries[key] = {"flops": value, "at": now}
    _write(_path, entries)
    return value, None


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
