"""Scheduler time per step, and simulator speed.

1. `Scheduler.schedule()` on a loaded step: 256 running requests decoding (2K-token contexts) and 1,000 waiting
   ShareGPT4-like prompts, for each policy, without a predictor (token budget only) and with the predictor and a
   target batch time (Llama-3-8B, h100, tp=8). After one warm-up step (it fills the per-request caches of
   remaining prefill time), `schedule()` is timed over consecutive steps, each completed as the engine would
   (untimed); the median is reported. Two admission regimes: `max_num_seqs` = 256
   (no slot free: the waiting requests cannot be admitted) and 2,048 (slots free: the step's budget is the
   limit and the scheduler must look at the waiting queue). Target: under 1 ms.
2. Simulator speed: one simulated hour at 2 QPS (ShareGPT4-like, no long requests), CPU seconds by
   `time.process_time`. Target: under 60 s.

    python scripts/bench_scheduler.py [--samples 5] [--profile] [--skip_sim]

`--profile` prints the cProfile top functions of the slowest configuration.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import numpy as np


from mnemojax.scheduling.kv_manager import KVCacheManager  # noqa: E402
from mnemojax.scheduling.request import Request, RequestStatus  # noqa: E402
from mnemojax.scheduling.sampling_params import SamplingParams  # noqa: E402
from mnemojax.scheduling.config import POLICIES, SchedulerConfig
from mnemojax.scheduling.scheduler import ChunkOutput, Scheduler
from mnemojax.sim.simulator import SimConfig, make_predictor, simulate, synthetic_trace  # noqa: E402


def build(policy: str, predictor, max_num_seqs: int, running: int = 256, waiting: int = 1000, seed: int = 0):
    rng = np.random.default_rng(seed)
    cfg = SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=max_num_seqs, chunk_size=4096,
                          scheduler_policy=policy, target_batch_time_ms=30.0 if predictor is not None else None, ppb_max_share=0.5)
    kv = KVCacheManager(1, 200_000, 16)
    s = Scheduler(cfg, kv, predictor, clock=lambda: 0.0)
    for i in range(running):
        n = int(rng.integers(500, 4000))
        r = Request(f"r{i}", range(n), SamplingParams(max_tokens=1000, ignore_eos=True), 0.0, seed=0)
        s.add(r)
        s.waiting.remove(r)
        kv.place(r)
        kv.grow(r, n)
        r.status, r.num_computed, r.output_token_ids = RequestStatus.RUNNING, n, [0]
        s.running.append(r)
    for i in range(waiting):
        n = int(min(8000, rng.lognormal(7.46, 0.93)))
        s.add(Request(f"w{i}", range(max(n, 1)), SamplingParams(max_tokens=400, ignore_eos=True),
                      float(rng.uniform(0, 1.0)), seed=0))
    return s


def complete(s: Scheduler, plan) -> None:
    """What the engine does when the micro-batch comes back (spp = 1): the scheduler's update, token 0 sampled."""
    s.update_from_output(plan, [ChunkOutput(0 if ch.sample else None) for ch in plan.chunks])


def time_schedule(policy, predictor, max_num_seqs, samples):
    """Median seconds of `schedule()` over `samples` consecutive steps of one state (after one warm-up step,
    which fills the per-request caches), completing each step as the engine would in between (untimed)."""
    s = build(policy, predictor, max_num_seqs)
    complete(s, s.schedule(now=1.0))
    ts = []
    for k in range(samples):
        now = 1.0 + 0.03 * (k + 1)
        t0 = time.perf_counter()
        plan = s.schedule(now=now)
        ts.append(time.perf_counter() - t0)
        complete(s, plan)
    return statistics.median(ts), plan, s


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--skip_sim", action="store_true")
    args = ap.parse_args()

    predictor = make_predictor(SimConfig(model="llama3-8b", hardware="h100", tp=8))
    print("Scheduler.schedule() with 256 running (decoding) + 1000 waiting; median over "
          f"{args.samples} consecutive steps after a warm-up step; llama3-8b h100 tp=8 predictor, target 30 ms")
    print(f"{'policy':<6} {'predictor':<10} {'max_num_seqs':>12} {'ms/step':>9} {'chunks':>7} {'tokens':>7} "
          f"{'running':>8} {'waiting':>8}   (last step's plan and queues)")
    worst = None
    for max_num_seqs in (256, 2048):
        for pred in (None, predictor):
            for policy in POLICIES:
                t, plan, s = time_schedule(policy, pred, max_num_seqs, args.samples)
                print(f"{policy:<6} {'yes' if pred else 'no':<10} {max_num_seqs:>12} {t * 1e3:>9.3f} "
                      f"{len(plan.chunks):>7} {plan.num_tokens:>7} {len(s.running):>8} {len(s.waiting):>8}",
                      flush=True)
                if worst is None or t > worst[0]:
                    worst = (t, policy, pred, max_num_seqs)
    if args.profile and worst is not None:
        t, policy, pred, max_num_seqs = worst
        print(f"\ncProfile of the slowest: policy={policy} predictor={'yes' if pred else 'no'} "
              f"max_num_seqs={max_num_seqs} ({t * 1e3:.1f} ms)")
        s = build(policy, pred, max_num_seqs)
        complete(s, s.schedule(now=1.0))
        prof = cProfile.Profile()
        prof.enable()
        s.schedule(now=1.03)
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(18)
        print(out.getvalue())

    if not args.skip_sim:
        trace = synthetic_trace(2.0, 3600.0, seed=0)
        for policy in ("fcfs", "ilrs"):
            cpu0 = time.process_time()
            res = simulate(SimConfig(scheduler_policy=policy), trace)
            cpu = time.process_time() - cpu0
            m = res.metrics
            print(f"simulator: 1 simulated hour at 2 QPS ({len(trace)} requests), policy {policy}: "
                  f"{cpu:.1f} CPU s (target < 60 s), {m['steps']} steps, {cpu / m['steps'] * 1e6:.0f} us/step, "
                  f"simulated {m['simulated_s']:.0f} s, completed {m['completed']}", flush=True)
