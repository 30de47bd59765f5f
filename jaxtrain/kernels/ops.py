"""The operations models and the train step call, each run by the implementation the registry picks.

Every function takes the config value of its key (``implementation``: ``model.attention``,
``model.matmul``, ``model.grouped_matmul``) and asks :mod:`jaxtrain.kernels.registry` which
implementation runs this call: inside the trainer the run's plan says (``auto`` resolved once per run,
:func:`jaxtrain.kernels.context.planned`); a model called on its own resolves from the call (the
backend, JAX's devices). Where the chosen implementation refuses a call (a shape its kernel does not
take), ``auto`` hands it to the next candidate that takes it, and an explicit choice is a named error.
Nothing here names a provider.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple, Optional

import jax

from jaxtrain.kernels import context, registry, target
from jaxtrain.kernels.registry import Facts, Implementation

# A kernel's matmul outputs carry this name (``jax.ad_checkpoint.checkpoint_name``), so that
# ``model.remat=save_matmuls`` keeps them as it keeps XLA's dots (models/decoder.py).
MATMUL_NAME = "kernel_matmul"


class AttentionCall(NamedTuple):
    """One attention call, as implementations' ``refuses`` see it: q [batch, q_len, heads, head_dim],
    k [batch, kv_len, kv_heads, head_dim], segment_ids [batch, length] or None, window, causal."""

    q: Any
    k: Any
    segment_ids: Any
    window: Optional[int]
    causal: bool


class MatmulCall(NamedTuple):
    """One call of the ``matmul`` key: ``kind`` 'matmul' (x [tokens, in] @ w [in, out]), 'mlp' (the SwiGLU
    MLP on x [tokens, embed], w its gate weight [embed, mlp]) or 'norm' (RMSNorm of x [..., embed])."""

    kind: str
    x: Any
    w: Any = None


class GroupedCall(NamedTuple):
    """One grouped call: rows [M, embed]; w_gate, w_up [E, embed, mlp]; w_down [E, mlp, embed]."""

    rows: Any
    w_gate: Any
    w_up: Any
    w_down: Any


def call_facts(op: str, call: Any = None) -> Facts:
    """The facts of a call made outside a run's plan: the backend, the active mesh's (or JAX's) devices,
    whether the trainer's sharding context is active and, for attention, whether it splits the length."""
    split = False
    if op == "attention" and call is not None:
        split = context.devices_along(call.q.shape, ("batch", "length", "heads", "kv"), 1) > 1
    return Facts(backend=target.backend(), devices=context.devices(),
                 sharded=context.active_sharding() is not None, length_split=split)


def choice(op: str, implementation: str, call: Any = None) -> registry.Choice:
    """How ``implementation`` of ``op`` resolves here: the run's plan where it has this value, else from
    the plan's facts (a model asking for another value) or the call's (no plan)."""
    plan = context.active_plan()
    if plan is None:
        return registry.choose(op, implementation, call_facts(op, call))
    if plan.facts.backend != target.backend():  # lowered for another backend (target.lowering_for)
        return registry.choose(op, implementation, replace(plan.facts, backend=target.backend()))
    planned = plan.choice(op)
    return planned if planned.value == implementation else registry.choose(op, implementation, plan.facts)


def pick(op: str, implementation: str, call: Any) -> Implementation:
    """The implementation that runs ``call``.

    Raises:
      ConfigError (AttentionBackendError for attention): an explicit choice that cannot run it.
    """
    chosen = choice(op, implementation, call)
    facts = _facts(op, call)
    why = chosen.impl.refuses(call, chosen.auto, facts)
    if why is None:
        return chosen.impl
    if not chosen.auto:
        raise registry.cannot_run(op, implementation, why, facts.backend)
    for alt in chosen.fallbacks:
        if alt.refuses(call, True, facts) is None:
            return alt
    raise registry.ConfigError(f"{registry.KEYS[op]}=auto: no implementation takes this call ({why})")


def _facts(op: str, call: Any) -> Facts:
    """The facts a call is judged on: the plan's (for the backend traced for), else the call's own; a
    length split the plan could not know (a custom model's attention) from the call."""
    plan = context.active_plan()
    if plan is None:
        return call_facts(op, call)
    facts = plan.facts if plan.facts.backend == target.backend() else replace(plan.facts, backend=target.backend())
    if op == "attention" and facts.length_split is None and call is not None:
        facts = replace(facts, length_split=call_facts(op, call).length_split)
    return facts


# --- attention

def rotates_inside(implementation: str, q, k, segment_ids=None, window: Optional[int] = None,
                   causal: bool = True) -> bool:
    """Whether the attention that runs this call applies rotary tables itself (``attention``'s ``rope``),
    saving XLA a pass over q and k each way."""
    return pick("attention", implementation, AttentionCall(q, k, segment_ids, window, causal)).rope_inside


def attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: Optional[jax.Array] = None,
              implementation: str = "auto", *, causal: bool = True, window: Optional[int] = None,
              rope: Optional[tuple] = None) -> jax.Array:
    """Softmax attention through the implementation the registry picks.

    Args:
      q: [batch, q_len, heads, head_dim]; k, v: [batch, kv_len, kv_heads, head_dim] (heads a multiple
        of kv_heads: grouped-query attention). segment_ids: [batch, length] int32 or None (tokens attend
        within their segment). window: keys a query sees back (q_pos - k_pos < window), or None.
        Causal masks are bottom-right aligned when q_len != kv_len.
      rope: rotary tables ``(cos, sin)`` [length, head_dim / 2] float32, only where
        :func:`rotates_inside` says the implementation applies them.
    Returns: [batch, q_len, heads, head_dim] in q's dtype.
    Raises:
      AttentionBackendError: an explicit choice that cannot run this call. ValueError: ``rope`` for an
        implementation that does not rotate.
    """
    impl = pick("attention", implementation, AttentionCall(q, k, segment_ids, window, causal))
    if rope is not None and not impl.rope_inside:
        raise ValueError(f"attention: {impl.name} does not apply rotary tables (rotate q and k first)")
    fn = impl.functions["attention"]
    if rope is not None:
        return fn(q, k, v, segment_ids, causal=causal, window=window, rope=rope)
    return fn(q, k, v, segment_ids, causal=causal, window=window)


# --- the matmul key: projections, the SwiGLU MLP, RMSNorm

def matmul(x: jax.Array, w: jax.Array, implementation: str = "auto") -> jax.Array:
    """``x @ w``: x [tokens, in], w [in, out] -> [tokens, out] in their dtype.

    Raises:
      ConfigError: an explicit choice that cannot take it (another backend, more than one device,
        non-float32 operands for a float32 kernel, a kernel that did not build).
    """
    return pick("matmul", implementation, MatmulCall("matmul", x, w)).functions["matmul"](x, w)


def matmuls(x: jax.Array, ws: tuple, implementation: str = "auto") -> Optional[tuple]:
    """``x @ w`` for each w of ``ws`` (x [tokens, in], w [in, out_i]) as one implementation's call sharing
    x (its gradient then one sum), or None where no implementation takes them together (call
    :func:`matmul` per product). Raises as :func:`matmul`."""
    impls = {pick("matmul", implementation, MatmulCall("matmul", x, w)) for w in ws}
    if len(impls) != 1:
        return None
    fn = next(iter(impls)).functions.get("matmuls")
    return None if fn is None else fn(x, tuple(ws))


def swiglu_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, implementation: str,
               names: tuple[str, ...]) -> Optional[jax.Array]:
    """``(silu(x w_gate) * (x w_up)) w_down`` fused by the implementation that takes its gate product, or
    None where none fuses it (compose it from :func:`matmul`). x [..., embed]; w_gate, w_up
    [embed, mlp]; w_down [mlp, embed]. ``names``: ``checkpoint_name`` s of the [tokens, mlp] values the
    backward reads (the SwiGLU carries each, nested in order), for remat and offload policies.
    Raises as :func:`matmul` (for the gate product)."""
    impl = pick("matmul", implementation, MatmulCall("matmul", x.reshape(-1, x.shape[-1]), w_gate))
    fn = impl.functions.get("mlp")
    if fn is None or impl.refuses(MatmulCall("mlp", x, w_gate), True, _facts("matmul", None)) is not None:
        return None
    return fn(x, w_gate, w_up, w_down, tuple(names))


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, implementation: str = "auto") -> Optional[jax.Array]:
    """RMSNorm of x [tokens, embed] with scale [embed] (float32) by the implementation of the ``matmul``
    key where it has a fused one that takes x, else None (compute it with XLA's ops)."""
    chosen = choice("matmul", implementation, MatmulCall("norm", x)).impl
    fn = chosen.functions.get("rms_norm")
    if fn is None or chosen.refuses(MatmulCall("norm", x), True, _facts("matmul", None)) is not None:
        return None
    return fn(x, scale, eps)


# --- the MoE experts' grouped SwiGLU

def grouped_swiglu(rows: jax.Array, expert: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                   implementation: str = "auto") -> jax.Array:
    """Each row through its expert's SwiGLU ``(silu(x w_gate[e]) * (x w_up[e])) w_down[e]`` (Shazeer 2020).

    Args:
      rows: [M, embed]; expert: [M] int32 in [0, E], E meaning no expert (output 0).
      w_gate, w_up: [E, embed, mlp]; w_down: [E, mlp, embed]; the rows' dtype.
    Returns: [M, embed] in the rows' dtype.
    Raises:
      ConfigError: an explicit choice that cannot take these operands.
    """
    impl = pick("grouped_matmul", implementation, GroupedCall(rows, w_gate, w_up, w_down))
    return impl.functions["grouped"](rows, expert, w_gate, w_up, w_down)


def buffers_swiglu(rows: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                   implementation: str = "auto") -> jax.Array:
    """Expert e's SwiGLU on its buffer ``rows[e]`` (capacity routing's slots): rows [E, slots, embed]
    -> [E, slots, embed]. Raises as :func:`grouped_swiglu`."""
    flat = rows.reshape(-1, rows.shape[-1])
    impl = pick("grouped_matmul", implementation, GroupedCall(flat, w_gate, w_up, w_down))
    return impl.functions["buffers"](rows, w_gate, w_up, w_down)


# --- the optimizer update

def fused_update(implementation: str = "auto") -> Optional[Any]:
    """The guarded AdamW update of the implementation the plan chose for ``optimizer.implementation``,
    or None where it has none (the step then runs optax's): ``(h, decay, count, loss, grads, params,
    opt_state, lr) -> (params, opt_state, grad_norm, finite)``."""
    return choice("optimizer", implementation).impl.functions.get("guarded_update")
