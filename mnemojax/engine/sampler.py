"""Next-token sampling and log-probs, batched over rows, for use inside the jitted step.

One row is one sequence's next-token distribution. Every per-row parameter is an array, so a single
compiled step serves any mix of greedy and sampled requests.

Semantics (vLLM's, stated exactly):
  * every row's logit biases are added first (`logit_bias`, and -inf for the stop tokens `min_tokens` bans and the
    tokens bad words ban in this row: the executor decides which); a row
    that allows only its slots' tokens (`allowed_token_ids`) has every other logit -inf first;
  * then the penalties (`apply_penalties`, vLLM's order and OpenAI's definitions), greedy rows' too: a token of the
    prompt or generated so far has its logit divided by `repetition_penalty` where positive, multiplied by it
    where not (transformers' rule, a division as transformers does); then `frequency_penalty` x its count among
    the generated tokens and `presence_penalty` (if generated at all) are subtracted;
  * greedy rows (temperature < `GREEDY_TEMPERATURE`) take `argmax(logits)`, the first index on ties;
  * other rows: logits / temperature, then min-p, then top-k, then top-p on the renormalized top-k
    distribution, then one draw `categorical(fold_in(key(seed), step), filtered, mode="high")`, where key(seed) is the
    threefry key of the 64-bit seed, words [seed >> 32, seed & 0xFFFFFFFF] (what `jax.random.key(seed)` gives
    with 64-bit integers on; for a seed below 2**32, exactly `jax.random.key(seed)`);
  * top-k keeps every token whose logit is >= the k-th largest, so tokens tied with the k-th are all
    kept (as vLLM does); top-p keeps the fewest most-likely tokens whose cumulative probability reaches
    top_p (at least one), plus any token tied with the last one kept (vLLM cuts top-p by sorted
    position, so which of several tied boundary tokens it keeps depends on sort order; keeping them
    all makes the set a function of the values alone);
  * min-p keeps a token when its probability is at least min_p times the most likely token's: when
    exp(z - max(z)) >= min_p for the scaled logits z (vLLM compares the softmax's values, the same ratio);
  * equivalently, by values: top-k keeps a token when fewer than k tokens are strictly above it, top-p
    when the renormalized probability mass strictly above it is < top_p (or it is the maximum). That is
    how they are computed: thresholds found by bisection, no sort of the vocabulary (a sort was most of
    the sampler's time on a GPU). The mass is summed in vocabulary order, not sorted order, so a top_p
    within float32 rounding (~1e-7) of a cumulative mass may be decided the other way than by a sorted
    cumsum, which itself rounds differently across backends;
  * log-probs are of the raw model distribution, `log_softmax(logits)`, before temperature/top-k/top-p
    (vLLM's default `logprobs_mode`).
All arithmetic is float32.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from mnemojax.scheduling.sampling_params import GREEDY_TEMPERATURE

NO_TOKEN = 2**31 - 1
"""A bias slot's token id when the slot is unused: past any vocabulary, so the sampler's scatters drop it."""


def _order_keys(x: jax.Array) -> jax.Array:
    """int32 keys that order like the float32 values `x`: a < b <=> key(a) < key(b), and equal values have equal
    keys (-0.0 is read as +0.0). Not for NaN."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # a negative value's key is -1 - its magnitude bits


def _lowest_key(keys: jax.Array, lo: jax.Array, hi: jax.Array, few_enough) -> jax.Array:
    """Per row, the lowest key t in (lo, hi] such that `few_enough(keys > t)` holds, by bisection; `hi` when
    none lower does.

    keys i32[N, V]; lo, hi i32[N], lo < hi (a row with hi == lo + 1 is already done); few_enough maps the
    mask bool[N, V] of the keys strictly above a candidate to bool[N] and must be monotone: if it holds for
    a mask, it holds for every smaller one. 32 rounds (any int32 range halves to one key in 32), each one
    masked reduction over [N, V]; no sort.
    """

    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo & hi) + ((lo ^ hi) >> 1)  # floor((lo + hi) / 2) without int32 overflow
        ok = few_enough(keys > mid[:, None])
        active = lo + 1 < hi
        return jnp.where(active & ~ok, mid, lo), jnp.where(active & ok, mid, hi)

    return jax.lax.fori_loop(0, 32, halve, (lo, hi))[1]


def apply_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Set the logits of tokens outside the top-k / top-p set to -inf.

    logits f32[N, V] (already temperature-scaled); top_k i32[N] (<= 0 => disabled);
    top_p f32[N] (>= 1 => disabled). Returns f32[N, V].

    The set is the one a descending sort defines (module docstring), found without sorting: each cut is a
    threshold, the lowest value whose count (top-k) or probability mass (top-p) of tokens strictly above
    it is small enough, found by bisection over the values' order keys (`_lowest_key`). Each search runs
    only when some row has that filter on.
    """
    vocab = logits.shape[-1]
    keys = _order_keys(logits)  # [N, V]
    low, high = jnp.min(keys, axis=-1), jnp.max(keys, axis=-1)  # [N]
    k = jnp.where(top_k <= 0, vocab, jnp.minimum(top_k, vocab)).astype(jnp.int32)
    k_on, p_on = k < vocab, top_p < 1.0

    # The k-th largest value: the lowest one with fewer than k tokens above it. Tokens tied with it are kept.
    kth = jax.lax.cond(
        jnp.any(k_on),
        lambda: _lowest_key(keys, low - 1, jnp.where(k_on, high, low), lambda above: jnp.sum(above, axis=-1) < k),
        lambda: low,
    )

    def nucleus():
        # The lowest value whose renormalized top-k mass strictly above it is < top_p: the sorted cut's last
        # token (the cumulative mass ahead of it is < top_p), its ties with it; the maximum at least.
        probs = jax.nn.softmax(jnp.where(keys >= kth[:, None], logits, -jnp.inf), axis=-1)
        mass_below_p = lambda above: jnp.sum(jnp.where(above, probs, 0.0), axis=-1) < top_p
        return _lowest_key(keys, kth - 1, jnp.where(p_on, high, kth), mass_below_p)

    threshold = jax.lax.cond(jnp.any(p_on), nucleus, lambda: kth)  # [N]
    return jnp.where(keys >= threshold[:, None], logits, -jnp.inf)


def apply_min_p(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """Set the logits of tokens less than min_p times as likely as the most likely one to -inf.

    logits f32[N, V] (already temperature-scaled); min_p f32[N] (0 => disabled: every finite logit is kept).
    A token stays when exp(logit - max logit) >= min_p, its probability over the maximum's."""
    ratio = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    return jnp.where(ratio >= min_p[:, None], logits, -jnp.inf)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Penalties:
    """What the penalties of a step's rows read: per sequence slot (the engine's, kept on the device between steps)
    the counts of the tokens generated so far, i32[S, V], and which tokens its prompt holds, bool[S, V]; per row
    its slot, i32[N] (any index where the row has no penalty: its rows are gathered clamped), and its three
    penalties, f32[N] (0, 0 and 1: none)."""

    counts: jax.Array
    in_prompt: jax.Array
    slots: jax.Array
    presence: jax.Array
    frequency: jax.Array
    repetition: jax.Array

    def any(self) -> jax.Array:
        """bool[]: whether some row has a penalty."""
        return jnp.any(self.presence != 0) | jnp.any(self.frequency != 0) | jnp.any(self.repetition != 1)


def apply_penalties(logits: jax.Array, counts: jax.Array, in_prompt: jax.Array, presence: jax.Array,
                    frequency: jax.Array, repetition: jax.Array) -> jax.Array:
    """vLLM's penalties of rows of logits f32[N, V], given each row's generated-token counts i32[N, V] and prompt
    tokens bool[N, V]: repetition (a token of the prompt or generated: logit / r where > 0, else logit x r), then
    frequency (- f x count) and presence (- p where count > 0). A row with none (0, 0, 1) keeps its logits
    exactly (x / 1, x x 1, x - 0)."""
    generated = counts > 0
    r = jnp.where(in_prompt | generated, repetition[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / r, logits * r)
    logits = logits - frequency[:, None] * counts.astype(jnp.float32)
    return logits - presence[:, None] * generated.astype(jnp.float32)


def seed_words(seeds: jax.Array) -> jax.Array:
    """u32[N, 2] threefry key words (high, low) of `seeds`: u32 or i32 [N] (32-bit seeds: the high word is 0; i32
    bits are read as u32, so -1 == 0xFFFFFFFF) or [N, 2] (the words of 64-bit seeds, as they are)."""
    seeds = seeds.astype(jnp.uint32)
    return seeds if seeds.ndim == 2 else jnp.stack([jnp.zeros_like(seeds), seeds], axis=-1)


def _draw(filtered: jax.Array, seeds: jax.Array, steps: jax.Array) -> jax.Array:
    """One categorical draw per row from `filtered` logits, keyed only by the row's (seed, step)."""

    def one(row, words, step):
        key = jax.random.fold_in(jax.random.wrap_key_data(words, impl="threefry2x32"), step)
        # "high" gumbel noise samples tokens down to probability ~1e-14 without bias ("low", the default,
        # stops near 1e-7); naming it also keeps draws stable if the library default changes.
        return jax.random.categorical(key, row, mode="high")

    return jax.vmap(one)(filtered, seed_words(seeds), steps.astype(jnp.uint32)).astype(jnp.int32)


def sample(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seeds: jax.Array,
    steps: jax.Array,
    min_p: jax.Array | None = None,
    bias_ids: jax.Array | None = None,
    bias_values: jax.Array | None = None,
    allow_only: jax.Array | None = None,
    penalties: Penalties | None = None,
    masks: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """Pick the next token of each row.

    logits f32[N, V]; temperature f32[N] (< GREEDY_TEMPERATURE, e.g. 0 => greedy argmax);
    top_k i32[N] (<= 0 => disabled); top_p f32[N] (>= 1.0 => disabled); seeds: per-request seed, u32 or i32 [N]
    (32 bits, read as uint32, so i32 -1 == u32 0xFFFFFFFF) or u32[N, 2] (a 64-bit seed's high and low words,
    `seed_words`); steps i32[N] (index of the token
    being generated, so the same (seed, step) gives the same token however requests are batched);
    min_p f32[N] (0 => disabled; None: every row's is 0); bias_ids i32[N, W], bias_values f32[N, W]: added to
    those logits first, greedy rows' too (a -inf bans a token; an id of `NO_TOKEN`, or any past the vocabulary, is
    an unused slot; None: no bias); allow_only bool[N]: the row keeps only its slots' tokens, every other logit
    -inf (vLLM's `allowed_token_ids`; None: no row); penalties: applied after the biases (None: no row has one);
    masks (u32[N, ceil(V / 32)] bits, bool[N] masked): a masked row keeps only the tokens whose bit is set (token t
    is bit t % 32 of word t // 32; structured outputs' regex), every other logit -inf, before the biases (None: no
    row). Returns i32[N] token ids.
    """
    logits = logits.astype(jnp.float32)
    pick = functools.partial(_pick, temperature=temperature.astype(jnp.float32), top_k=top_k, top_p=top_p,
                             seeds=seeds, steps=steps, min_p=min_p)
    biases = bias_ids is not None and bias_ids.shape[-1] > 0
    if not biases and penalties is None and masks is None:
        return pick(logits)
    # Only when some row has a bias or a penalty do the adjusted logits exist (a copy: the log-probs read the raw
    # ones); the cond returns tokens, so neither branch passes an [N, V] array through (XLA copied it twice).
    rows = jnp.arange(logits.shape[0])[:, None]

    def adjusted():
        b = logits
        if masks is not None:  # the bits of each row's tokens (an [N, V] gather, made only in this branch)
            bits, masked = masks
            v = jnp.arange(logits.shape[-1])
            keep = (jnp.take(bits, v // 32, axis=1) >> (v % 32).astype(jnp.uint32)) & 1
            b = jnp.where(masked[:, None] & (keep == 0), -jnp.inf, b)
        if biases:
            if allow_only is not None:  # -inf outside the row's slots (an [N, V] mask, made only in this branch)
                outside = jnp.ones(logits.shape, bool).at[rows, bias_ids].set(False, mode="drop")
                b = jnp.where(allow_only[:, None] & outside, -jnp.inf, b)
            b = b.at[rows, bias_ids].add(bias_values, mode="drop")
        if penalties is not None:  # each row's slot's counts and prompt tokens, gathered only in this branch
            p = penalties
            b = apply_penalties(b, jnp.take(p.counts, p.slots, axis=0, mode="clip"),
                                jnp.take(p.in_prompt, p.slots, axis=0, mode="clip"), p.presence.astype(jnp.float32),
                                p.frequency.astype(jnp.float32), p.repetition.astype(jnp.float32))
        return pick(b)

    some = jnp.zeros((), bool)
    if biases:
        some = some | jnp.any(bias_values != 0)
        if allow_only is not None:
            some = some | jnp.any(allow_only)
    if penalties is not None:
        some = some | penalties.any()
    if masks is not None:
        some = some | jnp.any(masks[1])
    return jax.lax.cond(some, adjusted, lambda: pick(logits))


def _pick(logits, *, temperature, top_k, top_p, seeds, steps, min_p) -> jax.Array:
    """`sample` of logits already biased."""
    greedy = temperature < GREEDY_TEMPERATURE
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled():
        scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
        scaled = jnp.minimum(scaled, jnp.finfo(jnp.float32).max)  # a tiny temperature must not make +inf
        # Greedy rows' filters are off, so they never make a threshold search run.
        if min_p is not None:
            row_min_p = jnp.where(greedy, 0.0, min_p.astype(jnp.float32))
            scaled = jax.lax.cond(jnp.any(row_min_p > 0), lambda: apply_min_p(scaled, row_min_p), lambda: scaled)
        row_k = jnp.where(greedy, -1, top_k)
        row_p = jnp.where(greedy, 1.0, top_p.astype(jnp.float32))
        filtered = jax.lax.cond(
            jnp.any((row_k > 0) | (row_p < 1.0)),
            lambda: apply_top_k_top_p(scaled, row_k, row_p),
            lambda: scaled,
        )
        return jnp.where(greedy, argmax, _draw(filtered, seeds, steps))

    # An all-greedy batch skips the filter and the random draws.
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
