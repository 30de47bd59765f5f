"""The HF export writes what the exported step was trained with, even after the run's config.yaml
changed a key that leaves the parameter shapes alone (a new launch with another ``model.top_k``)."""
import json

import jax

from jaxtrain.cli import export as export_cli
from jaxtrain.train import fit

MOE = ["model.family=mixtral", "model.n_layers=1", "model.n_experts=4", "model.d_ff=64", "checkpoint.every=2",
       "checkpoint.keep=5", "train.sample_tokens=0", "mesh.data=1"]


def test_an_export_takes_the_steps_own_model_keys_not_the_later_launchs(small_cfg, tmp_path, capsys):
    fit(small_cfg(*MOE, "model.top_k=2", "train.steps=2"), devices=jax.devices()[:1], quiet=True)
    fit(small_cfg(*MOE, "model.top_k=1", "train.steps=4"), devices=jax.devices()[:1], quiet=True)  # resumes at 2
    assert "top_k: 1" in (tmp_path / "run" / "config.yaml").read_text()
    capsys.readouterr()

    assert export_cli.main([str(tmp_path / "run"), str(tmp_path / "hf2"), "--step", "2"]) == 0
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())["num_experts_per_tok"] == 2
    err = capsys.readouterr().err
    assert ("note: exporting step 2 with model.top_k=2, what it was trained with (the run's config.yaml now has 1)\n"
            in err), err

    assert export_cli.main([str(tmp_path / "run"), str(tmp_path / "hf4")]) == 0  # the latest step, 4
    assert json.loads((tmp_path / "hf4" / "config.json").read_text())["num_experts_per_tok"] == 1
    assert "note: exporting" not in capsys.readouterr().err
