"""Pipeline keys without a pipeline are named, not ignored; the layer-split hint names only stage counts the
devices can hold. At 5eb7ae3 ``pipeline.microbatches`` and ``pipeline.schedule`` with ``mesh.stage=1`` were
silently ignored, and 3 layers on 8 devices with ``mesh.stage=2`` suggested ``mesh.stage in [3]``, which then
failed as a mesh error."""
import pytest

from jaxtrain.config import MESH_AXES, check_against_mesh
from jaxtrain.errors import ConfigError

ONE = {a: 1 for a in MESH_AXES}


@pytest.mark.parametrize("override, message", [
    ("pipeline.microbatches=4", "pipeline.microbatches: 4 without a pipeline (mesh.stage=1); set mesh.stage to the "
                                "number of stages, or leave pipeline.microbatches at 0"),
    ("pipeline.schedule=1f1b", "pipeline.schedule: 1f1b without a pipeline (mesh.stage=1); set mesh.stage to the "
                               "number of stages, or leave pipeline.schedule at gpipe"),
])
def test_a_pipeline_key_without_stages_is_named(small_cfg, override, message):
    with pytest.raises(ConfigError) as e:
        check_against_mesh(small_cfg(override), {**ONE, "data": 8}, "cpu")
    assert str(e.value) == message
    check_against_mesh(small_cfg(override, "train.global_batch=16"), {**ONE, "data": 4, "stage": 2}, "cpu")  # fine


def test_the_layer_split_hint_names_only_stage_counts_the_devices_hold(small_cfg):
    with pytest.raises(ConfigError) as e:  # 3 layers: 3 stages would split them, but 8 devices hold no 3
        check_against_mesh(small_cfg("model.n_layers=3"), {**ONE, "data": 4, "stage": 2}, "cpu")
    assert str(e.value) == ("model.n_layers: 3 layers do not split evenly over mesh.stage=2 = 2 chunks; "
                            "use n_layers in [2, 4]")
    with pytest.raises(ConfigError) as e:  # 6 devices hold 3 stages
        check_against_mesh(small_cfg("model.n_layers=3", "train.global_batch=6"), {**ONE, "data": 3, "stage": 2}, "cpu")
    assert str(e.value).endswith("use n_layers in [2, 4], or mesh.stage in [3]")
