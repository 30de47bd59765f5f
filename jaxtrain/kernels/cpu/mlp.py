"""The SwiGLU MLP ``(silu(x Wg) * (x Wu)) Wd`` (Shazeer 2020) through XLA:CPU kernels, float32, with
its elementwise work folded into the products (``mlp.cc``), and its gradients likewise: the Llama
MLP's path under ``model.matmul`` ``cpu_fused`` (and ``auto`` where that picks the kernel).

Why: with each projection a kernel call (:mod:`jaxtrain.kernels.cpu.matmul`), XLA still made the silu
and the products 3 passes over [tokens, d_ff] in the forward and 2 in the backward, ~0.1 ms each at the
shakespeare-char shape on a 2-core Intel Xeon, and dx a sum of two products. Here the forward is two
calls (gate, up and the SwiGLU in one; then ``Wd``) and the backward five (dh with dg and du in one,
dx as one sum, the three weight gradients).

One device, first-order reverse mode only, as :mod:`jaxtrain.kernels.cpu.matmul`. The kernel's
values differ from XLA's by float rounding (its own ``exp``, relative error ~1e-7).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.kernels.cpu import library
from jaxtrain.kernels.cpu.matmul import call, call_sum, product, rows_vmap


def _swiglu_call(x, w_gate, w_up):
    out = jax.ShapeDtypeStruct((x.shape[0], w_gate.shape[1]), jnp.float32)
    return tuple(jax.ffi.ffi_call(library.SWIGLU_FORWARD, (out, out, out), vmap_method="sequential")(
        x, w_gate, w_up))


_swiglu = rows_vmap(_swiglu_call)  # (h, g, u) [rows, d_ff] each


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _mlp(x, w_gate, w_up, w_down, names):
    return product(_tag(_swiglu(x, w_gate, w_up)[0], names), w_down)


def _tag(a, names):
    for name in names:
        a = checkpoint_name(a, name)
    return a


def _mlp_fwd(x, w_gate, w_up, w_down, names):
    h, g, u = _swiglu(x, w_gate, w_up)
    h, g, u = _tag(h, names), _tag(g, names[:1]), _tag(u, names[:1])
    return product(h, w_down), (x, w_gate, w_up, w_down, h, g, u)


def _mlp_bwd(names, res, dout):
    x, w_gate, w_up, w_down, h, g, u = res
    hidden = jax.ShapeDtypeStruct(g.shape, jnp.float32)
    # sequential under vmap (per-example gradients), as the matmul's calls
    dg, du = jax.ffi.ffi_call(library.SWIGLU_BACKWARD, (hidden, hidden), vmap_method="sequential")(dout, w_down, g, u)
    dx = call_sum(((dg, w_gate), (du, w_up)))
    return dx, call(x, dg, True, False), call(x, du, True, False), call(h, dout, True, False)


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


def mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, names: tuple[str, ...]) -> jax.Array:
    """``(silu(x w_gate) * (x w_up)) w_down`` and its gradients through the kernels.

    Args:
      x: [tokens, embed] float32; w_gate, w_up: [embed, mlp] float32; w_down: [mlp, embed] float32.
      names: ``checkpoint_name``s: the [tokens, mlp] values the backward reads (the gate and up products
        and the SwiGLU) carry the first, so that a remat policy saving it keeps them; the SwiGLU
        carries each one (nested, in order).
    Returns: [tokens, embed] float32; a row depends only on its own row of x.
    Raises:
      RuntimeError: the kernel is not available (:func:`jaxtrain.kernels.cpu.library.problem` says why).
      ValueError: shapes or dtypes the kernels do not take.
    """
    why = library.problem()
    if why:
        raise RuntimeError(f"model.matmul=cpu_fused: {why}")
    arrays = {"x": x, "w_gate": w_gate, "w_up": w_up, "w_down": w_down}
    bad = [f"{k} {a.dtype}{list(a.shape)}" for k, a in arrays.items() if a.ndim != 2 or a.dtype != jnp.float32]
    tokens, embed = x.shape if x.ndim == 2 else (0, 0)
    hidden = w_gate.shape[1] if w_gate.ndim == 2 else 0
    if bad or w_gate.shape != (embed, hidden) or w_up.shape != (embed, hidden) or w_down.shape != (hidden, embed):
        shapes = ", ".join(f"{k} {a.dtype}{list(a.shape)}" for k, a in arrays.items())
        raise ValueError(f"model.matmul=cpu_fused: the SwiGLU MLP takes 2-D float32 x [tokens, embed], w_gate and "
                         f"w_up [embed, mlp], w_down [mlp, embed]; got {shapes}")
    return _mlp(x, w_gate, w_up, w_down, tuple(names))
