"""HF Llama safetensors export and import: names, layouts, config.json, exact round trip, no pickle."""
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from jaxtrain.checkpoint import checkpointer as ckptlib
from jaxtrain.train import hf as exportlib
from jaxtrain.cli import export as export_cli
from jaxtrain.config import ConfigError
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
                  "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": tied,
                  "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02, "torch_dtype": "bfloat16"}
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


def test_import_into_a_different_model_lists_every_problem(small_cfg, tmp_path):
    cfg = small_cfg("model.vocab_size=256", "mesh.data=1")
    run_dir, _ = saved_run(cfg, jax.devices()[:1])
    exportlib.export(run_dir, tmp_path / "hf")
    wrong = small_cfg("model.vocab_size=256", "model.d_ff=96", "model.n_layers=3", run_dir="wrong")
    with pytest.raises(ConfigError) as err:
        exportlib.import_hf(tmp_path / "hf", wrong)
    lines = str(err.value).splitlines()
    assert lines[0] == "model: the safetensors do not fit this model config:"
    assert "  model.layers.0.mlp.down_proj.weight: shape (64, 128), expected (64, 96)" in lines
    assert "  model.layers.2.self_attn.q_proj.weight: missing (expected (64, 64))" in lines
    assert len(lines) == 1 + 3 * 2 + 9  # gate/up/down of 2 layers wrong, all 9 of layer 2 missing


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
