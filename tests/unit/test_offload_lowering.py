"""The one-H200 benchmark's 1.1B step with optimizer offload lowers for ``cuda`` on this CPU machine
(cross-platform lowering, as tests/unit/test_gpu_lowering.py): the moments and float32 masters are
``pinned_host`` arguments and results, and the step moves each to the device and back with XLA's
``annotate_device_placement`` (which JAX emits for GPU and TPU only; on CPU a device_put inside jit lowers
to nothing)."""
import re
from collections import Counter

import jax
import pytest

from jaxtrain import config as cfglib
from jaxtrain.kernels.target import lowering_for
from jaxtrain.train import setup


@pytest.mark.parametrize("overrides", [["offload.optimizer=host"],
                                       ["offload.optimizer=host", "offload.params=host"]])
def test_the_1b_step_with_offload_lowers_for_cuda(overrides):
    cfg = cfglib.load("llama_1b_h200", ["model.attention=pallas", "model.param_dtype=bfloat16", *overrides])
    s = setup(cfg, jax.devices()[:1], vocab=256)
    step = s.fns.train_step
    with lowering_for("gpu"):
        text = step.inner.trace(s.abstract_state(), s.abstract_batch(), step.hparams).lower(
            lowering_platforms=("cuda",)).as_text()
    n = len(jax.tree_util.tree_leaves(s.abstract_state()["params"]))
    main = re.search(r"func\.func public @main\((.*?)\) ->", text, re.S).group(1)
    assert main.count('mhlo.memory_kind = "pinned_host"') == 3 * n  # masters, mu, nu
    placements = Counter(re.findall(r'_xla_buffer_placement = "(\w+)"', text))
    assert placements["pinned_host"] >= 2 * 3 * n and placements["device"] >= 4 * n
    assert "__gpu$xla.gpu.triton" in text
    if "offload.params=host" in overrides:
        # The scan over layers slices the host-resident stacked weights and calls its body, which fetches the
        # 9 weights of one layer (wq, wk, wv, wo, w_gate, w_up, w_down and two norm scales) to the device: in the
        # forward pass and again in the backward pass (remat recomputes the fetch).
        funcs = dict(re.findall(r"func\.func (?:public|private) @(\w+)\((.*?)\n  \}", text, re.S))
        fetching = [name for name, body in funcs.items()
                    if name != "main" and body.count('_xla_buffer_placement = "device"') == 9]
        assert len(fetching) >= 2 and any(f"call @{name}(" in funcs["main"] for name in fetching)  # fwd, bwd
