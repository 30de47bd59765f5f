"""Every key that only a feature reads (jaxtrain.config.features.GATED), set while that feature is off:
a ConfigError naming the key, the feature and the default, exit 2 from the command line; the same key
with its feature on loads. The pipeline keys without a stage are checked with the mesh (test_config)."""
import subprocess
import sys
from pathlib import Path

import pytest

from jaxtrain import config as cfglib
from jaxtrain.config.features import GATED
from jaxtrain.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
# A value other than the default for each key, and the overrides that turn its feature on.
CASES = {
    "metrics.wandb_project": ("other", ["metrics.sinks=[console,wandb]"]),
    "metrics.wandb_mode": ("online", ["metrics.sinks=[console,wandb]"]),
    "profile.start_step": (3, ["profile.steps=2"]),
    "data.text_field": ("body", ["data.mode=packed"]),
    "data.separator": ("<|doc|>", ["data.mode=packed"]),
    "data.prefetch": (8, ["data.mode=packed"]),
    "data.bos_token": ("<s>", ["data.mode=packed", "data.add_bos=true"]),
    "data.eos_token": ("</s>", ["data.mode=packed", "data.add_eos=true"]),
    "checkpoint.s3_endpoint": ("http://127.0.0.1:9000", ["checkpoint.dir=s3://bucket/run"]),
    "checkpoint.best_metric": ("val_accuracy", ["checkpoint.keep_best=2"]),
    "checkpoint.best_mode": ("max", ["checkpoint.keep_best=2"]),
    "distributed.coordinator_address": ("10.0.0.1:1234", ["distributed.mode=on", "distributed.num_processes=2",
                                                          "distributed.process_id=0"]),
    "distributed.num_processes": (2, ["distributed.mode=on", "distributed.coordinator_address=10.0.0.1:1234",
                                      "distributed.process_id=0"]),
    "distributed.process_id": (0, ["distributed.mode=on", "distributed.coordinator_address=10.0.0.1:1234",
                                   "distributed.num_processes=2"]),
    "distributed.init_timeout_s": (60.0, ["distributed.mode=auto"]),
    "distributed.peer_timeout_s": (60.0, ["distributed.mode=auto"]),
    "distributed.stop_check_every": (5, ["distributed.mode=auto"]),
}
OFF = {"distributed": ["distributed.mode=off"]}  # the sections whose feature is on by default


def test_every_gated_key_has_a_case():
    assert sorted(CASES) == sorted(g.key for g in GATED)


@pytest.mark.parametrize("gated", GATED, ids=[g.key for g in GATED])
def test_a_gated_key_without_its_feature_is_named(gated):
    value, turn_on = CASES[gated.key]
    section, name = gated.key.split(".")
    default = getattr(getattr(cfglib.Config(), section), name)
    off = OFF.get(section, [])
    with pytest.raises(ConfigError) as err:
        cfglib.load(None, [*off, f"{gated.key}={value}"])
    shown = value if not isinstance(default, float) else float(value)
    assert str(err.value) == (f"{gated.key}: {shown!r} is read only with {gated.needs}, which this config does "
                              f"not have; turn that on, or leave {gated.key} at its default ({default!r})")
    cfg = cfglib.load(None, [*turn_on, f"{gated.key}={value}"])  # with its feature: loads
    assert getattr(getattr(cfg, section), name) == value


def test_the_command_line_exits_2_naming_the_key(tmp_path):
    done = subprocess.run([sys.executable, "-m", "jaxtrain.train", f"run.dir={tmp_path / 'r'}", "data.bos_token=<s>"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.splitlines()[-1] == (
        "error: data.bos_token: '<s>' is read only with data.add_bos=true, which this config does not have; turn "
        "that on, or leave data.bos_token at its default ('')")
    assert not (tmp_path / "r").exists()  # nothing written


@pytest.mark.parametrize("overrides, message", [
    (["data.mode=packed", "data.prefetch=0"], "data.prefetch: must be >= 1 (batches assembled ahead), got 0"),
    (["train.steps=2", "profile.steps=2", "profile.start_step=50"],
     "profile.start_step: steps 50..51 end after train.steps=2; trace steps within the run"),
])
def test_values_the_run_would_quietly_bend_are_named(overrides, message):
    """A new user's probe found both accepted: the data pipeline clamped the prefetch to 1, and a trace
    window after the last step wrote no trace."""
    with pytest.raises(ConfigError) as err:
        cfglib.load(None, overrides)
    assert str(err.value) == message
