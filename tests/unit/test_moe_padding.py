"""Padding in a mixture of experts (``loss_mask`` 0): routed nowhere, no capacity taken, never counted as
dropped, nothing added to the router losses or the gradients; capacity within [1, tokens]; the MoE's
validation loss is its cross-entropy. Cases other trainers' trackers taught us (padding that competed
for capacity and skewed the load-balancing loss)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_moe import CFG, layer, reference

from jaxtrain.models.mixtral import Mixtral
from jaxtrain.models.mixtral.loss import moe_loss


def padded_mask(b: int, t: int) -> np.ndarray:
    """[b, t]: sequence 0 starts with 5 pads (they would win capacity priority), 1 ends with 6, 2 has none."""
    mask = np.ones((b, t), np.int32)
    mask[0, :5] = 0
    mask[1, -6:] = 0
    return mask


@pytest.mark.parametrize("routing, factor", [("dropless", 1.0), ("capacity", 0.5)])
def test_padding_is_routed_nowhere_takes_no_capacity_and_is_not_in_the_router_losses(routing, factor):
    cfg = CFG.model_copy(update={"routing": routing, "capacity_factor": factor})
    moe, x, ws = layer(cfg, seed=3)
    mask = padded_mask(*x.shape[:2])
    y, stats = jax.jit(lambda m, v, k: m(v, k))(moe, x, jnp.asarray(mask))
    x64 = np.asarray(x, np.float64)
    # The reference sees each sequence's real tokens only, as if the padding were not there: its capacity
    # too is that of its real tokens.
    want, copies, drops = np.zeros_like(x64), [], []
    for s in range(x.shape[0]):
        real = mask[s].astype(bool)
        capacity = cfg.capacity(int(real.sum())) if routing == "capacity" else None
        ys, dropped, chosen = reference(x64[s:s + 1, real], *ws, cfg.top_k, capacity)
        want[s, real] = ys[0]
        copies.append(chosen[0])
        drops.append(dropped[0])
    np.testing.assert_allclose(np.asarray(y), want, atol=1e-5, rtol=0)
    assert not np.asarray(y)[mask == 0].any()  # padding's output is exactly 0: the residual carries it
    drops = np.concatenate(drops)
    assert float(stats["dropped"]) == pytest.approx(drops.mean())  # of the real copies only
    assert (routing == "capacity") == bool(drops.any())
    chosen = np.concatenate(copies)
    np.testing.assert_allclose(np.asarray(stats["frac"]), np.bincount(chosen.ravel(), minlength=4) / chosen.size,
                               atol=1e-7)
    # Switch's aux and ST-MoE's z over the real tokens.
    logits = x64[mask == 1] @ ws[0]
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    aux = 4 * np.sum(np.bincount(chosen.ravel(), minlength=4) / chosen.size * p.mean(0))
    lse = np.log(np.exp(logits).sum(-1))
    assert float(stats["aux"]) == pytest.approx(aux, rel=1e-5)
    assert float(stats["z"]) == pytest.approx(np.mean(lse ** 2), rel=1e-5)


@pytest.mark.parametrize("routing", ["dropless", "capacity"])
def test_what_padding_holds_changes_neither_the_loss_nor_any_gradient(routing):
    cfg = CFG.model_copy(update={"routing": routing, "capacity_factor": 0.5, "aux_loss_weight": 0.5,
                                 "z_loss_weight": 0.1})
    model = Mixtral(cfg, nnx.Rngs(0))
    rng = np.random.default_rng(0)
    b, t = 3, 16
    mask = padded_mask(b, t)
    segments = mask.copy()  # one document per row; padding is segment 0, which no real token attends to
    positions = np.where(mask == 1, np.cumsum(mask, 1) - 1, 0)
    batch = {"inputs": rng.integers(0, 64, (b, t)), "targets": rng.integers(0, 64, (b, t)), "loss_mask": mask,
             "segment_ids": segments, "positions": positions}
    other = dict(batch, inputs=np.where(mask == 1, batch["inputs"], rng.integers(0, 64, (b, t))),
                 targets=np.where(mask == 1, batch["targets"], rng.integers(0, 64, (b, t))))
    assert (other["inputs"] != batch["inputs"]).any()
    graphdef, params = nnx.split(model, nnx.Param)

    @jax.jit
    def grads(params, batch):
        return jax.value_and_grad(lambda p: moe_loss(nnx.merge(graphdef, p), batch), has_aux=True)(params)

    as_jnp = lambda d: {k: jnp.asarray(v, jnp.int32) for k, v in d.items()}  # noqa: E731
    (loss_a, aux_a), g_a = grads(params, as_jnp(batch))
    (loss_b, aux_b), g_b = grads(params, as_jnp(other))
    assert float(loss_a) == pytest.approx(float(loss_b), rel=1e-6)
    for k in ("moe_aux_loss", "moe_z_loss", "moe_dropped_frac"):
        assert float(aux_a[k]) == pytest.approx(float(aux_b[k]), rel=1e-6, abs=1e-9), k
    flat_a, flat_b = nnx.to_flat_state(g_a), nnx.to_flat_state(g_b)
    for (path, ga), (_, gb) in zip(flat_a, flat_b):
        ga, gb = np.asarray(ga.get_value()), np.asarray(gb.get_value())
        np.testing.assert_allclose(ga, gb, rtol=1e-5, atol=1e-6 * np.abs(ga).max(), err_msg=str(path))


def test_capacity_is_clamped_to_one_slot_and_to_the_tokens():
    big = CFG.model_copy(update={"routing": "capacity", "capacity_factor": 100.0})
    tiny = CFG.model_copy(update={"routing": "capacity", "capacity_factor": 1e-6})
    assert big.capacity(16) == 16 and tiny.capacity(16) == 1


def test_a_moe_validation_loss_is_its_cross_entropy(small_cfg):
    from jaxtrain.train import setup
    from jaxtrain.train.trainer import put_validation
    cfg = small_cfg("model.family=mixtral", "model.n_experts=4", "model.aux_loss_weight=0.5", "mesh.data=1",
                    "model.n_layers=1")
    s = setup(cfg, jax.devices()[:1], load_data=True)
    params = s.fns.init()["params"]
    val = put_validation(s.data.val, s.fns.batch_sharding)
    out = jax.device_get(s.fns.evaluate(params, val))
    assert "ce_loss" not in out and {"moe_aux_loss", "moe_z_loss"} <= set(out)
    objective, aux, _ = s.fns.grads(params, {k: v[:1] for k, v in s.data.val.items()})  # batch 0 as a step
    assert float(out["loss"][0]) == pytest.approx(float(aux["ce_loss"]), rel=1e-6)
    assert float(objective) > float(aux["ce_loss"]) + 0.4  # the training objective holds 0.5 x aux (about 1)
