"""The decoder every family builds on: token embedding, the stack of blocks, final norm, LM head.

A family subclasses :class:`Decoder` and names its block (``block_type``); the embedding, the
block stack (unrolled, or scanned with ``model.scan_layers``; rematerialised under
``model.remat``), the final RMSNorm and the head live here and nowhere else.

Parameter layout (logical names), whatever the block:
  embed.embedding        [vocab, embed]
  layers.i.<block's own parameters>          (``layers.<...> [layers, ...]`` when scanned)
  final_norm.scale       [embed]
  lm_head                [embed, vocab]  (absent when tie_embeddings)

With ``scan_layers`` the blocks are one module whose parameters are stacked on a leading
'layers' dim, run by ``jax.lax.scan``: the compiled step holds one block, so compile time stays
flat as depth grows. The initial values equal the unstacked layout's. ``remat`` recomputes each
block's activations in the backward pass: 'full' saves only the block input, 'save_matmuls'
also keeps the weight-matmul outputs (JAX's ``dots_with_no_batch_dims_saveable``, MaxText's
"minimal" policy, and the kernels' matmul outputs, named ``kernel_matmul``).
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.models.layers import MATMUL_NAME, RMSNorm, param, project
from jaxtrain.parallel import offload, pipeline
from jaxtrain.parallel.activations import constrain

_POLICIES = jax.checkpoint_policies
REMAT_POLICIES = {"full": None, "save_matmuls": _POLICIES.save_from_both_policies(
    _POLICIES.dots_with_no_batch_dims_saveable, _POLICIES.save_only_these_names(MATMUL_NAME))}

# (block, x [batch, length, embed], extras {name: [batch, ...]}) -> (x, aux): one block applied, aux a
# pytree of arrays or None. ``extras`` are the per-example inputs (positions, segment ids, masks),
# passed explicitly so a pipeline can cut them into microbatches beside x.
BlockCall = Callable[[nnx.Module, jax.Array, dict], tuple[jax.Array, Any]]


def checkpoint(fn: Callable, remat: str, prevent_cse: bool = True) -> Callable:
    """``fn`` with its activations recomputed in the backward pass under the ``model.remat`` policy
    ('none' returns ``fn`` itself). ``prevent_cse=False`` inside ``lax.scan``, where CSE cannot
    merge the recomputation away and the guard only costs speed.

    Activations named in ``offload.activations`` (tagged with ``checkpoint_name`` in the blocks) are
    saved to host memory instead of recomputed (``jaxtrain.parallel.offload.offloading_policy``).

    Raises:
      ValueError: an unknown policy.
    """
    if remat == "none":
        return fn
    if remat not in REMAT_POLICIES:
        raise ValueError(f"model.remat: unknown policy '{remat}' (known: none, {', '.join(REMAT_POLICIES)})")
    policy = offload.offloading_policy(offload.offloaded_activations(), REMAT_POLICIES[remat])
    return jax.checkpoint(fn, policy=policy, prevent_cse=prevent_cse)


def remat_block(block: nnx.Module, x: jax.Array, call: BlockCall, remat: str, extras: dict) -> tuple[jax.Array, Any]:
    """``call(block, x, extras)``, the block's activations recomputed in the backward pass under ``remat``."""
    if remat == "none":
        return call(block, x, extras)
    # jax.checkpoint takes arrays, not modules: pass the block's state and rebuild it inside.
    graphdef, state = nnx.split(block)
    return checkpoint(lambda h, st: call(nnx.merge(graphdef, st), h, extras), remat)(x, state)


def make_blocks(block_type: Callable[[Any, nnx.Rngs], nnx.Module], cfg: Any, rngs: nnx.Rngs,
                n: int) -> list[nnx.Module]:
    """``[block_type(cfg, rngs) for _ in range(n)]``, bitwise, with the construction traced once.

    Each block draws a fixed number of keys from each stream of ``rngs`` (``fold_in(key, count)``,
    the count advancing per draw), so block i's draws are those counts offset by i blocks' worth.
    The blocks are built as one ``jax.vmap`` over that offset: the init program holds one batched
    block instead of n (the shakespeare config's cached init executable: 341 -> 138 fusions,
    loaded in ~0.15 s instead of ~0.45 s), and the streams end where n sequential
    constructions leave them. A block that keeps an ``nnx.Rngs`` (e.g. for dropout) is built one
    by one, as it would share the caller's streams.
    """
    streams = dict(rngs.items())
    draws = _draws_per_block(block_type, cfg, list(streams)) if n > 1 else None
    if draws is None:
        return [block_type(cfg, rngs) for _ in range(n)]
    keys = {name: s.key.get_value() for name, s in streams.items()}
    starts = {name: s.count.get_value() for name, s in streams.items()}
    graphdef = []

    def build(i):  # block i with its own streams, counts advanced by i blocks' draws
        own = nnx.Rngs(**keys)
        for name in keys:
            getattr(own, name).count.set_value(starts[name] + i * jnp.uint32(draws[name]))
        g, state = nnx.split(block_type(cfg, own))
        graphdef.append(g)
        return state

    stacked = jax.vmap(build)(jnp.arange(n, dtype=jnp.uint32))
    for name, s in streams.items():
        s.count.set_value(starts[name] + jnp.uint32(n * draws[name]))
    return [nnx.merge(graphdef[0], jax.tree_util.tree_map(lambda x: x[i], stacked)) for i in range(n)]


def _draws_per_block(block_type: Callable, cfg: Any, names: list[str]) -> Optional[dict[str, int]]:
    """How many keys one block draws from each stream, from an abstract construction whose counts
    are numpy values (so they stay concrete); None when the block keeps random state of its own."""
    counted: dict[str, int] = {}

    def probe():
        own = nnx.Rngs(**{name: jax.random.key(0) for name in names})
        for name in names:
            getattr(own, name).count.set_value(np.zeros((), np.uint32))
        block = block_type(cfg, own)
        if not nnx.state(block, nnx.RngState):
            counted.update({name: int(getattr(own, name).count.get_value()) for name in names})

    jax.eval_shape(probe)
    return counted or None


def stack_blocks(blocks: list[nnx.Module]) -> nnx.Module:
    """One block whose parameters are the blocks' stacked on a leading 'layers' dim (logical
    axes gain a leading 'layers'). All blocks must share one structure."""
    graphdef, _ = nnx.split(blocks[0])
    stacked = nnx.merge(graphdef, jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *map(nnx.state, blocks)))
    for _, node in nnx.iter_graph(stacked):
        if isinstance(node, nnx.Param):
            node.set_metadata(axes=("layers", *node.get_metadata()["axes"]))
    return stacked


def scan_blocks(stacked: nnx.Module, x: jax.Array, call: BlockCall, remat: str,
                extras: dict) -> tuple[jax.Array, Any]:
    """x [batch, length, embed] through every layer of a stacked block with ``jax.lax.scan``
    -> (x, aux stacked on a leading [layers] dim). With ``offload.params: host`` the stacked weights
    stay in host memory and each iteration fetches its layer's (``jaxtrain.parallel.offload``)."""
    graphdef, state = nnx.split(stacked)

    def body(h, layer_state):
        return call(nnx.merge(graphdef, offload.fetch_layer(layer_state)), h, extras)

    return jax.lax.scan(checkpoint(body, remat, prevent_cse=False), x, state)


def run_blocks(layers: nnx.Module, x: jax.Array, call: BlockCall, remat: str, scanned: bool,
               extras: Optional[dict] = None) -> tuple[jax.Array, Any]:
    """x [batch, length, embed] through ``layers`` (a stacked block when ``scanned``, else an
    ``nnx.List`` of blocks) -> (x, each layer's aux stacked on a leading [layers] dim).

    Inside an active pipeline (``jaxtrain.parallel.pipeline``, entered by the train step when
    ``mesh.stage > 1``) the stacked layers run as its schedule, microbatched; the result is the same.
    """
    extras = extras or {}
    schedule = pipeline.active_schedule()
    if schedule is not None and scanned:
        return pipeline.run(layers, x, extras, call, lambda fn: checkpoint(fn, remat, prevent_cse=False), schedule)
    if scanned:
        return scan_blocks(layers, x, call, remat, extras)
    applies: list[tuple[Any, Callable]] = []  # (graphdef, its traced_once), one per block structure
    per_layer = []
    for block in layers:
        graphdef, state = nnx.split(block)
        apply = next((fn for g, fn in applies if g == graphdef), None)
        if apply is None:
            apply = traced_once(graphdef, call, remat)
            applies.append((graphdef, apply))
        x, aux = apply(state, x, extras)
        per_layer.append(aux)
    return x, jax.tree_util.tree_map(lambda *v: jnp.stack(v), *per_layer)


def traced_once(graphdef: Any, call: BlockCall, remat: str) -> Callable:
    """``(state, x, extras) -> remat_block(merge(graphdef, state), x, call, remat, extras)`` as a nested
    ``jax.jit``: JAX traces and lowers it once per input shapes, and every layer of this structure
    reuses that trace; XLA inlines the calls, so the compiled step is the unrolled one. Tracing the 4
    blocks of the shakespeare config one by one was most of the train step's tracing (0.43 of
    0.64 s), and it grows with depth."""
    return jax.jit(lambda state, x, extras: remat_block(nnx.merge(graphdef, state), x, call, remat, extras))


class Decoder(nnx.Module):
    """Decoder-only LM: tokens [batch, length] int32 -> logits [batch, length, vocab] float32.

    A family sets ``block_type``: a module built as ``block_type(cfg, rngs)`` and called as
    ``block(x, positions, segment_ids, **inputs)`` on x [batch, length, embed] in ``cfg.dtype``.
    It returns x, or ``(x, aux)`` when ``block_returns_aux`` (aux: a pytree of arrays, e.g. router
    statistics, which :meth:`decode` stacks over layers). ``cfg`` provides vocab_size (resolved,
    >= 1), d_model, n_layers, norm_eps, init_std, dtype, param_dtype, tie_embeddings,
    scan_layers and remat.
    """

    block_type: ClassVar[type]
    block_returns_aux: ClassVar[bool] = False

    def __init__(self, cfg: Any, rngs: nnx.Rngs):
        if cfg.vocab_size < 1:
            raise ValueError(f"{type(self).__name__} needs a resolved vocab_size, got {cfg.vocab_size}")
        self.cfg = cfg
        pd = cfg.param_dtype
        # The order of construction fixes which random draws each parameter gets: keep it.
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, param_dtype=jnp.dtype(pd), rngs=rngs,
                               embedding_init=nnx.initializers.normal(cfg.init_std))
        self.embed.embedding.set_metadata(axes=("vocab", "embed"))
        blocks = make_blocks(self.block_type, cfg, rngs, cfg.n_layers)
        self.layers = stack_blocks(blocks) if cfg.scan_layers else nnx.List(blocks)
        self.final_norm = RMSNorm(cfg)
        if not cfg.tie_embeddings:
            self.lm_head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std, pd)

    def decode(self, tokens: jax.Array, positions: Optional[jax.Array] = None,
               segment_ids: Optional[jax.Array] = None, **inputs: Any) -> tuple[jax.Array, Any]:
        """tokens, positions, segment_ids [batch, length] int32 -> (logits [batch, length, vocab]
        float32, aux): positions default to 0..length-1, segment_ids restrict attention to tokens of
        the same packed document; ``inputs`` (e.g. a [batch, length] mask) go to every block as
        keywords. aux is the blocks' aux stacked on a leading [layers] dim (None without aux)."""
        extras = {"positions": positions, "segment_ids": segment_ids, **inputs}
        x, aux = run_blocks(self.layers, self.embed_tokens(tokens), self.block_call, self.cfg.remat,
                            self.cfg.scan_layers, extras)
        return self.head(x), aux

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """tokens [batch, length] int32 -> x [batch, length, embed] in the compute dtype."""
        # Gather the FSDP shards of the table before the lookup (as FSDP does for every
        # weight); a lookup into an fsdp-sharded embed dim forces a full rematerialisation.
        table = constrain(self.embed.embedding[...], "vocab", None)
        return constrain(table[tokens].astype(jnp.dtype(self.cfg.dtype)), "batch", "residual_length", "embed")

    def block_call(self, block: nnx.Module, h: jax.Array, extras: dict) -> tuple[jax.Array, Any]:
        """One block on h [batch, length, embed] with the per-example ``extras`` -> (h, aux or None)."""
        out = block(h, extras.get("positions"), extras.get("segment_ids"),
                    **{k: v for k, v in extras.items() if k not in ("positions", "segment_ids")})
        return out if self.block_returns_aux else (out, None)

    def block_inputs(self, batch: dict) -> dict:
        """The per-example inputs the blocks take from a training batch (a family may add its own)."""
        return {"positions": batch.get("positions"), "segment_ids": batch.get("segment_ids")}

    def head(self, x: jax.Array) -> jax.Array:
        """x [batch, length, embed] -> logits [batch, length, vocab] float32: final norm and LM head."""
        dt = jnp.dtype(self.cfg.dtype)
        x = self.final_norm(x)
        head = self.embed.embedding[...].T if self.cfg.tie_embeddings else self.lm_head[...]
        return constrain(project(x, head.astype(dt), implementation=self.cfg.matmul).astype(jnp.float32),
                         "batch", "length", "vocab")
