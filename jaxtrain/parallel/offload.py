"""Host-memory offload (the ``offload:`` keys): optimizer state, parameters and named activations.

Three independent kinds, each one key, for every family and for ``jaxtrain.fit`` custom models:

* ``offload.optimizer: host``: the AdamW moments, and the float32 master weights of low-precision
  parameters (``optimizer.master_weights``), live in ``pinned_host`` memory between steps: their
  shardings carry ``memory_kind="pinned_host"`` in the state's shardings, so in the jitted step's
  in/out shardings and its donation. The step brings them to device memory for the update
  (:func:`guarded_update`) and puts the results back; the gradients and every intermediate of
  the update are device values (JAX types memory spaces: an op mixing host and device operands
  is a trace-time error, and nothing here computes on host values).
* ``offload.params: host``: every parameter lives in host memory. Those of the shared decoder's
  stacked layers stay there inside the step: the decoder's scan fetches one layer's weights per
  iteration (:func:`fetch_layer`, a transfer XLA can overlap with the previous layer's compute),
  for the forward and again for the backward (the remat policy recomputes the fetch rather than
  keeping every layer's weights: hence ``model.remat`` must not be ``none``). The other
  parameters (embedding, final norm, head; all of a custom model's) are fetched at the start of
  the step (:func:`for_forward`). JAX types the cotangent of a host value as a host value, so the
  stacked layers' gradients come out of the backward scan typed host; the step moves them to the
  device at once (:func:`to_device`), before any use: no gradient is kept in host memory.
* ``offload.activations: [names]``: activations tagged with
  ``jax.ad_checkpoint.checkpoint_name`` under these names are saved to ``pinned_host`` in the
  forward and brought back for the backward, instead of being recomputed
  (:func:`offloading_policy`, built on ``jax.checkpoint_policies.save_and_offload_only_these_names``).
  The decoder families tag ``attn_in``, ``qkv``, ``attn_out``, ``mlp_in`` (and llama ``mlp_hidden``);
  a custom model tags its own and wraps its blocks in :func:`checkpoint`. Names the model does not tag
  are a ConfigError listing those it does (:func:`model_names`, :func:`check_names`). Offloading needs
  a remat policy that recomputes (``model.remat`` full or save_matmuls): without one the backward
  keeps derivative terms, not the named values, so nothing would move.

XLA:CPU: every memory kind exists, so all of this compiles and runs on CPU with the same
results, but ``device_put`` inside ``jit`` lowers to nothing there (JAX emits the
``annotate_device_placement`` transfers for ``cuda``/``rocm``/``tpu`` only): on CPU the placement
shows in the entry layout (``S(5)``, host memory space) and the input/output shardings; the
in-program transfers show when the step is lowered for ``cuda`` (tests/unit/test_offload.py).
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import Recompute

from jaxtrain.errors import ConfigError

HOST = "pinned_host"  # the memory kind offloaded state and activations live in
DEVICE = "device"


@dataclass(frozen=True)
class Plan:
    """What one run offloads (from ``cfg.offload``).

    Attributes:
      optimizer: the moments and float32 masters live in host memory.
      params: every parameter lives in host memory.
      activations: the tagged activations saved to host instead of recomputed.
      streamed: the parameters under the top-level ``layers`` key (the shared decoder's stacked
        blocks) stay in host memory inside the step and are fetched one layer at a time.
    """

    optimizer: bool = False
    params: bool = False
    activations: tuple[str, ...] = ()
    streamed: bool = False

    @classmethod
    def from_config(cls, cfg: Any) -> "Plan":
        o = cfg.offload
        params = o.params == "host"
        stacked = bool(getattr(cfg.model, "scan_layers", False)) and getattr(type(cfg.model), "pipelines", False)
        return cls(optimizer=o.optimizer == "host", params=params, activations=tuple(o.activations),
                   streamed=params and stacked)

    @property
    def state(self) -> bool:
        """Whether any part of the train state lives in host memory."""
        return self.optimizer or self.params


def is_host(x: Any) -> bool:
    """Whether ``x`` (an array or a tracer) is typed as living in host memory."""
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


def to_device(tree: Any) -> Any:
    """Every host-typed leaf of ``tree`` moved to device memory (inside ``jit``); others as they are."""
    return jax.tree_util.tree_map(lambda x: jax.device_put(x, jax.memory.Space.Device) if is_host(x) else x, tree)


def like(tree: Any, shardings: Any) -> Any:
    """``tree`` (device values) put in the memory kinds of ``shardings`` (a matching pytree)."""
    return jax.tree_util.tree_map(
        lambda x, s: jax.device_put(x, jax.memory.Space.Host) if s.memory_kind == HOST else x, tree, shardings)


def host_mask(plan: Plan, stored: Any, model_dtypes: Any) -> Any:
    """Which parameters live in host memory: all with ``params``; with ``optimizer``, the float32
    masters (stored dtype wider than the model's). A pytree of bools like ``stored`` (dtypes)."""
    return jax.tree_util.tree_map(lambda s, m: plan.params or (plan.optimizer and jnp.dtype(s) != jnp.dtype(m)),
                                  stored, model_dtypes)


def with_kind(shardings: Any, mask: Any = True) -> Any:
    """``shardings`` with ``memory_kind=pinned_host`` where ``mask`` (a bool, or a matching pytree) holds."""
    if isinstance(mask, bool):
        return jax.tree_util.tree_map(lambda s: s.with_memory_kind(HOST) if mask else s, shardings)
    return jax.tree_util.tree_map(lambda s, m: s.with_memory_kind(HOST) if m else s, shardings, mask)


def for_forward(params: dict, plan: Plan) -> dict:
    """The params the model sees: host leaves fetched to device, except the streamed stacked layers
    (``params['layers']``), which the decoder fetches per layer (:func:`fetch_layer`)."""
    if not plan.streamed:
        return to_device(params)
    return {k: v if k == "layers" else to_device(v) for k, v in params.items()}


def guarded_update(update: Callable, finite: jax.Array, params: Any, opt_state: Any, shardings: dict) -> tuple:
    """``update(params, opt_state)`` on device copies of host-resident state, kept only where
    ``finite`` (per leaf: the non-finite guard without a ``cond`` over host values, which would keep
    the whole state on the device at once), then put back in the kinds of ``shardings``
    (``{'params', 'opt_state'}``). Returns (params, opt_state)."""
    p, o = to_device(params), to_device(opt_state)
    new_p, new_o = update(p, o)
    keep = lambda new, old: jax.tree_util.tree_map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
    return like(keep(new_p, p), shardings["params"]), like(keep(new_o, o), shardings["opt_state"])


# ---------------------------------------------------------------- inside the model (the decoder)

@dataclass
class _Active:
    plan: Plan
    layer_dtypes: Optional[dict] = None  # the model dtypes of one stacked layer's params (pure dict)


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("jaxtrain_offload", default=None)


@contextlib.contextmanager
def active(plan: Plan, layer_dtypes: Optional[dict] = None):
    """While tracing inside this context, the decoder fetches streamed layers (:func:`fetch_layer`)
    and its remat policies offload ``plan.activations`` (:func:`checkpoint`)."""
    token = _ACTIVE.set(_Active(plan, layer_dtypes))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def offloaded_activations() -> tuple[str, ...]:
    """The activation names the active context offloads (none outside one)."""
    a = _ACTIVE.get()
    return a.plan.activations if a is not None else ()


def fetch_layer(state: Any) -> Any:
    """One layer's parameters (an ``nnx.State`` sliced from the stacked layers inside the scan)
    fetched to device memory and cast to the model's dtypes; unchanged when nothing is streamed."""
    a = _ACTIVE.get()
    leaves = jax.tree_util.tree_leaves(state)
    if a is None or not a.plan.streamed or not any(is_host(x) for x in leaves):
        return state
    from flax import nnx
    pure = nnx.to_pure_dict(state)
    dtypes = a.layer_dtypes if a.layer_dtypes is not None else jax.tree_util.tree_map(lambda x: x.dtype, pure)
    fetched = jax.tree_util.tree_map(lambda x, dt: jax.device_put(x, jax.memory.Space.Device).astype(dt),
                                     pure, dtypes)
    state = jax.tree_util.tree_map(lambda x: x, state)  # fresh Variables
    nnx.replace_by_pure_dict(state, fetched)
    return state


def cast(x: jax.Array, dtype: Any) -> jax.Array:
    """``x.astype(dtype)`` for device values; a host value is left for :func:`fetch_layer` to cast
    after its transfer (a cast of a host value would be host compute)."""
    return x if is_host(x) else x.astype(dtype)


def offloading_policy(names: Iterable[str], base: Optional[Callable] = None) -> Optional[Callable]:
    """A remat policy: ``names`` offloaded to ``pinned_host`` (``save_and_offload_only_these_names``
    with ``offload_src="device"``, ``offload_dst="pinned_host"``), everything else as ``base``
    decides (None: recomputed). Returns ``base`` itself when ``names`` is empty."""
    names = tuple(names)
    if not names:
        return base
    offload = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=names, offload_src=DEVICE, offload_dst=HOST)

    def policy(prim, *args, **params):
        decision = offload(prim, *args, **params)
        if decision is not Recompute or base is None:
            return decision
        return base(prim, *args, **params)
    return policy


def checkpoint(fn: Callable, base: Optional[Callable] = None, prevent_cse: bool = True) -> Callable:
    """``jax.checkpoint(fn)`` whose policy offloads the active context's activation names and leaves
    the rest to ``base`` (None: recompute): what a custom model wraps its blocks in."""
    return jax.checkpoint(fn, policy=offloading_policy(offloaded_activations(), base), prevent_cse=prevent_cse)


# ---------------------------------------------------------------- the names a model tags

def tagged_names(jaxpr: Any) -> set[str]:
    """Every ``checkpoint_name`` in a (closed) jaxpr and the jaxprs nested in it (scan, cond, remat...)."""
    found: set[str] = set()
    todo = [jaxpr]
    while todo:
        j = todo.pop()
        j = getattr(j, "jaxpr", j)
        for eqn in j.eqns:
            if eqn.primitive.name == "name":
                found.add(eqn.params["name"])
            for v in eqn.params.values():
                for sub in v if isinstance(v, (list, tuple)) else (v,):
                    if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                        todo.append(sub)
    return found


def names_of(fn: Callable, *args: Any) -> set[str]:
    """The names ``fn(*args)`` tags, from its jaxpr (``args``: arrays, tracers or ShapeDtypeStructs)."""
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), args)
    return tagged_names(jax.make_jaxpr(fn)(*abstract))


def model_names(model_spec: Any, micro: dict) -> set[str]:
    """The names a ModelSpec's loss tags on one micro-batch ``{field: [micro, ...]}`` (shapes suffice)."""
    from flax import nnx
    model = nnx.eval_shape(lambda: model_spec.make(nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    return names_of(lambda st, b: model_spec.loss(nnx.merge(graphdef, st), b)[0], state, micro)


def check_names(wanted: Iterable[str], tagged: Iterable[str], model: str) -> None:
    """Raises ConfigError naming the ``offload.activations`` entries ``model`` does not tag. The kernels' own
    tag of their matmul outputs (``jaxtrain.kernels.ops.MATMUL_NAME``, for remat) is not an activation a
    user offloads: it exists only where a kernel runs, so accepting it would depend on the device count."""
    from jaxtrain.kernels.ops import MATMUL_NAME
    tagged = sorted(set(tagged) - {MATMUL_NAME})
    unknown = [n for n in wanted if n not in tagged]
    if unknown:
        known = ", ".join(tagged) if tagged else "none (tag activations with jax.ad_checkpoint.checkpoint_name)"
        raise ConfigError(f"offload.activations: {', '.join(repr(n) for n in unknown)} not tagged by model "
                          f"'{model}'; it tags: {known}")


# ---------------------------------------------------------------- layouts the planner weighs

@dataclass(frozen=True)
class Layout:
    """One (``model.remat``, ``offload.*``) combination (``python -m jaxtrain.plan --device-memory``)."""

    remat: str
    optimizer: bool = False
    params: bool = False
    activations: tuple[str, ...] = ()
    scan: bool = False  # also sets model.scan_layers=true (parameter offload streams the stacked layers)

    def overrides(self) -> list[str]:
        """The config overrides that select this layout."""
        kind = lambda on: "host" if on else "device"  # noqa: E731
        return [f"model.remat={self.remat}", f"offload.optimizer={kind(self.optimizer)}",
                f"offload.params={kind(self.params)}", f"offload.activations=[{','.join(self.activations)}]",
                *(["model.scan_layers=true"] if self.scan else [])]

    def apply(self, cfg: Any) -> Any:
        """``cfg`` (a Config) with this layout's keys, validated like a loaded config (ConfigError)."""
        from jaxtrain.config import from_dict
        tree = cfg.to_dict()
        tree["model"]["remat"] = self.remat
        if self.scan:
            tree["model"]["scan_layers"] = True
        tree["offload"] = {"optimizer": "host" if self.optimizer else "device",
                           "params": "host" if self.params else "device", "activations": list(self.activations)}
        return from_dict(tree)

    def __str__(self) -> str:
        parts = [p for p, on in (("optimizer", self.optimizer), ("params", self.params),
                                 ("activations", bool(self.activations))) if on]
        return f"remat={self.remat} offload={'+'.join(parts) or '-'}" + (" scan_layers=true" if self.scan else "")


def layouts(names: tuple[str, ...], scan: bool = False) -> list[Layout]:
    """Every layout: remat none / save_matmuls / full x optimizer, params on host or not x the named
    activations offloaded or not (parameter and activation offload need a recomputing remat policy).
    ``scan``: the config's layers are not stacked, so the parameter-offload layouts stack them too
    (``model.scan_layers=true``), rather than being refused for it."""
    out = []
    for remat in ("none", "save_matmuls", "full"):
        for optimizer in (False, True):
            for params in (False, True):
                for acts in ((), tuple(names)) if names else ((),):
                    if remat == "none" and (params or acts):
                        continue
                    out.append(Layout(remat, optimizer, params, acts, scan=scan and params))
    return out


def recompute_flops(remat: str, per_token: float, per_token_no_attention: float, head: float) -> float:
    """FLOPs per token the backward pass recomputes: 0 without remat; the attention core's forward with
    ``save_matmuls`` (its batched dots are not saved): (F(T) - F(0)) / 3 from the family's training
    FLOPs per token F at length T and 0; the whole forward but the LM head (``head``: its training
    FLOPs per token) with ``full``: (F(T) - head) / 3."""
    if remat == "none":
        return 0.0
    if remat == "save_matmuls":
        return (per_token - per_token_no_attention) / 3
    return (per_token - head) / 3


def transfer_bytes(layout: Layout, params_host: int, opt_host: int, acts_host: int, accum: int) -> int:
    """Host<->device bytes per device per step: the moments in and out (2x) and the masters fetched for
    the forward and the update and written back (3x); with parameters on host, every parameter fetched
    for each micro-batch's forward and backward, its gradient out and back, and in and out for the
    update ((2 accum + 4)x); offloaded activations out and back per micro-batch (2x)."""
    b = 2 * opt_host if layout.optimizer else 0
    if layout.params:
        b += (2 * accum + 4) * params_host
    elif layout.optimizer:
        b += 3 * params_host
    return b + 2 * acts_host * accum
