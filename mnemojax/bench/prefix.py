"""Time to first token of a follow-up question over a shared context, with and without the prefix cache.

For each context length L (a multiple of the question length Q): a context of L random tokens, a first question
and a follow-up question of Q tokens each. With the cache, context + first question is served first (it fills the
cache), then the follow-up's TTFT is measured: it computes only its Q new tokens over the cached L. Without the
cache the follow-up computes all L + Q tokens, in chunks of Q tokens (`chunk_size` = Q), so its last step
computes exactly the follow-up's new tokens at the same context: that step's time is the *cost of the new
tokens*, the reference. Target: follow-up TTFT with the cache <= 1.1 x that cost. Each length is run once
untimed (compilation), then `--repeats` times with fresh contexts; medians are reported. The tiny model's
context limit is 8192 tokens.

    python scripts/bench_prefix.py [--lengths 1024 4096 8000] [--question 64] [--repeats 3] [--model tiny]
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

import jax
import numpy as np

from mnemojax.bench.attention import hardware
from mnemojax.engine.llm import LLM
from mnemojax.scheduling.sampling_params import SamplingParams

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def follow_up(llm: LLM, prompt: list[int]) -> tuple[float, float, int]:
    """Serves `prompt` alone (one token); returns (TTFT s, the last step's seconds, cached tokens). Each step is
    waited for (steps are dispatched asynchronously; the sampling step's fetch would otherwise wait for all the
    steps before it), so the last step's time is its own."""
    e = llm.engine
    rid = e.add_request(prompt, ONE_TOKEN)
    last = 0.0
    while e.has_unfinished():
        t0 = time.perf_counter()
        e.step()
        jax.block_until_ready(e.executor.k_cache)
        last = time.perf_counter() - t0
    out = e.pop_finished(rid)
    return out.metrics.first_token_time - out.metrics.arrival_time, last, out.num_cached_tokens


def run(lengths, question: int, repeats: int, model: str, page_size: int) -> list[dict]:
    top = max(lengths) + 2 * question + 16
    kw = dict(model=model, page_size=page_size, chunk_size=question, max_num_batched_tokens=question,
              max_model_len=top, num_pages=2 * (top // page_size) + 8)
    on, off = LLM(**kw), LLM(enable_prefix_caching=False, **kw)
    rows = []
    for L in lengths:
        if L % question:
            raise ValueError(f"context length {L} must be a multiple of the question length {question}")
        res = {"on": [], "off": [], "new": [], "cached": []}
        for r in range(repeats + 1):  # the first is the warm-up (compilation of this context's shapes)
            rng = np.random.default_rng([L, r])
            context, q1, q2 = (rng.integers(0, on.engine.model_config.vocab_size, n).tolist()
                               for n in (L, question, question))
            on.generate([context + q1], ONE_TOKEN)  # fills the cache
            jax.block_until_ready(on.engine.executor.k_cache)  # the device idle, as before the reference's last step
            ttft_on, _, cached = follow_up(on, context + q2)
            ttft_off, last_off, _ = follow_up(off, context + q2)
            on.engine.reset_prefix_cache()
            if r:
                for k, v in zip(("on", "off", "new", "cached"), (ttft_on, ttft_off, last_off, cached)):
                    res[k].append(v)
        med = {k: statistics.median(v) for k, v in res.items()}
        rows.append({"context": L, **med, "ratio": med["on"] / med["new"], "speedup": med["off"] / med["on"]})
        print(f"{L:>8} {question:>5} {int(med['cached']):>7} {med['off'] * 1e3:>12.1f} {med['on'] * 1e3:>11.1f} "
              f"{med['new'] * 1e3:>13.1f} {rows[-1]['ratio']:>11.2f} {rows[-1]['speedup']:>8.1f}x", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8000])
    ap.add_argument("--question", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--page_size", type=int, default=16)
    args = ap.parse_args(argv)
    print("$ python scripts/bench_prefix.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])))
    for line in hardware():
        print(line)
    print(f"model {args.model}, page_size {args.page_size}, chunk_size = budget = question = {args.question} tokens; "
          f"medians of {args.repeats}")
    print(f"{'context':>8} {'new':>5} {'cached':>7} {'TTFT off ms':>12} {'TTFT on ms':>11} {'new-tok ms':>13} "
          f"{'on / new':>11} {'speedup':>9}")
    rows = run(args.lengths, args.question, args.repeats, args.model, args.page_size)
    worst = max(r["ratio"] for r in rows)
    print(f"target: follow-up TTFT with the cache <= 1.1 x the cost of its new tokens: "
          f"{'met' if worst <= 1.1 else 'NOT met'} (worst {worst:.2f})")
    return rows
