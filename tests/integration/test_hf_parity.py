"""Logit parity with ``transformers`` itself (CPU, float32), both ways, and the import's named errors.

HF -> jaxtrain: tiny random LlamaForCausalLM (GQA, rope_theta 500000, llama3 RoPE scaling; untied
in one file, tied in shards) and MixtralForCausalLM (4 experts, top-2, same attention; shards),
saved with ``save_pretrained`` and imported with ``python -m jaxtrain.export --import``; the
imported run's checkpoint must give transformers' logits. jaxtrain -> HF: a 2-step run of the
shakespeare_char config exported in shards and loaded with ``from_pretrained``; importing that
export again must give the run's model keys (a run exported with rope_theta 500000 and norm_eps
1e-6 once came back with the defaults). ``initializer_range`` / ``init_std`` are large enough
that attention is far from uniform, so a wrong RoPE would show (checked for the first case).
"""
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import yaml
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from jaxtrain import config as cfglib
from jaxtrain.checkpoint.checkpointer import Checkpointer
from jaxtrain.cli import export as export_cli
from jaxtrain.models.llama.config import RopeScaling
from jaxtrain.models.llama.model import rope_frequencies, rotary
from jaxtrain.train import fit, setup

TOL = 1e-4
SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 64}  # head_dim 16: some frequencies kept, some smoothed, some divided
OURS = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}
SIZES = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             rope_theta=500000.0, rms_norm_eps=1e-6, max_position_embeddings=256, initializer_range=0.1)
TOKENS = np.random.default_rng(0).integers(0, 96, (2, 48))


def hf_model(kind: str, rope_scaling=SCALING):
    rope_scaling = dict(rope_scaling) if rope_scaling else None  # transformers adds rope_theta to it
    torch.manual_seed(0)
    if kind == "mixtral":
        return MixtralForCausalLM(MixtralConfig(**SIZES, intermediate_size=48, num_local_experts=4,
                                                num_experts_per_tok=2, rope_scaling=rope_scaling)).eval()
    return LlamaForCausalLM(LlamaConfig(**SIZES, intermediate_size=96, tie_word_embeddings=kind == "llama_tied",
                                        rope_scaling=rope_scaling)).eval()


def torch_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def run_logits(run_dir, tokens) -> np.ndarray:
    """Logits of the latest checkpoint of ``run_dir``, built from its config.yaml on one device."""
    cfg = cfglib.load(str(run_dir / "config.yaml"), ["mesh.data=1"])
    s = setup(cfg, jax.devices()[:1])
    ckpt = Checkpointer(cfg, run_dir)
    try:
        state, _ = ckpt.restore(ckpt.restorable()[-1], s.abstract_state())
    finally:
        ckpt.close()
    return np.asarray(s.fns.apply(state["params"], jnp.asarray(tokens, jnp.int32)))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """{kind: (save_pretrained directory, transformers' logits on TOKENS)}: the untied llama in one
    file, the tied llama and the mixtral in shards (small max_shard_size: an index)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for kind, shard in (("llama", None), ("llama_tied", "40KB"), ("mixtral", "60KB")):
        model = hf_model(kind)
        model.save_pretrained(root / kind, **({"max_shard_size": shard} if shard else {}))
        out[kind] = (root / kind, torch_logits(model, TOKENS))
    return out


@pytest.mark.parametrize("kind", ["llama", "llama_tied", "mixtral"])
def test_transformers_models_import_with_the_same_logits(hf_dirs, tmp_path, kind):
    hf_dir, want = hf_dirs[kind]
    assert (hf_dir / "model.safetensors.index.json").is_file() == (kind != "llama")
    assert export_cli.main(["--import", str(hf_dir), f"run.dir={tmp_path / 'run'}", "data.seq_len=48"]) == 0
    model = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"]
    assert {k: model[k] for k in ("family", "vocab_size", "d_model", "n_heads", "n_kv_heads", "rope_theta",
                                  "rope_scaling", "norm_eps", "tie_embeddings", "max_positions")} == {
        "family": "mixtral" if kind == "mixtral" else "llama", "vocab_size": 96, "d_model": 64, "n_heads": 4,
        "n_kv_heads": 2, "rope_theta": 500000.0, "rope_scaling": OURS, "norm_eps": 1e-6,
        "tie_embeddings": kind == "llama_tied", "max_positions": 256}
    if kind == "mixtral":
        assert (model["n_experts"], model["top_k"], model["d_ff"]) == (4, 2, 48)
    diff = float(np.abs(run_logits(tmp_path / "run", TOKENS) - want).max())
    print(f"\n{kind}: transformers -> jaxtrain, max |logit diff| = {diff:.2e} (logits up to {np.abs(want).max():.2f})")
    assert diff <= TOL
    if kind == "llama":  # the comparison can see the RoPE: without the scaling the logits move by far more
        assert np.abs(torch_logits(hf_model(kind, rope_scaling=None), TOKENS) - want).max() > 1000 * TOL
    else:  # and back out: the imported run's export loads in transformers with the same logits
        assert export_cli.main([str(tmp_path / "run"), str(tmp_path / "out")]) == 0
        back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True, dtype=torch.float32)
        assert type(back).__name__ == ("MixtralForCausalLM" if kind == "mixtral" else "LlamaForCausalLM")
        diff = float(np.abs(torch_logits(back.eval(), TOKENS) - want).max())
        print(f"{kind}: ... -> jaxtrain -> transformers, max |logit diff| = {diff:.2e}")
        assert diff <= TOL


def test_a_jaxtrain_run_exports_to_transformers_and_imports_back(tmp_path, corpus_path, capsys):
    model_keys = ["model.d_model=64", "model.n_layers=1", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=96",
                  "model.init_std=0.1", "model.rope_theta=500000", "model.norm_eps=1e-6",
                  "model.rope_scaling.factor=8", "model.rope_scaling.original_max_position_embeddings=16"]
    cfg = cfglib.load("shakespeare_char", [f"data.path={corpus_path}", f"run.dir={tmp_path / 'run'}", *model_keys,
                                           "train.steps=2", "train.global_batch=4", "train.eval_batches=1",
                                           "train.sample_tokens=0", "mesh.data=1", "run.progress=false"])
    fit(cfg, devices=jax.devices()[:1], quiet=True)
    out = tmp_path / "hf"
    assert export_cli.main([str(tmp_path / "run"), str(out), "--max-shard-size", "40KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    hf_cfg = json.loads((out / "config.json").read_text())
    assert (hf_cfg["rope_theta"], hf_cfg["rms_norm_eps"], hf_cfg["max_position_embeddings"]) == (500000.0, 1e-6, 64)
    assert hf_cfg["rope_scaling"] == {**SCALING, "original_max_position_embeddings": 16}

    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32).eval()
    assert hf.config.rope_parameters["rope_type"] == "llama3" and hf.config.rms_norm_eps == 1e-6
    tokens = np.random.default_rng(1).integers(0, hf_cfg["vocab_size"], (2, 64))
    want = run_logits(tmp_path / "run", tokens)
    diff = float(np.abs(torch_logits(hf, tokens) - want).max())
    with capsys.disabled():
        print(f"\nllama: jaxtrain -> transformers, max |logit diff| = {diff:.2e} (logits up to "
              f"{np.abs(want).max():.2f})")
    assert diff <= TOL
    plain = AutoConfig.from_pretrained(out, local_files_only=True)
    plain.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    unscaled = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, config=plain, dtype=torch.float32)
    assert np.abs(torch_logits(unscaled.eval(), tokens) - want).max() > 1000 * TOL  # the scaling shows

    # Back in, with the config the run used: config.json's model keys replace the file's, named.
    capsys.readouterr()
    assert export_cli.main(["--import", str(out), "--config", "shakespeare_char", f"data.path={corpus_path}",
                            f"run.dir={tmp_path / 'back'}", "train.global_batch=16"]) == 0
    assert "note: model.d_model: 64 from config.json replaces the config file's 128\n" in capsys.readouterr().err
    before = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"]
    after = yaml.safe_load((tmp_path / "back" / "config.yaml").read_text())["model"]
    # init_std is not a model key of config.json (initializer_range only matters for a fresh init).
    assert after == {**before, "vocab_size": hf_cfg["vocab_size"], "max_positions": 64, "init_std": 0.02}
    assert (after["rope_theta"], after["norm_eps"]) == (500000.0, 1e-6)


def test_llama3_frequencies_are_transformers_and_none_changes_nothing():
    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0, max_position_embeddings=131072,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    got = rope_frequencies(128, 500000.0, RopeScaling())  # the defaults are Llama 3.1's numbers
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-6)
    # No scaling: bit for bit the plain rotary of before (theta^(-i/half), cos/sin per half), as compiled.
    @jax.jit
    def plain(x, pos):
        inv = 1.0 / (10000.0 ** (jnp.arange(8, dtype=jnp.float32) / 8))
        ang = pos.astype(jnp.float32)[..., None, None] * inv
        cos, sin = jnp.cos(ang), jnp.sin(ang)
        return jnp.concatenate([x[..., :8] * cos - x[..., 8:] * sin, x[..., 8:] * cos + x[..., :8] * sin], axis=-1)

    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 3, 16)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(8), (2, 8))
    ours = jax.jit(lambda x, pos: rotary(x, pos, 10000.0, None))
    np.testing.assert_array_equal(np.asarray(ours(x, pos)), np.asarray(plain(x, pos)))


def _edited(src, dst, **changes):
    """A copy of config.json of ``src`` into ``dst`` with ``changes`` (no weights: refused before them)."""
    dst.mkdir()
    hf = json.loads((src / "config.json").read_text())
    hf.update(changes)
    (dst / "config.json").write_text(json.dumps(hf))
    return dst


def test_named_import_errors_exit_2_and_write_nothing(hf_dirs, tmp_path, capsys):
    llama = hf_dirs["llama"][0]
    cases = [
        (_edited(llama, tmp_path / "gpt2", architectures=["GPT2LMHeadModel"]), [],
         "config.json architectures: 'GPT2LMHeadModel' is not supported (supported: LlamaForCausalLM, "
         "MistralForCausalLM, MixtralForCausalLM)"),
        (_edited(llama, tmp_path / "yarn", rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                             "rope_theta": 500000.0}), [],
         "config.json rope_parameters.rope_type: 'yarn' is not supported (supported: default, llama3)"),
        (llama, ["model.rope_theta=10000"],
         f"model.rope_theta: the override 10000.0 contradicts 500000.0 from {llama / 'config.json'} (an import "
         f"takes the model keys from config.json; leave the override out)"),
        (llama, ["model.rope_scaling.factor=4"],
         f"model.rope_scaling.factor: the override 4.0 contradicts 8.0 from {llama / 'config.json'} (an import "
         f"takes the model keys from config.json; leave the override out)"),
    ]
    for hf_dir, overrides, message in cases:
        capsys.readouterr()
        assert export_cli.main(["--import", str(hf_dir), f"run.dir={tmp_path / 'run'}", *overrides]) == 2
        assert capsys.readouterr().err == f"error: {message}\n"
        assert not (tmp_path / "run").exists()
    shutil.rmtree(tmp_path / "gpt2")
