"""Files and folders that are not what a key needs: a named ConfigError (exit 2), never a traceback."""
import numpy as np
import pytest

from jaxtrain import config as cfglib
from jaxtrain.analysis import report
from jaxtrain.checkpoint import storage
from jaxtrain.errors import ConfigError, DataError
from jaxtrain.interop import hf, hf_files
from jaxtrain.parallel.rules import Rules


def test_a_config_or_rules_file_that_is_not_utf8_is_named(tmp_path):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("# résumé\ntrain:\n  steps: 3\n".encode("latin-1"))
    with pytest.raises(ConfigError) as e:
        cfglib.load(str(bad), [])
    assert str(e.value) == f"config file {bad}: not UTF-8 text (byte 3: invalid continuation byte)"
    assert e.value.exit_code == 2
    with pytest.raises(ConfigError, match=rf"^sharding.rules: {bad}: not UTF-8 text \(byte 3: "):
        Rules.load(str(bad))


def test_a_file_where_a_folder_must_be_is_named(tmp_path):
    file = tmp_path / "notes.txt"
    file.write_text("hi")
    for where in (file, file / "sub" / "deeper"):  # the file itself, or on the way to the folder
        with pytest.raises(ConfigError, match=rf"^checkpoint.dir: '{file}' exists and is not a directory$"):
            storage.open_store(str(where))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("model: {}\n")
    with pytest.raises(ConfigError, match=rf"^export: '{file}' exists and is not a directory$"):
        hf.export(tmp_path / "run", file)
    assert storage.open_store(str(tmp_path / "new" / "ckpts")).root.name == "ckpts"  # nothing in the way


def test_an_export_into_the_run_directory_or_its_checkpoints_is_refused_before_any_work(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "5").mkdir(parents=True)
    (run / "config.yaml").write_text("model: {}\n")
    with pytest.raises(ConfigError) as e:
        hf.export(run, run)
    assert str(e.value) == (f"export: OUT_DIR '{tmp_path / 'run'}' is the run directory itself; name a new folder "
                            f"(e.g. {run / 'hf'})")
    for out in (run / "checkpoints", run / "checkpoints" / "hf"):
        with pytest.raises(ConfigError) as e:
            hf.export(run, out)
        assert str(e.value) == (f"export: OUT_DIR '{out}' is inside the run's checkpoint folder {run / 'checkpoints'}, "
                                f"whose every entry is read as a checkpoint step; name a folder outside it")
    assert sorted(p.name for p in run.rglob("*")) == ["5", "checkpoints", "config.yaml"]  # nothing written


def test_an_export_into_a_folder_of_weights_it_did_not_write_is_refused(tmp_path):
    from safetensors.numpy import save_file
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model: {}\n")
    mine = tmp_path / "mine"
    mine.mkdir()
    for i in (1, 2):
        save_file({"w": np.ones(2, np.float32)}, str(mine / f"model-0000{i}-of-00002.safetensors"))
    (mine / "model.safetensors.index.json").write_text("{}")
    before = {p.name: p.read_bytes() for p in mine.iterdir()}
    with pytest.raises(ConfigError) as e:
        hf.export(run, mine)
    assert str(e.value) == (f"export: OUT_DIR '{mine}' holds model-00001-of-00002.safetensors, "
                            f"model-00002-of-00002.safetensors, model.safetensors.index.json, not written by a "
                            f"jaxtrain export, which this export would replace or delete; nothing was written "
                            f"(name another folder, or move them)")
    assert {p.name: p.read_bytes() for p in mine.iterdir()} == before
    ours = tmp_path / "ours"  # an earlier export's files: replaced as documented (no error before the work)
    ours.mkdir()
    save_file({"w": np.ones(2, np.float32)}, str(ours / "model.safetensors"), metadata={"jaxtrain_step": "3"})
    hf_files.check_no_foreign_weights(ours)


def test_report_names_an_unknown_image_type_and_a_broken_run_config(tmp_path):
    with pytest.raises(ConfigError, match=r"^report: -o .*r.txt: the file must end in .png, .svg, .pdf$"):
        report.write([tmp_path], tmp_path / "r.txt")
    (tmp_path / "config.yaml").write_text("train: [1, 2\n")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "step_time_s": 0.1}\n')
    with pytest.raises(ConfigError, match=r"config.yaml is not a run's config \(ParserError: "):
        report.load(tmp_path)


def test_windows_mode_reads_text_only_and_counts_what_it_replaces(tmp_path, corpus_path):
    from jaxtrain.data import corpus

    records = tmp_path / "docs.jsonl"
    records.write_text('{"text": "hello"}\n' * 2000)
    with pytest.raises(ConfigError, match=r"^data.format: jsonl needs data.mode=packed or padded \(windows reads "):
        cfglib.load(None, [f"data.path={records}", "data.format=jsonl"])
    cfg = cfglib.load(None, [f"data.path={records}", "data.tokenizer=char", "data.seq_len=16"])
    with pytest.raises(DataError, match=rf"^data.path: '{records}' is JSONL records by its name, and data.mode="):
        corpus.load(cfg)
    as_text = cfglib.load(None, [f"data.path={records}", "data.format=text", "data.tokenizer=char", "data.seq_len=16"])
    assert corpus.load(as_text).info == []  # read as text when asked
    latin = tmp_path / "latin.txt"
    latin.write_bytes(open(corpus_path, "rb").read()[:20000] + "café résumé".encode("latin-1"))
    got = corpus.load(cfglib.load(None, [f"data.path={latin}", "data.tokenizer=char", "data.seq_len=16"]))
    assert got.info == [f"data: replaced 3 invalid UTF-8 sequence(s) in '{latin}' with U+FFFD"]
    byte = corpus.load(cfglib.load(None, [f"data.path={latin}", "data.tokenizer=byte", "data.seq_len=16"]))
    assert byte.info == []  # the byte tokenizer keeps every byte: nothing replaced
