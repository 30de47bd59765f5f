"""The NNX Llama against an independent NumPy implementation of the same equations."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.models.llama import Llama, LlamaConfig
from jaxtrain.train.step import count_params


def np_rmsnorm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def np_rope(x, theta):
    # Complex-number form of RoPE on (i, i + half) pairs: x_j + i*x_{j+half} rotated by pos*theta^(-2j/d).
    t, d = x.shape[1], x.shape[3]
    half = d // 2
    freqs = theta ** (-np.arange(half) / half)
    rot = np.exp(1j * np.arange(t)[:, None] * freqs)[None, :, None, :]
    z = (x[..., :half] + 1j * x[..., half:]) * rot
    return np.concatenate([z.real, z.imag], -1)


def np_forward(p, tokens, cfg: LlamaConfig):
    x = p["embed"]["embedding"][tokens]
    b, t = tokens.shape
    group = cfg.n_heads // cfg.n_kv_heads
    causal = np.tril(np.ones((t, t), bool))
    for i in range(cfg.n_layers):
        lp = p["layers"][i]
        h = np_rmsnorm(x, lp["attn_norm"]["scale"], cfg.norm_eps)
        q = np_rope(np.einsum("btd,dhk->bthk", h, lp["attn"]["wq"]), cfg.rope_theta)
        k = np_rope(np.einsum("btd,dhk->bthk", h, lp["attn"]["wk"]), cfg.rope_theta)
        v = np.einsum("btd,dhk->bthk", h, lp["attn"]["wv"])
        k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)  # GQA: kv head j serves q heads j*g..
        s = np.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(cfg.head_dim)
        s = np.where(causal, s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        o = np.einsum("bhqs,bshk->bqhk", w, v)
        x = x + np.einsum("bthk,hkd->btd", o, lp["attn"]["wo"])
        h = np_rmsnorm(x, lp["mlp_norm"]["scale"], cfg.norm_eps)
        g = h @ lp["mlp"]["w_gate"]
        x = x + ((g / (1 + np.exp(-g))) * (h @ lp["mlp"]["w_up"])) @ lp["mlp"]["w_down"]
    x = np_rmsnorm(x, p["final_norm"]["scale"], cfg.norm_eps)
    head = p["embed"]["embedding"].T if cfg.tie_embeddings else p["lm_head"]
    return x @ head


@pytest.mark.parametrize("n_kv_heads,tie", [(4, False), (2, True), (1, False)])
def test_logits_match_numpy_reference(n_kv_heads, tie):
    cfg = LlamaConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, d_ff=48,
                      tie_embeddings=tie, init_std=0.2)
    model = Llama(cfg, nnx.Rngs(3))
    params = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64),
                                    nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    tokens = np.random.default_rng(0).integers(0, 50, size=(2, 11))
    got = np.asarray(model(jnp.asarray(tokens)))
    want = np_forward(params, tokens, cfg)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    assert got.shape == (2, 11, 50) and got.dtype == np.float32


def test_causality_one_hot_probe():
    cfg = LlamaConfig(vocab_size=20, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32, init_std=0.3)
    model = Llama(cfg, nnx.Rngs(0))
    tokens = np.zeros((1, 8), np.int32)
    base = np.asarray(model(jnp.asarray(tokens)))
    tokens[0, 5] = 7  # change position 5 only
    probe = np.asarray(model(jnp.asarray(tokens)))
    np.testing.assert_array_equal(probe[0, :5], base[0, :5])  # earlier positions never see it
    assert np.abs(probe[0, 5:] - base[0, 5:]).max() > 1e-4


def test_param_count_and_logical_axes():
    cfg = LlamaConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=40)
    model = Llama(cfg, nnx.Rngs(0))
    per_layer = 32 * 32 * 2 + 32 * 16 * 2 + 3 * 32 * 40 + 2 * 32  # q,o + k,v + mlp + 2 norms
    assert count_params(model) == 64 * 32 * 2 + 3 * per_layer + 32
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        axes = var.get_metadata()["axes"]
        assert len(axes) == var.get_value().ndim, path


def test_segment_ids_isolate_documents():
    cfg = LlamaConfig(vocab_size=20, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, init_std=0.3)
    model = Llama(cfg, nnx.Rngs(0))
    seg = jnp.asarray([[0, 0, 0, 1, 1, 1, 1, 1]])
    pos = jnp.asarray([[0, 1, 2, 0, 1, 2, 3, 4]])
    a = np.array([[1, 2, 3, 4, 5, 6, 7, 8]])
    b = a.copy()
    b[0, 1] = 9  # change document 0 only
    la, lb = (np.asarray(model(jnp.asarray(t), pos, seg)) for t in (a, b))
    np.testing.assert_array_equal(la[0, 3:], lb[0, 3:])
    # Document 1 packed after document 0 equals document 1 alone (positions restart).
    alone = np.asarray(model(jnp.asarray(a[:, 3:])))
    np.testing.assert_allclose(la[0, 3:], alone[0], rtol=1e-5, atol=1e-5)
