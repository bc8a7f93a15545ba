"""Next-token sampling and log-probs, batched over rows, for use inside the jitted step.

One row is one sequence's next-token distribution. Every per-row parameter is an array, so a single
compiled step serves any mix of greedy and sampled requests.

Semantics (vLLM's, stated exactly):
  * greedy rows (temperature < `GREEDY_TEMPERATURE`) take `argmax(logits)`, the first index on ties;
  * other rows: logits / temperature, then top-k, then top-p on the renormalized top-k distribution,
    then one draw `categorical(fold_in(key(uint32(seed)), step), filtered, mode="high")`;
  * top-k keeps every token whose logit is >= the k-th largest, so tokens tied with the k-th are all
    kept (as vLLM does); top-p keeps the fewest most-likely tokens whose cumulative probability reaches
    top_p (at least one), plus any token tied with the last one kept (vLLM cuts top-p by sorted
    position, so which of several tied boundary tokens it keeps depends on sort order; keeping them
    all makes the set a function of the values alone);
  * log-probs are of the raw model distribution, `log_softmax(logits)`, before temperature/top-k/top-p
    (vLLM's default `logprobs_mode`).
All arithmetic is float32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mnemojax.scheduling.sampling_params import GREEDY_TEMPERATURE


def apply_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Set the logits of tokens outside the top-k / top-p set to -inf.

    logits f32[N, V] (already temperature-scaled); top_k i32[N] (<= 0 => disabled);
    top_p f32[N] (>= 1 => disabled). Returns f32[N, V].
    """
    vocab = logits.shape[-1]
    desc = jnp.sort(logits, axis=-1, descending=True)  # [N, V]
    k = jnp.where(top_k <= 0, vocab, jnp.minimum(top_k, vocab)).astype(jnp.int32)
    kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)  # [N, 1]
    in_k = desc >= kth  # a prefix of the sorted row, ties with the k-th included

    probs = jax.nn.softmax(jnp.where(in_k, desc, -jnp.inf), axis=-1)
    cum = jnp.cumsum(probs, axis=-1)
    before = jnp.pad(cum[:, :-1], ((0, 0), (1, 0)))  # probability mass strictly ahead of each token
    top_p = top_p[:, None]
    in_p = (before < top_p) | (top_p >= 1.0)  # also a prefix: `before` never decreases

    n_keep = jnp.maximum(jnp.sum(in_k & in_p, axis=-1), 1)  # [N]
    threshold = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)  # [N, 1]
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def _draw(filtered: jax.Array, seeds: jax.Array, steps: jax.Array) -> jax.Array:
    """One categorical draw per row from `filtered` logits, keyed only by the row's (seed, step)."""

    def one(row, seed, step):
        key = jax.random.fold_in(jax.random.key(seed), step)
        # "high" gumbel noise samples tokens down to probability ~1e-14 without bias ("low", the default,
        # stops near 1e-7); naming it also keeps draws stable if the library default changes.
        return jax.random.categorical(key, row, mode="high")

    return jax.vmap(one)(filtered, seeds.astype(jnp.uint32), steps.astype(jnp.uint32)).astype(jnp.int32)


def sample(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seeds: jax.Array,
    steps: jax.Array,
) -> jax.Array:
    """Pick the next token of each row.

    logits f32[N, V]; temperature f32[N] (< GREEDY_TEMPERATURE, e.g. 0 => greedy argmax);
    top_k i32[N] (<= 0 => disabled); top_p f32[N] (>= 1.0 => disabled); seeds u32 or i32 [N] (per-request
    seed; the 32 bits are read as uint32, so i32 -1 == u32 0xFFFFFFFF); steps i32[N] (index of the token
    being generated, so the same (seed, step) gives the same token however requests are batched).
    Returns i32[N] token ids.
    """
    logits = logits.astype(jnp.float32)
    temperature = temperature.astype(jnp.float32)
    greedy = temperature < GREEDY_TEMPERATURE
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled():
        scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
        scaled = jnp.minimum(scaled, jnp.finfo(jnp.float32).max)  # a tiny temperature must not make +inf
        needs_filter = jnp.any(~greedy & ((top_k > 0) | (top_p < 1.0)))
        filtered = jax.lax.cond(
            needs_filter,
            lambda: apply_top_k_top_p(scaled, top_k, top_p.astype(jnp.float32)),
            lambda: scaled,
        )
        return jnp.where(greedy, argmax, _draw(filtered, seeds, steps))

    # An all-greedy batch skips the sort and the random draws.
    return jax.lax.cond(jnp.all(greedy), lambda: argmax, sampled)


def logprobs(
    logits: jax.Array, sampled: jax.Array, targets: jax.Array, num_top: int, want_top: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Log-probs from the raw model distribution, `log_softmax(logits)`.

    logits f32[N, V]; sampled i32[N]; targets i32[N] (a prompt token to score; -1 => score `sampled`);
    num_top static; want_top bool[] (None => True): whether any row asked for top log-probs. When none did, the
    top-k over the whole vocabulary (a sort on GPUs) is skipped and the top entries are zeros.
    Returns (sampled_lp f32[N], target_lp f32[N], top_ids i32[N, num_top], top_lp f32[N, num_top]), top ids
    by descending log-prob (lower id first on ties).
    """
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [N, V]

    def gather(ids):
        return jnp.take_along_axis(lp, ids.astype(jnp.int32)[:, None], axis=-1)[:, 0]

    sampled_lp = gather(sampled)
    target_lp = gather(jnp.where(targets < 0, sampled, targets))
    if num_top == 0:
        n = logits.shape[0]
        return sampled_lp, target_lp, jnp.zeros((n, 0), jnp.int32), jnp.zeros((n, 0), jnp.float32)
    def top():
        top_lp, top_ids = jax.lax.top_k(lp, num_top)
        return top_ids.astype(jnp.int32), top_lp

    def skipped():
        # Zeros computed from `lp` (not created afresh), so inside shard_map both branches vary over the same
        # mesh axes, as cond requires.
        zeros = jnp.where(False, lp[:, :num_top], 0.0)
        return zeros.astype(jnp.int32), zeros

    if want_top is None:
        top_ids, top_lp = top()
    else:
        top_ids, top_lp = jax.lax.cond(want_top, top, skipped)
    return sampled_lp, target_lp, top_ids, top_lp
