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

The yardstick is the ZeRO paper's table (Rajbhandari et al. 2020, section 3.1): mixed-
precision Adam keeps 16 bytes per parameter (2 fp16 params + 2 fp16 grads + 12 for the fp32
master copy, momentum and variance). jaxtrain's float32 AdamW also keeps 16 bytes per
parameter (4 params + 4 grads + 8 moments). Data parallelism holds all 16 on every device;
ZeRO-1 (``zero1``) divides the optimizer share by the data-parallel degree; ZeRO-3
(``fsdp``) divides all of it by the fsdp degree.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

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


def compiled_bytes(compiled: Any) -> dict[str, int]:
    """``argument``, ``output``, ``alias``, ``temp`` and ``peak`` bytes per device of a compiled program."""
    m = compiled.memory_analysis()
    out = {"argument": int(m.argument_size_in_bytes), "output": int(m.output_size_in_bytes),
           "alias": int(m.alias_size_in_bytes), "temp": int(m.temp_size_in_bytes)}
    # XLA's own peak (where reported) can leave out temporaries, as on CPU; take the larger.
    out["peak"] = max(int(getattr(m, "peak_memory_in_bytes", 0) or 0),
                      out["argument"] + out["output"] - out["alias"] + out["temp"])
    return out


@dataclass
class MemoryReport:
    """Per-device bytes: state (from shardings) and, after compile, the program's figures."""

    params: int
    grads: int
    opt_state: int
    compiled: dict[str, int] = field(default_factory=dict)

    @property
    def state(self) -> int:
        return self.params + self.grads + self.opt_state

    def summary(self) -> str:
        s = (f"memory per device: params {fmt_bytes(self.params)}, grads {fmt_bytes(self.grads)}, "
             f"optimizer {fmt_bytes(self.opt_state)}")
        if self.compiled:
            c = self.compiled
            s += (f" | compiled: peak {fmt_bytes(c['peak'])} (arguments {fmt_bytes(c['argument'])}, "
                  f"outputs {fmt_bytes(c['output'])}, aliased {fmt_bytes(c['alias'])}, "
                  f"temporaries {fmt_bytes(c['temp'])})")
        return s


def state_report(abstract_state: dict, state_shardings: dict, compiled: Any = None) -> MemoryReport:
    """MemoryReport of a train state ``{'params', 'opt_state', ...}`` (arrays or ShapeDtypeStructs).

    Args:
      abstract_state: the state (or ``jax.eval_shape(trainer.init)``).
      state_shardings: the matching pytree of shardings (``Trainer.state_shardings``).
      compiled: optionally the compiled train step, for :func:`compiled_bytes`.
    """
    params = tree_bytes(abstract_state["params"], state_shardings["params"])
    return MemoryReport(params=params, grads=params,
                        opt_state=tree_bytes(abstract_state["opt_state"], state_shardings["opt_state"]),
                        compiled=compiled_bytes(compiled) if compiled is not None else {})


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # unreachable
