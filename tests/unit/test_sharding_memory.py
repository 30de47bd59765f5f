"""Memory accounting: per-device state bytes follow the ZeRO arithmetic of each rule set."""
import pytest
from conftest import SMALL

from jaxtrain import config as cfglib
from jaxtrain.metrics import memory
from jaxtrain.train import setup
from jaxtrain.train.optimizer import HYPERPARAMETERS
from jaxtrain.train.step import count_params

V, D, L, H, KV, FF = 256, 64, 2, 4, 2, 128
HD = D // H
# Embedding and untied head, then per layer wq, wo (D*D each), wk, wv (D*KV*HD each),
# three SwiGLU matrices and two norm scales; the final norm.
N_PARAMS = 2 * V * D + D + L * (2 * D * D + 2 * D * KV * HD + 3 * D * FF + 2 * D)
COUNTERS = 4  # the int32 update count of Adam in the optax state, replicated


def report(rules: str, mesh: tuple[str, ...]):
    cfg = cfglib.load(None, [*SMALL, *mesh, f"sharding.rules={rules}"])
    s = setup(cfg, vocab=V)
    abstract = s.abstract_state()
    assert count_params(abstract["params"]) == N_PARAMS
    return memory.state_report(abstract, s.fns.state_shardings), s, abstract


@pytest.mark.parametrize("rules,mesh,param_div,opt_div", [
    ("dp", ("mesh.data=8",), 1, 1),
    ("fsdp", ("mesh.data=1", "mesh.fsdp=8"), 8, 8),
    ("zero1", ("mesh.data=8",), 1, 8),
])
def test_zero_arithmetic(rules, mesh, param_div, opt_div):
    rep, _, _ = report(rules, mesh)
    full = 4 * N_PARAMS  # float32
    assert rep.params == rep.grads == full // param_div
    assert rep.opt_state == 2 * full // opt_div + COUNTERS  # AdamW mu + nu
    # The ZeRO yardstick: 16 bytes per parameter in all, divided as each stage promises.
    assert rep.state == pytest.approx(16 * N_PARAMS * (2 / param_div + 2 / opt_div) / 4, abs=COUNTERS)


def test_compiled_arguments_are_the_sharded_state_and_batch():
    rep, s, abstract = report("fsdp", ("mesh.data=1", "mesh.fsdp=8"))
    compiled, _ = s.compile_abstract()
    got = memory.state_report(abstract, s.fns.state_shardings, compiled)
    step_and_rng = 4 + 8  # int32 step, uint32[2] key data (replicated)
    batch = 3 * 1 * 1 * 32 * 4  # inputs, targets, loss_mask: [1, 8, 32] int32, 1 row of 8 per device
    hparams = 4 * len(HYPERPARAMETERS)  # the optimizer's traced float32 scalars (replicated)
    assert got.compiled["argument"] == rep.params + rep.opt_state + step_and_rng + batch + hparams
    assert got.compiled["alias"] == rep.params + rep.opt_state + step_and_rng  # the donated state
    assert got.compiled["peak"] >= got.compiled["argument"] and got.compiled["temp"] > 0
    assert got.summary().startswith(f"memory per device: params {memory.fmt_bytes(rep.params)}, ")
