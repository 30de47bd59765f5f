"""The compiled programs of a warm command-line start, loaded on a thread while the process still imports.

A warm start reads its init program, train step and evaluation from JAX's persistent compilation
cache, and rebuilding each executable from its stored form is XLA work of ~0.3 s (2-core AMD EPYC,
``configs/shakespeare_char.yaml``) that waits until setup has traced or loaded the programs. The
imports before setup (Flax, Grain, Orbax: ~1 s of one core) leave the other core idle, so:

- each run records the compilation-cache entries it reads (JAX's cache key and the serialized
  ``CompileOptions``) under a *launch key*, a SHA-256 of what decides its programs and is known
  before the imports: the resolved config without the keys that only steer the loop (as the
  program cache's key, :mod:`.program_cache`), jaxtrain's sources, the devices, ``XLA_FLAGS``
  and the Python, JAX and jaxlib versions;
- :func:`start` (the command line calls it once the backend is up, before importing the trainer,
  through the ``cpu`` provider's hooks: :mod:`.hooks`)
  loads the entries a run with the same launch key recorded, on a thread of its own;
- JAX's cache read is then answered from that thread's result when it asks for one of them (waiting
  at most :data:`WAIT_S`), and reads the cache itself otherwise.

A recorded entry is only a guess about which programs this run compiles: the cache key JAX computes
from the program decides which executable is used, exactly as without prefetching. A guess that
misses costs the thread's work. Applies where the program cache does (one process, one device) and
JAX's persistent cache is on. The hook on JAX's ``_cache_read`` is private: where it is missing,
nothing is prefetched.
"""
from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Optional

import jax

from jaxtrain.kernels.cpu import program_cache

log = logging.getLogger("jaxtrain")
WAIT_S = 120.0  # the longest a compile waits for the thread's load of its entry
FOLDER = "launch"  # under the program cache's root
MAX_ENTRIES = 16  # per launch key: a run's programs, not every program it ever compiled

_lock = threading.Lock()
_state: dict[str, Any] = {"path": None, "recorded": [], "entries": [], "futures": {}, "original": None}


def launch_key(cfg: Any, devices: list) -> str:
    """The hex SHA-256 a run's recorded entries are filed under (see the module docstring)."""
    import jaxlib
    conf = cfg.model_dump(mode="json")
    for section in program_cache.LOOP_ONLY:
        conf.pop(section, None)
    conf["train"] = {k: conf["train"][k] for k in program_cache.TRAIN_KEYS}
    h = hashlib.sha256()
    for part in (conf, [(d.platform, d.device_kind, d.id) for d in devices], os.environ.get("XLA_FLAGS", ""),
                 [sys.version, jax.__version__, jaxlib.__version__]):
        h.update(json.dumps(part, sort_keys=True, default=repr).encode() + b"\0")
    for name, path in program_cache.sources():
        h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def start(cfg: Any) -> bool:
    """Records this run's cache reads under its launch key and starts loading those recorded there
    before. Returns whether prefetching is on (not where the program cache is off, several processes
    or devices run, JAX's persistent cache is off, JAX's hook is missing, or anything here fails:
    the run then reads the cache as JAX does)."""
    try:
        return _start(cfg)
    except Exception as err:  # noqa: BLE001 - a speed-up only
        log.debug("prefetching is off: %s", err)
        return False


def _start(cfg: Any) -> bool:
    from jax._src import compilation_cache, compiler
    devices = jax.devices()
    if (not program_cache.enabled() or len(devices) != 1 or jax.process_count() != 1
            or devices[0].platform != "cpu" or not compilation_cache.is_persistent_cache_enabled()
            or not hasattr(compiler, "_cache_read")):
        return False
    path = program_cache.root() / FOLDER / f"{launch_key(cfg, devices)}.json"
    recorded = _readable(path)
    with _lock:
        # This run's reads replace the list as they come: the next run prefetches what this one read.
        _state.update(path=path, recorded=[], entries=[], futures={e["key"]: Future() for e in recorded},
                      record_failed=False)
        if _state["original"] is None:
            _state["original"] = compiler._cache_read
            compiler._cache_read = _cache_read
    if _state["futures"]:
        threading.Thread(target=_load, args=(recorded, dict(_state["futures"]), devices), name="jaxtrain-prefetch",
                         daemon=True).start()
    return True


def _readable(path: Path) -> list:
    """The recorded entries of ``path`` that can be loaded: each key once, with its options; nothing
    from a file that is missing or not such a list (edited by hand, cut short)."""
    try:
        entries = json.loads(path.read_text())["entries"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    found: dict[str, dict] = {}
    for e in entries if isinstance(entries, list) else []:
        if isinstance(e, dict) and isinstance(e.get("key"), str) and isinstance(e.get("options"), str):
            found.setdefault(e["key"], e)
    return list(found.values())[:MAX_ENTRIES]


def stop() -> None:
    """Puts JAX's cache read back and forgets what was loaded (a ``main()`` called in-process)."""
    from jax._src import compiler
    with _lock:
        if _state["original"] is not None:
            compiler._cache_read = _state["original"]
        _state.update(path=None, recorded=[], entries=[], futures={}, original=None)


def _load(entries: list, futures: dict, devices: list) -> None:
    """On the prefetch thread: each recorded entry from JAX's cache, in the order it was first read,
    except those a compile asked for before the thread began them (cancelled: it reads them itself)."""
    from jax._src import compilation_cache, xla_bridge
    from jax._src.lib import xla_client as xc
    backend = xla_bridge.get_backend()
    if backend.platform == "cpu":  # an executable calling the XLA:CPU kernels needs them registered first
        from jaxtrain.kernels.cpu import library
        library.register_if_built()
    for e in entries:
        future = futures.get(e["key"])
        if future is None or future.done() or not future.set_running_or_notify_cancel():
            continue
        try:
            options = xc.CompileOptions.ParseFromString(base64.b64decode(e["options"]))
            future.set_result(compilation_cache.get_executable_and_time(
                e["key"], options, backend, xc.DeviceList(tuple(devices))))
        except Exception as err:  # noqa: BLE001 - e.g. an entry evicted since: JAX reads the cache itself
            log.debug("prefetching %s failed: %s", e.get("key"), err)
            future.set_result((None, None))


def _cache_read(module_name, cache_key, compile_options, backend, executable_devices, *args, **kwargs):
    """JAX's ``compiler._cache_read``, answered from the prefetch thread's load when it has this key."""
    future = _state["futures"].pop(cache_key, None)
    if future is not None and not future.cancel():  # being loaded, or loaded: wait for it (not yet begun: read here)
        try:
            found = future.result(timeout=WAIT_S)
        except Exception:  # noqa: BLE001 - the wait's bound passed: read it here as JAX would
            found = (None, None)
        if found[0] is not None:
            _record(cache_key, compile_options, executable_devices, True)
            return found
    found = _state["original"](module_name, cache_key, compile_options, backend, executable_devices, *args, **kwargs)
    _record(cache_key, compile_options, executable_devices, False)
    return found


def _record(cache_key: str, compile_options: Any, executable_devices: Any, prefetched: bool) -> None:
    """Adds a single-device read to this launch key's list (written at once, atomically), with
    whether the prefetch thread had loaded it."""
    path: Optional[Path] = _state["path"]
    if path is None or len(executable_devices) != 1:
        return
    with _lock:
        if cache_key in _state["recorded"] or len(_state["recorded"]) >= MAX_ENTRIES:
            return
        _state["recorded"].append(cache_key)
        entries = _state["entries"]
        entries.append({"key": cache_key, "options": base64.b64encode(compile_options.SerializeAsString()).decode(),
                        "prefetched": prefetched})
        _state["entries"] = entries
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_text(json.dumps({"entries": entries}))
            os.replace(tmp, path)
        except OSError as err:  # said once: only the next run's prefetch is lost
            if not _state.get("record_failed"):
                _state["record_failed"] = True
                log.warning(f"warning: jaxtrain's program cache: recording what to prefetch in {path} failed "
                            f"({err.strerror or err}); the next run reads its programs as JAX does")
