"""Bad config input fails with a named error before anything is compiled."""
import pytest

from jaxtrain import config as cfglib
from jaxtrain.cli import train as train_cli
from jaxtrain.errors import ConfigError, DataError
from jaxtrain.train import fit, step


@pytest.fixture
def no_compile(monkeypatch):
    """Any attempt to build/compile the step fails the test: errors must come first."""
    def boom(*a, **k):
        raise AssertionError("reached step.build: the error was not raised before compiling")
    monkeypatch.setattr(step, "build", boom)


def test_defaults_are_the_default_job():
    cfg = cfglib.load()
    assert cfg.data.path == "stdlib" and cfg.data.tokenizer == "byte"
    assert cfg.run.dir == "runs/default"


def test_yaml_and_overrides_merge(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  steps: 7\n  global_batch: 4\nmodel:\n  d_model: 64\n")
    cfg = cfglib.load(str(f), ["train.steps=9", "optimizer.lr=3e-4", "run.dir=/x/y"])
    assert (cfg.train.steps, cfg.train.global_batch, cfg.model.d_model) == (9, 4, 64)
    assert cfg.optimizer.lr == pytest.approx(3e-4) and cfg.run.dir == "/x/y"


def test_shipped_config_by_name():
    cfg = cfglib.load("shakespeare_char")
    assert (cfg.model.n_layers, cfg.model.n_heads, cfg.model.d_model) == (4, 4, 128)
    assert (cfg.data.seq_len, cfg.train.global_batch, cfg.train.steps) == (64, 12, 2000)


def test_unknown_key_suggests_closest():
    with pytest.raises(ConfigError) as e:
        cfglib.load(None, ["train.stpes=10"])
    assert str(e.value) == "unknown config key 'train.stpes'; did you mean 'train.steps'?"


def test_unknown_section_suggests_closest(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("optimiser:\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match=r"^unknown config key 'optimiser'; did you mean 'optimizer'\?$"):
        cfglib.load(str(f))


def test_wrong_type_names_key():
    with pytest.raises(ConfigError) as e:
        cfglib.load(None, ["train.steps=abc"])
    assert str(e.value).startswith("train.steps: Input should be a valid integer")
    assert "'abc'" in str(e.value)


def test_override_without_equals():
    with pytest.raises(ConfigError, match="override 'train.steps': expected dotted key=value"):
        cfglib.load(None, ["train.steps"])


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError) as err:
        cfglib.load("nope.yaml")
    assert str(err.value) == ("--config: 'nope.yaml' is no such file, and no name in configs/ (known names: "
                              "digits_mlp, llama_1b_h200, llama_25m, moe_shakespeare, shakespeare_char)")
    with pytest.raises(ConfigError, match=rf"^--config: '{tmp_path}' is a folder, not a YAML file, and no name in "):
        cfglib.load(str(tmp_path))


def test_inconsistent_heads():
    with pytest.raises(ConfigError, match=r"^model.n_kv_heads: model.n_heads=4 is not divisible by n_kv_heads=3$"):
        cfglib.load(None, ["model.n_kv_heads=3"])


def test_batch_not_divisible_by_data_fsdp(small_cfg, no_compile):
    cfg = small_cfg("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.global_batch=6")
    with pytest.raises(ConfigError) as e:
        fit(cfg, quiet=True)
    assert str(e.value) == ("train.global_batch: micro-batch 6 (global_batch 6 / grad_accum 1) is not divisible "
                            "by data*fsdp*expert = 2*2*1 = 4")


def test_heads_not_divisible_by_tensor(small_cfg, no_compile):
    cfg = small_cfg("mesh.data=1", "mesh.tensor=8", "model.n_heads=4", "model.n_kv_heads=4")
    with pytest.raises(ConfigError, match=r"^model.n_heads: 4 is not divisible by mesh.tensor=8$"):
        fit(cfg, quiet=True)


def test_mesh_product_must_match_devices(small_cfg, no_compile):
    cfg = small_cfg("mesh.data=3")
    with pytest.raises(ConfigError, match=r"^mesh: the axis sizes multiply to 3 but there are 8 devices"):
        fit(cfg, quiet=True)


def test_missing_data_path(small_cfg, tmp_path, no_compile):
    cfg = small_cfg(f"data.path={tmp_path}/nothing*.txt")
    with pytest.raises(DataError) as e:
        fit(cfg, quiet=True)
    assert str(e.value) == f"data.path: no file matches '{tmp_path}/nothing*.txt'"
    assert not (tmp_path / "run").exists()  # nothing written for a run that cannot start


def test_corpus_shorter_than_one_window(small_cfg, tmp_path, no_compile):
    short = tmp_path / "short.txt"
    short.write_text("x" * 100)  # 90 train tokens, 10 validation tokens; window is 33
    with pytest.raises(DataError) as e:
        fit(small_cfg(f"data.path={short}"), quiet=True)
    assert str(e.value) == (f"data.path: the validation split of '{short}' has 10 tokens, fewer than one window "
                            f"of data.seq_len+1 = 33 tokens")


def test_cli_prints_error_and_exits_2(capsys):
    assert train_cli.main(["train.stpes=1"]) == 2
    assert capsys.readouterr().err == "error: unknown config key 'train.stpes'; did you mean 'train.steps'?\n"


def parsed(argv):
    args = train_cli.parse_args(argv)
    return args.config, args.overrides


def test_cli_positional_config_file():
    assert parsed(["configs/x.yaml", "a.b=1"]) == ("configs/x.yaml", ["a.b=1"])
    assert parsed(["--config", "c.yaml"]) == ("c.yaml", [])


@pytest.mark.parametrize("override,message", [
    ("optimizer.lr=-1", "optimizer.lr: must be > 0, got -1.0"),
    ("optimizer.lr=nan", "optimizer.lr: must be a finite number, got nan"),
    ("optimizer.b1=1.5", "optimizer.b1: must be in [0, 1), got 1.5"),
    ("optimizer.clip_norm=-1", "optimizer.clip_norm: must be > 0, got -1.0"),
    ("optimizer.weight_decay=-5", "optimizer.weight_decay: must be >= 0, got -5.0"),
    ("optimizer.warmup_steps=-3", "optimizer.warmup_steps: must be >= 0, got -3"),
    ("optimizer.min_lr=1", "optimizer.min_lr: must be in [0, optimizer.lr=0.001], got 1.0"),
    ("optimizer.decay_steps=10", "optimizer.decay_steps: must be > optimizer.warmup_steps=20, got 10"),
    ("train.sample_tokens=-1", "train.sample_tokens: must be >= 0, got -1"),
    ("train.gc_every=-1", "train.gc_every: must be >= 0 (0 = Python's automatic collection), got -1"),
    ("train.peak_tflops=-1", "train.peak_tflops: must be a positive number, got -1.0"),
    ("run.dir=", "run.dir: must not be empty"),
    ("train.steps=true", "train.steps: Input should be a valid integer (got True)"),
    ("train.steps=2.5", "train.steps: Input should be a valid integer (got 2.5)"),
    # a key inside an optional section is typed like any other (it was left a string: pydantic's message)
    ("model.rope_scaling.factor=nan", "model.rope_scaling.factor: must be a finite number, got nan"),
])
def test_bad_values_are_named(override, message):
    with pytest.raises(ConfigError) as e:
        cfglib.load(None, [override])
    assert str(e.value) == message


def test_string_fields_keep_override_text():
    cfg = cfglib.load(None, ["data.path=2024", "train.sample_prompt=123", "optimizer.decay_steps=null"])
    assert cfg.data.path == "2024" and cfg.train.sample_prompt == "123" and cfg.optimizer.decay_steps is None


def test_a_quoted_string_override_is_read_as_yaml_reads_it():
    """'data.separator="\\n\\n"' is two newlines, as in a YAML file (it was the six characters, quotes kept);
    text that is not one whole quoted string is kept as written."""
    cfg = cfglib.load(None, ["data.mode=packed", 'data.separator="\\n\\n"', "train.sample_prompt='it''s'",
                             'data.path="x', "run.dir=a'b'"])  # packed: where data.separator is read
    assert (cfg.data.separator, cfg.train.sample_prompt, cfg.data.path, cfg.run.dir) == ("\n\n", "it's", '"x', "a'b'")


@pytest.mark.parametrize("text, expected", [
    ("train:\n  steps: 5\n  steps: 6\n",
     "line 3, column 3: invalid YAML: duplicate key 'steps' (YAML alone would silently keep the last)"),
    ("model:\n  d_model: 128\n n_layers: [4\n",
     "line 3, column 2: invalid YAML: expected <block end>, but found '<block mapping start>'"),
])
def test_a_bad_yaml_config_is_one_line_with_its_position(tmp_path, text, expected):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as err:
        cfglib.load(str(f))
    assert str(err.value) == f"config file {f}, {expected}"


@pytest.mark.parametrize("text", ["", "# all commented out\n# train:\n#   steps: 5\n", "---\n"])
def test_an_empty_config_file_is_an_error_not_the_default_job(tmp_path, text):
    f = tmp_path / "empty.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as err:
        cfglib.load(str(f))
    assert str(err.value) == (f"config file {f}: empty (no keys); leave out --config for the built-in default "
                              f"job, or write '{{}}' for the defaults")
    f.write_text("{}\n")
    assert cfglib.load(str(f)) == cfglib.load(None)


def test_a_mapping_for_a_whole_section_merges_into_it():
    """'train={log_every: 1}' sets one key; the file's other train keys (and earlier overrides) stay,
    as with train.log_every=1. A mapping-valued key (data.mixture) is still replaced whole."""
    file = cfglib.load("shakespeare_char")
    cfg = cfglib.load("shakespeare_char", ["train.steps=4", "train={log_every: 1}", "model={d_model: 64}"])
    assert (cfg.train.steps, cfg.train.log_every, cfg.train.global_batch) == (4, 1, file.train.global_batch)
    assert (cfg.model.d_model, cfg.model.n_layers) == (64, file.model.n_layers)
    assert cfg == cfglib.load("shakespeare_char", ["train.steps=4", "train.log_every=1", "model.d_model=64"])
    mixed = cfglib.load(None, ["data.mode=packed", "data.mixture={a.txt: 1}", "data.mixture={b.txt: 2}"])
    assert mixed.data.mixture == {"b.txt": 2}


@pytest.mark.parametrize("override, key", [
    ("sharding.extra_rules={embed: [null], embed: [fsdp]}", "embed"),
    ("data.mixture={a.txt: 1, a.txt: 2}", "a.txt"),
    ("train={steps: 3, steps: 4}", "steps"),
])
def test_a_key_given_twice_in_an_override_value_is_named(override, key):
    with pytest.raises(ConfigError) as err:
        cfglib.load(None, [override])
    assert str(err.value) == f"override '{override}': duplicate key '{key}' (YAML alone would silently keep the last)"


def test_a_mapping_written_without_a_space_after_the_colon_gets_a_hint():
    with pytest.raises(ConfigError) as err:
        cfglib.load(None, ["data.mode=packed", "data.mixture={a.jsonl:3, b.txt: 1}"])
    assert str(err.value) == ("data.mixture.a.jsonl:3: Input should be a valid number; YAML reads 'a.jsonl:3' as one "
                              "key without a value: write 'a.jsonl: 3', with a space (got None)")


def test_yaml_files_may_use_merge_keys_empty_sections_but_not_dotted_keys(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  <<: &base {steps: 7, log_every: 1}\n  steps: 5\nmodel:\n#  d_model: 64\n")
    cfg = cfglib.load(str(f), ["model.n_layers=2"])
    assert (cfg.train.steps, cfg.train.log_every, cfg.model.n_layers) == (5, 1, 2)
    assert cfglib.load(str(f)).model == cfglib.load(None).model  # 'model:' with its keys commented out
    f.write_text("train.steps: 2\n")
    with pytest.raises(ConfigError) as err:
        cfglib.load(str(f))
    assert str(err.value) == ("unknown config key 'train.steps'; dotted keys are for key=value overrides: in a "
                              "YAML file, nest it ('train:' with 'steps:' indented below it)")
    f.write_text("train:\n  steps: 2\n---\ntrain:\n  steps: 3\n")
    with pytest.raises(ConfigError) as err:
        cfglib.load(str(f))
    assert str(err.value) == (f"config file {f}, line 3, column 1: invalid YAML: expected a single document in "
                              f"the stream, but found another document")


def test_overrides_may_precede_config():
    assert parsed(["train.steps=3", "--config", "c.yaml", "run.dir=x"]) == ("c.yaml", ["train.steps=3", "run.dir=x"])


def test_shipped_configs_validate_and_their_data_exists():
    """Every file in configs/ loads, and a data.path it names exists (relative to the checkout, as the
    README runs them)."""
    from pathlib import Path
    repo = Path(__file__).resolve().parents[2]
    names = sorted(p.stem for p in (repo / "configs").glob("*.yaml"))
    assert names == ["digits_mlp", "llama_1b_h200", "llama_25m", "moe_shakespeare", "shakespeare_char"]
    for name in names:
        cfg = cfglib.load(name)
        if cfg.data.path != "stdlib":
            assert (repo / cfg.data.path).is_file(), (name, cfg.data.path)


@pytest.mark.parametrize("value", ["0", "-1", "inf"])
def test_compile_timeout_is_a_positive_number_of_seconds_or_null(value):
    with pytest.raises(ConfigError) as err:
        cfglib.load(None, [f"train.compile_timeout_s={value}"])
    why = "a finite number" if value == "inf" else "a positive number of seconds (null: no limit)"
    assert str(err.value) == f"train.compile_timeout_s: must be {why}, got {float(value)}"
    assert cfglib.load(None, ["train.compile_timeout_s=null"]).train.compile_timeout_s is None
