"""``offload.activations`` takes only what the model tags as activations, the same on any device count: the
kernels' tag of their matmul outputs (for remat) is not one. At 5eb7ae3 a one-device CPU run accepted
the internal ``cpu_matmul`` tag that 8 devices refused."""
import jax
import pytest

from jaxtrain.errors import ConfigError
from jaxtrain.kernels.ops import MATMUL_NAME
from jaxtrain.parallel import offload
from jaxtrain.train import setup

TAGS = "attn_in, attn_out, mlp_hidden, mlp_in, qkv"


def test_the_kernels_tag_is_not_an_activation_to_offload():
    with pytest.raises(ConfigError) as e:
        offload.check_names([MATMUL_NAME], {MATMUL_NAME, "mlp_hidden"}, "llama")
    assert str(e.value) == "offload.activations: 'kernel_matmul' not tagged by model 'llama'; it tags: mlp_hidden"


@pytest.mark.parametrize("devices", [1, 8])
def test_a_run_refuses_it_on_one_device_as_on_eight(small_cfg, devices):
    cfg = small_cfg("model.remat=full", f"offload.activations=[{MATMUL_NAME}]", f"mesh.data={devices}")
    with pytest.raises(ConfigError) as e:
        setup(cfg, jax.devices()[:devices], vocab=256)
    assert str(e.value) == f"offload.activations: '{MATMUL_NAME}' not tagged by model 'llama'; it tags: {TAGS}"
