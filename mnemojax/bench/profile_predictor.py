"""Fits the runtime predictor's efficiency factors to timed steps of the real executor; saves a profile.

    python scripts/profile_predictor.py [--hardware auto] [--model M] [--dtype D] [--reps 7] [--out PROFILE]
    python scripts/profile_predictor.py --check mnemojax/scheduling/profiles/cpu.json   # measure and compare, no fit
    python scripts/profile_predictor.py --wake_only --out PROFILE    # measure the wake factor into PROFILE

Builds an engine on one device (the 1x1x1 mesh) of the machine it runs on, then times
`engine.executor.execute(plan)` on a spread of plans built by hand (requests given pages straight from the pool,
`ScheduledChunk`s, a `StepPlan`). `--hardware auto` takes the predictor preset of the first device (`cpu`, or
`a100` / `h100` / `h200` on those NVIDIA GPUs); the set-up follows it (`SETUPS`):
  - on a CPU, the tiny model in float32 (`cpu_plans`): decode batches of 1..64 at contexts 16..2048, single
    prefill chunks of 16..512 tokens at contexts 0..2048, prefill chunks mixed with decodes, and several prefill
    chunks together;
  - on a GPU, llama3.2-1b in bf16 with random weights, the attention kernels the engine runs there ("pallas"),
    a 1M-token page pool (`gpu_plans`): decode batches of 1..256 at contexts 1K..128K, prefill chunks of
    128..4096 tokens at up to 128K, mixed and multi-prefill steps.
The profile goes to `--out`, by default the shipped profile of the hardware (`mnemojax/scheduling/profiles/
<hardware>.json`), which the engine, the simulator and the planner read for that preset. Every plan runs once
first (compiling its shape bucket), then in each of `--reps` rounds every plan runs twice back to back and the
second run is timed (the steady state of consecutive steps of one shape; see `Bench.measure`); a plan's time is
the median of its rounds. `execute` returns host values, so each call is complete when it returns. Run it on a
quiet machine (`--wait_quiet`): on 2 cores, one busy process elsewhere slows every step by up to half.

Then the wake-up (`Profile.wake_factor`, `Profile.wake_overhead_s`): what an engine that waited for a request pays
for its first step, the one effect the steady-state plans above cannot see. For each of `WAKE_TOKENS` (16 to 256
tokens, a new request's first chunk), a request goes through the engine's own loop (`Bench.first_token`:
admission, scheduling, the steps, the results) after `--wake_idle_s` of sleep, and again at once; the line
cold first token = factor x step + overhead is fitted over the sizes, the step being that prefill's steady-state
time. The simulator applies it to a step launched after the device idled, so an idle engine's first token costs
what the engine's loop makes it cost (on this VM: 1.4-1.6x the step + ~1 ms; the loop's host work around the step,
two launches before the first collect, is in it whether the machine slept or not).

The factors (`mnemojax.scheduling.predictor.Profile`; `fitted_factors`: the reference kernel's own ones only
when the engine ran it) are fitted on two thirds of the plans (every category split the same way) by
Nelder-Mead on the log of each factor, minimising the mean squared log error of predicted vs measured time;
the summary reports the relative error |predicted / measured - 1| (median, p90, max) on the held-out third and
on all plans. The profile file records the factors, the engine settings they describe,
the error summary, the samples, the date and the command. Prints the command, the hardware, and the table.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import random
import shlex
import statistics
import sys
import time
from typing import Callable

from mnemojax.scheduling.buckets import bucket
from mnemojax.scheduling.predictor import HARDWARE, PROFILE_DIR, ChunkShape, Predictor, Profile
from models.kernels import REFERENCE

FITTED = ("linear_flops_eff", "linear_bw_eff", "attn_flops_eff", "attn_bw_eff", "attn_gather_bw_eff",
          "attn_gather_cache_bytes", "attn_block_overhead_s", "step_overhead_s", "per_token_overhead_s",
          "per_request_overhead_s", "per_row_overhead_s")
"""The factors the fit moves; the rest (layout, collectives: none on one device) stay as set."""

REFERENCE_ONLY = ("attn_gather_bw_eff", "attn_gather_cache_bytes", "attn_block_overhead_s")
"""Factors only the reference kernel's cost uses: not fitted for the GPU kernels (they cannot move the loss)."""


def fitted_factors(attention: str) -> tuple[str, ...]:
    """The factors a fit moves for an engine running `attention` (a resolved kernel name)."""
    return FITTED if attention == REFERENCE else tuple(k for k in FITTED if k not in REFERENCE_ONLY)


Plan = list[ChunkShape]


# ---------------------------------------------------------------------- plans
def cpu_plans(seed: int = 0) -> list[tuple[str, Plan]]:
    """(category, chunks) over the spread the predictor must cover on a CPU (the tiny model); at most 512
    tokens and 64 requests."""
    rng = random.Random(seed)
    plans: list[tuple[str, Plan]] = []
    for batch in (1, 4, 16, 64):
        for ctx in (16, 128, 512, 2048):
            plans.append(("decode", [ChunkShape(1, ctx)] * batch))
    for batch, ctx in ((2, 64), (8, 1024), (32, 256), (2, 1024), (8, 64), (32, 1536)):
        plans.append(("decode", [ChunkShape(1, ctx)] * batch))
    for q in (16, 64, 128, 256, 512):
        for start in (0, 1024, 2048):
            plans.append(("prefill", [ChunkShape(q, start + q)]))
    for _ in range(12):
        q = rng.choice((16, 32, 64, 128, 256, 384))
        n = rng.choice((1, 2, 4, 8, 16, 32, 64))
        n = min(n, 512 - q, 63)  # 64 sequence rows
        chunks = [ChunkShape(q, rng.randrange(0, 2049) + q)]
        chunks += [ChunkShape(1, rng.randrange(16, 2049)) for _ in range(n)]
        plans.append(("mixed", chunks))
    for _ in range(6):
        sizes = [rng.choice((16, 32, 64, 128)) for _ in range(rng.randrange(2, 5))]
        plans.append(("prefills", [ChunkShape(q, rng.randrange(0, 2049) + q) for q in sizes]))
    return plans


GPU_POOL_TOKENS = 1 << 20
"""KV tokens of the GPU set-up's page pool (llama3.2-1b in bf16: 32 KiB a token, 32 GiB in all)."""


def gpu_plans(seed: int = 0) -> list[tuple[str, Plan]]:
    """(category, chunks) for a GPU (llama3.2-1b, bf16): decode batches of 1..256 at contexts of 1K..128K,
    prefill chunks of 128..4096 tokens at up to 128K of context, chunks mixed with decodes, and several prefill
    chunks together; at most 4096 tokens and 256 requests a plan, every plan's keys within the page pool
    (`GPU_POOL_TOKENS`), so no two of its requests share a page."""
    rng = random.Random(seed)
    max_ctx = 131072
    plans: list[tuple[str, Plan]] = []
    for batch in (1, 8, 32, 128, 256):
        for ctx in (1024, 8192, 32768, max_ctx):
            if batch * ctx <= GPU_POOL_TOKENS:
                plans.append(("decode", [ChunkShape(1, ctx)] * batch))
    for batch, ctx in ((2, 65536), (16, 16384), (64, 4096), (256, 2048), (4, 200), (96, 6000)):
        plans.append(("decode", [ChunkShape(1, ctx)] * batch))
    for q in (128, 512, 1024, 2048, 4096):
        for start in (0, 8192, 32768, max_ctx - 4096):
            plans.append(("prefill", [ChunkShape(q, start + q)]))
    for _ in range(12):
        q = rng.choice((128, 256, 512, 1024, 2048, 3072))
        n = min(rng.choice((1, 4, 16, 64, 128, 255)), 4096 - q)
        chunks = [ChunkShape(q, rng.randrange(0, 65536) + q)]
        budget = GPU_POOL_TOKENS - chunks[0].context_len
        chunks += [ChunkShape(1, rng.randrange(256, min(32768, budget // n) + 1)) for _ in range(n)]
        plans.append(("mixed", chunks))
    for _ in range(6):
        sizes = [rng.choice((128, 256, 512, 1024)) for _ in range(rng.randrange(2, 5))]
        plans.append(("prefills", [ChunkShape(q, rng.randrange(0, 65536) + q) for q in sizes]))
    return plans


@dataclasses.dataclass(frozen=True)
class Setup:
    """The engine a profile is fitted on, and the plans timed on it, for one kind of machine."""

    model: str
    dtype: str
    plans: Callable[[int], list[tuple[str, Plan]]]
    max_num_seqs: int
    num_pages: int
    max_num_batched_tokens: int
    max_model_len: int | None = None
    page_size: int = 16
    block_pages: int = 8


SETUPS: dict[str, Setup] = {
    "cpu": Setup("tiny", "float32", cpu_plans, max_num_seqs=64, num_pages=8 * 1024 + 512,
                 max_num_batched_tokens=512),
    "gpu": Setup("llama3.2-1b", "bfloat16", gpu_plans, max_num_seqs=256, num_pages=GPU_POOL_TOKENS // 16 + 512,
                 max_num_batched_tokens=4096, max_model_len=131072),
}
"""By kind of machine: the tiny model in float32 on a CPU; on a GPU (any of the NVIDIA presets) llama3.2-1b in
bf16 with random weights, whose 131,072-token context reaches the long-context shapes the GPU presets plan."""


def setup_for(hardware: str) -> Setup:
    """The set-up a profile of the hardware preset `hardware` is fitted with."""
    return SETUPS["cpu" if hardware == "cpu" else "gpu"]


def split(plans: list[tuple[str, Plan]]) -> tuple[list[int], list[int]]:
    """(train, held-out) indices: within each category, every third plan is held out."""
    train, held, seen = [], [], {}
    for i, (cat, _) in enumerate(plans):
        k = seen[cat] = seen.get(cat, -1) + 1
        (held if k % 3 == 2 else train).append(i)
    return train, held


def describe(chunks: Plan) -> str:
    dec = [c for c in chunks if c.query_tokens == 1]
    pre = [c for c in chunks if c.query_tokens > 1]
    parts = [f"{c.query_tokens}@{c.context_len}" for c in pre]
    if dec:
        ctx = sorted(c.context_len for c in dec)
        parts.append(f"{len(dec)}dec@{ctx[0]}" + (f"..{ctx[-1]}" if ctx[-1] != ctx[0] else ""))
    return " + ".join(parts)


# ---------------------------------------------------------------------- measuring
class Bench:
    """An engine on one device and a way to turn chunk shapes into executable plans."""

    def __init__(self, setup: Setup, model: str | None = None, dtype: str | None = None):
        from mnemojax.engine.llm_engine import EngineConfig, LLMEngine

        self.config = EngineConfig(model=model or setup.model, dtype=dtype or setup.dtype,
                                   max_num_seqs=setup.max_num_seqs, num_pages=setup.num_pages,
                                   block_pages=setup.block_pages, page_size=setup.page_size,
                                   max_num_batched_tokens=setup.max_num_batched_tokens,
                                   max_model_len=setup.max_model_len,
                                   precompile=False)  # each plan's first run compiles its shape, untimed
        self.engine = LLMEngine(self.config)
        self._next_page = 0
        self._rng = random.Random(0)

    @property
    def attention(self) -> str:
        """The attention kernels the engine runs ("reference" on a CPU; on an NVIDIA GPU "mosaic" on Hopper for a
        model they support, else "pallas": `mnemojax.engine.loader.engine_attention`)."""
        return self.engine.executor.spec.attention

    def first_token(self, n: int) -> float:
        """Seconds from a new request's arrival to its first token through the engine's own loop (admission,
        scheduling, the steps, the results): a prompt of `n` random tokens (no prefix-cache hit), 2 to generate."""
        from mnemojax.scheduling.sampling_params import SamplingParams

        engine = self.engine
        prompt = [self._rng.randrange(256) for _ in range(n)]
        t0 = engine.clock()
        rid = engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0),
                                 arrival_time=t0)
        while engine.has_unfinished():
            engine.step()
        return engine.pop_finished(rid).metrics.first_token_time - t0

    @property
    def block_tokens(self) -> int:
        ex = self.engine.executor
        return min(self.config.block_pages, ex.max_pages_per_seq) * self.config.page_size

    def plan(self, chunks: Plan):
        """A `StepPlan` for `chunks`: fresh requests, each given its own pages (cycling through the pool)."""
        from mnemojax.scheduling.request import Request
        from mnemojax.scheduling.sampling_params import SamplingParams
        from mnemojax.scheduling.scheduler import ScheduledChunk, StepPlan

        usable, ps = self.engine.kv.ranks[0].num_usable, self.config.page_size
        out = []
        for i, c in enumerate(chunks):
            req = Request(f"p{i}", [1] * c.context_len, SamplingParams(), 0.0, seed=i)
            n = -(-c.context_len // ps)
            req.kv_ranks = [0]
            req.pages = [[1 + (self._next_page + j) % usable for j in range(n)]]
            self._next_page += n
            req.num_computed = c.context_len
            out.append(ScheduledChunk(req, c.context_len - c.query_tokens, c.query_tokens, sample=True))
        return StepPlan(out, [])

    def measure(self, plans: list[Plan], reps: int, seed: int = 0, log=None) -> list[float]:
        """Steady-state seconds of `executor.execute` per plan: the median over `reps` rounds of the second of
        two back-to-back runs (as consecutive serving steps have nearly the same shapes), after a compiling
        run of each plan.

        The first run of each pair also absorbs what belongs to a change of shape, not to the plan: caches
        holding the previous plan's data, and the executor allocating a pipeline register of the new size
        whenever the padded token rows T change. Plans with the same T run together, in a shuffled order, so a
        burst of load from another process spreads over them.
        """
        ex = self.engine.executor
        built = [self.plan(p) for p in plans]
        for i, p in enumerate(built):
            t = time.perf_counter()
            ex.execute(p)
            if log:
                log(f"  warm-up {i + 1}/{len(built)}: {time.perf_counter() - t:.2f} s")
        groups: dict[int, list[int]] = {}
        for i, p in enumerate(plans):
            groups.setdefault(_padded_tokens(p), []).append(i)
        times: list[list[float]] = [[] for _ in built]
        rng = random.Random(seed)
        for _ in range(reps):
            for T in rng.sample(sorted(groups), len(groups)):
                for i in rng.sample(groups[T], len(groups[T])):
                    ex.execute(built[i])
                    t = time.perf_counter()
                    ex.execute(built[i])
                    times[i].append(time.perf_counter() - t)
        return [statistics.median(ts) for ts in times]


WAKE_TOKENS = (16, 64, 128, 192, 256)
"""Prompt lengths of the wake measurement: what an engine that idled starts with, a new request's first chunk (each
one chunk at the default `chunk_size`)."""


def measure_wake(first_token, step, sizes, reps: int, idle_s: float, *, sleep=time.sleep,
                 seed: int = 0) -> list[tuple[float, float, float]]:
    """(step, cold, warm) seconds per prompt size: `step(n)` the steady-state time of the step that prefills a
    new request of n tokens (what the predictor models), `first_token(n)` the seconds from a new request's arrival
    to its first token through the engine's loop, after `idle_s` of sleep (cold) and again at once (warm); each
    the median over `reps` rounds, sizes in a shuffled order each round."""
    cold: list[list[float]] = [[] for _ in sizes]
    warm: list[list[float]] = [[] for _ in sizes]
    rng = random.Random(seed)
    for _ in range(reps):
        for i in rng.sample(range(len(sizes)), len(sizes)):
            sleep(idle_s)
            cold[i].append(first_token(sizes[i]))
            warm[i].append(first_token(sizes[i]))
    return [(step(n), statistics.median(c), statistics.median(w)) for n, c, w in zip(sizes, cold, warm)]


def wake_fit(points: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(`Profile.wake_factor`, `Profile.wake_overhead_s`) from `measure_wake`'s (step, cold, warm) points: the
    least-squares line cold = factor x step + overhead, with factor >= 1 and overhead >= 0 (a bound that binds
    is held and the other refitted)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    factor = max(1.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 1.0)
    overhead = my - factor * mx
    if overhead < 0:  # through the origin
        overhead = 0.0
        factor = max(1.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs))
    return factor, overhead


def wake_record(points: list[tuple[float, float, float]], sizes, idle_s: float, reps: int) -> dict:
    """How the wake factor and overhead were measured, for the profile file."""
    factor, overhead = wake_fit(points)
    return dict(idle_s=idle_s, reps=reps, factor=factor, overhead_s=overhead,
                plans=[{"tokens": n, "step_s": st, "cold_first_token_s": c, "warm_first_token_s": w}
                       for n, (st, c, w) in zip(sizes, points)])


def set_wake(profile_file: dict, record: dict) -> dict:
    """A profile file's contents with the wake factor and overhead of `record` (from `wake_record`) set, the rest
    unchanged."""
    return {**profile_file, "factors": {**profile_file["factors"], "wake_factor": record["factor"],
                                        "wake_overhead_s": record["overhead_s"]}, "wake": record}


class OtherLoad:
    """Measures the CPU time other processes take while a block runs, as a fraction of the machine.

    `with OtherLoad() as load: ...` then `load.fraction`: (busy CPU time of the whole machine - this
    process's) / (wall time x cores), from /proc/stat (0 where it cannot be read).
    """

    def __enter__(self):
        self._start = self._sample()
        return self

    def __exit__(self, *exc):
        (busy0, own0, wall0), (busy1, own1, wall1) = self._start, self._sample()
        wall = (wall1 - wall0) * (os.cpu_count() or 1)
        self.fraction = max(0.0, ((busy1 - busy0) - (own1 - own0)) / wall) if wall > 0 and busy1 else 0.0
        return False

    @staticmethod
    def _sample() -> tuple[float, float, float]:
        busy = 0.0
        try:
            with open("/proc/stat", encoding="utf-8") as f:
                ticks = [int(x) for x in f.readline().split()[1:]]
            busy = (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle, iowait
        except (OSError, ValueError, IndexError):
            pass
        t = os.times()
        return busy, t.user + t.system, time.monotonic()


QUIET = 0.15
"""Other processes' share of the CPUs below which `--wait_quiet` accepts a timing run."""


def wait_for_quiet(max_wait_s: float, threshold: float = 0.1, window_s: float = 20.0, log=print) -> float:
    """Waits (at most `max_wait_s`) until other processes use under `threshold` of the CPUs for `window_s`;
    returns their share in the last window."""
    deadline = time.monotonic() + max_wait_s
    while True:
        with OtherLoad() as load:
            time.sleep(window_s)
        if load.fraction < threshold or time.monotonic() > deadline:
            return load.fraction
        log(f"  waiting for a quiet machine: other processes use {load.fraction:.0%} of the CPUs")


def _padded_tokens(chunks: Plan) -> int:
    """The executor's token rows for `chunks` on one device: a power of two, at least 16."""
    return bucket(sum(c.query_tokens for c in chunks), 16)


# ---------------------------------------------------------------------- fitting
def errors(pred: list[float], meas: list[float]) -> list[float]:
    """Relative errors predicted / measured - 1."""
    return [p / m - 1 for p, m in zip(pred, meas)]


def summary(errs: list[float]) -> dict[str, float]:
    a = sorted(abs(e) for e in errs)
    if not a:
        return {}
    p90 = a[min(len(a) - 1, math.ceil(0.9 * len(a)) - 1)]
    return {"n": len(a), "median": statistics.median(a), "p90": p90, "max": a[-1],
            "mean_signed": statistics.fmean(errs)}


def nelder_mead(f, x0: list[float], step: float = 1.0, iters: int = 3000, tol: float = 1e-10) -> list[float]:
    """Minimises f over R^n from x0 (plain Nelder-Mead, standard coefficients)."""
    n = len(x0)
    pts = [list(x0)] + [[x + (step if j == i else 0.0) for j, x in enumerate(x0)] for i in range(n)]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = sorted(range(n + 1), key=vals.__getitem__)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if vals[-1] - vals[0] < tol:
            break
        centroid = [sum(p[j] for p in pts[:-1]) / n for j in range(n)]

        def toward(t):
            return [c + t * (w - c) for c, w in zip(centroid, pts[-1])]

        xr = toward(-1.0)
        fr = f(xr)
        if fr < vals[0]:
            xe = toward(-2.0)
            fe = f(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = toward(0.5)
            fc = f(xc)
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:
                for i in range(1, n + 1):
                    pts[i] = [b + 0.5 * (x - b) for b, x in zip(pts[0], pts[i])]
                    vals[i] = f(pts[i])
    return pts[min(range(n + 1), key=vals.__getitem__)]


def fit(make_predictor, base: Profile, plans: list[Plan], times: list[float],
        factors: tuple[str, ...] = FITTED) -> Profile:
    """The profile (base with `factors`, some of `FITTED`, moved) minimising the mean squared log error.

    Works on the logs of the factors, clamped to efficiencies in [1e-3, 1e3] of the hardware preset's
    ceilings, overheads in [1e-12, 1] s (an overhead that does not matter fits to ~0), the cache size in
    [1e5, 1e10] bytes.
    """
    bounds = [(math.log(1e-3), math.log(1e3)) if k.endswith("_eff") else
              (math.log(1e5), math.log(1e10)) if k.endswith("_bytes") else (math.log(1e-12), 0.0) for k in factors]

    def profile_at(x):
        return dataclasses.replace(base, **{k: math.exp(min(max(v, lo), hi))
                                            for k, v, (lo, hi) in zip(factors, x, bounds)})

    def loss(x):
        pred = make_predictor(profile_at(x))
        return statistics.fmean((math.log(pred.step_time(p) / t)) ** 2 for p, t in zip(plans, times))

    start = dict(attn_gather_cache_bytes=16 * 2**20)  # a last-level cache's worth
    best = [math.log(max(start.get(k) or getattr(base, k), 1e-12)) for k in factors]
    for step in (2.0, 1.0, 0.5, 0.25):  # restarts from the best point so far, shrinking the simplex
        best = nelder_mead(loss, best, step=step)
    return profile_at(best)


# ---------------------------------------------------------------------- reporting
def hardware_lines() -> list[str]:
    import jax

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else ()
    return [f"cpu: {cpu}, {os.cpu_count()} cores; load average {' '.join(f'{x:.2f}' for x in load)}",
            f"jax {jax.__version__}, device {jax.devices()[0].device_kind} x {len(jax.devices())}",
            f"python {platform.python_version()}, {platform.platform()}"]


def table(plans: list[tuple[str, Plan]], T: list[int], meas: list[float], pred: list[float],
          held: set[int]) -> str:
    rows = [f"{'#':>3} {'kind':8} {'set':5} {'T':>4} {'measured ms':>11} {'predicted ms':>12} {'error':>7}  plan"]
    for i, ((cat, chunks), t, m, p) in enumerate(zip(plans, T, meas, pred)):
        rows.append(f"{i:>3} {cat:8} {'held' if i in held else 'fit':5} {t:>4} {m * 1e3:>11.2f} {p * 1e3:>12.2f} "
                    f"{p / m - 1:>+7.1%}  {describe(chunks)}")
    return "\n".join(rows)


def summary_line(name: str, s: dict) -> str:
    return (f"{name:9} n={s['n']:>3}  |error| median {s['median']:6.1%}  p90 {s['p90']:6.1%}  max {s['max']:6.1%}"
            f"  (mean signed {s['mean_signed']:+.1%})")


def time_plans(args, bench: Bench, plans, command) -> tuple[list[float], dict, dict]:
    """(measured seconds per plan, engine settings, how they were timed) on this machine."""
    print(f"timing {len(plans)} plans ...", flush=True)
    deadline = time.monotonic() + args.wait_quiet
    while True:
        if args.wait_quiet:
            wait_for_quiet(max(0.0, deadline - time.monotonic()), log=lambda s: print(s, flush=True))
        t0 = time.perf_counter()
        with OtherLoad() as other:
            meas = bench.measure([p for _, p in plans], args.reps, args.seed,
                                 log=lambda s: print(s, flush=True) if os.environ.get("PROFILE_VERBOSE") else None)
        elapsed = time.perf_counter() - t0
        if other.fraction <= QUIET or time.monotonic() > deadline:
            break
        print(f"  other processes used {other.fraction:.0%} of the CPUs while timing: timing again", flush=True)
    engine = dict(page_size=bench.config.page_size, block_pages=bench.config.block_pages,
                  block_tokens=bench.block_tokens, max_model_len=bench.engine.max_model_len,
                  max_num_seqs=bench.config.max_num_seqs, attention=bench.attention)
    timing = dict(command=command, date=_now(), machine=hardware_lines(), reps=args.reps,
                  seconds=round(elapsed, 1), other_processes_cpu=round(other.fraction, 3))
    return meas, engine, timing


def time_wake(args, bench: Bench) -> dict:
    """The wake measurement on `bench` (`measure_wake` over `WAKE_TOKENS`), as `wake_record`."""
    print(f"timing {len(WAKE_TOKENS)} new requests' first tokens after {args.wake_idle_s:g} s idle and at once, "
          f"{args.wake_reps} rounds ...", flush=True)
    steps = dict(zip(WAKE_TOKENS, bench.measure([[ChunkShape(n, n)] for n in WAKE_TOKENS], max(3, args.wake_reps),
                                                args.seed)))
    for n in WAKE_TOKENS:  # the engine loop's shapes compiled
        bench.first_token(n)
    points = measure_wake(bench.first_token, steps.__getitem__, WAKE_TOKENS, args.wake_reps, args.wake_idle_s,
                          seed=args.seed)
    return wake_record(points, WAKE_TOKENS, args.wake_idle_s, args.wake_reps)


def wake_line(wake: dict) -> str:
    if "overhead_s" not in wake:  # a record of the older measurement (executor.execute after a sleep): factor only
        return f"wake factor {wake['factor']:.3f} after {wake['idle_s']:g} s idle (measured by an older script)"
    firsts = ", ".join(f"{p['tokens']} tokens {p['step_s'] * 1e3:.1f} / {p['cold_first_token_s'] * 1e3:.1f} / "
                       f"{p['warm_first_token_s'] * 1e3:.1f}" for p in wake["plans"])
    return (f"wake: a step after {wake['idle_s']:g} s idle takes {wake['factor']:.3f} x its time + "
            f"{wake['overhead_s'] * 1e3:.2f} ms (ms of the step / a new request's first token after the idle / "
            f"at once, medians over {wake['reps']} rounds: {firsts})")


def wake_only(args, command) -> dict:
    """`--wake_only`: measures the wake factor and writes it into the profile file at `args.out`."""
    with open(args.out, encoding="utf-8") as f:
        profile = json.load(f)
    print(f"building the engine ({profile['model']}, {profile['dtype']}, 1 device) ...", flush=True)
    bench = Bench(setup_for(profile["hardware"]), profile["model"], profile["dtype"])
    if args.wait_quiet:
        wait_for_quiet(args.wait_quiet, log=lambda s: print(s, flush=True))
    with OtherLoad() as other:
        wake = time_wake(args, bench)
    wake.update(command=command, date=_now(), other_processes_cpu=round(other.fraction, 3))
    profile = set_wake(profile, wake)
    Profile.from_dict(profile["factors"])  # still a valid profile
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(profile, f, indent=2)
        f.write("\n")
    print()
    print("command:", command)
    for line in hardware_lines():
        print("hardware:", line)
    print(f"other processes used {other.fraction:.0%} of the CPUs meanwhile")
    print(wake_line(wake))
    print("written to", os.path.relpath(args.out))
    return wake


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def resolve_defaults(args, source: dict | None = None) -> None:
    """Fills the arguments left to the machine: `--hardware auto` from the first device, `--model` and `--dtype`
    from its set-up (`setup_for`), `--out` as the shipped profile of the hardware. `source`: the profile file of
    `--samples`, whose model, dtype and hardware they are."""
    if source is not None:
        args.model, args.dtype, args.hardware = source["model"], source["dtype"], source["hardware"]
    elif args.hardware == "auto":
        from mnemojax.engine.llm_engine import detect_hardware

        args.hardware = detect_hardware()
    if args.hardware not in HARDWARE:
        raise SystemExit(f"--hardware {args.hardware!r} is not a predictor preset; known: {sorted(HARDWARE)}")
    setup = setup_for(args.hardware)
    args.model = args.model or setup.model
    args.dtype = args.dtype or setup.dtype
    if args.out is None:
        args.out = os.path.join(PROFILE_DIR, f"{args.hardware}.json")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None,
                    help="a preset name (models.config.PRESETS); default: tiny on a CPU, llama3.2-1b on a GPU")
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                    help="default: float32 on a CPU, bfloat16 on a GPU")
    ap.add_argument("--hardware", default="auto",
                    help="hardware preset the factors are relative to (mnemojax.scheduling.predictor.HARDWARE); "
                         "auto: the first device's (cpu, a100, h100, h200)")
    ap.add_argument("--reps", type=int, default=7, help="timed rounds over all plans; a plan's time is the median")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None,
                    help="profile file to write; default: the shipped one, mnemojax/scheduling/profiles/<hardware>.json")
    ap.add_argument("--check", default=None, metavar="PROFILE",
                    help="time the plans and compare with this profile's predictions; fit and write nothing")
    ap.add_argument("--samples", default=None, metavar="PROFILE",
                    help="fit to the samples stored in this profile file instead of timing anew")
    ap.add_argument("--wake_idle_s", type=float, default=1.0,
                    help="seconds of sleep before each cold run that measures the wake factor (0: not measured, 1)")
    ap.add_argument("--wake_reps", type=int, default=5, help="rounds of the wake measurement")
    ap.add_argument("--wake_only", action="store_true",
                    help="measure only the wake factor and set it in the profile at --out (nothing refitted)")
    ap.add_argument("--wait_quiet", type=float, default=0.0, metavar="SECONDS",
                    help="for up to this long, wait for other processes to leave the CPUs (mostly) idle before "
                         "timing, and time again when they did not stay so")
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    command = "python " + " ".join(shlex.quote(a) for a in ["scripts/profile_predictor.py"] +
                                   (sys.argv[1:] if argv is None else list(argv)))
    source = Predictor.load_profile(args.samples) if args.samples else None
    resolve_defaults(args, source)

    from models.config import preset

    if args.wake_only:
        return wake_only(args, command)
    wake = None
    if source is not None:
        plans = [(x["kind"], [ChunkShape(*c) for c in x["chunks"]]) for x in source["samples"]]
        meas = [x["measured_s"] for x in source["samples"]]
        held = [i for i, x in enumerate(source["samples"]) if x["held_out"]]
        train = [i for i in range(len(plans)) if i not in held]
        engine, timing, wake = source["engine"], source["timing"], source.get("wake")
    else:
        setup = setup_for(args.hardware)
        plans = setup.plans(args.seed)
        train, held = split(plans)
        print(f"building the engine ({args.model}, {args.dtype}, 1 device, for {args.hardware}) ...", flush=True)
        bench = Bench(setup, args.model, args.dtype)
        meas, engine, timing = time_plans(args, bench, plans, command)
        if args.wake_idle_s > 0 and not args.check:
            wake = time_wake(args, bench)
    model = preset(args.model)

    def make(profile):
        return Predictor(model, args.hardware, dtype_bytes=4 if args.dtype == "float32" else 2, profile=profile)

    if args.check:
        predictor = Predictor(model, args.hardware, profile=args.check)
        held = list(range(len(plans)))
    else:
        attention = engine.get("attention", REFERENCE)  # profiles before this field timed the reference kernel
        layout = dict(attention=attention, block_tokens=engine["block_tokens"], pad_tokens_min=16, pad_rows_min=8)
        base = dataclasses.replace(Profile(), **layout)
        fitted = fit(make, base, [plans[i][1] for i in train], [meas[i] for i in train],
                     factors=fitted_factors(attention))
        predictor = make(dataclasses.replace(fitted, wake_factor=wake["factor"] if wake else 1.0,
                                             wake_overhead_s=wake.get("overhead_s", 0.0) if wake else 0.0))
    pred = [predictor.step_time(p) for _, p in plans]
    errs = errors(pred, meas)
    result = {"all": summary(errs), "held_out": summary([errs[i] for i in held])}
    if not args.check:
        result["fit"] = summary([errs[i] for i in train])
        predictor.save_profile(
            args.out, model=args.model, engine=engine, date=_now(), command=command, errors=result, timing=timing,
            **({"wake": wake} if wake else {}),
            samples=[{"kind": c, "chunks": [[x.query_tokens, x.context_len, x.num_ranks] for x in p],
                      "measured_s": m, "held_out": i in held}
                     for i, ((c, p), m) in enumerate(zip(plans, meas))])

    print()
    print("command:", command)
    if args.samples:
        print(f"samples: {args.samples}, timed by: {timing['command']} ({timing['date']})")
    for line in timing["machine"]:
        print("hardware:", line)
    print(f"timing: {len(plans)} plans x {timing['reps']} rounds in {timing['seconds']:.0f} s (warm-up included); "
          f"other processes used {timing['other_processes_cpu']:.0%} of the CPUs meanwhile")
    print("factors:", ", ".join(f"{k}={getattr(predictor.profile, k):.3g}"
                                for k in fitted_factors(predictor.attention)))
    if wake:
        print(wake_line(wake))
    if not args.check:
        print("profile written to", os.path.relpath(args.out))
    print()
    print(table(plans, [predictor.padded_tokens(p) for _, p in plans], meas, pred, set(held)))
    print()
    for name in ("fit", "held_out", "all"):
        if name in result:
            print(summary_line(name, result[name]))
    return result
