"""The sampler's top-k / top-p filter: the bisection thresholds against a full-vocabulary sort (issue 12, item 3).

`sampler.apply_top_k_top_p` finds the top-k and top-p cuts by bisection over the values' order keys (32 masked
reductions per cut, no sort). The baseline here, `sorted_filter`, is the filter it replaced: a descending sort
of every row, then the cuts by sorted position. Both give the same kept sets (tests/engine/test_sampler.py). Each
is jitted alone and timed warm, median of `--repeats` runs, on `--rows` rows of `--vocab` random logits, for
rows with top-k only, top-p only, both, and for the whole `sampler.sample` (its random draws included) on
greedy-only, unfiltered and mixed batches, with either filter inside. A second table times `sample` with the
penalties' state (vLLM's presence / frequency / repetition penalties) against the same batch without it.

    python scripts/bench_sampler.py [--rows 32] [--vocab 128256] [--repeats 10]
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time

import numpy as np

from mnemojax.bench import print_header

CASES = {  # name: (top_k, top_p) of every row
    "top-k 50": (50, 1.0),
    "top-p 0.9": (-1, 0.9),
    "top-k 50 + top-p 0.9": (50, 0.9),
    "top-k 2000": (2000, 1.0),
}


def sorted_filter(logits, top_k, top_p):
    """The sort-based filter `sampler.apply_top_k_top_p` replaced: the same arguments and kept sets."""
    import jax
    import jax.numpy as jnp

    vocab = logits.shape[-1]
    desc = jnp.sort(logits, axis=-1, descending=True)
    k = jnp.where(top_k <= 0, vocab, jnp.minimum(top_k, vocab)).astype(jnp.int32)
    in_k = desc >= jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)
    cum = jnp.cumsum(jax.nn.softmax(jnp.where(in_k, desc, -jnp.inf), axis=-1), axis=-1)
    before = jnp.pad(cum[:, :-1], ((0, 0), (1, 0)))
    in_p = (before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    n_keep = jnp.maximum(jnp.sum(in_k & in_p, axis=-1), 1)
    threshold = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def _sample_args(rows: int) -> tuple:
    """Placeholder per-row arguments of `sampler.sample` after the logits (for lowering: shapes and dtypes)."""
    f32, i32 = np.zeros(rows, np.float32), np.zeros(rows, np.int32)
    return f32, i32, f32, i32.astype(np.uint32), i32


def time_ms(fn, args, repeats: int) -> float:
    """Median wall ms of `fn(*args)` after one warm-up call (which compiles)."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def measure(rows: int, vocab: int, repeats: int) -> list[tuple[str, float, float]]:
    """(case, sort ms, bisection ms) for each filter case, then for `sampler.sample` on a few batches (its draws
    included), with the sort-based filter and with the bisection."""
    import jax

    from mnemojax.engine import sampler

    logits = (np.random.default_rng(0).normal(size=(rows, vocab)) * 2).astype(np.float32)
    sort_fn, new_fn = jax.jit(sorted_filter), jax.jit(sampler.apply_top_k_top_p)
    out = []
    for name, (k, p) in CASES.items():
        args = (logits, np.full(rows, k, np.int32), np.full(rows, p, np.float32))
        a, b = np.asarray(sort_fn(*args)), np.asarray(new_fn(*args))
        assert np.array_equal(np.isfinite(a), np.isfinite(b)), f"{name}: the kept sets differ"
        out.append((name, time_ms(sort_fn, args, repeats), time_ms(new_fn, args, repeats)))
    sample = jax.jit(sampler.sample)
    filter_fn = sampler.apply_top_k_top_p
    try:  # `sample` as it was: the same function with the sort-based filter
        sampler.apply_top_k_top_p = sorted_filter
        sample_sorted = jax.jit(lambda *a: sampler.sample(*a)).lower(logits, *_sample_args(rows)).compile()
    finally:
        sampler.apply_top_k_top_p = filter_fn
    seeds, steps = np.arange(rows, dtype=np.uint32), np.zeros(rows, np.int32)
    mixed_t = np.where(np.arange(rows) % 4 == 0, 0.0, 0.8).astype(np.float32)
    mixed_k = np.array([-1, 50, -1, 50] * (rows // 4 + 1), np.int32)[:rows]
    mixed_p = np.array([1.0, 1.0, 0.9, 0.9] * (rows // 4 + 1), np.float32)[:rows]
    for name, (t, k, p) in {
        "sample: greedy only": (np.zeros(rows, np.float32), mixed_k, mixed_p),
        "sample: temperature only (no filter)": (np.full(rows, 0.8, np.float32), np.full(rows, -1, np.int32),
                                                 np.ones(rows, np.float32)),
        "sample: mixed greedy/top-k/top-p/both": (mixed_t, mixed_k, mixed_p),
    }.items():
        args = (logits, t, k, p, seeds, steps)
        out.append((name, time_ms(sample_sorted, args, repeats), time_ms(sample, args, repeats)))
    return out


def measure_penalties(rows: int, vocab: int, repeats: int) -> list[tuple[str, float]]:
    """(case, ms) of `sampler.sample` on a batch of `rows` sampled rows (temperature 0.8, top-k 50) with `rows`
    sequence slots of penalty state ([rows + 1, vocab] counts and prompt tokens, as the engine keeps them): without
    biases or penalty state (the baseline), with the state and no row penalized, with every row penalized
    (presence, frequency and repetition), and with one biased row and no penalty, with and without the state."""
    import jax

    from mnemojax.engine import sampler

    rng = np.random.default_rng(1)
    logits = (rng.normal(size=(rows, vocab)) * 2).astype(np.float32)
    base = (logits, np.full(rows, 0.8, np.float32), np.full(rows, 50, np.int32), np.ones(rows, np.float32),
            np.arange(rows, dtype=np.uint32), np.zeros(rows, np.int32))
    counts = rng.integers(0, 3, size=(rows + 1, vocab)).astype(np.int32) * (rng.random((rows + 1, vocab)) < 0.01)
    in_prompt = rng.random((rows + 1, vocab)) < 0.01
    slots = np.arange(rows, dtype=np.int32)
    none, some = np.zeros(rows, np.float32), np.full(rows, 0.5, np.float32)
    bias_ids = np.full((rows, 1), vocab, np.int32)  # an unused slot
    bias_values = np.zeros((rows, 1), np.float32)
    bias_ids[0, 0], bias_values[0, 0] = 7, 2.0

    def penalties(p, f, r):
        return sampler.Penalties(counts, in_prompt, slots, p, f, r)

    fn = jax.jit(sampler.sample)
    cases = {
        "no biases, no penalty state": {},
        "penalty state, no row penalized": {"penalties": penalties(none, none, np.ones(rows, np.float32))},
        "every row penalized": {"penalties": penalties(some, some, np.full(rows, 1.2, np.float32))},
        "one row biased, no penalty state": {"bias_ids": bias_ids, "bias_values": bias_values},
        "one row biased, penalty state": {"bias_ids": bias_ids, "bias_values": bias_values,
                                          "penalties": penalties(none, none, np.ones(rows, np.float32))},
    }
    return [(name, time_ms(functools.partial(fn, **kw), base, repeats)) for name, kw in cases.items()]


def penalties_table(results, rows: int, vocab: int) -> str:
    lines = [f"sampler.sample, {rows} sampled rows x {vocab} vocab (temperature 0.8, top-k 50), {rows + 1} slots of "
             f"penalty state; median ms per call, warm",
             f"{'case':40s} {'ms':>9s} {'x baseline':>11s}"]
    for name, ms in results:
        lines.append(f"{name:40s} {ms:9.2f} {ms / results[0][1]:10.2f}x")
    return "\n".join(lines)


def table(results, rows: int, vocab: int) -> str:
    lines = [f"{rows} rows x {vocab} vocab, float32; median ms per call, warm",
             f"{'case':40s} {'sort':>9s} {'bisection':>10s} {'speed-up':>9s}"]
    for name, sort_ms, new_ms in results:
        lines.append(f"{name:40s} {sort_ms:9.2f} {new_ms:10.2f} {sort_ms / new_ms:8.1f}x")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    print_header(argv)
    print(table(measure(args.rows, args.vocab, args.repeats), args.rows, args.vocab))
    print()
    print(penalties_table(measure_penalties(args.rows, args.vocab, args.repeats), args.rows, args.vocab))
