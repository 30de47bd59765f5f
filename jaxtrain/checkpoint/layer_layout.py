"""Checkpoints do not depend on how the decoder holds its layers.

The decoder's blocks are either one subtree per layer (``layers.0.attn.wq``, ...) or one subtree
whose leaves are stacked on a leading ``[layers]`` dim (``layers.attn.wq``: ``model.scan_layers``,
or any pipelined run). The same holds in the optimizer state, whose moments mirror the params. A
restore into the other layout reads the checkpoint in the layout it was saved in, then stacks or
unstacks every ``layers`` subtree into the run's own layout and shardings, so a run moves freely
between scanned, unrolled and pipelined (any ``mesh.stage``) without converting files.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.checkpoint.integrity import mismatches, tree_summary

LAYERS = "layers"


def _unrolled(node: Any) -> bool:
    """A ``layers`` node holding one subtree per layer: {0: ..., 1: ...}."""
    return isinstance(node, dict) and bool(node) and all(isinstance(k, int) for k in node)


def _walk(tree: Any, at_layers: Callable[[Any], Any]) -> Any:
    """``tree`` with every dict entry named ``layers`` replaced by ``at_layers(entry)``; dicts, lists,
    tuples and named tuples (optax states) are walked, anything else is kept."""
    if isinstance(tree, dict):
        return {k: at_layers(v) if k == LAYERS else _walk(v, at_layers) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_walk(v, at_layers) for v in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(_walk(v, at_layers) for v in tree)
    return tree


def _stack_abstract(layers: dict) -> Any:
    """Abstract per-layer leaves -> one abstract stacked leaf per path ([layers, ...], the layer dim
    replicated, the other dims sharded as before)."""
    def stack(*xs):
        x = xs[0]
        sharding = NamedSharding(x.sharding.mesh, P(None, *x.sharding.spec))
        return jax.ShapeDtypeStruct((len(xs), *x.shape), x.dtype, sharding=sharding)
    return jax.tree_util.tree_map(stack, *(layers[i] for i in sorted(layers)))


def _unstack_abstract(layers: Any, n: int) -> dict:
    """An abstract stacked subtree -> n abstract per-layer subtrees (the other dims sharded as before)."""
    def one(x):
        spec = tuple(x.sharding.spec) + (None,) * (len(x.shape) - len(x.sharding.spec))
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=NamedSharding(x.sharding.mesh, P(*spec[1:])))
    return {i: jax.tree_util.tree_map(one, layers) for i in range(n)}


def saved_layout(abstract_state: Any, saved_tree: dict) -> Optional[Any]:
    """``abstract_state`` in the layer layout of a checkpoint whose tree summary is ``saved_tree``
    (the same when it already fits); None when stacking or unstacking does not make it fit."""
    if not mismatches(saved_tree, tree_summary(abstract_state)):
        return abstract_state
    n = _saved_layers(saved_tree)
    stacked_now = not any(_unrolled(v) for v in _layer_nodes(abstract_state))
    if stacked_now and n:
        alt = _walk(abstract_state, lambda layers: _unstack_abstract(layers, n))
    elif not stacked_now:
        alt = _walk(abstract_state, lambda layers: _stack_abstract(layers) if _unrolled(layers) else layers)
    else:
        return None
    return alt if not mismatches(saved_tree, tree_summary(alt)) else None


def convert(state: Any, target: Any) -> Any:
    """``state`` (restored in the other layer layout) stacked or unstacked into ``target``'s layout,
    placed on ``target``'s shardings (one jitted program: every process runs it alike)."""
    if jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(target):
        return state
    stacked_target = not any(_unrolled(v) for v in _layer_nodes(target))

    def to_target(tree):
        if stacked_target:
            return _walk(tree, lambda layers: jax.tree_util.tree_map(lambda *xs: jnp.stack(xs),
                                                                   *(layers[i] for i in sorted(layers))))
        n = _count(_layer_nodes(target))
        return _walk(tree, lambda layers: {i: jax.tree_util.tree_map(lambda a, i=i: a[i], layers) for i in range(n)})

    shardings = jax.tree_util.tree_map(lambda x: x.sharding, target)
    return jax.jit(to_target, out_shardings=shardings)(state)


def _layer_nodes(tree: Any) -> list:
    found: list = []
    _walk(tree, lambda layers: found.append(layers) or layers)
    return found


def _count(nodes: list) -> int:
    return next(len(v) for v in nodes if _unrolled(v))


def _saved_layers(saved_tree: dict) -> int:
    """How many per-layer subtrees a saved tree summary holds (0 when it is stacked)."""
    ids = {int(parts[i + 1]) for path in saved_tree for parts in [path.split(".")]
           for i in range(len(parts) - 1) if parts[i] == LAYERS and parts[i + 1].isdigit()}
    return len(ids)
