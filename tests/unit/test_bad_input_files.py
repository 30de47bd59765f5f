"""Files and folders that are not what a key needs: a named ConfigError (exit 2), never a traceback."""
import pytest

from jaxtrain import config as cfglib
from jaxtrain.analysis import report
from jaxtrain.checkpoint import storage
from jaxtrain.errors import ConfigError
from jaxtrain.interop import hf
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


def test_report_names_an_unknown_image_type_and_a_broken_run_config(tmp_path):
    with pytest.raises(ConfigError, match=r"^report: -o .*r.txt: the file must end in .png, .svg, .pdf$"):
        report.write([tmp_path], tmp_path / "r.txt")
    (tmp_path / "config.yaml").write_text("train: [1, 2\n")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "step_time_s": 0.1}\n')
    with pytest.raises(ConfigError, match=r"config.yaml is not a run's config \(ParserError: "):
        report.load(tmp_path)
