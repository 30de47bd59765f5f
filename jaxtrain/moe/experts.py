"""Routed SwiGLU experts: dropless grouped matmuls or capacity buffers, and expert parallelism.

The router (top-k choice and combine weights) is the model's; this module runs every
token copy through its chosen expert and adds the copies back up:

  y[token] = sum_j combine[token, j] * expert_{idx[token, j]}(x[token])
  expert_e(x) = (silu(x w_gate[e]) * (x w_up[e])) w_down[e]

Two ways to run the experts:

* **dropless** (MegaBlocks, Gale et al. 2023): the copies are sorted by expert and run as
  grouped matmuls: ``jax.lax.ragged_dot`` with the per-expert group sizes on GPU and TPU.
  XLA:CPU expands ``ragged_dot`` into one masked dense matmul per group (n_experts x the
  work), so on CPU the sorted copies run through the kernel registry's grouped implementation for
  CPU (``model.grouped_matmul``: :func:`jaxtrain.kernels.ops.grouped_swiglu`). No token is dropped.
* **capacity** (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2022): each expert has
  ``capacity`` slots per sequence; the model gives each copy its slot, and copies whose slot
  is >= capacity are dropped (they contribute zero; the residual carries the token on).
  The experts run over ``[experts, slots, embed]`` buffers (:func:`jaxtrain.kernels.ops.buffers_swiglu`).

**Expert parallelism.** Inside the trainer's activation-sharding context, when the rules shard
the ``exp`` dimension of the expert weights over mesh axes (``sharding_rules/ep.yaml``:
``exp: [expert]``), the experts run under ``shard_map``: each device keeps its
``n_experts / ep`` experts' weights (never gathering the others) and its own tokens, sends
each copy to the device that holds its expert with ``jax.lax.all_to_all``, runs its experts
on what it receives, and sends the results back with a second all-to-all. Dropless routing
sends each device exactly the copies for its experts (``jax.lax.ragged_all_to_all``) into a
receive buffer sized for the worst case (every copy of every device), and the grouped matmul
computes only the rows received. XLA:CPU has no ragged all-to-all: there it is emulated with a
dense all-to-all of chunks padded to the worst case (``ep`` x the bytes; correct, for tests and small
runs); what the grouped matmul computes of that buffer depends on its implementation. Capacity routing sends
each expert's slot buffers. The ``mlp`` dimension may be split over other axes (``tensor``):
each device then holds a slice of every local expert's hidden units and the outputs are summed
over those axes. Model code never sees a
mesh: it calls :func:`routed_experts`, which reads the active rules.
"""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxtrain.errors import ShardingError
from jaxtrain.kernels import ops, target
from jaxtrain.kernels.rows import inverse_permutation, permute_rows
from jaxtrain.parallel import pipeline
from jaxtrain.parallel.activations import active_sharding


def _ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis, chunk: int):
    """``jax.lax.ragged_all_to_all`` on GPU and TPU; on CPU (which lacks it) the same result from a dense
    all-to-all of each destination's rows padded to ``chunk`` rows (the most any one chunk holds).

    Chunk j of ``operand`` (rows ``input_offsets[j]`` .. ``+ send_sizes[j]``) lands in device j's
    ``output`` at its ``output_offsets[j]``; ``recv_sizes[i]`` is the row count device i sends here.
    """
    if target.backend() != "cpu":
        return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                         axis_name=axis)
    ep = send_sizes.shape[0]
    row = jnp.arange(chunk)
    src = jnp.clip(input_offsets[:, None] + row, 0, operand.shape[0] - 1)  # [ep, chunk]
    tail = (1,) * (operand.ndim - 1)
    chunks = jnp.where((row < send_sizes[:, None]).reshape(ep, chunk, *tail), operand[src], 0)
    recv = jax.lax.all_to_all(chunks, axis, 0, 0, tiled=True)  # [ep (source), chunk, ...]
    at = jax.lax.all_to_all(output_offsets, axis, 0, 0, tiled=True)  # where each source's chunk goes here
    dst = jnp.where(row < recv_sizes[:, None], at[:, None] + row, output.shape[0])  # past the end: dropped
    return output.at[dst.reshape(-1)].set(recv.reshape(ep * chunk, *operand.shape[1:]), mode="drop")


def _dropless(x2, idx, w_gate, w_up, w_down, axis, ep: int, grouped: str = "auto") -> jax.Array:
    """x2 [n, embed], idx [n, k] (global expert ids) -> expert outputs per copy [n, k, embed].

    With experts on ``ep`` devices: the copies, sorted by destination device, go out in one ragged
    all-to-all (each device's receive buffer holds the worst case, every copy of every device:
    ``ep * n * k`` rows, of which only the received ones are computed by the grouped matmul on
    GPU/TPU), and the results come back the same way.
    """
    n, k = idx.shape
    m, e = n * k, idx.reshape(-1)
    # Each token's k copies side by side: a broadcast, whose transpose is a sum (a gather's is a scatter-add).
    copies = jnp.broadcast_to(x2[:, None], (n, k, x2.shape[1])).reshape(m, -1)
    if ep == 1:
        return ops.grouped_swiglu(copies, e, w_gate, w_up, w_down, grouped).reshape(n, k, -1)
    e_loc = w_gate.shape[0]  # experts on this device
    dest = e // e_loc
    order = jnp.argsort(dest, stable=True).astype(jnp.int32)  # copies grouped by destination device
    inverse = inverse_permutation(order)
    sizes = jnp.bincount(dest, length=ep).astype(jnp.int32)
    in_off = jnp.cumsum(sizes) - sizes  # where each destination's rows start here
    recv_sizes = jax.lax.all_to_all(sizes, axis, 0, 0, tiled=True)  # rows each source sends here
    recv_off = jnp.cumsum(recv_sizes) - recv_sizes  # where each source's rows start in the receive buffer
    out_off = jax.lax.all_to_all(recv_off, axis, 0, 0, tiled=True)  # where my rows start at each destination
    send = lambda rows, fill: _ragged_all_to_all(  # noqa: E731
        rows, jnp.full((ep * m, *rows.shape[1:]), fill, rows.dtype), in_off, sizes, out_off, recv_sizes, axis, m)
    rows = send(permute_rows(copies, order, inverse), 0)  # [ep * m, embed]
    expert = send((e % e_loc)[order][:, None].astype(jnp.int32), e_loc)[:, 0]  # e_loc: an empty row
    out = ops.grouped_swiglu(rows, expert, w_gate, w_up, w_down, grouped)
    # Back: each source's rows from where they landed here to where they left it.
    back = _ragged_all_to_all(out, jnp.zeros((m, out.shape[1]), out.dtype), recv_off, recv_sizes,
                              jax.lax.all_to_all(in_off, axis, 0, 0, tiled=True), sizes, axis, m)
    return permute_rows(back, inverse, order).reshape(n, k, -1)


def _capacity(x, idx, slots, capacity: int, w_gate, w_up, w_down, axis, ep: int, grouped: str = "auto") -> jax.Array:
    """x [b, t, embed], idx/slots [b, t, k] -> expert outputs per copy [b, t, k, embed] (dropped: 0)."""
    b, t, k = idx.shape
    n_exp = w_gate.shape[0] * ep
    keep = slots < capacity
    slot = jnp.where(keep, slots, capacity)  # dropped copies go to a spare slot that is cut off
    row = jnp.broadcast_to(jnp.arange(b)[:, None, None], idx.shape)
    copies = jnp.broadcast_to(x[:, :, None, :], (b, t, k, x.shape[-1]))
    buf = jnp.zeros((n_exp, b, capacity + 1, x.shape[-1]), x.dtype).at[idx, row, slot].set(copies)
    buf = buf[:, :, :capacity]  # [experts, b, capacity, embed]
    if ep > 1:
        buf = jax.lax.all_to_all(buf, axis, 0, 0, tiled=True)  # my experts' buffers from every source
        buf = buf.reshape(ep, n_exp // ep, b, capacity, -1).swapaxes(0, 1)
    rows = buf.reshape(w_gate.shape[0], -1, x.shape[-1])  # [local experts, slots, embed]
    out = ops.buffers_swiglu(rows, w_gate, w_up, w_down, grouped).reshape(buf.shape)
    if ep > 1:
        out = jax.lax.all_to_all(out.swapaxes(0, 1).reshape(n_exp, b, capacity, -1), axis, 0, 0, tiled=True)
    out = jnp.pad(out, ((0, 0), (0, 0), (0, 1), (0, 0)))  # the spare slot reads zeros
    return jnp.where(keep[..., None], out[idx, row, slot], 0)


def _local(x, idx, combine, slots, w_gate, w_up, w_down, *, capacity, axis, ep, mlp_axes, grouped="auto"):
    """The per-device computation (the whole thing on one device): [b, t, embed] -> same."""
    b, t, d = x.shape
    if capacity is None:
        y = _dropless(x.reshape(b * t, d), idx.reshape(b * t, -1), w_gate, w_up, w_down, axis, ep, grouped)
        y = y.reshape(b, t, -1, d)
    else:
        y = _capacity(x, idx, slots, capacity, w_gate, w_up, w_down, axis, ep, grouped)
    out = jnp.einsum("btkd,btk->btd", y.astype(jnp.float32), combine.astype(jnp.float32))
    if mlp_axes:  # each device summed over its slice of the hidden units
        out = jax.lax.psum(out, mlp_axes)
    return out.astype(x.dtype)


def _check_vma() -> bool:
    """shard_map's replication check, off inside a pipeline stage: there the stage ``vmap`` (its
    ``spmd_axis_name``) makes every value vary over ``stage`` as well, which the check cannot see."""
    return pipeline.active_schedule() is None


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def top_k(probs: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k`` over the last dim of probs [batch, length, E], on each device's own tokens.

    GSPMD gathers the whole batch before a sharded ``top_k``; under the trainer's activation
    sharding this runs it per device inside ``shard_map`` instead (the choice is per token).
    Returns (values [batch, length, k] float32, indices [batch, length, k] int32).
    """
    active = active_sharding()
    if active is None:
        return jax.lax.top_k(probs, k)
    rules, mesh = active
    spec = rules.partition_spec("moe router probabilities", ("batch", "length", None), probs.shape, mesh)
    return jax.shard_map(lambda p: tuple(jax.lax.top_k(p, k)), mesh=mesh, in_specs=spec, out_specs=(spec, spec),
                         check_vma=_check_vma(),
                         )(probs)


def expert_layout(rules, mesh_shape, w_shape, x_shape):
    """(exp axes, mlp axes, (batch axes or None, length axes or None)) of the experts under ``rules``.

    Mesh axes of size 1 are left out (they split nothing). ``mesh_shape``: axis -> size;
    ``w_shape``: [exp, embed, mlp]; ``x_shape``: [batch, length, embed].
    Raises ShardingError as :func:`routed_experts` documents.
    """
    sized = type("Sizes", (), {"shape": dict(mesh_shape)})  # what Rules.partition_spec reads of a mesh
    big = lambda entry: tuple(a for a in _axes(entry) if mesh_shape[a] > 1)  # noqa: E731
    w_spec = rules.partition_spec("moe expert weights", ("exp", "embed", "mlp"), w_shape, sized)
    exp_axes, mlp_axes = big(w_spec[0]), big(w_spec[2])
    tok_spec = rules.partition_spec("moe tokens", ("batch", "length", "embed"), x_shape, sized)
    tok_axes = big(tok_spec[0]) + big(tok_spec[1])
    clash = [a for a in mlp_axes if a in tok_axes]
    if clash:
        raise ShardingError(f"moe expert weights: dimension 2 ('mlp') uses mesh axis '{clash[0]}', which also "
                            f"splits the tokens ('batch'/'length') in rule set '{rules.name}'")
    lone = [a for a in exp_axes if a not in tok_axes]
    if lone:  # each device must send its own tokens: tokens copied over an expert axis would be sent twice
        raise ShardingError(f"moe expert weights: dimension 0 ('exp') uses mesh axis '{lone[0]}', which does not "
                            f"split the tokens in rule set '{rules.name}' (add it to the 'batch' rule)")
    return exp_axes, mlp_axes, (big(tok_spec[0]) or None, big(tok_spec[1]) or None)


def routed_experts(x: jax.Array, idx: jax.Array, combine: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                   w_down: jax.Array, slots: Optional[jax.Array] = None,
                   capacity: Optional[int] = None, grouped: str = "auto") -> jax.Array:
    """Every token through its top-k experts, weighted: see the module docstring.

    Args:
      x: [batch, length, embed] tokens, in the compute dtype.
      idx: [batch, length, k] int32 expert of each copy; combine: [batch, length, k] float32 weights.
      w_gate, w_up: [exp, embed, mlp]; w_down: [exp, mlp, embed] (compute dtype).
      slots: [batch, length, k] int32 slot of each copy in its expert's per-sequence buffer
        (capacity routing; copies with slot >= capacity are dropped), or None (dropless).
      capacity: slots per expert and sequence, or None (dropless).
      grouped: ``model.grouped_matmul``, the experts' grouped matmul (:func:`jaxtrain.kernels.ops.grouped_swiglu`;
        capacity routing's buffers: :func:`jaxtrain.kernels.ops.buffers_swiglu`).
    Returns:
      [batch, length, embed] in x's dtype.
    Raises:
      ShardingError: the rules split the experts' ``mlp`` over an axis that also splits the tokens,
        split ``exp`` over an axis that does not split the tokens, or the expert count is not
        divisible by the devices on ``exp``.
    """
    active = active_sharding()
    fn = dict(capacity=capacity, grouped=grouped)
    if active is None:
        return _local(x, idx, combine, slots, w_gate, w_up, w_down, axis=None, ep=1, mlp_axes=(), **fn)
    rules, mesh = active
    exp_axes, mlp_axes, tok_entries = expert_layout(rules, mesh.shape, w_gate.shape, x.shape)
    ep = math.prod(mesh.shape[a] for a in exp_axes)
    t_spec = P(*tok_entries, None)
    e_entry, m_entry = exp_axes or None, mlp_axes or None
    win, wout = P(e_entry, None, m_entry), P(e_entry, m_entry, None)
    slot_arg = jnp.zeros(idx.shape, jnp.int32) if slots is None else slots
    body = lambda *a: _local(*a, axis=exp_axes or None, ep=ep, mlp_axes=mlp_axes, **fn)  # noqa: E731
    run = jax.shard_map(body, mesh=mesh, in_specs=(t_spec, t_spec, t_spec, t_spec, win, win, wout),
                        out_specs=t_spec, check_vma=_check_vma())
    return run(x, idx, combine, slot_arg, w_gate, w_up, w_down)
