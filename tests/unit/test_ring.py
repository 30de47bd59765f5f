"""Ring attention over the `sequence` mesh axis (zig-zag layout) on 4 and 8 simulated devices."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_helpers import assert_matches_reference, corpus_windows, inputs
from conftest import put_windows
from jax.sharding import AxisType, Mesh

from jaxtrain.analysis import collectives
from jaxtrain.config import MESH_AXES
from jaxtrain.errors import RingAttentionError
from jaxtrain.kernels.xla import ring
from jaxtrain.parallel.activations import activation_sharding
from jaxtrain.parallel.rules import Rules
from jaxtrain.train import setup

RULES = Rules("test_sp", {"batch": [("data",)], "length": [("sequence",)], "heads": [None],
                          "kv_heads": [None], "kv": [None]})


def sequence_mesh(n, data=1):
    devices = np.asarray(jax.devices()[:n * data]).reshape(data, 1, 1, n, 1, 1)
    return Mesh(devices, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def ring_on(mesh):
    def fn(q, k, v, qseg=None, kvseg=None, causal=True):
        with activation_sharding(RULES, mesh):
            return ring.ring_attention(q, k, v, qseg, causal=causal)
    return fn


@pytest.mark.parametrize("n,data,causal,packed", [(4, 2, True, True), (8, 1, True, True), (4, 1, False, True),
                                                  (8, 1, True, False)])
def test_ring_equals_full_attention(n, data, causal, packed):
    q, k, v, do = inputs(2, 4 * n, 4 * n, 4, 2, 16)
    seg = jnp.asarray(np.sort(np.random.default_rng(n).integers(0, 3, (2, 4 * n))), jnp.int32) if packed else None
    assert_matches_reference(ring_on(sequence_mesh(n, data)), q, k, v, do, seg, seg, causal=causal)


def test_ring_rejects_indivisible_length():
    q, k, v, _ = inputs(1, 24, 24, 2, 2, 16)
    with pytest.raises(RingAttentionError, match="length 24 .* not divisible by 2 \\* mesh axis sequence = 16"):
        jax.jit(ring_on(sequence_mesh(8)))(q, k, v)


def test_ring_training_matches_single_device(small_cfg, corpus_path):
    # Five real train steps on the same token windows: rule set sp on mesh data=2 x sequence=4 with
    # ring attention, against one device with XLA attention.
    windows = corpus_windows(corpus_path)
    setups = {"one": (("mesh.data=1", "model.attention=xla"), "fsdp_tp", jax.devices()[:1]),
              "ring": (("mesh.data=2", "mesh.sequence=4", "model.attention=ring"), "sp", jax.devices())}
    losses = {}
    for name, (overrides, rules, devices) in setups.items():
        cfg = small_cfg(*overrides, "model.n_layers=1", "sharding.rules=" + rules)
        fns = setup(cfg, devices, vocab=256).fns
        state, losses[name] = fns.init(), []
        for batch in windows:
            state, metrics = fns.train_step(state, put_windows(batch, fns.batch_sharding))
            losses[name].append(float(metrics["loss"]))
        if name == "ring":  # K/V move by collective-permute only: nothing is all-gathered
            hlo = fns.train_step.lower(state, put_windows(windows[0], fns.batch_sharding)).compile()
            moved = collectives.totals(collectives.parse(hlo.as_text()))
            assert moved["all-gather"] == 0 and moved["collective-permute"] > 0, moved
    assert losses["one"][4] < losses["one"][0]
    np.testing.assert_allclose(losses["ring"], losses["one"], rtol=0, atol=1e-4)
