"""The (kvp, spp, tp) device mesh.

Every degree may be 1: a single device is the 1x1x1 mesh and runs the same code path as any other shape.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

KVP = "kvp"  # KV-cache parallelism: a long request's KV split along the sequence over ranks
SPP = "spp"  # sequence pipeline parallelism: layers split into pipeline stages
TP = "tp"  # tensor parallelism: heads and MLP columns split within a server
AXES = (KVP, SPP, TP)


def make_mesh(kvp: int = 1, spp: int = 1, tp: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds the (kvp, spp, tp) mesh with explicit axis types from the first kvp*spp*tp devices.

    Raises ValueError naming the shortfall when there are too few devices.
    """
    for name, degree in zip(AXES, (kvp, spp, tp)):
        if not isinstance(degree, int) or degree < 1:
            raise ValueError(f"{name} must be a positive integer, got {degree!r}")
    devices = list(jax.devices() if devices is None else devices)
    need = kvp * spp * tp
    if need > len(devices):
        raise ValueError(
            f"mesh kvp={kvp} x spp={spp} x tp={tp} needs {need} devices, only {len(devices)} available "
            f"(short by {need - len(devices)})"
        )
    grid = np.asarray(devices[:need], dtype=object).reshape(kvp, spp, tp)
    return Mesh(grid, AXES, axis_types=(AxisType.Explicit,) * 3)
