"""The one decoder both families build on (models/decoder.py): the scanned and the unrolled stack,
every remat policy, the stacked block outputs (Mixtral's router statistics), the parameter layout;
and no family reaches into another's private names."""
import ast
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.models.decoder import REMAT_POLICIES, Decoder, checkpoint, make_blocks
from jaxtrain.models.llama import Llama, LlamaConfig
from jaxtrain.models.mixtral import Mixtral, MixtralConfig

REPO = Path(__file__).resolve().parents[2]
SIZES = dict(vocab_size=40, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24, init_std=0.2, attention="xla")


def build(family: str, **over):
    if family == "llama":
        return Llama(LlamaConfig(**{**SIZES, **over}), nnx.Rngs(1))
    return Mixtral(MixtralConfig(**{**SIZES, "n_experts": 4, "top_k": 2, **over}), nnx.Rngs(1))


def run(model, tokens, mask):
    """(logits, stats or None, grads of a scalar of both) through jit."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def f(p):
        m = nnx.merge(graphdef, p, rest)
        if isinstance(m, Mixtral):
            logits, stats = m.forward(tokens, mask=mask)
            return (logits ** 2).mean() + stats["aux"] + stats["z"], (logits, stats)
        logits = m(tokens)
        return (logits ** 2).mean(), (logits, None)

    (_, (logits, stats)), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params)
    return logits, stats, nnx.to_pure_dict(grads)


def unstack(grads: dict, n_layers: int) -> dict:
    """A scanned model's gradients in the unrolled layout ({'layers': {i: ...}})."""
    layers = grads["layers"]
    return {**grads, "layers": {i: jax.tree_util.tree_map(lambda a, i=i: a[i], layers) for i in range(n_layers)}}


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_scanned_and_unrolled_stacks_under_every_remat_policy_agree(family):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 40, size=(2, 10)), jnp.int32)
    mask = jnp.asarray(np.r_[np.zeros(3), np.ones(17)].reshape(2, 10), jnp.int32)  # 3 pads in sequence 0
    want_logits, want_stats, want_grads = run(build(family), tokens, mask)
    # Against the unrolled stack without remat: scanned, and each policy once (each compile costs seconds).
    combos = [(True, "none")] + [(i % 2 == 0, remat) for i, remat in enumerate(REMAT_POLICIES)]
    for scan, remat in combos:
        logits, stats, grads = run(build(family, scan_layers=scan, remat=remat), tokens, mask)
        if scan:
            grads = unstack(grads, SIZES["n_layers"])
        np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-6, err_msg=f"{scan} {remat}")
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), grads,
                               want_grads)
        if family == "mixtral":
            assert stats["frac"].shape == (SIZES["n_layers"], 4)  # per layer, per expert
            assert all(stats[k].shape == () for k in ("aux", "z", "dropped"))  # averaged over layers
            jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), stats,
                                   want_stats)


def test_unrolled_blocks_of_one_structure_are_traced_once_and_compute_the_same(monkeypatch):
    from jaxtrain.models.llama.model import Block
    calls = []
    real = Block.__call__
    monkeypatch.setattr(Block, "__call__", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    model = build("llama", n_layers=4)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 40, size=(2, 10)), jnp.int32)
    logits = jax.jit(lambda t: model(t))(tokens)
    assert len(calls) == 1  # traced once, called for the 4 layers
    # The same value as the blocks applied one after the other, eagerly (each traced on its own).
    x = model.embed_tokens(tokens)
    for block in model.layers:
        x = real(block, x, None, None)
    np.testing.assert_allclose(logits, model.head(x), rtol=1e-5, atol=1e-6)
    assert len(calls) == 1


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_blocks_built_as_one_vmap_equal_the_blocks_built_one_by_one(family):
    from jaxtrain.models.llama.model import Block as LlamaBlock
    from jaxtrain.models.mixtral.model import Block as MixtralBlock
    block_type = LlamaBlock if family == "llama" else MixtralBlock
    cfg = build(family).cfg

    def blocks(make):  # 3 blocks after one draw, then one more draw: the streams must end alike
        rngs = nnx.Rngs(params=jax.random.key(3), default=jax.random.key(5))
        rngs.params()
        built = make(rngs)
        return [nnx.to_pure_dict(nnx.state(b)) for b in built], jax.random.key_data(rngs.params())

    one_by_one = jax.jit(lambda: blocks(lambda r: [block_type(cfg, r) for _ in range(3)]))()
    vmapped = jax.jit(lambda: blocks(lambda r: make_blocks(block_type, cfg, r, 3)))()
    flat_want, flat_got = jax.tree_util.tree_leaves(one_by_one), jax.tree_util.tree_leaves(vmapped)
    assert len(flat_got) == len(flat_want) > 3
    for want, got in zip(flat_want, flat_got):
        assert np.asarray(want).tobytes() == np.asarray(got).tobytes()  # bitwise: the same draws
    # and the layers differ from one another (each drew its own keys)
    assert not np.array_equal(vmapped[0][0]["attn"]["wq"], vmapped[0][1]["attn"]["wq"])


def test_a_block_that_keeps_its_own_rngs_is_built_one_by_one():
    class Noisy(nnx.Module):  # keeps a stream, as a dropout layer does: it shares the caller's
        def __init__(self, cfg, rngs):
            self.w = nnx.Param(jax.random.normal(rngs.params(), (2,)))
            self.rngs = rngs

    rngs = nnx.Rngs(params=0)
    built = make_blocks(Noisy, None, rngs, 3)
    assert all(b.rngs is rngs for b in built) and int(rngs.params.count.get_value()) == 3


def test_both_families_are_the_shared_decoder_with_their_own_block():
    assert issubclass(Llama, Decoder) and issubclass(Mixtral, Decoder) and not issubclass(Mixtral, Llama)
    llama, mixtral = build("llama", scan_layers=True), build("mixtral", scan_layers=True)
    axes = {".".join(map(str, p)): v.get_metadata()["axes"]
            for p, v in nnx.to_flat_state(nnx.state(mixtral, nnx.Param))}
    assert axes["layers.moe.w_gate"] == ("layers", "exp", "embed", "mlp")
    assert axes["layers.attn.wq"] == ("layers", "embed", "heads", "kv")
    assert axes["embed.embedding"] == ("vocab", "embed") and axes["lm_head"] == ("embed", "vocab")
    # Everything but the feed-forward block is the same tree in both families.
    llama_names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(llama, nnx.Param))}
    assert {n for n in llama_names if ".mlp." not in n} == {n for n in axes if ".moe." not in n}


def test_an_unknown_remat_policy_is_named():
    with pytest.raises(ValueError, match="model.remat: unknown policy 'some'"):
        checkpoint(lambda x: x, "some")


def test_no_family_imports_a_private_name_of_another_module():
    offenders = []
    for path in sorted((REPO / "models").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxtrain.models"):
                offenders += [f"{path.relative_to(REPO)}: {node.module}.{a.name}" for a in node.names
                              if a.name.startswith("_")]
    assert offenders == []
