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

    Auto (GSPMD-style) axes let sharding constraints propagate rather than
    assert, which is what the logical-rule approach relies on.
    """
    devices = list(devices) if devices is not None else jax.devices()
    sizes = resolve_sizes(mesh_cfg, len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    try:
        grid = mesh_utils.create_device_mesh(shape, devices=devices)
    except Exception:  # non-TPU topologies without a physical layout: plain order
        grid = np.asarray(devices).reshape(shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def describe(mesh: Mesh) -> str:
    n = mesh.devices.size
    return " ".join(f"{a}={mesh.shape[a]}" for a in MESH_AXES) + f" ({n} device{'s' if n > 1 else ''})"
