"""The one device mesh: axes (data, fsdp, tensor, sequence, expert)."""
from __future__ import annotations

import math
from typing import Optional, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jaxtrain.config import MESH_AXES, MeshConfig
from jaxtrain.errors import ConfigError


def resolve_sizes(mesh_cfg: MeshConfig, n_devices: int) -> dict[str, int]:
    """Axis sizes with the single -1 filled in so that their product is ``n_devices``.

    Raises:
      ConfigError: the product does not equal ``n_devices`` (naming every size),
        or the -1 axis cannot be filled evenly.
    """
    sizes = {a: getattr(mesh_cfg, a) for a in MESH_AXES}
    fixed = math.prod(s for s in sizes.values() if s != -1)
    desc = ", ".join(f"{a}={s}" for a, s in sizes.items())
    free = [a for a, s in sizes.items() if s == -1]
    if free:
        if n_devices % fixed:
            raise ConfigError(f"mesh.{free[0]}: cannot fill -1: {n_devices} devices are not divisible by "
                              f"the product {fixed} of the other axes ({desc})")
        sizes[free[0]] = n_devices // fixed
    elif fixed != n_devices:
        raise ConfigError(f"mesh: the axis sizes multiply to {fixed} but there are {n_devices} devices ({desc})")
    return sizes


def build_mesh(mesh_cfg: MeshConfig, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A ``jax.sharding.Mesh`` over ``devices`` (default: all) with Auto axis types.

    Auto (GSPMD-style) axes let sharding constraints propagate rather than assert, which is what
    the logical-rule approach relies on. The grid is laid out with ``stage`` outermost (pipeline
    stages exchange one activation per microbatch: the axis that talks least), then the axes in
    order, ``expert`` innermost. With ``mesh.across_nodes`` it is a hybrid mesh: each axis split
    into a part across nodes (processes, or TPU slices) and a part within one
    (``create_hybrid_device_mesh``), so an axis kept within a node never crosses the slow network.

    Raises:
      ConfigError: ``mesh.across_nodes`` does not fit the axis sizes or the number of nodes.
    """
    devices = list(devices) if devices is not None else jax.devices()
    sizes = resolve_sizes(mesh_cfg, len(devices))
    order = ("stage", *[a for a in MESH_AXES if a != "stage"])
    if mesh_cfg.across_nodes:
        grid = _hybrid_grid(sizes, dict(mesh_cfg.across_nodes), devices, order)
    else:
        shape = tuple(sizes[a] for a in order)
        try:
            grid = mesh_utils.create_device_mesh(shape, devices=devices)
        except Exception:  # non-TPU topologies without a physical layout: plain order
            grid = np.asarray(devices).reshape(shape)
    grid = np.transpose(grid, [order.index(a) for a in MESH_AXES])
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _hybrid_grid(sizes: dict[str, int], across: dict[str, int], devices: list, order: tuple) -> np.ndarray:
    """The device grid (axes in ``order``) of a hybrid mesh: ``across[a]`` nodes along axis a."""
    # TPU slices are the nodes of a multi-slice job; elsewhere (GPU, CPU) each process is a node.
    by_slice = devices[0].platform == "tpu" and all(getattr(d, "slice_index", None) is not None for d in devices)
    nodes = len({d.slice_index if by_slice else d.process_index for d in devices})
    for axis, n in across.items():
        if sizes[axis] % n:
            raise ConfigError(f"mesh.across_nodes.{axis}: mesh.{axis}={sizes[axis]} does not split over {n} nodes")
    if math.prod(across.values()) != nodes:
        raise ConfigError(f"mesh.across_nodes: {across} spans {math.prod(across.values())} nodes, but the job "
                          f"has {nodes} (processes or slices); the axes across nodes must multiply to that")
    within = tuple(sizes[a] // across.get(a, 1) for a in order)
    between = tuple(across.get(a, 1) for a in order)
    return mesh_utils.create_hybrid_device_mesh(within, between, devices=devices, process_is_granule=not by_slice)


def describe(mesh: Mesh) -> str:
    """``data=2 fsdp=2 tensor=2 sequence=1 expert=1 (8 devices)``: every axis, and ``stage`` when the
    run pipelines (``stage=1`` is no pipeline, so it is left out)."""
    n = mesh.devices.size
    axes = [a for a in MESH_AXES if a != "stage" or mesh.shape[a] > 1]
    return " ".join(f"{a}={mesh.shape[a]}" for a in axes) + f" ({n} device{'s' if n > 1 else ''})"


def nodes_along(mesh: Mesh, axes) -> str:
    """Which process holds each index of the axes that span nodes, e.g. ``stage 0: process 0, stage 1:
    process 1`` ('' when no axis is given): what a hybrid mesh put where."""
    out = []
    for axis in axes:
        dim = mesh.axis_names.index(axis)
        for i in range(mesh.shape[axis]):
            procs = sorted({d.process_index for d in np.take(mesh.devices, i, axis=dim).flat})
            out.append(f"{axis} {i}: process{'es' if len(procs) > 1 else ''} {', '.join(map(str, procs))}")
    return ", ".join(out)
