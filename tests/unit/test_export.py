"""HF Llama safetensors export and import: names, layouts, config.json, exact round trip, no pickle."""
import hashlib
import json
import struct
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from jaxtrain.checkpoint import checkpointer as ckptlib
from jaxtrain.cli import export as export_cli
from jaxtrain.errors import ConfigError
from jaxtrain.interop import hf as exportlib
from jaxtrain.models import registry
from jaxtrain.train import rundir, setup


def saved_run(cfg, devices, step=3):
    """A run dir whose committed checkpoint ``step`` holds freshly initialised (random) params."""
    state = setup(cfg, devices, vocab=256).fns.init()
    with rundir.opened(cfg) as run_dir:
        rundir.write_config_file(cfg, run_dir)
        ckpt = ckptlib.Checkpointer(cfg, run_dir)
        ckpt.save(step, state, {})
        ckpt.close()
    return run_dir, jax.device_get(state["params"])


@pytest.mark.parametrize("tied", [False, True])
def test_export_names_layouts_and_exact_round_trip(small_cfg, tmp_path, tied):
    extra = ("model.vocab_size=256", f"model.tie_embeddings={str(tied).lower()}")
    cfg = small_cfg(*extra, "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "model.param_dtype=bfloat16")
    run_dir, params = saved_run(cfg, jax.devices()[:4])
    # The run keeps float32 masters of its bf16 params; export writes them as bf16.
    assert {x.dtype for x in jax.tree_util.tree_leaves(params)} == {np.dtype(np.float32)}
    params = jax.tree_util.tree_map(lambda x: np.asarray(x).astype(jnp.bfloat16).astype(np.float32), params)
    out = tmp_path / "hf"
    assert export_cli.main([str(run_dir), "--step", "3", "--format", "safetensors", str(out)]) == 0

    hf = json.loads((out / "config.json").read_text())
    assert hf == {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
                  "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu", "max_position_embeddings": 32,
                  "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None, "tie_word_embeddings": tied,
                  "attention_dropout": 0.0, "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02,
                  "torch_dtype": "bfloat16", "dtype": "bfloat16"}
    with safe_open(str(out / exportlib.WEIGHTS_FILE), "flax") as f:
        names = set(f.keys())
        t = {n: np.asarray(f.get_tensor(n).astype("float32")) for n in names}
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == "bfloat16"
    hf_shapes = registry.get("llama").hf.shapes(cfg.model)
    assert names == set(hf_shapes) and ("lm_head.weight" in names) == (not tied)
    assert len(names) == 2 + 9 * 2 + (not tied)
    f32 = lambda x: np.asarray(x).astype(np.float32)  # noqa: E731
    wq, wk, wo = (f32(params["layers"][1]["attn"][k]) for k in ("wq", "wk", "wo"))
    # torch Linear [out, in]: q_proj row h*16+j is head h, dim j.
    np.testing.assert_array_equal(t["model.layers.1.self_attn.q_proj.weight"][2 * 16 + 5], wq[:, 2, 5])
    np.testing.assert_array_equal(t["model.layers.1.self_attn.k_proj.weight"].shape, (32, 64))
    np.testing.assert_array_equal(t["model.layers.1.self_attn.k_proj.weight"][16 + 3], wk[:, 1, 3])
    np.testing.assert_array_equal(t["model.layers.1.self_attn.o_proj.weight"][:, 3 * 16 + 7], wo[3, 7, :])
    np.testing.assert_array_equal(t["model.layers.0.mlp.down_proj.weight"],
                                  f32(params["layers"][0]["mlp"]["w_down"]).T)
    np.testing.assert_array_equal(t["model.layers.0.post_attention_layernorm.weight"],
                                  f32(params["layers"][0]["mlp_norm"]["scale"]))
    np.testing.assert_array_equal(t["model.embed_tokens.weight"], f32(params["embed"]["embedding"]))
    if not tied:
        np.testing.assert_array_equal(t["lm_head.weight"], f32(params["lm_head"]).T)

    # Import into a new run on another mesh: step 0 holds exactly the exported params (as float32 masters).
    cfg2 = small_cfg(*extra, "mesh.data=1", "mesh.fsdp=8", "model.param_dtype=bfloat16", run_dir="imported")
    exportlib.import_hf(out, cfg2)
    ckpt = ckptlib.Checkpointer(cfg2, cfg2.run.dir)
    assert list(ckpt.committed()) == [0]
    state, _ = ckpt.restore(0, setup(cfg2, vocab=256).abstract_state())
    ckpt.close()
    got = jax.device_get(state["params"])
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(params)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(params)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(state["step"]) == 0

    # Importing again into that run is refused before anything of it is written.
    before = {p.name: p.read_bytes() for p in Path(cfg2.run.dir).iterdir() if p.is_file()}
    with pytest.raises(ConfigError) as err:
        exportlib.import_hf(out, cfg2)
    assert str(err.value) == f"run.dir: '{cfg2.run.dir}' is not empty; give a new or empty directory"
    assert {p.name: p.read_bytes() for p in Path(cfg2.run.dir).iterdir() if p.is_file()} == before


def test_sharded_export_and_import_and_tensors_that_do_not_fit(small_cfg, tmp_path, capsys):
    cfg = small_cfg("model.vocab_size=256", "mesh.data=1")
    run_dir, params = saved_run(cfg, jax.devices()[:1])
    out = tmp_path / "hf"
    exportlib.export(run_dir, out)  # first one file, then shards over it: the single file goes
    assert export_cli.main([str(run_dir), str(out), "--max-shard-size", "20KB"]) == 0
    index = json.loads((out / exportlib.INDEX_FILE).read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(shards)
    assert n > 2 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert capsys.readouterr().out == f"wrote {n} shards, {out / exportlib.INDEX_FILE} and {out / 'config.json'}\n"
    held = {}
    for shard in shards:
        with safe_open(str(out / shard), "numpy") as f:
            sizes = {k: f.get_tensor(k).nbytes for k in f.keys()}
        assert sum(sizes.values()) <= 20_000 or len(sizes) == 1  # a bigger tensor sits alone in its shard
        held.update({k: (shard, b) for k, b in sizes.items()})
    assert index["weight_map"] == {k: v[0] for k, v in sorted(held.items())}
    assert index["metadata"]["total_size"] == sum(b for _, b in held.values()) == 4 * sum(
        np.asarray(x).size for x in jax.tree_util.tree_leaves(params))
    assert set(held) == set(registry.get("llama").hf.shapes(cfg.model))
    cfg2 = small_cfg("model.vocab_size=256", run_dir="from_shards")
    exportlib.import_hf(out, cfg2)  # the shards give back the params exactly
    ckpt = ckptlib.Checkpointer(cfg2, cfg2.run.dir)
    state, _ = ckpt.restore(0, setup(cfg2, vocab=256).abstract_state())
    ckpt.close()
    for got, want in zip(jax.tree_util.tree_leaves(jax.device_get(state["params"])),
                         jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    exportlib.export(run_dir, out)  # back to one file: the shards and index of before go
    assert sorted(p.name for p in out.iterdir()) == ["config.json", exportlib.WEIGHTS_FILE]

    # A config whose model keys differ from config.json's is refused naming each key (Python API) ...
    wrong = small_cfg("model.vocab_size=256", "model.d_ff=96", "model.n_layers=3", run_dir="wrong")
    with pytest.raises(ConfigError) as err:
        exportlib.import_hf(out, wrong)
    assert str(err.value) == (f"model.n_layers: the config has 3, {out / 'config.json'} gives 2\n"
                              f"model.d_ff: the config has 96, {out / 'config.json'} gives 128")
    # ... and tensors that do not fit config.json are listed, every one.
    hf = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**hf, "intermediate_size": 96, "num_hidden_layers": 3}))
    with pytest.raises(ConfigError) as err:
        exportlib.import_hf(out, wrong)
    lines = str(err.value).splitlines()
    assert lines[0] == "model: the safetensors do not fit this model config:"
    assert "  model.layers.0.mlp.down_proj.weight: shape (64, 128), expected (64, 96)" in lines
    assert "  model.layers.2.self_attn.q_proj.weight: missing (expected (64, 64))" in lines
    assert len(lines) == 1 + 3 * 2 + 9  # gate/up/down of 2 layers wrong, all 9 of layer 2 missing
    assert not Path(wrong.run.dir).exists()


def _hf_dir(path, weights: dict, index=None, **config):
    """A small HF directory: config.json of a 1-layer llama, ``weights`` {file: {name: array}}, an index."""
    from safetensors.numpy import save_file
    path.mkdir()
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 16,
          "num_hidden_layers": 1, "num_attention_heads": 2, **config}
    (path / "config.json").write_text(json.dumps(hf))
    for name, tensors in weights.items():
        save_file(tensors, str(path / name))
    if index is not None:
        (path / exportlib.INDEX_FILE).write_text(index if isinstance(index, str) else json.dumps(index))
    return path


def test_weight_file_problems_are_named_exit_2_and_write_nothing(tmp_path, capsys):
    one = {"model.embed_tokens.weight": np.zeros((8, 8), np.float32)}
    d = tmp_path
    cases = [
        (_hf_dir(d / "a", {"model-00001-of-00002.safetensors": one},
                 {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                                 "model.norm.weight": "model-00002-of-00002.safetensors"}}),
         f"import: {d / 'a' / exportlib.INDEX_FILE} names shard files missing from '{d / 'a'}': "
         f"model-00002-of-00002.safetensors (the index puts 1 tensor in it: model.norm.weight)"),
        (_hf_dir(d / "b", {"model-00001-of-00001.safetensors": one},
                 {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00001.safetensors",
                                 "model.norm.weight": "model-00001-of-00001.safetensors"}}),
         f"import: {exportlib.INDEX_FILE} names tensors its shards do not hold: model.norm.weight "
         f"(in model-00001-of-00001.safetensors)"),
        (_hf_dir(d / "c", {}, "{not json"), None),
        (_hf_dir(d / "d", {}, {"metadata": {}}), f"import: {d / 'd' / exportlib.INDEX_FILE} has no weight_map "
                                                 f"(tensor name -> shard file)"),
        (_hf_dir(d / "e", {}, {"weight_map": {"x": "../elsewhere.safetensors"}}),
         f"import: {d / 'e' / exportlib.INDEX_FILE}: weight_map names '../elsewhere.safetensors', which is not "
         f"a .safetensors file beside it"),
        (_hf_dir(d / "f", {}), f"import: no {exportlib.WEIGHTS_FILE} or {exportlib.INDEX_FILE} in '{d / 'f'}'"),
    ]
    (d / "f" / "pytorch_model.bin").write_bytes(b"pickle")
    cases.append((d / "f", f"import: '{d / 'f'}' holds pytorch_model.bin (a PyTorch pickle) but no "
                           f"{exportlib.WEIGHTS_FILE} or {exportlib.INDEX_FILE}; jaxtrain reads safetensors only "
                           f"(loading a pickle runs code). Save the model with transformers' save_pretrained, "
                           f"which writes safetensors, and import that"))
    cases.pop(5)
    (d / "g").mkdir()
    cases.append((d / "g", f"import: no config.json in '{d / 'g'}' (it names the architecture and its "
                           f"hyper-parameters; a Hugging Face model directory has one)"))
    (d / "h").mkdir()
    (d / "h" / "config.json").write_text("[1]")
    cases.append((d / "h", f"import: {d / 'h' / 'config.json'} is not a JSON object"))
    for hf_dir, message in cases:
        capsys.readouterr()
        assert export_cli.main(["--import", str(hf_dir), f"run.dir={d / 'run'}", "data.seq_len=8"]) == 2
        err = capsys.readouterr().err
        if message is None:
            assert err.startswith(f"error: import: {hf_dir / exportlib.INDEX_FILE} is not valid JSON (")
        else:
            assert err == f"error: {message}\n"
        assert not (d / "run").exists()


LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 2, "num_attention_heads": 4}


def test_config_json_fields_that_change_the_math_are_read_or_refused_by_name():
    family, keys, notes = exportlib.model_keys(LLAMA, 128)
    # Left out: the HF class's defaults (transformers' LlamaConfig: rms_norm_eps 1e-6, 2048 positions).
    assert (family.name, keys) == ("llama", {
        "family": "llama", "vocab_size": 32, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "d_ff": 96,
        "norm_eps": 1e-6, "tie_embeddings": False, "max_positions": 2048, "rope_theta": 10000.0,
        "rope_scaling": None})
    assert notes == []
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    ours = {"type": "llama3", **llama3}
    for hf in ({"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **llama3}},  # transformers 4
               {"rope_theta": 5e5, "rope_scaling": {"type": "llama3", **llama3}},  # older
               {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **llama3}}):  # transformers 5
        _, keys, _ = exportlib.model_keys({**LLAMA, **hf}, 128)
        assert (keys["rope_theta"], keys["rope_scaling"]) == (5e5, ours)
    _, keys, _ = exportlib.model_keys({**LLAMA, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, 8)
    assert (keys["rope_theta"], keys["rope_scaling"]) == (1e6, None)
    _, keys, notes = exportlib.model_keys({**LLAMA, "architectures": ["MistralForCausalLM"], "sliding_window": 4096,
                                           "rope_scaling": None, "my_key": 1}, 4096)
    assert keys["max_positions"] == 131072 and notes == [
        "config.json sliding_window=4096: attention over at most data.seq_len=4096 tokens equals it; keep "
        "data.seq_len <= 4096 when training this model",
        "config.json keys not read (they change nothing jaxtrain computes, or are unknown to it): my_key"]
    refused = [
        ({"attention_bias": True}, "config.json attention_bias: True is not supported (jaxtrain's layers have no "
                                   "biases)"),
        ({"mlp_bias": True}, "config.json mlp_bias: True is not supported (jaxtrain's layers have no biases)"),
        ({"hidden_act": "gelu"}, "config.json hidden_act: 'gelu' is not supported (jaxtrain computes silu)"),
        ({"head_dim": 32}, "config.json head_dim: 32 is not hidden_size / num_attention_heads = 64 / 4 (jaxtrain's "
                           "head size is model.d_model / model.n_heads)"),
        ({"attention_dropout": 0.1}, "config.json attention_dropout: 0.1 is not supported (jaxtrain has no dropout)"),
        ({"architectures": ["MistralForCausalLM"]},  # transformers' MistralConfig default window: 4096
         "config.json sliding_window: 4096 is less than data.seq_len=8192 (jaxtrain's attention is fully causal: "
         "it equals sliding-window attention only on sequences no longer than the window)"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
         "config.json rope_scaling.rope_type: 'dynamic' is not supported (supported: default, llama3)"),
        ({"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
         "config.json rope_theta: 10000.0 contradicts rope_parameters.rope_theta=500000.0"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **llama3, "low_freq_factor": 4.0}},
         "config.json rope_parameters.high_freq_factor: must be > low_freq_factor=4.0, got 4.0"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
         "config.json rope_parameters.low_freq_factor: missing (needed by rope_type llama3)"),
        ({"partial_rotary_factor": 0.5}, "config.json partial_rotary_factor: 0.5 is not supported (jaxtrain rotates "
                                         "the whole head)"),
        ({"num_attention_heads": "4"}, "config.json num_attention_heads: expected an integer >= 1, got '4'"),
        ({"hidden_size": None}, "config.json hidden_size: missing (needed for LlamaForCausalLM)"),
        ({"architectures": "LlamaForCausalLM"}, "config.json architectures: expected a list naming the model class "
                                                "(e.g. [\"LlamaForCausalLM\"]), got 'LlamaForCausalLM'"),
    ]
    for change, message in refused:
        with pytest.raises(ConfigError) as err:
            exportlib.model_keys({**LLAMA, **change}, 8192)
        assert str(err.value) == message


def test_rope_scaling_keys_from_the_command_line(small_cfg):
    cfg = small_cfg("model.rope_scaling.factor=16")  # one key: the others keep Llama 3.1's numbers
    assert cfg.model.rope_scaling.model_dump() == {"type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert small_cfg("model.rope_scaling.type=llama3", "model.rope_scaling=null").model.rope_scaling is None
    for override, message in [
            ("model.rope_scaling.type=yarn", "model.rope_scaling.type: Input should be 'llama3' (got 'yarn')"),
            ("model.rope_scaling.high_freq_factor=1",
             "model.rope_scaling.high_freq_factor: must be > low_freq_factor=1.0, got 1.0"),
            ("model.rope_scaling.factor=0.5", "model.rope_scaling.factor: must be >= 1 (it stretches wavelengths), "
                                              "got 0.5"),
            ("model.rope_scaling.original_max_position_embeddings=0",
             "model.rope_scaling.original_max_position_embeddings: must be > 0, got 0"),
            ("model.rope_scaling.fator=2", "model.rope_scaling.fator: Extra inputs are not permitted (got 2)"),
            ("model.rope_theta=0", "model.rope_theta: must be a finite number > 0, got 0.0")]:
        with pytest.raises(ConfigError) as err:
            small_cfg(override)
        assert str(err.value) == message


def _hashes(out: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())}


def test_exports_of_one_step_are_byte_identical(small_cfg, tmp_path):
    cfg = small_cfg("model.vocab_size=256", "mesh.data=1")
    run_dir, _ = saved_run(cfg, jax.devices()[:1])
    hashes = []
    for out in (tmp_path / "a", tmp_path / "b"):  # two directories, a second apart: nothing of either shows
        assert export_cli.main([str(run_dir), str(out), "--max-shard-size", "20KB"]) == 0
        hashes.append(_hashes(out))
        time.sleep(1.1)
    assert len(hashes[0]) > 3 and hashes[0] == hashes[1]
    # safetensors keeps the metadata in a HashMap (a random order per write): written sorted, first.
    shard = sorted((tmp_path / "a").glob("model-*.safetensors"))[0].read_bytes()
    header = json.loads(shard[8:8 + struct.unpack("<Q", shard[:8])[0]])
    assert list(header)[0] == "__metadata__" and header["__metadata__"] == {"format": "pt", "jaxtrain_step": "3"}
    assert list(header["__metadata__"]) == ["format", "jaxtrain_step"]
    from jaxtrain.interop.hf_files import write_weights
    tensors = {"b": np.arange(6, dtype=np.float32).reshape(2, 3), "a": np.ones(4, jnp.bfloat16)}
    meta = {"zeta": "1", "format": "pt", "alpha": "2", "jaxtrain_step": "3"}  # 24 orders a HashMap may pick
    seen = set()
    for i in range(6):
        (tmp_path / f"w{i}").mkdir()
        write_weights(tensors, tmp_path / f"w{i}", 10 ** 6, meta)
        seen.add(_hashes(tmp_path / f"w{i}")[exportlib.WEIGHTS_FILE])
    assert len(seen) == 1
    with safe_open(str(tmp_path / "w0" / exportlib.WEIGHTS_FILE), "numpy") as f:  # still a valid file
        assert f.metadata() == meta and np.array_equal(f.get_tensor("b"), tensors["b"])


def test_shard_sizes():
    from jaxtrain.interop.hf_files import parse_size
    assert [parse_size(s) for s in ("5GB", "2GiB", "200KB", "1.5MB", "123", 7)] == [
        5 * 10 ** 9, 2 * 2 ** 30, 200_000, 1_500_000, 123, 7]
    for bad in ("5 parsecs", "0", "-1KB"):
        with pytest.raises(ConfigError, match=r"^--max-shard-size: "):
            parse_size(bad)


def test_scanned_layers_export_and_import_like_the_unscanned_layout(small_cfg, tmp_path):
    # Same seed: the stacked layout starts from the same values (models/llama.py), so both runs
    # must write byte-identical tensors, and importing into a scanned config must re-stack them.
    outs = {}
    for scan in ("false", "true"):
        cfg = small_cfg("model.vocab_size=256", "mesh.data=1", f"model.scan_layers={scan}", run_dir=f"run_{scan}")
        run_dir, params = saved_run(cfg, jax.devices()[:1])
        outs[scan] = tmp_path / f"hf_{scan}"
        assert export_cli.main([str(run_dir), str(outs[scan])]) == 0
    assert params["layers"]["attn"]["wq"].shape == (2, 64, 4, 16)  # the scanned run's: stacked
    with safe_open(str(outs["false"] / exportlib.WEIGHTS_FILE), "flax") as a, \
            safe_open(str(outs["true"] / exportlib.WEIGHTS_FILE), "flax") as b:
        assert set(a.keys()) == set(b.keys())
        for name in a.keys():
            np.testing.assert_array_equal(np.asarray(a.get_tensor(name)), np.asarray(b.get_tensor(name)), name)
    cfg = small_cfg("model.vocab_size=256", "mesh.data=1", "model.scan_layers=true", run_dir="imported")
    run_dir = exportlib.import_hf(outs["false"], cfg, jax.devices()[:1])
    ckpt = ckptlib.Checkpointer(cfg, run_dir)
    state, _ = ckpt.restore(0, setup(cfg, jax.devices()[:1], vocab=256).abstract_state())
    ckpt.close()
    for got, want in zip(jax.tree_util.tree_leaves(state["params"]), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
