"""Correctness cases of the Hugging Face import: transformers 5's fused Mixtral experts, notes for
config.json keys that are not read, a tied model's copy of its embedding table, shards the index
leaves out or does not choose. Every case goes through ``python -m jaxtrain.export --import``
where its notes reach the user; transformers itself writes the fused layout and gives the logits.
"""
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file
from test_hf_parity import TOKENS, TOL, hf_model, torch_logits

from jaxtrain import config as cfglib
from jaxtrain.checkpoint.checkpointer import Checkpointer
from jaxtrain.cli import export as export_cli
from jaxtrain.errors import ConfigError
from jaxtrain.interop import hf as hflib
from jaxtrain.interop.hf_files import INDEX_FILE, WEIGHTS_FILE, load_tensors, weight_files
from jaxtrain.train import lm, setup


def imported(hf_dir, run_dir, capsys) -> tuple[dict, np.ndarray, str]:
    """(params, logits on TOKENS, stderr) of ``hf_dir`` imported by the CLI into ``run_dir``."""
    capsys.readouterr()
    assert export_cli.main(["--import", str(hf_dir), f"run.dir={run_dir}", "data.seq_len=48"]) == 0
    err = capsys.readouterr().err
    cfg = cfglib.load(str(run_dir / "config.yaml"), ["mesh.data=1"])
    s = setup(cfg, jax.devices()[:1])
    ckpt = Checkpointer(cfg, run_dir)
    try:
        state, _ = ckpt.restore(0, s.abstract_state())
    finally:
        ckpt.close()
    logits = np.asarray(s.fns.apply(state["params"], jnp.asarray(TOKENS, jnp.int32)))
    return jax.device_get(state["params"]), logits, err


def read(path) -> dict:
    """{name: numpy array} of one safetensors file (float32 files only here)."""
    with safe_open(str(path), "numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def copy_with(src, dst, tensors: dict):
    """``dst``: config.json of ``src`` and ``tensors`` as one model.safetensors."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    save_file(tensors, str(dst / WEIGHTS_FILE), metadata={"format": "pt"})
    return dst


def test_mixtral_fused_experts_import_like_per_expert_ones_and_the_halves_are_checked(tmp_path, capsys):
    model = hf_model("mixtral")
    want = torch_logits(model, TOKENS)
    model.save_pretrained(tmp_path / "per_expert")
    model.save_pretrained(tmp_path / "fused", save_original_format=False, max_shard_size="60KB")
    index = json.loads((tmp_path / "fused" / INDEX_FILE).read_text())["weight_map"]
    # transformers 5.24's fused names: [E, 2*d_ff, d] gate then up, [E, d, d_ff], and the router under mlp.
    names = {n for n in index if n.startswith("model.layers.1.")}
    assert {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.gate_up_proj",
            "model.layers.1.mlp.experts.down_proj"} <= names and not any("block_sparse_moe" in n for n in names)
    with safe_open(str(tmp_path / "fused" / index["model.layers.1.mlp.experts.gate_up_proj"]), "numpy") as f:
        gate_up = f.get_tensor("model.layers.1.mlp.experts.gate_up_proj")
    assert gate_up.shape == (4, 96, 64)
    per_expert = read(tmp_path / "per_expert" / WEIGHTS_FILE)
    np.testing.assert_array_equal(gate_up[2, :48], per_expert["model.layers.1.block_sparse_moe.experts.2.w1.weight"])

    params, logits, err = imported(tmp_path / "fused", tmp_path / "run_fused", capsys)
    base, base_logits, _ = imported(tmp_path / "per_expert", tmp_path / "run_per_expert", capsys)
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(base)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(base)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    diff = float(np.abs(logits - want).max())
    assert diff <= TOL, diff
    np.testing.assert_array_equal(logits, base_logits)
    assert ("note: config.json router_aux_loss_coef=0.001 is not read: jaxtrain weights its load-balancing loss by "
            "model.aux_loss_weight from the run's config; HF's loss is num_experts_per_tok=2 times jaxtrain's, so the "
            "same weight is model.aux_loss_weight=0.002 (an export writes router_aux_loss_coef = aux_loss_weight / "
            "top_k)\n") in err
    assert "output_router_logits" not in err  # it only asks transformers to return the router logits

    # gate and up swapped in the file: the import must not give transformers' logits.
    tensors = {}
    for shard in sorted(set(index.values())):
        tensors.update(read(tmp_path / "fused" / shard))
    for i in range(2):
        gu = tensors[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        tensors[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.concatenate([gu[:, 48:], gu[:, :48]], axis=1)
    _, swapped, _ = imported(copy_with(tmp_path / "fused", tmp_path / "swapped", tensors), tmp_path / "run_sw", capsys)
    wrong = float(np.abs(swapped - want).max())
    print(f"\nmixtral fused: max |logit diff| {diff:.2e}; with gate/up swapped {wrong:.2e}")
    assert wrong > 1000 * TOL


def test_router_aux_loss_coef_is_a_note_and_not_read():
    mixtral = {"architectures": ["MixtralForCausalLM"], "vocab_size": 32, "hidden_size": 64, "intermediate_size": 96,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_local_experts": 8, "num_experts_per_tok": 3,
               "router_aux_loss_coef": 0.02, "output_router_logits": True}
    _, keys, notes = hflib.model_keys(mixtral, 128)
    assert (keys["n_experts"], keys["top_k"]) == (8, 3) and "aux_loss_weight" not in keys
    assert notes == ["config.json router_aux_loss_coef=0.02 is not read: jaxtrain weights its load-balancing loss by "
                     "model.aux_loss_weight from the run's config; HF's loss is num_experts_per_tok=3 times "
                     "jaxtrain's, so the same weight is model.aux_loss_weight=0.06 (an export writes "
                     "router_aux_loss_coef = aux_loss_weight / top_k)"]
    _, _, notes = hflib.model_keys({k: v for k, v in mixtral.items() if k != "router_aux_loss_coef"}, 128)
    assert notes == []  # left out: nothing to say
    with pytest.raises(ConfigError, match=r"^config.json router_aux_loss_coef: expected a finite number, got 'x'$"):
        hflib.model_keys({**mixtral, "router_aux_loss_coef": "x"}, 128)
    llama = {**mixtral, "architectures": ["LlamaForCausalLM"]}  # no experts: unknown to the llama family
    _, _, notes = hflib.model_keys(llama, 128)
    assert notes == ["config.json keys not read (they change nothing jaxtrain computes, or are unknown to it): "
                     "num_experts_per_tok, num_local_experts, router_aux_loss_coef"]


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    """A tiny tied LlamaForCausalLM saved by transformers (one file: no lm_head.weight in it)."""
    path = tmp_path_factory.mktemp("tied") / "hf"
    hf_model("llama_tied").save_pretrained(path)
    return path


def test_a_tied_models_exact_lm_head_copy_is_a_note(tied_dir, tmp_path, capsys):
    tensors = read(tied_dir / WEIGHTS_FILE)
    assert "lm_head.weight" not in tensors
    table = tensors["model.embed_tokens.weight"]
    inv_freq = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32) for i in range(2)}
    with_copy = copy_with(tied_dir, tmp_path / "copy", {**tensors, "lm_head.weight": table.copy(), **inv_freq})
    params, _, err = imported(with_copy, tmp_path / "run", capsys)
    assert "lm_head" not in params
    np.testing.assert_array_equal(np.asarray(params["embed"]["embedding"]), table)
    assert ("note: model: lm_head.weight is an exact copy of model.embed_tokens.weight and config.json ties them "
            "(tie_word_embeddings true): read once, as the embedding table\n") in err
    assert ("note: model: buffers jaxtrain recomputes from config.json are not read: "
            "model.layers.0.self_attn.rotary_emb.inv_freq, model.layers.1.self_attn.rotary_emb.inv_freq\n") in err


def test_a_tied_models_differing_lm_head_is_refused_with_the_difference(tied_dir, tmp_path, capsys):
    tensors = read(tied_dir / WEIGHTS_FILE)
    head = tensors["model.embed_tokens.weight"].copy()
    head[3, 5] += 0.25
    differing = copy_with(tied_dir, tmp_path / "differ", {**tensors, "lm_head.weight": head})
    capsys.readouterr()
    assert export_cli.main(["--import", str(differing), f"run.dir={tmp_path / 'run'}", "data.seq_len=48"]) == 2
    assert capsys.readouterr().err == (
        "error: model: the safetensors do not fit this model config:\n  lm_head.weight: differs from "
        "model.embed_tokens.weight (max abs difference 0.25), but config.json ties them (tie_word_embeddings true), "
        "so a tied model has one table; set tie_word_embeddings to false to import both\n")
    assert not (tmp_path / "run").exists()
    cfg = hflib.import_config(differing, None, [f"run.dir={tmp_path / 'run'}", "data.seq_len=48"])[0]
    conv, mcfg = hflib.converter(cfg), lm.model_config(cfg, 96)
    with pytest.raises(ConfigError) as err:
        conv.from_hf({**tensors, "lm_head.weight": head[:90]}, mcfg)
    assert str(err.value).splitlines()[1] == (
        "  lm_head.weight: shape (90, 64) differs from model.embed_tokens.weight's (96, 64), but config.json ties "
        "them (tie_word_embeddings true), so a tied model has one table; set tie_word_embeddings to false to "
        "import both")


def shards(path, files: dict, index: dict):
    """An HF directory at ``path``: config.json of a 1-layer llama, ``files`` {name: tensors}, the index."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "tie_word_embeddings": True}))
    for name, tensors in files.items():
        save_file(tensors, str(path / name))
    (path / INDEX_FILE).write_text(json.dumps({"weight_map": index}))
    return path


def test_a_missing_shard_names_the_tensors_the_index_put_in_it(tmp_path):
    x = np.zeros((2,), np.float32)
    names = [f"model.layers.0.t{i}" for i in range(7)]
    one, two, three = (f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3))
    d = shards(tmp_path / "hf", {one: {"model.norm.weight": x}},
               {"model.norm.weight": one, **{n: two for n in names}, "lm_head.weight": three})
    with pytest.raises(ConfigError) as err:
        weight_files(d)
    assert str(err.value) == (
        f"import: {d / INDEX_FILE} names shard files missing from '{d}': {two} (the index puts 7 tensors in it: "
        f"model.layers.0.t0, model.layers.0.t1, model.layers.0.t2, model.layers.0.t3, model.layers.0.t4 and 2 "
        f"more); {three} (the index puts 1 tensor in it: lm_head.weight)")


def test_tensors_the_index_does_not_choose_are_warned_about(tied_dir, tmp_path, capsys):
    tensors = read(tied_dir / WEIGHTS_FILE)
    one, two = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    first = {n: x for n, x in tensors.items() if not n.startswith("model.layers.1.")}
    second = {n: x for n, x in tensors.items() if n.startswith("model.layers.1.")}
    stale = second["model.layers.1.input_layernorm.weight"] + 1.0  # an old copy in shard 1: not the index's
    d = tmp_path / "hf"
    d.mkdir()
    shutil.copy(tied_dir / "config.json", d / "config.json")
    save_file({**first, "model.layers.1.input_layernorm.weight": stale, "old.bias": stale}, str(d / one))
    save_file(second, str(d / two))
    (d / INDEX_FILE).write_text(json.dumps({"weight_map": {**{n: one for n in first}, **{n: two for n in second}}}))
    notes = []
    load_tensors(d, weight_files(d), notes)
    assert notes == [
        f"warning: {one} holds 1 tensor that {INDEX_FILE} maps to another shard, whose copy is read: "
        f"model.layers.1.input_layernorm.weight (index: {two})",
        f"warning: {one} holds 1 tensor that {INDEX_FILE} does not name, not read: old.bias"]
    params, _, err = imported(d, tmp_path / "run", capsys)  # the notes reach the CLI's user, as warnings
    assert "".join(f"{n}\n" for n in notes) in err
    np.testing.assert_array_equal(np.asarray(params["layers"][1]["attn_norm"]["scale"]),
                                  second["model.layers.1.input_layernorm.weight"])
