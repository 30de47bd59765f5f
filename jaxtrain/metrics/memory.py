"""Per-device memory accounting: state bytes from the shardings, program bytes from XLA.

Which bytes are counted (all per device, in bytes):
  * ``params``: every parameter leaf in its stored dtype (float32 masters for bf16 params
    unless ``optimizer.master_weights=false``), as sharded;
  * ``grads``: one gradient per parameter, same dtype and sharding as the parameter (the
    step casts gradients to the parameter dtype and constrains them to the parameter
    sharding; the float32 accumulation buffer of gradient accumulation is a temporary and
    shows up in the compiled ``temp`` figure instead);
  * ``opt_state``: every leaf of the optax state (AdamW ``mu`` and ``nu`` in the parameter
    dtype, plus the int32 step counters), as sharded;
  * from ``compiled.memory_analysis()``: ``argument`` (inputs: state + batch), ``output``,
    ``alias`` (outputs that reuse donated inputs), ``temp`` (activations and other XLA
    temporaries) and ``peak``: argument + output - alias + temp, the program's whole
    allocation (or XLA's own peak figure if larger; on CPU that one leaves out temporaries).

Device and host memory (``offload:``, ``jaxtrain.parallel.offload``). The memory model splits every
state figure by the memory kind of its sharding: ``params``/``opt_state`` are the device bytes,
``params_host``/``opt_state_host`` the ``pinned_host`` ones (gradients are always device bytes).
The compiled figures split where XLA separates them: ``host`` is XLA's ``host_argument + host_output
- host_alias + host_temp`` and ``device_peak`` the peak without it. XLA:CPU (jax 0.10.2) does not:
it counts a ``pinned_host`` argument in ``argument_size_in_bytes`` (and in the outputs and aliases
when donated) and reports 0 in every ``host_*`` field; there ``device_peak`` is the peak minus the
memory model's host state bytes and ``host_source`` says ``memory model``.

The yardstick is the ZeRO paper's table (Rajbhandari et al. 2020, section 3.1): mixed-
precision Adam keeps 16 bytes per parameter (2 fp16 params + 2 fp16 grads + 12 for the fp32
master copy, momentum and variance). jaxtrain's float32 AdamW also keeps 16 bytes per
parameter (4 params + 4 grads + 8 moments). Data parallelism holds all 16 on every device;
ZeRO-1 (``zero1``) divides the optimizer share by the data-parallel degree; ZeRO-3
(``fsdp``) divides all of it by the fsdp degree.
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import jax


def shard_bytes(leaf: Any, sharding: Optional[jax.sharding.Sharding] = None) -> int:
    """Bytes of the largest shard of one array (or ShapeDtypeStruct) on any device."""
    sharding = sharding if sharding is not None else getattr(leaf, "sharding", None)
    shape = tuple(leaf.shape)
    if sharding is not None:
        shape = tuple(sharding.shard_shape(shape))
    return math.prod(shape) * jax.numpy.dtype(leaf.dtype).itemsize


def tree_bytes(tree: Any, shardings: Any = None) -> int:
    """Sum of :func:`shard_bytes` over a pytree (shardings: a matching pytree, or taken from leaves)."""
    leaves = jax.tree_util.tree_leaves(tree)
    if shardings is None:
        return sum(shard_bytes(x) for x in leaves)
    sh = jax.tree_util.tree_leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    if len(sh) != len(leaves):
        raise ValueError(f"{len(sh)} shardings for {len(leaves)} arrays")
    return sum(shard_bytes(x, s) for x, s in zip(leaves, sh))


def compiled_bytes(compiled: Any, host_state: int = 0) -> dict:
    """Bytes per device of a compiled program: ``argument``, ``output``, ``alias``, ``temp``, ``peak``
    (all memory XLA counts there), ``host`` and ``device_peak`` (see the module docstring), and
    ``host_source``: 'xla' or 'memory model' (``host_state``: the state's host bytes per device)."""
    m = compiled.memory_analysis()
    out = {"argument": int(m.argument_size_in_bytes), "output": int(m.output_size_in_bytes),
           "alias": int(m.alias_size_in_bytes), "temp": int(m.temp_size_in_bytes)}
    # XLA's own peak (where reported) can leave out temporaries, as on CPU; take the larger.
    out["peak"] = max(int(getattr(m, "peak_memory_in_bytes", 0) or 0),
                      out["argument"] + out["output"] - out["alias"] + out["temp"])
    xla_host = sum(sign * int(getattr(m, f"host_{k}_size_in_bytes", 0) or 0)
                   for sign, k in ((1, "argument"), (1, "output"), (-1, "alias"), (1, "temp")))
    if xla_host > 0:  # XLA separates them (accelerators): its argument/output bytes are the device's
        out["host"], out["host_source"], out["device_peak"] = xla_host, "xla", out["peak"]
    else:  # XLA:CPU: pinned_host state counted in the arguments (and outputs, aliases): the model's split
        out["host"], out["host_source"] = host_state, "memory model"
        out["device_peak"] = out["peak"] - host_state
    return out


@dataclass
class MemoryReport:
    """Per-device bytes: state (from shardings) and, after compile, the program's figures."""

    params: int  # device bytes (as every figure below without _host)
    grads: int
    opt_state: int
    compiled: dict = field(default_factory=dict)
    params_host: int = 0  # pinned_host bytes (offload.params, or the masters with offload.optimizer)
    opt_state_host: int = 0  # pinned_host bytes (offload.optimizer)

    @property
    def state(self) -> int:
        """The state's device bytes: params + grads + optimizer state."""
        return self.params + self.grads + self.opt_state

    @property
    def host(self) -> int:
        """The state's host bytes."""
        return self.params_host + self.opt_state_host

    def summary(self) -> str:
        s = (f"memory per device: params {fmt_bytes(self.params)}, grads {fmt_bytes(self.grads)}, "
             f"optimizer {fmt_bytes(self.opt_state)}")
        if self.host:
            s += (f"; host memory: params {fmt_bytes(self.params_host)}, optimizer "
                  f"{fmt_bytes(self.opt_state_host)}")
        if self.compiled:
            c = self.compiled
            s += (f" | compiled: peak {fmt_bytes(c['peak'])} (arguments {fmt_bytes(c['argument'])}, "
                  f"outputs {fmt_bytes(c['output'])}, aliased {fmt_bytes(c['alias'])}, "
                  f"temporaries {fmt_bytes(c['temp'])})")
            if c.get("host"):
                s += (f"; device peak {fmt_bytes(c['device_peak'])}, host {fmt_bytes(c['host'])} "
                      f"(from the {c['host_source']}"
                      f"{': XLA:CPU counts pinned_host in the arguments' if c['host_source'] != 'xla' else ''})")
        return s


def state_report(abstract_state: dict, state_shardings: dict, compiled: Any = None) -> MemoryReport:
    """MemoryReport of a train state ``{'params', 'opt_state', ...}`` (arrays or ShapeDtypeStructs).

    Args:
      abstract_state: the state (or ``jax.eval_shape(trainer.init)``).
      state_shardings: the matching pytree of shardings (``Trainer.state_shardings``).
      compiled: optionally the compiled train step, for :func:`compiled_bytes`.
    """
    params, params_host = split_bytes(abstract_state["params"], state_shardings["params"])
    opt, opt_host = split_bytes(abstract_state["opt_state"], state_shardings["opt_state"])
    grads = tree_bytes(abstract_state["params"], state_shardings["params"])  # always in device memory
    return MemoryReport(params=params, grads=grads, opt_state=opt, params_host=params_host, opt_state_host=opt_host,
                        compiled=compiled_bytes(compiled, params_host + opt_host) if compiled is not None else {})


def split_bytes(tree: Any, shardings: Any) -> tuple[int, int]:
    """(device bytes, pinned_host bytes) per device of a pytree, by each sharding's memory kind."""
    leaves = jax.tree_util.tree_leaves(tree)
    sh = jax.tree_util.tree_leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    if len(sh) != len(leaves):
        raise ValueError(f"{len(sh)} shardings for {len(leaves)} arrays")
    host = sum(shard_bytes(x, s) for x, s in zip(leaves, sh) if s.memory_kind == "pinned_host")
    return sum(shard_bytes(x, s) for x, s in zip(leaves, sh)) - host, host


def activation_bytes(model_spec: Any, micro: dict, context: Callable = contextlib.nullcontext,
                     split: int = 1) -> tuple[int, int]:
    """(device, host) bytes per device that the forward pass of one micro-batch saves for the backward:
    the residuals of ``jax.vjp`` of the model's loss, by their memory space (offloaded activations are
    host-typed), from shapes alone (a jaxpr; nothing is compiled). Parameters and inputs passed through
    are not counted. An estimate: global bytes divided by ``split`` (the devices the batch is split
    over); activations also split over ``tensor`` or ``sequence`` are counted unsplit (conservative).

    Args:
      model_spec: the model (``make``, ``loss``); its remat policy is the model config's.
      micro: one micro-batch of ShapeDtypeStructs ``{field: [micro, ...]}``.
      context: entered while tracing (``jaxtrain.parallel.offload.active`` for offloaded names).
    """
    from flax import nnx
    model = nnx.eval_shape(lambda: model_spec.make(nnx.Rngs(0)))
    graphdef, params = nnx.split(model)

    def residuals(p, b):
        return jax.vjp(lambda q: model_spec.loss(nnx.merge(graphdef, q), b)[0], p)[1]

    with context():
        closed = jax.make_jaxpr(residuals)(params, micro)
    inputs = set(closed.jaxpr.invars)
    device = host = 0
    for v in closed.jaxpr.outvars:
        if v in inputs or not hasattr(v, "aval") or not hasattr(v.aval, "shape"):
            continue
        n = math.prod(v.aval.shape) * jax.numpy.dtype(v.aval.dtype).itemsize // split
        if getattr(v.aval, "memory_space", None) == jax.memory.Space.Host:
            host += n
        else:
            device += n
    return device, host


def check_fits(report: "MemoryReport", devices) -> None:
    """Refuses a compiled step that cannot run on ``devices``: its device peak above an accelerator's
    memory (``memory_stats()['bytes_limit']``), or on CPU its peak times this process's devices above
    the host's physical memory (a bound, not a fit: XLA:CPU's figure counts buffers it may reuse).
    Without this a step of 1.2 TiB was dispatched and died with RESOURCE_EXHAUSTED, exit 1.

    Raises:
      InputError: naming the peak, the memory and the keys that size it.
    """
    from jaxtrain.errors import InputError
    peak = (report.compiled or {}).get("device_peak")
    local = [d for d in devices if d.process_index == jax.process_index()]
    if not peak or not local:
        return
    if local[0].platform == "cpu":
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return
        need, what = peak * len(local), f"{len(local)} CPU device{'s' if len(local) > 1 else ''} x {fmt_bytes(peak)}"
    else:
        total = (local[0].memory_stats() or {}).get("bytes_limit") if hasattr(local[0], "memory_stats") else None
        if not total:
            return
        need, what = peak, f"{fmt_bytes(peak)} per {local[0].platform.upper()} device"
    if need > total:
        raise InputError(f"train.global_batch: the compiled train step needs {what} = {fmt_bytes(need)}, more than "
                         f"the {fmt_bytes(total)} there is; lower train.global_batch (or raise train.grad_accum), "
                         f"data.seq_len or the model, or find a layout: python -m jaxtrain.plan --device-memory")


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # unreachable
