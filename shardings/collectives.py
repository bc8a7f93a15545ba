"""Collective primitives used inside the step's shard_map. Each has a test against the unsharded computation.

Sizes, for a step of T query rows, N local heads of H dims, D hidden: the KVP merge moves O(T x N x H) per
layer (query-sized, never context-sized); the pipeline shift moves one [T, D] activation block per stage
boundary per step.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from shardings.mesh import KVP, SPP

# Large finite negative log-weight: a shard with no visible key gets weight exp(NEG - m) = 0, never NaN.
NEG = -1e30


def kvp_merge(out, lse, shared):
    """Exact online-softmax merge of partial attention over the KVP ranks, for the rows marked `shared`.

    out f32[T, N, H] and lse f32[T, N]: this rank's attention over its own KV shard (float32: a partial rounded
    to 16 bits before the merge would differ from one device's result; such an out raises when kvp > 1). shared bool[T]: the row
    holds a query token of a request whose KV spans several ranks; the same token sits in the same row on
    each of its ranks. Ranks where the row is not shared contribute nothing and keep their own result (such a
    rank may use the row for a request of its own: whatever it holds there, even a non-finite value, never
    reaches the merge). Returns out f32[T, N, H] (with one KVP rank, `out` itself, in its own dtype).
    """
    if lax.axis_size(KVP) == 1:
        return out  # nothing to merge (and no collective left in the layer loop)
    if out.dtype != jnp.float32:
        raise ValueError(f"kvp_merge needs float32 partials (ask the attention for out_dtype=float32), got {out.dtype}")
    w_lse = jnp.where(shared[:, None], lse, NEG)
    m = lax.pmax(w_lse, KVP)
    w = jnp.where(shared[:, None], jnp.exp(w_lse - m), 0.0)  # [T, N]
    num = lax.psum(jnp.where(shared[:, None, None], out * w[..., None], 0.0), KVP)
    den = lax.psum(w, KVP)
    merged = num / jnp.where(den == 0.0, 1.0, den)[..., None]
    return jnp.where(shared[:, None, None], merged, out)


def pipeline_shift(x):
    """Sends each stage's activations to the next stage (the last stage's go nowhere; stage 0 gets zeros)."""
    n = lax.axis_size(SPP)
    if n == 1:
        return jnp.zeros_like(x)
    return lax.ppermute(x, SPP, perm=[(s, s + 1) for s in range(n - 1)])


def from_last_stage(x):
    """The value of `x` held by the last pipeline stage, on every stage (one block of x over `spp`)."""
    last = lax.axis_size(SPP) - 1
    return lax.psum(jnp.where(lax.axis_index(SPP) == last, x, jnp.zeros_like(x)), SPP)


def from_every_rank(x):
    """Every KVP rank's `x`, stacked [kvp, ...] and the same on every device (a psum of one-hot blocks, so the
    result is typed invariant over `kvp`; `x` is small: a step's sampled tokens)."""
    n = lax.axis_size(KVP)
    mine = lax.axis_index(KVP) == jnp.arange(n).reshape((n,) + (1,) * x.ndim)
    return lax.psum(jnp.where(mine, x[None], jnp.zeros_like(x)[None]), KVP)
