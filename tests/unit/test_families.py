"""Model families: the registry, the config union discriminated by model.family, and a second family
that is only a folder (tests/tiny_family) plus one registry line."""
import ast
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from jaxtrain import config as cfglib
from jaxtrain.analysis.explain import explain
from jaxtrain.errors import CheckpointError, ConfigError
from jaxtrain.interop import hf
from jaxtrain.kernels import registry as kernel_registry
from jaxtrain.models import registry
from jaxtrain.train import fit

REPO = Path(__file__).resolve().parent.parent
TINY = ["model.family=tinylm", "model.width=32", "model.hidden=64", "data.tokenizer=byte", "data.seq_len=32",
        "train.global_batch=8", "train.log_every=1", "train.eval_every=1000", "train.eval_batches=2",
        "optimizer.warmup_steps=2", "optimizer.lr=0.05", "run.progress=false"]


@pytest.fixture
def tiny(monkeypatch, tmp_path, corpus_path):
    monkeypatch.setitem(registry.FAMILIES, "tinylm", "tiny_family")  # the one registry line

    def make(*overrides, run_dir="run"):
        return cfglib.load(None, [*TINY, f"data.path={corpus_path}", f"run.dir={tmp_path / run_dir}", *overrides])
    return make


def test_a_new_family_is_a_folder_and_one_registry_line(tiny, tmp_path):
    eight = ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "checkpoint.every=3")
    full = fit(tiny("train.steps=6", *eight, run_dir="full"), quiet=True)
    one = fit(tiny("train.steps=6", "mesh.data=1", "checkpoint.enabled=false", run_dir="one"),
              devices=jax.devices()[:1], quiet=True)
    losses = [full.losses[s] for s in range(1, 7)]
    assert losses[-1] < losses[0] - 0.3  # it learns
    np.testing.assert_allclose(losses, [one.losses[s] for s in range(1, 7)], rtol=1e-4)  # 8 devices == 1
    # Its own FLOPs formula gives MFU; its own keys are recorded in the run directory.
    assert all(r["mfu"] is not None and r["mfu"] > 0 for r in full.rows if "loss" in r)
    saved = yaml.safe_load((full.run_dir / "config.yaml").read_text())["model"]
    assert saved == {"family": "tinylm", "vocab_size": 0, "width": 32, "hidden": 64}
    spec = full.state["params"]["embed"].sharding.spec
    assert spec == jax.sharding.PartitionSpec("tensor", "fsdp")  # ('vocab', 'embed') under fsdp_tp

    # Resume: 3 steps, then the same command to 6, equals the uninterrupted run bit for bit.
    fit(tiny("train.steps=3", "optimizer.decay_steps=6", *eight, run_dir="resumed"), quiet=True)
    second = fit(tiny("train.steps=6", *eight, run_dir="resumed"), quiet=True)
    assert second.start_step == 3 and [second.losses[s] for s in (4, 5, 6)] == losses[3:]
    with pytest.raises(ConfigError, match=r"^model.family: 'tinylm' has no Hugging Face converter"):
        hf.export(full.run_dir, tmp_path / "hf")
    # The run resumed as another family: refused, naming the family change first.
    llama = cfglib.load(None, ["data.tokenizer=byte", "data.seq_len=32", "train.global_batch=8", "train.steps=8",
                               "run.progress=false", f"data.path={tiny().data.path}", f"run.dir={full.run_dir}",
                               *eight])
    with pytest.raises(CheckpointError) as e:
        fit(llama, quiet=True)
    assert "\nconfig keys changed since the checkpoint (use a new run.dir or the saved values):\n" \
           "  model.family: checkpoint has 'tinylm', config has 'llama'\n" in str(e.value)


def test_the_family_schema_names_unknown_keys_and_checks_values(tiny):
    with pytest.raises(ConfigError) as e:
        tiny("model.d_model=64")
    assert str(e.value) == "unknown config key 'model.d_model'; did you mean 'model.hidden'?"  # tinylm's keys
    with pytest.raises(ConfigError) as e:
        tiny("model.rope_theta=1.0")  # a llama key, not one of tinylm's
    assert str(e.value) == "unknown config key 'model.rope_theta'; did you mean 'model.width'?"
    with pytest.raises(ConfigError, match=r"^model.width: width and hidden must be >= 1, got 0, 64$"):
        tiny("model.width=0")
    with pytest.raises(ConfigError, match=r"^model.hidden: Input should be a valid integer"):
        tiny("model.hidden=wide")


def test_the_new_family_goes_through_explain_and_export_says_it_has_no_converter(tiny, tmp_path):
    cfg = tiny("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    text = explain(cfg, jax.devices(), vocab=256)
    assert text.startswith("mesh data=2 fsdp=2 tensor=2 sequence=1 expert=1 (8 devices) | rules fsdp_tp | "
                           "model tinylm | ")
    row = next(ln.split() for ln in text.splitlines() if ln.startswith("w_in "))
    assert row[:6] == ["w_in", "32x64", "(embed,", "mlp)", "(fsdp,", "tensor)"]
    (tmp_path / hf.WEIGHTS_FILE).write_bytes(b"")
    with pytest.raises(ConfigError) as e:
        hf.import_hf(tmp_path, cfg)
    assert str(e.value) == "model.family: 'tinylm' has no Hugging Face converter (its Family has no hf)"


def test_unknown_and_custom_families_are_named(tmp_path):
    with pytest.raises(ConfigError) as e:
        cfglib.load(None, ["model.family=gpt9"])
    assert str(e.value) == ("model.family: unknown family 'gpt9' (known: llama, mixtral, and custom for a model given "
                            "to jaxtrain.fit in Python)")
    custom = cfglib.load(None, ["model.family=custom", "model.options.hidden=128"])
    assert custom.model.options == {"hidden": 128}
    with pytest.raises(ConfigError) as e:
        fit(cfglib.load(None, ["model.family=custom", f"run.dir={tmp_path / 'custom'}"]))
    assert str(e.value) == ("model.family: 'custom' is a model built in Python and given to jaxtrain.fit with a "
                            "ModelSpec; from a config alone these families can be trained: llama, mixtral")
    assert not (tmp_path / "custom").exists()


def test_llama_is_the_default_family_and_found_through_the_registry():
    cfg = cfglib.load()
    assert type(cfg.model) is registry.get("llama").config and cfg.model.family == "llama"
    assert cfg.to_dict()["model"]["family"] == "llama"
    # the values come from the kernel registry (a provider may add one), checked by a validator
    assert type(cfg.model).model_fields["attention"].annotation is str
    assert set(kernel_registry.names("attention")) >= {"auto", "xla", "blockwise", "cudnn", "pallas", "ring",
                                                       "cpu_fused"}


def test_no_library_module_imports_a_family_by_name():
    """Only models/ (the family folders themselves) may import a family; everything else asks the registry."""
    families = tuple(registry.FAMILIES.values())
    offenders = []
    for path in sorted((REPO / "jaxtrain").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names] \
                if isinstance(node, ast.ImportFrom) else []
            if any(n == f or n.startswith(f + ".") for n in names for f in families):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert offenders == []


def test_a_family_in_another_package_is_found_by_its_entry_point(monkeypatch):
    from importlib import metadata
    ep = metadata.EntryPoint(name="tinylm", value="tiny_family", group=registry.ENTRY_POINTS)
    monkeypatch.setattr(registry.metadata, "entry_points",
                        lambda group: [ep] if group == registry.ENTRY_POINTS else [])
    assert registry.names() == ["llama", "mixtral", "tinylm"]
    cfg = cfglib.load(None, ["model.family=tinylm", "model.width=16"])
    assert (type(cfg.model).__name__, cfg.model.width) == ("TinyConfig", 16)


def test_a_built_in_family_is_found_without_scanning_the_installed_packages(monkeypatch):
    def scan(group):  # ~10 ms a call over a full environment, several calls per run
        raise AssertionError(f"scanned entry points of {group}")
    monkeypatch.setattr(registry.metadata, "entry_points", scan)
    assert registry.get("llama").name == "llama"
    assert type(cfglib.load(None, ["model.family=mixtral"]).model).__name__ == "MixtralConfig"
