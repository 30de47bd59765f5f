"""Path keys: file:// is a local path; an unsupported storage scheme is a named error (exit 2)
before anything is built, for every path key."""
import os

import pytest

from jaxtrain.cli import train as train_cli
from jaxtrain.config import load
from jaxtrain.errors import ConfigError

REMOTE_OK = "takes a local path, file://, gs:// or s3://"
LOCAL_ONLY = "takes a local path or file://"
CASES = [  # (override, the error after "<key>: ")
    ("checkpoint.dir=hdfs://nn/ckpt",
     f"unsupported storage scheme 'hdfs://' in 'hdfs://nn/ckpt'; checkpoint.dir {REMOTE_OK}"),
    ("checkpoint.dir=az://c/ckpt", f"unsupported storage scheme 'az://' in 'az://c/ckpt'; checkpoint.dir {REMOTE_OK}"),
    ("checkpoint.dir=gs://", "'gs://' names no bucket"),
    ("checkpoint.dir=gs:///path", "'gs:///path' names no bucket"),
    ("data.path=hdfs://nn/corpus.txt",
     f"unsupported storage scheme 'hdfs://' in 'hdfs://nn/corpus.txt'; data.path {REMOTE_OK}"),
    ("data.path=https://example.com/x.txt",
     f"unsupported storage scheme 'https://' in 'https://example.com/x.txt'; data.path {REMOTE_OK}"),
    ("data.mixture={az://c/a.jsonl: 1.0}",
     f"unsupported storage scheme 'az://' in 'az://c/a.jsonl'; data.mixture {REMOTE_OK}"),
    ("data.tokenizer_path=s3://b/tokenizer.json",
     f"unsupported storage scheme 's3://' in 's3://b/tokenizer.json'; data.tokenizer_path {LOCAL_ONLY}"),
    ("run.dir=gs://b/run", f"unsupported storage scheme 'gs://' in 'gs://b/run'; run.dir {LOCAL_ONLY}"),
    ("sharding.rules=hdfs://r.yaml",
     f"unsupported storage scheme 'hdfs://' in 'hdfs://r.yaml'; sharding.rules {LOCAL_ONLY}"),
    ("checkpoint.dir=file://relative/ckpt", "'file://relative/ckpt' is not a local file URL; write file:///absolute/path"),
    ("checkpoint.dir=file:/abs/ckpt", "'file:/abs/ckpt' is not a local file URL; write file:///absolute/path"),
]


@pytest.mark.parametrize("override,message", CASES)
def test_unsupported_schemes_are_named(override, message):
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as err:
        load(None, [override])
    assert str(err.value) == f"{key}: {message}"


def test_the_cli_exits_2_before_building_anything(tmp_path, capsys):
    assert train_cli.main([f"run.dir={tmp_path / 'run'}", "checkpoint.dir=hdfs://nn/ckpt"]) == 2
    assert capsys.readouterr().err == f"error: checkpoint.dir: {CASES[0][1]}\n"
    assert not (tmp_path / "run").exists()


def test_file_urls_are_local_paths(tmp_path):
    cfg = load(None, [f"checkpoint.dir=file://{tmp_path}/ck", f"run.dir=file://localhost{tmp_path}/run",
                      f"data.path=file://{tmp_path}/my%20corpus.txt", "checkpoint.dir=gs://bucket/ck"])
    assert (cfg.run.dir, cfg.data.path) == (f"{tmp_path}/run", f"{tmp_path}/my corpus.txt")
    assert cfg.checkpoint.dir == "gs://bucket/ck"  # supported remote URLs are kept as given
    assert load(None, ["checkpoint.dir=GS://bucket/ck", "data.path=S3://b/x.txt"]).data.path == "s3://b/x.txt"
    assert load(None, [f"checkpoint.dir=file://{tmp_path}/ck"]).checkpoint.dir == f"{tmp_path}/ck"


def test_a_file_url_checkpoint_dir_trains_and_resumes(small_cfg, tmp_path):
    import jax

    from jaxtrain.train import fit
    cfg = small_cfg("train.steps=2", "checkpoint.every=1", "mesh.data=1", f"checkpoint.dir=file://{tmp_path}/ck")
    fit(cfg, devices=jax.devices()[:1], quiet=True)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["1", "2"]
    assert fit(small_cfg("train.steps=3", "checkpoint.every=1", "mesh.data=1", f"checkpoint.dir=file://{tmp_path}/ck"),
               devices=jax.devices()[:1], quiet=True).start_step == 2


def test_prepare_out_takes_the_same_schemes(tmp_path, capsys):
    from jaxtrain.cli import prepare
    assert prepare.main(["--out", "hdfs://nn/cache", f"data.path={tmp_path}/x.txt"]) == 2
    assert capsys.readouterr().err == ("error: --out: unsupported storage scheme 'hdfs://' in 'hdfs://nn/cache'; "
                                       f"--out {REMOTE_OK}\n")


def test_prepare_out_is_a_new_empty_or_cache_folder(tmp_path, capsys):
    """A file in the way was a traceback (exit 1); a folder of other files got the cache mixed in."""
    from jaxtrain.cli import prepare
    text = tmp_path / "x.txt"
    text.write_text("hello world\n" * 50)
    (tmp_path / "victim.txt").write_text("keep me")
    assert prepare.main(["--out", str(tmp_path / "victim.txt"), f"data.path={text}", "--no-progress"]) == 2
    assert capsys.readouterr().err == f"error: --out: '{tmp_path / 'victim.txt'}' exists and is not a directory\n"
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.md").write_text("mine")
    assert prepare.main(["--out", str(tmp_path / "mine"), f"data.path={text}", "--no-progress"]) == 2
    assert capsys.readouterr().err == (f"error: --out: '{tmp_path / 'mine'}' holds other files and is not a token "
                                       f"cache (no cache.json); name a new or empty folder\n")
    assert (tmp_path / "victim.txt").read_text() == "keep me" and os.listdir(tmp_path / "mine") == ["notes.md"]
    for _ in range(2):  # a new folder, then the same cache again
        assert prepare.main(["--out", str(tmp_path / "cache"), f"data.path={text}", "--no-progress"]) == 0
    assert (tmp_path / "cache" / "cache.json").is_file()
