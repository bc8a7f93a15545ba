"""mnemojax.engine.sampler against independent numpy references.

Every expected value here is computed in numpy (float64) from the definitions: argmax, the top-k set,
the nucleus, the filtered softmax, log_softmax. The sampler is jitted once per shape and batched over
seeds, so a few compiles cover the whole file.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mnemojax.engine import sampler
from mnemojax.scheduling.sampling_params import MAX_LOGPROBS

_sample = jax.jit(sampler.sample)
_filter = jax.jit(sampler.apply_top_k_top_p)
_min_p = jax.jit(sampler.apply_min_p)
_logprobs = jax.jit(sampler.logprobs, static_argnums=3)


def run_sample(logits, temperature, top_k, top_p, seeds, steps, seed_dtype=np.uint32, min_p=None):
    """Call the jitted sampler with every per-row parameter broadcast to the number of rows."""
    logits = np.asarray(logits, np.float32)
    n = logits.shape[0]
    extra = () if min_p is None else (np.broadcast_to(np.asarray(min_p, np.float32), (n,)),)
    tokens = _sample(
        logits,
        np.broadcast_to(np.asarray(temperature, np.float32), (n,)),
        np.broadcast_to(np.asarray(top_k, np.int32), (n,)),
        np.broadcast_to(np.asarray(top_p, np.float32), (n,)),
        np.broadcast_to(np.asarray(seeds, seed_dtype), (n,)),
        np.broadcast_to(np.asarray(steps, np.int32), (n,)),
        *extra,
    )
    tokens = np.asarray(tokens)
    assert tokens.dtype == np.int32 and tokens.shape == (n,)
    return tokens


# ----------------------------------------------------------------------------------------------------
# numpy references


def np_softmax(z):
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max())
    return e / e.sum()


def np_log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def np_filtered(logits_row, temperature, top_k, top_p, *, min_margin=1e-4):
    """(keep mask, filtered probabilities) for one row, by the definitions in float64.

    top-k keeps every token >= the k-th largest value (ties kept). top-p keeps the fewest most-likely
    tokens whose cumulative probability reaches top_p, plus tokens tied with the last one. Asserts the
    nucleus boundary is at least `min_margin` away from top_p, so float32 rounding cannot decide it.
    """
    z = np.asarray(logits_row, np.float64) / temperature
    keep = np.ones(z.shape, bool)
    if top_k > 0:
        kth = np.sort(z)[::-1][min(top_k, z.size) - 1]
        keep &= z >= kth
    if top_p < 1.0:
        p = np_softmax(np.where(keep, z, -np.inf))
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        n = min(int(np.searchsorted(cum, top_p)) + 1, int(keep.sum()))
        assert cum[n - 1] - top_p > min_margin or n == keep.sum(), "ambiguous nucleus; pick another top_p"
        assert n == 1 or top_p - cum[n - 2] > min_margin, "ambiguous nucleus; pick another top_p"
        keep &= p >= p[order[n - 1]]
    return keep, np_softmax(np.where(keep, z, -np.inf))


def np_min_p_keep(z, min_p, *, min_margin=1e-5):
    """min-p's keep mask for one row of scaled logits `z`, by the definition in float64: probability >= min_p times
    the largest. None when a token's ratio is within `min_margin` of min_p (float32 may decide it either way)."""
    p = np_softmax(z)
    ratio = p / p.max()
    if min_p > 0 and np.any(np.abs(ratio - min_p) < min_margin):
        return None
    return ratio >= min_p


def chi2_critical(df, z=4.753):
    """Upper quantile of chi-square(df) at one-sided normal z (4.753 => p = 1e-6), Wilson-Hilferty.

    The approximation is within a few percent for df >= 2, far below the gap between a right and a wrong
    distribution in the tests below (checked by `test_frequency_test_has_power`).
    """
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_stat(counts, probs):
    """Pearson's statistic over the support of `probs`; a count outside the support is infinitely off."""
    n = counts.sum()
    support = probs > 0
    if counts[~support].any():
        return math.inf, int(support.sum()) - 1
    expected = n * probs[support]
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


# ----------------------------------------------------------------------------------------------------
# greedy


def test_greedy_is_numpy_argmax_first_on_ties():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(16, 1000)).astype(np.float32) * 3
    logits[3, [10, 500, 999]] = 50.0  # tie for the max: the first index wins (torch/HF argmax)
    logits[4, [0, 1]] = 50.0
    logits[5, :] = 0.0  # all tied
    logits[6, :400] = -np.inf
    logits[7, ::2] = -np.finfo(np.float32).max
    temperature = np.array([0, 0, 1e-6, 0, 0, 0, 0, 0, 0.0, 9e-6, 0, 0, 0, 0, 0, 0], np.float32)
    top_k = np.array([-1, 0, 1, 5, 2, 3, -1, 7, 100, -1, 1, 0, 4, 4, 4, 4], np.int32)  # ignored when greedy
    top_p = np.array([1, 0.5, 0.1, 0.9, 1, 0.2, 1, 0.3, 1, 0.01, 1, 0.99, 1, 1, 1, 1], np.float32)
    tokens = run_sample(logits, temperature, top_k, top_p, np.arange(16), np.arange(16))
    np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))
    assert tokens[3] == 10 and tokens[4] == 0 and tokens[5] == 0


def test_greedy_rows_unchanged_in_a_mixed_batch():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(16, 1000)).astype(np.float32)
    greedy = np.arange(16) % 2 == 0
    temperature = np.where(greedy, 0.0, 1.0).astype(np.float32)
    tokens = run_sample(logits, temperature, 40, 0.9, np.arange(16) + 123, 3)
    np.testing.assert_array_equal(tokens[greedy], np.argmax(logits[greedy], axis=-1))
    # The sampled rows really sample (8 draws all equal to the argmax won't happen), and within each
    # row's own top-k/top-p set, whatever the greedy rows beside them do.
    assert (tokens[~greedy] != np.argmax(logits[~greedy], axis=-1)).any()
    for row in np.flatnonzero(~greedy):
        keep, _ = np_filtered(logits[row], 1.0, 40, 0.9, min_margin=0)
        assert keep[tokens[row]], row


def test_one_compile_for_any_mix_of_rows():
    traces = []

    def counted(*args):
        traces.append(None)
        return sampler.sample(*args)

    fn = jax.jit(counted)
    logits = np.random.default_rng(2).normal(size=(4, 64)).astype(np.float32)
    seeds, steps = np.arange(4, dtype=np.uint32), np.zeros(4, np.int32)
    for temperature, top_k, top_p in [
        ([0, 0, 0, 0], [-1] * 4, [1] * 4),  # all greedy
        ([1, 1, 1, 1], [-1] * 4, [1] * 4),  # all sampled, no filter
        ([0, 0.5, 1, 2], [0, 3, -1, 10], [1, 0.5, 0.9, 1]),  # mixed
    ]:
        fn(
            logits,
            np.array(temperature, np.float32),
            np.array(top_k, np.int32),
            np.array(top_p, np.float32),
            seeds,
            steps,
        ).block_until_ready()
    assert len(traces) == 1


# ----------------------------------------------------------------------------------------------------
# the filter, exactly


def kept(filtered_row):
    return np.isfinite(np.asarray(filtered_row))


def test_top_k_mask_is_the_k_largest_and_keeps_ties():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(8, 300)).astype(np.float32)
    logits[4, [7, 8, 9, 200]] = 10.0  # 4-way tie at the top
    logits[5, :] = np.round(logits[5] * 2) / 2  # many ties everywhere
    logits[6, 100:] = -np.inf
    top_k = np.array([1, 5, 299, 300, 2, 17, 150, 40], np.int32)
    out = np.asarray(_filter(logits, top_k, np.ones(8, np.float32)))
    for row in range(8):
        keep, _ = np_filtered(logits[row], 1.0, top_k[row], 1.0)
        keep &= np.isfinite(logits[row])  # row 6: -inf logits are "kept" as -inf when k exceeds the rest
        np.testing.assert_array_equal(kept(out[row]), keep, err_msg=f"row {row}")
        np.testing.assert_array_equal(out[row][keep], logits[row][keep])  # kept logits untouched
    assert kept(out[0]).sum() == 1 and kept(out[1]).sum() == 5
    assert kept(out[4]).sum() == 4  # k=2, but all four tied values stay (vLLM's rule)
    assert kept(out[5]).sum() > 17  # ties at the 17th value kept


def test_top_k_disabled_and_larger_than_vocab_keep_everything():
    logits = np.random.default_rng(4).normal(size=(8, 300)).astype(np.float32)
    top_k = np.array([-1, 0, 300, 10_000, -1, 0, 300, 2**31 - 1], np.int32)
    out = np.asarray(_filter(logits, top_k, np.ones(8, np.float32)))
    np.testing.assert_array_equal(out, logits)


@pytest.mark.parametrize("size", [1, 2, 5, 30, 100, 150])
def test_top_p_mask_is_the_numpy_nucleus(size):
    """Each row gets a top_p halfway between the cumulative probability of its `size`-1 and `size` most
    likely tokens (computed in float64), so the exact nucleus has `size` tokens with a clear margin."""
    rng = np.random.default_rng(5)
    logits = (rng.normal(size=(8, 300)) * np.linspace(0.5, 4, 8)[:, None]).astype(np.float32)
    cum = np.cumsum(-np.sort(-np.stack([np_softmax(r) for r in logits]), axis=-1), axis=-1)
    top_p = ((cum[:, size - 2] if size > 1 else 0.0) + cum[:, size - 1]) / 2
    out = np.asarray(_filter(logits, np.full(8, -1, np.int32), top_p.astype(np.float32)))
    for row in range(8):
        keep, _ = np_filtered(logits[row], 1.0, -1, top_p[row], min_margin=1e-6)
        assert keep.sum() == size
        np.testing.assert_array_equal(kept(out[row]), keep, err_msg=f"row {row}")


def test_top_p_keeps_at_least_one_and_top_p_one_keeps_all():
    logits = np.random.default_rng(6).normal(size=(8, 300)).astype(np.float32)
    logits[2, 5:] = -np.inf
    top_p = np.array([1e-9, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0], np.float32)  # 0.0: invalid, still safe
    out = np.asarray(_filter(logits, np.full(8, -1, np.int32), top_p))
    np.testing.assert_array_equal(kept(out[0]), np.arange(300) == np.argmax(logits[0]))
    np.testing.assert_array_equal(kept(out[3]), np.arange(300) == np.argmax(logits[3]))
    np.testing.assert_array_equal(out[1], logits[1])
    np.testing.assert_array_equal(kept(out[2]), np.arange(300) < 5)


def test_top_p_applies_to_the_renormalized_top_k_distribution():
    # Probabilities 0.4, 0.3, 0.2, 0.1. Top-p 0.75 alone keeps 3 tokens (0.4 + 0.3 < 0.75). After top-k=2
    # the distribution is 4/7, 3/7: top_p=0.75 keeps both (4/7 < 0.75), top_p=0.5 keeps one (4/7 >= 0.5).
    logits = np.full((8, 300), -np.inf, np.float32)
    logits[:, :4] = np.log([0.4, 0.3, 0.2, 0.1])
    top_k = np.array([-1, 2, 2, -1, -1, -1, -1, -1], np.int32)
    out = np.asarray(_filter(logits, top_k, np.array([0.75, 0.75, 0.5, 1, 1, 1, 1, 1], np.float32)))
    np.testing.assert_array_equal(kept(out[:3, :4]), [[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]])
    assert not kept(out[:, 4:]).any()


def random_batch(rng, n, vocab):
    """`n` rows of random logits, some with ties forced, and per-row filters covering the edge cases: top_k 1,
    vocab - 1, vocab, beyond vocab, off; top_p tiny, 0, 1, near 1, random; both filters on in some rows."""
    logits = (rng.normal(size=(n, vocab)) * rng.uniform(0.3, 4, size=(n, 1))).astype(np.float32)
    logits[::3] = np.round(logits[::3] * 2) / 2  # many ties, at every boundary
    logits[1, : vocab // 2] = -np.inf
    logits[2] = 0.0  # all tied
    top_k = rng.choice([-1, 0, 1, 2, 3, vocab - 1, vocab, vocab + 7], size=n).astype(np.int32)
    top_k[::4] = rng.integers(1, vocab + 1, size=len(top_k[::4]))
    top_p = rng.choice([1.0, 1e-9, 0.0, 0.999, 0.5], size=n).astype(np.float32)
    top_p[::2] = rng.uniform(0, 1, size=len(top_p[::2]))
    return logits, top_k, top_p


def reference_keep(logits, top_k, top_p):
    """`np_filtered`'s keep masks row by row, None for a row whose nucleus is within 1e-6 of its top_p (float32
    rounding may decide it either way, in the sampler and in the sort it replaced alike)."""
    out = []
    for row, k, p in zip(logits, top_k, top_p):
        try:
            out.append(np_filtered(row, 1.0, k, p, min_margin=1e-6)[0])
        except AssertionError:
            out.append(None)
    return out


@pytest.mark.parametrize("vocab", [7, 300, 5000])
def test_filter_matches_the_sorted_definition_on_random_rows(vocab):
    """The bisection thresholds keep exactly the set a descending sort defines (numpy, float64), ties at
    every boundary included, with greedy-like, top-k, top-p and both in one batch."""
    rng = np.random.default_rng(20 + vocab)
    checked = 0
    for _ in range(4):
        logits, top_k, top_p = random_batch(rng, 32, vocab)
        out = np.asarray(_filter(logits, top_k, top_p))
        for row, keep in enumerate(reference_keep(logits, top_k, top_p)):
            if keep is None:
                continue
            checked += 1
            expected = np.where(keep, logits[row], -np.inf)  # kept logits untouched, the others -inf
            np.testing.assert_array_equal(out[row], expected, err_msg=f"row {row}: k={top_k[row]} p={top_p[row]}")
    assert checked >= 120  # ambiguous nuclei are rare


def test_sample_draws_from_the_sorted_definition_set_with_its_seed():
    """Mixed greedy / top-k / top-p / both rows in one batch: each sampled row's token is the documented draw,
    `categorical(fold_in(key(seed), step), where(keep, logits / t, -inf), mode="high")` with numpy's keep set."""
    rng = np.random.default_rng(30)
    n, vocab = 32, 400
    logits, top_k, top_p = random_batch(rng, n, vocab)
    temperature = rng.choice([0.0, 0.5, 1.0, 1.7], size=n).astype(np.float32)
    seeds, steps = rng.integers(0, 2**32, size=n).astype(np.uint32), rng.integers(0, 1000, size=n).astype(np.int32)
    tokens = run_sample(logits, temperature, top_k, top_p, seeds, steps)

    def keep_of(i, scaled):
        return reference_keep(scaled[None], top_k[i : i + 1], top_p[i : i + 1])[0]

    assert check_draws(tokens, logits, temperature, seeds, steps, keep_of) >= 16


def check_draws(tokens, logits, temperature, seeds, steps, keep_of) -> int:
    """Asserts each greedy row's token is numpy's argmax and each sampled row's is the documented draw,
    `categorical(fold_in(key(seed), step), where(keep, logits / t, -inf), mode="high")`, `keep_of(i, scaled)` its
    keep set (None: too close to a cut to decide, not checked). Returns how many sampled rows were checked."""
    drawn = 0
    for i in range(len(tokens)):
        if temperature[i] == 0:
            assert tokens[i] == np.argmax(logits[i]), i
            continue
        scaled = logits[i] / temperature[i]
        keep = keep_of(i, scaled)
        if keep is None:
            continue
        key = jax.random.fold_in(jax.random.key(int(seeds[i])), int(steps[i]))
        expected = jax.random.categorical(key, jnp.where(jnp.asarray(keep), scaled, -jnp.inf), mode="high")
        assert tokens[i] == int(expected), i
        drawn += 1
    return drawn


def test_compiled_sampler_never_sorts_the_vocabulary():
    """One compiled `sample` serves every mix of rows (greedy only, top-k only, top-p, both), so no sort (and no
    TopK) anywhere in its optimized HLO means none for any batch. The check finds the sort it replaced."""
    from mnemojax.bench.sampler import sorted_filter

    n, vocab = 4, 1000
    f32, i32 = np.zeros((n,), np.float32), np.zeros((n,), np.int32)
    logits = np.zeros((n, vocab), np.float32)
    hlo = jax.jit(sampler.sample).lower(logits, f32, i32, f32, i32.astype(np.uint32), i32).compile().as_text()
    assert " sort(" not in hlo and "TopK" not in hlo
    assert " sort(" in jax.jit(sorted_filter).lower(logits, i32, f32).compile().as_text()


# ----------------------------------------------------------------------------------------------------
# sampling: support and frequencies over many seeds (one batch, one compile)

N_SEEDS = 4000
_V = 16
_LOGITS = (np.random.default_rng(7).normal(size=_V) * 1.5).astype(np.float32)

# (temperature, top_k, top_p); top_p values are away from any nucleus boundary (np_filtered checks).
CONFIGS = [
    (1.0, -1, 1.0),
    (0.6, -1, 1.0),
    (1.7, 5, 1.0),
    (1.0, 0, 0.75),
    (0.8, 8, 0.9),
    (2.5, 3, 0.5),
]


def draws(temperature, top_k, top_p, *, logits=_LOGITS, n=N_SEEDS):
    """`n` draws for one request's distribution, one per seed, all in one batch."""
    logits = np.broadcast_to(logits, (n, logits.shape[-1]))
    return run_sample(logits, temperature, top_k, top_p, np.arange(n) * 7919 + 11, 0)


@pytest.mark.parametrize("temperature, top_k, top_p", CONFIGS)
def test_frequencies_match_the_filtered_softmax(temperature, top_k, top_p):
    keep, probs = np_filtered(_LOGITS, temperature, top_k, top_p)
    tokens = draws(temperature, top_k, top_p)
    counts = np.bincount(tokens, minlength=_V)
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(keep)), "a filtered-out token was sampled"
    if top_k > 0:
        top = set(np.argsort(-_LOGITS)[:top_k])
        assert set(np.flatnonzero(counts)) <= top
    stat, df = chi2_stat(counts, probs)
    # For a correct sampler the statistic exceeds this bound with probability 1e-6; the seeds are fixed,
    # so the test is deterministic rather than flaky.
    assert stat < chi2_critical(df), (stat, df, counts, np.round(probs * N_SEEDS))


def test_frequency_test_has_power():
    """The chi-square bound above rejects nearby wrong distributions with 4000 draws."""
    tokens = draws(1.0, -1, 1.0)
    counts = np.bincount(tokens, minlength=_V)
    for wrong_temperature in (0.85, 1.2):
        stat, df = chi2_stat(counts, np_softmax(_LOGITS / wrong_temperature))
        assert stat > chi2_critical(df), wrong_temperature
    _, exact_top3 = np_filtered(_LOGITS, 2.5, 3, 1.0)
    tokens = draws(2.5, 3, 0.5)  # the right answer keeps fewer tokens than top-k alone
    stat, df = chi2_stat(np.bincount(tokens, minlength=_V), exact_top3)
    assert stat > chi2_critical(df)


def test_top_k_support_on_a_large_vocabulary():
    logits = np.random.default_rng(8).normal(size=1000).astype(np.float32)
    for k in (1, 3, 20):
        tokens = draws(1.5, k, 1.0, logits=logits, n=1000)
        assert set(tokens) <= set(np.argsort(-logits)[:k])
        assert len(set(tokens)) == k  # not just the argmax
    keep, _ = np_filtered(logits, 0.7, -1, 0.6)
    tokens = draws(0.7, -1, 0.6, logits=logits, n=1000)
    assert set(tokens) <= set(np.flatnonzero(keep))
    assert len(set(tokens)) > 0.8 * keep.sum()


# ----------------------------------------------------------------------------------------------------
# seeds and steps


def test_same_seed_and_step_give_the_same_token_in_any_batch():
    rng = np.random.default_rng(9)
    vocab = 1000
    row = rng.normal(size=vocab).astype(np.float32) * 0.3  # high entropy: a different key, a different token
    others = rng.normal(size=(16, vocab)).astype(np.float32)
    for seed, step, temperature, top_k, top_p in [(5, 0, 1.0, -1, 1.0), (5, 1, 0.9, 50, 1.0), (77, 9, 1.3, 0, 0.8)]:
        alone = run_sample(row[None], temperature, top_k, top_p, seed, step)[0]
        for position in (0, 13):
            batch = others.copy()
            batch[position] = row
            temps = rng.uniform(0.5, 2, size=16).astype(np.float32)
            temps[1] = 0.0
            ks = rng.integers(-1, 30, size=16).astype(np.int32)
            ps = rng.uniform(0.3, 1, size=16).astype(np.float32)
            seeds = rng.integers(0, 2**31, size=16)
            steps = rng.integers(0, 100, size=16)
            temps[position], ks[position], ps[position] = temperature, top_k, top_p
            seeds[position], steps[position] = seed, step
            assert run_sample(batch, temps, ks, ps, seeds, steps)[position] == alone, (seed, step, position)


def test_steps_and_seeds_change_the_draw():
    logits = np.zeros((16, 1000), np.float32)  # uniform over 1000 tokens
    by_step = run_sample(logits, 1.0, -1, 1.0, 1234, np.arange(16))
    by_seed = run_sample(logits, 1.0, -1, 1.0, np.arange(16), 7)
    repeated = run_sample(logits, 1.0, -1, 1.0, 1234, 7)
    # 16 independent uniform draws collide 0.12 times on average; 3 or more collisions (fewer than 14
    # distinct) has probability < 1e-3, and a key that ignored the step or seed would give 1 distinct.
    assert len(set(by_step)) >= 14 and len(set(by_seed)) >= 14
    assert len(set(repeated)) == 1 and repeated[0] == by_step[7]


def test_key_is_fold_in_of_seed_and_step():
    """Documented derivation, so a request's tokens are reproducible from (seed, step) alone."""
    logits = np.random.default_rng(10).normal(size=(16, 1000)).astype(np.float32)
    seeds = np.array([0, 1, 42, 2**31 - 1, 2**31, 2**32 - 1] + list(range(1000, 1010)), np.uint32)
    steps = np.array([0, 5, 1, 3, 100, 7] + list(range(10)), np.int32)
    tokens = run_sample(logits, 0.5, -1, 1.0, seeds, steps)
    for i in range(16):
        key = jax.random.fold_in(jax.random.key(int(seeds[i])), int(steps[i]))
        expected = jax.random.categorical(key, jnp.asarray(logits[i]) / 0.5, mode="high")
        assert tokens[i] == int(expected), i


def test_64_bit_seeds_key_threefry_by_both_words():
    """Seeds given as (high, low) u32 words (the engine's: a seed is 64 bits) key threefry with both words, so s
    and s + 2**32 differ; a high word of 0 draws exactly as the 32-bit seed does, whose key jax.random.key(s) has
    the words (0, s)."""
    logits = np.random.default_rng(11).normal(size=(8, 1000)).astype(np.float32)
    seeds = [5, 5 + 2**32, 2**32 - 1, 2**63 - 1, 2**40 + 7, 7, 0, 2**33]
    words = np.array([(s >> 32, s & 0xFFFFFFFF) for s in seeds], np.uint32)
    steps = np.arange(8, dtype=np.int32)
    n = len(seeds)
    tokens = np.asarray(_sample(logits, np.ones(n, np.float32), np.full(n, -1, np.int32), np.ones(n, np.float32),
                                words, steps))
    for i, (hi, lo) in enumerate(words):
        key = jax.random.fold_in(jax.random.wrap_key_data(np.array([hi, lo], np.uint32), impl="threefry2x32"),
                                 int(steps[i]))
        assert tokens[i] == int(jax.random.categorical(key, jnp.asarray(logits[i]), mode="high")), i
    low = [i for i, s in enumerate(seeds) if s < 2**32]
    np.testing.assert_array_equal(tokens[low], run_sample(logits[low], 1.0, -1, 1.0, words[low, 1], steps[low]))
    for s in (0, 5, 2**32 - 1):
        np.testing.assert_array_equal(jax.random.key_data(jax.random.key(s)), [0, s])
    # the same row with seeds 5 and 5 + 2**32 (step 0): 16 draws each, all alike only if the high word were lost
    rows = np.broadcast_to(logits[:1], (32, 1000))
    pair = np.array([(0, 5)] * 16 + [(1, 5)] * 16, np.uint32)
    drawn = np.asarray(_sample(rows, np.ones(32, np.float32), np.full(32, -1, np.int32), np.ones(32, np.float32),
                               pair, np.tile(np.arange(16, dtype=np.int32), 2)))
    assert list(drawn[:16]) != list(drawn[16:])


def test_int32_and_uint32_seeds_agree_bitwise():
    logits = np.zeros((16, 1000), np.float32)
    seeds_u = np.array([0, 1, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1] + list(range(5, 15)), np.uint32)
    as_u = run_sample(logits, 1.0, -1, 1.0, seeds_u, 3)
    as_i = run_sample(logits, 1.0, -1, 1.0, seeds_u.view(np.int32), 3, seed_dtype=np.int32)
    np.testing.assert_array_equal(as_u, as_i)


# ----------------------------------------------------------------------------------------------------
# numerics


def test_extreme_temperatures_and_large_negative_logits():
    rng = np.random.default_rng(11)
    vocab = 1000
    base = rng.uniform(-3, 3, size=vocab).astype(np.float32)
    invalid = [0, 50, 100]
    base[invalid] = [-np.inf, -np.finfo(np.float32).max, -1e30]
    base[10] = 3.5  # the argmax, 0.5 above the rest: at t=1e-4 that is a logit gap of 5000

    cold = draws(1e-4, -1, 1.0, logits=base, n=1000)
    assert set(cold) == {10}
    for top_k, top_p in [(-1, 1.0), (20, 1.0), (-1, 0.9), (3000, 0.5)]:
        hot = draws(100.0, top_k, top_p, logits=base, n=1000)  # nearly uniform over the finite logits
        assert ((hot >= 0) & (hot < vocab)).all() and not set(hot) & set(invalid)
        assert len(set(hot)) > (15 if top_k == 20 else 300)

    # A logit that overflows to +inf when divided by a tiny temperature is still sampled cleanly.
    huge = np.zeros(vocab, np.float32)
    huge[[3, 4]] = [1e35, -1e35]
    assert set(draws(1e-4, -1, 1.0, logits=huge, n=1000)) == {3}

    # The filtered logits themselves never hold NaN, at either extreme.
    row = base[:300]
    with np.errstate(over="ignore"):
        scaled = np.stack([row / 1e-4, row / 100, row, huge[:300] / 1e-4] * 2).astype(np.float32)
    top_k = np.array([5, -1, 1000, 2, -1, 7, 0, -1], np.int32)
    top_p = np.array([0.5, 0.99, 0.3, 1.0, 0.2, 1.0, 0.7, 0.01], np.float32)
    out = np.asarray(_filter(scaled, top_k, top_p))
    assert not np.isnan(out).any()


# ----------------------------------------------------------------------------------------------------
# log-probs


def test_logprobs_match_numpy_log_softmax():
    rng = np.random.default_rng(12)
    n, vocab = 6, 500
    logits = (rng.normal(size=(n, vocab)) * 4).astype(np.float32)
    logits[2, :100] = -1e9
    logits[3, 200:] = -np.inf
    sampled = np.array([0, 17, 499, 150, 3, 9], np.int32)
    targets = np.array([-1, 5, -1, 199, 250, -1], np.int32)
    s_lp, t_lp, top_ids, top_lp = (np.asarray(a) for a in _logprobs(logits, sampled, targets, MAX_LOGPROBS))

    ref = np_log_softmax(logits)
    rows = np.arange(n)
    np.testing.assert_allclose(s_lp, ref[rows, sampled], rtol=0, atol=1e-5)
    want_targets = np.where(targets < 0, sampled, targets)
    np.testing.assert_allclose(t_lp, ref[rows, want_targets], rtol=0, atol=1e-5)
    np.testing.assert_array_equal(t_lp[targets < 0], s_lp[targets < 0])  # -1 scores the sampled token

    assert top_ids.dtype == np.int32 and top_ids.shape == (n, MAX_LOGPROBS)
    np.testing.assert_array_equal(top_ids, np.argsort(-ref, axis=-1, kind="stable")[:, :MAX_LOGPROBS])
    np.testing.assert_allclose(top_lp, np.take_along_axis(ref, top_ids, axis=-1), rtol=0, atol=1e-5)
    assert (np.diff(top_lp, axis=-1) <= 0).all()


def test_logprobs_ignore_sampling_transforms_and_allow_zero_top():
    logits = np.log(np.array([[0.5, 0.25, 0.125, 0.125]], np.float32))
    s_lp, t_lp, top_ids, top_lp = _logprobs(logits, np.array([1], np.int32), np.array([3], np.int32), 0)
    np.testing.assert_allclose(np.asarray(s_lp), [np.log(0.25)], atol=1e-6)
    np.testing.assert_allclose(np.asarray(t_lp), [np.log(0.125)], atol=1e-6)
    assert top_ids.shape == (1, 0) and top_lp.shape == (1, 0)


def test_logprobs_skip_the_top_k_when_no_row_wants_it():
    """want_top False: the same sampled / target log-probs, zeros for the top entries (nobody reads them); True:
    the same top entries as without the flag."""
    logits = np.log(np.array([[0.5, 0.25, 0.125, 0.125], [0.1, 0.2, 0.3, 0.4]], np.float32))
    sampled, targets = np.array([1, 3], np.int32), np.array([-1, 0], np.int32)
    with_flag = jax.jit(sampler.logprobs, static_argnums=3)
    full = _logprobs(logits, sampled, targets, 2)
    on = with_flag(logits, sampled, targets, 2, jnp.bool_(True))
    off = with_flag(logits, sampled, targets, 2, jnp.bool_(False))
    for a, b in zip(full, on):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(off[0]), np.asarray(full[0]))
    np.testing.assert_array_equal(np.asarray(off[1]), np.asarray(full[1]))
    assert not np.asarray(off[2]).any() and not np.asarray(off[3]).any()
    np.testing.assert_array_equal(np.asarray(full[2]), [[0, 1], [3, 2]])


# ----------------------------------------------------------------------------------------------------
# min-p


def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_top():
    """`apply_min_p` keeps exactly numpy's set (float64 softmax ratios): min_p 0 keeps everything, 1 the maximum and
    its ties; the kept logits are untouched, the others -inf."""
    rng = np.random.default_rng(40)
    logits = (rng.normal(size=(64, 300)) * rng.uniform(0.3, 4, size=(64, 1))).astype(np.float32)
    logits[::5] = np.round(logits[::5])  # ties with the maximum
    min_p = rng.choice([0.0, 1e-3, 0.05, 0.3, 0.9, 1.0], size=64).astype(np.float32)
    min_p[::2] = rng.uniform(0, 1, size=32)
    out = np.asarray(_min_p(logits, min_p))
    checked = 0
    for row in range(64):
        keep = np_min_p_keep(logits[row], float(min_p[row]))
        if keep is None:
            continue
        checked += 1
        np.testing.assert_array_equal(out[row], np.where(keep, logits[row], -np.inf), err_msg=f"min_p {min_p[row]}")
    assert checked >= 50
    assert (np.asarray(_min_p(logits, np.zeros(64, np.float32))) == logits).all()
    top = np.asarray(_min_p(logits, np.ones(64, np.float32)))
    assert ((top > -np.inf) == (logits == logits.max(axis=1, keepdims=True))).all()


def test_sample_applies_min_p_after_the_temperature_and_before_top_k_top_p():
    """Each sampled row's token is `categorical(fold_in(key(seed), step), filtered, mode="high")` where `filtered`
    is min-p on logits / t, then numpy's top-k / top-p set of what min-p kept; greedy rows ignore min-p; min_p 0
    gives the same tokens as no min-p at all."""
    rng = np.random.default_rng(41)
    n, vocab = 32, 400
    logits, top_k, top_p = random_batch(rng, n, vocab)
    logits[1] = rng.normal(size=vocab)  # random_batch's -inf half: no maximum ratio to test on those
    temperature = rng.choice([0.0, 0.5, 1.0, 1.7], size=n).astype(np.float32)
    min_p = rng.choice([0.0, 0.02, 0.2, 0.6], size=n).astype(np.float32)
    seeds, steps = rng.integers(0, 2**32, size=n).astype(np.uint32), rng.integers(0, 1000, size=n).astype(np.int32)
    tokens = run_sample(logits, temperature, top_k, top_p, seeds, steps, min_p=min_p)

    def keep_of(i, scaled):  # min-p first, then numpy's top-k / top-p set of what it kept
        keep_p = np_min_p_keep(scaled, float(min_p[i]))
        if keep_p is None:
            return None
        (keep,) = reference_keep(np.where(keep_p, scaled, -np.inf)[None], top_k[i : i + 1], top_p[i : i + 1])
        return None if keep is None else keep & keep_p

    assert check_draws(tokens, logits, temperature, seeds, steps, keep_of) >= 14
    np.testing.assert_array_equal(run_sample(logits, temperature, top_k, top_p, seeds, steps, min_p=0.0),
                                  run_sample(logits, temperature, top_k, top_p, seeds, steps))


@pytest.mark.parametrize("temperature, min_p", [(1.0, 0.1), (0.7, 0.06), (2.0, 0.3)])
def test_min_p_frequencies_match_the_filtered_softmax(temperature, min_p):
    scaled = _LOGITS / temperature
    keep = np_min_p_keep(scaled, min_p)
    assert keep is not None and 1 < keep.sum() < _V  # a real cut
    tokens = run_sample(np.broadcast_to(_LOGITS, (N_SEEDS, _V)), temperature, -1, 1.0,
                        np.arange(N_SEEDS) * 7919 + 11, 0, min_p=min_p)
    counts = np.bincount(tokens, minlength=_V)
    stat, df = chi2_stat(counts, np_softmax(np.where(keep, scaled, -np.inf)))
    assert stat < chi2_critical(df), (stat, df, counts)


# ----------------------------------------------------------------------------------------------------
# logit biases (logit_bias, min_tokens' bans)


def test_biases_are_added_before_everything_and_bans_are_never_drawn():
    """Each row's (token, bias) slots are added to its logits first: greedy rows take numpy's argmax of the biased
    logits, sampled rows draw `categorical(fold_in(key(seed), step), biased / t)`; a -inf slot bans its token (never
    drawn over 4000 seeds); unused slots (token 0, bias 0) change nothing."""
    rng = np.random.default_rng(50)
    n, vocab, w = 16, 64, 4
    logits = rng.normal(size=(n, vocab)).astype(np.float32)
    ids = rng.integers(0, vocab, size=(n, w)).astype(np.int32)
    values = rng.choice([0.0, -3.0, 2.5, 8.0, -np.inf], size=(n, w)).astype(np.float32)
    for i in range(n):  # distinct tokens per row (a request's logit_bias is a dict), padding as the engine's
        ids[i] = rng.permutation(vocab)[:w]
    ids[::3, 2:], values[::3, 2:] = 0, 0.0
    temperature = np.where(np.arange(n) % 2 == 0, 0.0, 0.8).astype(np.float32)
    seeds, steps = rng.integers(0, 2**32, size=n).astype(np.uint32), rng.integers(0, 100, size=n).astype(np.int32)
    tokens = np.asarray(_sample(logits, temperature, np.full(n, -1, np.int32), np.ones(n, np.float32), seeds, steps,
                                None, ids, values))
    for i in range(n):
        biased = logits[i].astype(np.float32).copy()
        np.add.at(biased, ids[i], values[i])
        if temperature[i] == 0:
            assert tokens[i] == np.argmax(biased), i
        else:
            key = jax.random.fold_in(jax.random.key(int(seeds[i])), int(steps[i]))
            assert tokens[i] == int(jax.random.categorical(key, biased / temperature[i], mode="high")), i
    banned = np.array([[int(np.argmax(_LOGITS)), 3, 0, 0]], np.int32)
    ban = np.array([[-np.inf, -np.inf, 0.0, 0.0]], np.float32)
    many = run_sample(np.broadcast_to(_LOGITS, (N_SEEDS, _V)), 1.0, -1, 1.0, np.arange(N_SEEDS) * 7919 + 11, 0)
    drawn = np.asarray(_sample(np.broadcast_to(_LOGITS, (N_SEEDS, _V)), np.ones(N_SEEDS, np.float32),
                               np.full(N_SEEDS, -1, np.int32), np.ones(N_SEEDS, np.float32),
                               (np.arange(N_SEEDS) * 7919 + 11).astype(np.uint32), np.zeros(N_SEEDS, np.int32), None,
                               np.repeat(banned, N_SEEDS, 0), np.repeat(ban, N_SEEDS, 0)))
    assert not np.isin(drawn, banned[0, :2]).any() and np.isin(many, banned[0, :2]).any()
    keep = np.ones(_V, bool)
    keep[banned[0, :2]] = False
    stat, df = chi2_stat(np.bincount(drawn, minlength=_V), np_softmax(np.where(keep, _LOGITS, -np.inf)))
    assert stat < chi2_critical(df)


def test_allow_only_rows_draw_only_their_slots_tokens():
    """A row that allows only its slots' tokens (allowed_token_ids) has every other logit -inf before its biases:
    greedy rows take numpy's argmax over the allowed biased logits, sampled rows draw `categorical(fold_in(key(seed),
    step), where(allowed, biased, -inf) / t)`; unused slots (`NO_TOKEN`) allow nothing, even the row's best token;
    rows beside them that allow everything are as without. Over 4000 seeds the draws are only allowed tokens, at
    the restricted softmax's frequencies."""
    rng = np.random.default_rng(51)
    n, vocab, w = 12, 64, 4
    logits = rng.normal(size=(n, vocab)).astype(np.float32)
    ids = np.full((n, w), sampler.NO_TOKEN, np.int32)
    values = np.zeros((n, w), np.float32)
    only = np.arange(n) % 3 != 2  # every third row allows everything (slots of a plain logit_bias)
    for i in range(n):
        k = 1 + i % w  # 1 to 4 slots used
        ids[i, :k] = rng.permutation(vocab)[:k]
        values[i, :k] = rng.choice([0.0, 1.5, -2.0], size=k)
        logits[i, (ids[i, 0] + 1) % vocab] += 6.0  # a token the row would pick, if allowed
    temperature = np.where(np.arange(n) % 2 == 0, 0.0, 0.9).astype(np.float32)
    seeds, steps = rng.integers(0, 2**32, size=n).astype(np.uint32), rng.integers(0, 100, size=n).astype(np.int32)
    tokens = np.asarray(_sample(logits, temperature, np.full(n, -1, np.int32), np.ones(n, np.float32), seeds, steps,
                                None, ids, values, only))
    for i in range(n):
        used = ids[i][ids[i] != sampler.NO_TOKEN]
        biased = logits[i].copy()
        biased[used] += values[i][:len(used)]
        if only[i]:
            biased = np.where(np.isin(np.arange(vocab), used), biased, -np.inf)
            assert tokens[i] in used, i
        if temperature[i] == 0:
            assert tokens[i] == np.argmax(biased), i
        else:
            key = jax.random.fold_in(jax.random.key(int(seeds[i])), int(steps[i]))
            assert tokens[i] == int(jax.random.categorical(key, biased / temperature[i], mode="high")), i
    allowed = np.array([[3, 11, 14, sampler.NO_TOKEN]], np.int32)
    drawn = np.asarray(_sample(np.broadcast_to(_LOGITS, (N_SEEDS, _V)), np.ones(N_SEEDS, np.float32),
                               np.full(N_SEEDS, -1, np.int32), np.ones(N_SEEDS, np.float32),
                               (np.arange(N_SEEDS) * 7919 + 11).astype(np.uint32), np.zeros(N_SEEDS, np.int32), None,
                               np.repeat(allowed, N_SEEDS, 0), np.zeros((N_SEEDS, 4), np.float32),
                               np.ones(N_SEEDS, bool)))
    assert set(np.unique(drawn)) == {3, 11, 14}
    keep = np.isin(np.arange(_V), allowed[0, :3])
    stat, df = chi2_stat(np.bincount(drawn, minlength=_V)[keep], np_softmax(_LOGITS[keep]))
    assert stat < chi2_critical(df)


def test_biases_cost_one_copy_of_the_logits_and_none_without_them():
    """The compiled sampler, the raw logits alive beside it as in the step (the log-probs read them): no [N, V]
    copy without bias slots, and one with them (the biased logits, made only in the branch where some row has a
    bias). A cond passing the logits through copied them twice."""
    import re

    n, vocab = 64, 4096
    shapes = [((n, vocab), jnp.float32), ((n,), jnp.float32), ((n,), jnp.int32), ((n,), jnp.float32),
              ((n, 2), jnp.uint32), ((n,), jnp.int32), ((n,), jnp.float32)]
    bias = [((n, 16), jnp.int32), ((n, 16), jnp.float32)]

    def copies(args):
        def step(*a):
            return sampler.sample(*a), jax.nn.log_softmax(a[0], axis=-1)[:, 0]

        hlo = jax.jit(step).lower(*(jax.ShapeDtypeStruct(s, d) for s, d in args)).compile().as_text()
        return len(re.findall(rf"= f32\[{n},{vocab}\](?:\{{[^}}]*\}})? copy\(", hlo))

    assert (copies(shapes), copies(shapes + bias)) == (0, 1)
    # with the allow-only column, as the step passes it: none (in the biased branch the masked logits come out of
    # the fusion that applies the mask, which the scatter of the biases then updates in place)
    assert copies(shapes + bias + [((n,), jnp.bool_)]) == 0


def test_penalties_follow_vllm_after_the_biases():
    """Per row, after its biases (vLLM's order): a token of the prompt or generated so far has its logit divided
    by the repetition penalty where positive, multiplied where not; then frequency x its count and presence (once,
    if generated) are subtracted; numpy computes the same in float32 from those definitions. Greedy rows take its
    argmax, sampled rows draw `categorical(fold_in(key(seed), step), penalized / t)`. The counts and prompt flags
    are per sequence slot, each row reading its own; rows without penalties (0, 0, 1) are as without."""
    rng = np.random.default_rng(52)
    n, vocab, slots, w = 16, 64, 5, 2
    logits = rng.normal(scale=2.0, size=(n, vocab)).astype(np.float32)
    logits[:, 7] = 0.0  # a zero logit: neither divided nor multiplied into anything else
    counts = rng.choice([0, 0, 0, 1, 2, 5], size=(slots, vocab)).astype(np.int32)
    in_prompt = rng.random((slots, vocab)) < 0.3
    row_slot = rng.integers(0, slots, size=n).astype(np.int32)
    presence = rng.choice([0.0, 0.7, -1.2], size=n).astype(np.float32)
    frequency = rng.choice([0.0, 0.4, -2.0], size=n).astype(np.float32)
    repetition = rng.choice([1.0, 1.3, 0.6], size=n).astype(np.float32)
    presence[:3], frequency[:3], repetition[:3] = 0.0, 0.0, 1.0  # rows without penalties
    ids = np.stack([rng.permutation(vocab)[:w] for _ in range(n)]).astype(np.int32)
    values = rng.choice([0.0, 3.0, -np.inf], size=(n, w)).astype(np.float32)
    temperature = np.where(np.arange(n) % 2 == 0, 0.0, 0.7).astype(np.float32)
    seeds, steps = rng.integers(0, 2**32, size=n).astype(np.uint32), rng.integers(0, 100, size=n).astype(np.int32)
    common = (logits, temperature, np.full(n, -1, np.int32), np.ones(n, np.float32), seeds, steps, None, ids, values,
              None)
    penalties = sampler.Penalties(counts, in_prompt, row_slot, presence, frequency, repetition)
    tokens = np.asarray(_sample(*common, penalties))
    plain = np.asarray(_sample(*common))
    for i in range(n):
        z = logits[i].copy()
        np.add.at(z, ids[i], values[i])
        c, seen = counts[row_slot[i]], in_prompt[row_slot[i]] | (counts[row_slot[i]] > 0)
        r = np.float32(repetition[i])
        z = np.where(seen & (z > 0), z / r, np.where(seen, z * r, z)).astype(np.float32)
        z = (z - np.float32(frequency[i]) * c.astype(np.float32) - np.float32(presence[i]) * (c > 0)).astype(
            np.float32)
        if temperature[i] == 0:
            assert tokens[i] == np.argmax(z), i
        else:
            key = jax.random.fold_in(jax.random.key(int(seeds[i])), int(steps[i]))
            assert tokens[i] == int(jax.random.categorical(key, z / temperature[i], mode="high")), i
        if i < 3:
            assert tokens[i] == plain[i], i
    assert (tokens != plain).sum() >= n // 2  # the penalties change most rows' tokens: the test sees them
    # none anywhere: the same tokens as without the argument (the cond's other branch)
    none = sampler.Penalties(counts, in_prompt, row_slot, np.zeros(n, np.float32), np.zeros(n, np.float32),
                             np.ones(n, np.float32))
    np.testing.assert_array_equal(np.asarray(_sample(*common, none)), plain)


def test_masked_rows_draw_only_the_tokens_of_their_bits():
    """Structured outputs' masks (`masks`: uint32 words, token t bit t % 32 of word t // 32): a masked row has every
    token whose bit is clear at -inf, then its penalties; greedy rows take numpy's argmax over the allowed logits,
    sampled rows draw `categorical(fold_in(key(seed), step), where(allowed, logits, -inf) / t)`; rows not masked
    (their bits ignored) are as without masks."""
    rng = np.random.default_rng(8)
    n, vocab = 8, 70  # 3 words, the last one partial
    logits = rng.normal(size=(n, vocab)).astype(np.float32)
    allowed = rng.random((n, vocab)) < 0.2
    allowed[:, 65] = True  # a token of the partial last word
    logits[np.arange(n), np.argmax(np.where(allowed, -np.inf, logits), axis=1)] += 8.0  # the best: not allowed
    words = np.zeros((n, 3), np.uint32)
    for i in range(n):
        for t in np.flatnonzero(allowed[i]):
            words[i, t // 32] |= np.uint32(1) << np.uint32(t % 32)
    masked = np.arange(n) % 4 != 3
    temperature = np.where(np.arange(n) % 2 == 0, 0.0, 0.8).astype(np.float32)
    seeds, steps = rng.integers(0, 2**32, size=n).astype(np.uint32), rng.integers(0, 100, size=n).astype(np.int32)
    tokens = np.asarray(_sample(logits, temperature, np.full(n, -1, np.int32), np.ones(n, np.float32), seeds, steps,
                                masks=(words, masked)))
    plain = np.asarray(_sample(logits, temperature, np.full(n, -1, np.int32), np.ones(n, np.float32), seeds, steps))
    for i in range(n):
        if not masked[i]:
            assert tokens[i] == plain[i], i
            continue
        kept = np.where(allowed[i], logits[i], -np.inf)
        assert allowed[i, tokens[i]], i
        if temperature[i] == 0:
            assert tokens[i] == np.argmax(kept), i
        else:
            key = jax.random.fold_in(jax.random.key(int(seeds[i])), int(steps[i]))
            assert tokens[i] == int(jax.random.categorical(key, kept / temperature[i], mode="high")), i
    assert not allowed[masked, np.argmax(logits[masked], axis=1)].any()  # the mask changed every masked row's pick
