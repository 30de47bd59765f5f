"""Data sources on a real object store: gs:// paths through fake-gcs-server (the GCS emulator)."""
import json

from data_helpers import cfg_of

from jaxtrain import data as datalib
from jaxtrain.data import sources, store


def test_object_store_paths_on_a_gcs_emulator(gcs, tmp_path, monkeypatch):
    """gs:// globs, reads, cache writes and cache reads through epath/gcsfs against fake-gcs-server."""
    from jaxtrain.cli import prepare
    bucket, fs = gcs.new_bucket("data"), gcs.fs()
    monkeypatch.setenv("JAXTRAIN_DATA_CACHE", str(tmp_path / "local-cache"))
    for i in range(2):
        docs = [{"text": f"shard {i} doc {j} " * 5} for j in range(20)]
        fs.pipe_file(f"{bucket}/corpus/part-{i}.jsonl", "".join(json.dumps(d) + "\n" for d in docs).encode())
    fs.pipe_file(f"{bucket}/corpus/notes.txt", b"not part of the glob")
    src, out = f"gs://{bucket}/corpus/part-*.jsonl", f"gs://{bucket}/cache"
    assert sources.expand(src) == [f"gs://{bucket}/corpus/part-{i}.jsonl" for i in range(2)]
    direct = datalib.load(cfg_of(f"data.path={src}"))
    assert prepare.main([f"data.path={src}", "--out", out, "--no-progress"]) == 0
    objects = {p.rsplit("/", 1)[-1]: fs.info(p)["generation"] for p in fs.find(f"{bucket}/cache")}
    assert {store.CACHE_META, "lengths.u32"} < set(objects), sorted(objects)
    last = max(objects, key=lambda name: int(objects[name]))
    assert last == store.CACHE_META  # the index is written last: a reader never sees a partial cache
    assert store.is_cache(out) and not store.is_cache(f"gs://{bucket}/corpus")
    cached = datalib.load(cfg_of(f"data.path={out}"))
    assert direct.schedule.rows_per_epoch() == cached.schedule.rows_per_epoch() > 0
    for g in range(direct.schedule.rows_per_epoch()):
        a, b = direct.schedule.row(g), cached.schedule.row(g)
        assert all((a[k] == b[k]).all() for k in a)
