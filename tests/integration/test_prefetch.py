"""jaxtrain.train.prefetch: a warm command-line start loads its executables while it imports."""
import json
import subprocess
import sys
from pathlib import Path

from conftest import SMALL
from multiproc import environment

from jaxtrain.kernels.cpu import prefetch

PROBE = Path(__file__).resolve().parents[1] / "helpers" / "prefetch_probe"


def _run(tmp_path, corpus_path, name: str, extra: dict | None = None) -> str:
    env = environment(1, {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla"),
                          "JAXTRAIN_PROGRAM_CACHE_DIR": str(tmp_path / "programs"), **(extra or {})})
    done = subprocess.run([sys.executable, "-m", "jaxtrain.train", *SMALL, f"data.path={corpus_path}", "train.steps=2",
                           "train.eval_every=2", f"run.dir={tmp_path / name}"],
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return next(line for line in done.stdout.splitlines() if line.startswith("validation loss"))


def _recorded(tmp_path) -> list:
    (index,) = (tmp_path / "programs" / prefetch.FOLDER).glob("*.json")
    return json.loads(index.read_text())["entries"]


def test_a_warm_start_gets_every_executable_from_the_prefetch(tmp_path, corpus_path):
    """The first run records the compilation-cache entries it looks up (and, finding none, compiles
    and stores them); the second loads those on its prefetch thread and is answered from it for
    every one; both give the same validation loss."""
    cold = _run(tmp_path, corpus_path, "cold")
    entries = _recorded(tmp_path)
    assert len(entries) >= 3 and not any(e["prefetched"] for e in entries)  # init, train step, evaluation...
    for e in entries:  # each one is an executable JAX stored
        assert list((tmp_path / "xla").glob(f"{e['key']}*")), e["key"]
    warm = _run(tmp_path, corpus_path, "warm", {"PYTHONPATH": str(PROBE)})  # reads wait for the thread to begin
    again = _recorded(tmp_path)
    assert sorted(e["key"] for e in again) == sorted(e["key"] for e in entries)
    assert all(e["prefetched"] for e in again), again
    assert cold == warm


class _Options:
    def SerializeAsString(self) -> bytes:
        return b"options"


def test_a_miss_or_a_failed_load_falls_back_to_jaxs_own_read(tmp_path, monkeypatch):
    from concurrent.futures import Future
    failed, loaded, pending = Future(), Future(), Future()
    failed.set_result((None, None))  # e.g. the entry was evicted since it was recorded
    loaded.set_result(("prefetched executable", 7))
    reads = []
    monkeypatch.setitem(prefetch._state, "original", lambda name, key, *a: reads.append(key) or ("read", 1))
    monkeypatch.setitem(prefetch._state, "futures", {"a": failed, "b": loaded, "d": pending})
    monkeypatch.setitem(prefetch._state, "path", tmp_path / "launch.json")
    monkeypatch.setitem(prefetch._state, "recorded", [])
    monkeypatch.setitem(prefetch._state, "entries", [])
    one = [object()]  # one device
    assert prefetch._cache_read("m", "a", _Options(), None, one) == ("read", 1)
    assert prefetch._cache_read("m", "b", _Options(), None, one) == ("prefetched executable", 7)
    assert prefetch._cache_read("m", "c", _Options(), None, one) == ("read", 1)  # never recorded
    assert prefetch._cache_read("m", "b", _Options(), None, one) == ("read", 1)  # a prefetched load serves once
    assert prefetch._cache_read("m", "d", _Options(), None, one) == ("read", 1)  # not begun: read here, not waited for
    assert pending.cancelled()  # so the thread skips it
    assert reads == ["a", "c", "b", "d"]
    saved = json.loads((tmp_path / "launch.json").read_text())["entries"]
    assert [(e["key"], e["prefetched"]) for e in saved] == [("a", False), ("b", True), ("c", False), ("d", False)]


def test_only_loadable_entries_of_a_record_are_kept(tmp_path):
    """A record edited by hand or cut short: what is not a keyed entry with options is left out, a
    key listed twice is loaded once, and an unreadable file is no record at all."""
    good = {"key": "k1", "options": "b3B0aW9ucw=="}
    path = tmp_path / "launch.json"
    path.write_text(json.dumps({"entries": [{"key": 5, "options": None}, "x", None, good, dict(good), {"key": "k2"}]}))
    assert prefetch._readable(path) == [good]
    for text in ("garbage{{{", "[1, 2]", '{"entries": 3}', ""):
        path.write_text(text)
        assert prefetch._readable(path) == []
    assert prefetch._readable(tmp_path / "missing.json") == []
