"""Collective primitives used inside the step's shard_map. Each has a test against the unsharded computation."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from shardings.mesh import SPP


def vary_over(x, axes: tuple[str, ...]):
    """Marks `x` as holding different values on each device of `axes` (shard_map's varying-axes type).

    Needed for a loop carry that starts the same everywhere but is updated with device-local weights, such as
    the residual stream entering a pipeline stage's layers.
    """
    return lax.pcast(x, axes, to="varying")


def from_last_stage(x):
    """The value of `x` held by the last pipeline stage, on every stage (one block of x over `spp`)."""
    last = lax.axis_size(SPP) - 1
    return lax.psum(jnp.where(lax.axis_index(SPP) == last, x, jnp.zeros_like(x)), SPP)
