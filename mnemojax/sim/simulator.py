"""A discrete-event simulator: the engine's own scheduler and page manager, with the runtime predictor as the clock.

Plain Python (numpy for the trace and percentiles; matplotlib, imported lazily, for plots). Nothing here runs a
model: the simulator asks the `Predictor` how long each step would take and advances a simulated clock, so a
deployment far beyond one machine (1M-token prompts on 128 GPUs) can be planned, and the papers' scheduling
results reproduced, on a laptop.

The loop is the engine's (`LLMEngine.step()`: schedule, execute, update) with a `PredictedExecutor` in place of
the executor, an executor whose clock is the predictor. One simulated step:

1. Requests whose arrival time has come are added to the `Scheduler` (a request that can never fit the KV
   pages, `KVCacheManager.capacity_error`, is *rejected*, as the engine's `validate` would refuse it).
2. `Scheduler.schedule(now)` plans one micro-batch; it enters pipeline stage 0 (`mnemojax.scheduling.pipeline.Pipeline`,
   the executor's: `spp` micro-batches in flight, empty ones while it fills).
3. **Clocked pipeline**: every stage works at once, each on its own micro-batch, so the step lasts as long as
   the slowest: `max` over the micro-batches in flight of `predictor.stage_time(its chunks)`, each chunk as
   `ChunkShape(num_tokens, start + num_tokens, len(request.kv_ranks))`, and with KV parallelism the busiest
   KVP rank's time (a request spanning several ranks has its rows on the ranks holding its KV, as in the
   executor: `Scheduler.plan_shapes`). A micro-batch's time is computed when it is planned (its requests' KV
   placement is known then).
4. The micro-batch leaving the last stage (the one that entered `spp - 1` steps earlier) comes back with token
   0 for each sampling chunk, and `scheduler.update_from_output` does what it does in the engine: tokens
   appended at the step's end time, a request with `max_tokens` tokens finished and its pages freed.
   The step starts when the device is free and the clock moves to its end when it is collected. With
   `async_scheduling` (the engine's default) the step launched in one iteration is collected in the next,
   after the next one is planned and launched, as `LLMEngine.step` does.
5. With nothing planned and nothing in flight the clock jumps to the next arrival (a plan that only preempted
   is planned again; with no arrival left and requests still waiting for KV pages, the run ends: "deadlock").

So a prompt of K chunks alone completes its prefill (first token) after K + spp - 1 steps, and a decoding
request's tokens come spp steps apart (its next token can enter only once the previous one has left).

Requests are `Request(id, prompt_token_ids=range(n), SamplingParams(max_tokens=m, ignore_eos=True), arrival,
seed=0, priority=p)` (p the trace's, 0 unless given): `range` keeps million-token prompts free. There is no EOS, no stop string and no `max_model_len`
(Medha serves 10M tokens with RoPE scaling): a request generates exactly its `output_tokens`.

Metrics (seconds). TTFT = first token time - arrival; TBT = the gaps between a request's consecutive tokens,
pooled over requests. Requests are *short* or *long* by prompt length (`long_threshold_tokens`). A request that
has no first token when the simulation ends (the `max_simulated_s` horizon, or a KV deadlock) enters the TTFT
percentiles at its lower bound, end - arrival, so a policy cannot look better by never serving someone; their
number is reported (`unfinished`). Throughput = (prompt + generated tokens of completed requests) / the
makespan (first arrival to last completion).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from mnemojax.scheduling.kv_manager import KVCacheManager
from mnemojax.scheduling.pipeline import Pipeline
from mnemojax.scheduling.config import POLICIES, ParallelConfig, SchedulerConfig
from mnemojax.scheduling.predictor import HARDWARE, Predictor, default_profile
from mnemojax.scheduling.predictor import make_predictor as deployment_predictor
from mnemojax.scheduling.request import Request
from mnemojax.scheduling.sampling_params import SamplingParams
from mnemojax.scheduling.scheduler import ChunkOutput, Scheduler, StepPlan
from mnemojax.sim.reports import pyplot, save_figure
from models.config import LlamaConfig, preset

# ShareGPT4 (openchat_sharegpt4, the short trace of Medha and Sarathi-Serve; Sarathi-Serve's Table 2): prompt
# tokens median 1730, P90 5696; output tokens median 415, P90 834. A lognormal with the same median and P90:
# mu = ln(median), sigma = ln(P90 / median) / z_0.9 (z_0.9 = 1.2816). Requests are capped at 8K tokens
# (prompt + output), as Medha caps ShareGPT4, by redrawing (a truncated lognormal, no spike at the cap).
_Z90 = 1.2815515655446004
SHAREGPT4_PROMPT = (math.log(1730), math.log(5696 / 1730) / _Z90)  # (mu, sigma): sigma = 0.930
SHAREGPT4_OUTPUT = (math.log(415), math.log(834 / 415) / _Z90)  # sigma = 0.545
SHORT_MAX_TOKENS = 8192
# Long requests: outputs like Medha-SWE's (decode median 518, P90 808 tokens), lognormal fitted the same way.
# Prompts are log-uniform in [long_min_tokens, long_max_tokens]: over Medha's 128K-1M this gives a median of
# 362K and a P90 of 814K, close to Medha-SWE's 393K and 839K.
LONG_OUTPUT = (math.log(518), math.log(808 / 518) / _Z90)  # sigma = 0.347


# ------------------------------------------------------------------------------------------------ traces
@dataclasses.dataclass(frozen=True)
class TraceRequest:
    """One request of a trace."""

    arrival_time: float
    """Seconds from the trace's start."""
    prompt_tokens: int
    """Prompt length."""
    output_tokens: int
    """Tokens to generate (exactly: no EOS)."""
    prefix_id: int | None = None
    """Requests with the same prefix id share their first `prefix_tokens` prompt tokens (a shared context: the
    prefix cache reuses it); the rest of every prompt is its own."""
    prefix_tokens: int = 0
    """How many of its prompt tokens are the shared prefix's."""
    priority: int = 0
    """vLLM's request priority: under scheduler_policy priority, lower first (0 under any other policy)."""

    def __post_init__(self):
        if not (isinstance(self.arrival_time, (int, float)) and not isinstance(self.arrival_time, bool)
                and math.isfinite(self.arrival_time) and self.arrival_time >= 0):
            raise ValueError(f"arrival_time must be a finite number >= 0, got {self.arrival_time!r}")
        for name in ("prompt_tokens", "output_tokens"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if (not isinstance(self.prefix_tokens, (int, np.integer)) or isinstance(self.prefix_tokens, bool)
                or not 0 <= self.prefix_tokens <= self.prompt_tokens):
            raise ValueError(f"prefix_tokens must be an integer in [0, prompt_tokens], got {self.prefix_tokens!r}")
        if self.prefix_id is not None and (not isinstance(self.prefix_id, (int, np.integer))
                                           or isinstance(self.prefix_id, bool)):
            raise ValueError(f"prefix_id must be an integer (or None), got {self.prefix_id!r}")
        if not isinstance(self.priority, (int, np.integer)) or isinstance(self.priority, bool):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        if (self.prefix_id is None) != (self.prefix_tokens == 0):
            raise ValueError("prefix_id and prefix_tokens go together (a shared prefix has an id and a length), got "
                             f"{self.prefix_id!r} and {self.prefix_tokens!r}")


class SimPrompt(Sequence):
    """A simulated prompt's token ids, made up on demand: the first `prefix_tokens` are those of prefix
    `prefix_id` (equal across requests sharing it), the others the request's own (distinct from every other's)."""

    _SPAN = 1 << 40

    def __init__(self, uid: int, n: int, prefix_id: int | None = None, prefix_tokens: int = 0):
        self.uid, self.n, self.prefix_id, self.prefix_tokens = uid, n, prefix_id, prefix_tokens

    def __len__(self) -> int:
        return self.n

    def _token(self, i: int) -> int:
        if i < self.prefix_tokens:
            return (self.prefix_id + 1) * self._SPAN + i
        return -(self.uid + 1) * self._SPAN - i

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._token(k) for k in range(*i.indices(self.n))]
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return self._token(i % self.n)


def synthetic_trace(qps: float, duration_s: float, *, long_fraction: float = 0.0, long_min_tokens: int = 131072,
                    long_max_tokens: int = 1048576, seed: int = 0) -> list[TraceRequest]:
    """Poisson arrivals at `qps` for `duration_s` seconds. Each request is long with probability
    `long_fraction` (prompt log-uniform in [long_min_tokens, long_max_tokens], Medha-SWE-like output), else
    ShareGPT4-like (see `SHAREGPT4_PROMPT`). Deterministic for a seed."""
    if not qps > 0 or not duration_s > 0:
        raise ValueError(f"qps and duration_s must be positive, got {qps}, {duration_s}")
    if not 0.0 <= long_fraction <= 1.0:
        raise ValueError(f"long_fraction must be in [0, 1], got {long_fraction}")
    if not 1 <= long_min_tokens <= long_max_tokens:
        raise ValueError(f"need 1 <= long_min_tokens ({long_min_tokens}) <= long_max_tokens ({long_max_tokens})")
    rng = np.random.default_rng(seed)
    out: list[TraceRequest] = []
    t = 0.0
    while True:
        t += rng.exponential(1.0 / qps)
        if t >= duration_s:
            return out
        if rng.random() < long_fraction:
            u = rng.random()
            prompt = int(round(math.exp(math.log(long_min_tokens) + u * math.log(long_max_tokens / long_min_tokens))))
            output = max(1, int(round(rng.lognormal(*LONG_OUTPUT))))
        else:
            while True:  # truncated at SHORT_MAX_TOKENS
                prompt = max(1, int(round(rng.lognormal(*SHAREGPT4_PROMPT))))
                output = max(1, int(round(rng.lognormal(*SHAREGPT4_OUTPUT))))
                if prompt + output <= SHORT_MAX_TOKENS:
                    break
        out.append(TraceRequest(float(t), prompt, output))


def save_trace(trace: Iterable[TraceRequest], path: str) -> None:
    """Writes a JSONL trace: one `{"arrival_time", "prompt_tokens", "output_tokens"}` object per line, with
    `"prefix_id"` and `"prefix_tokens"` for a request with a shared prefix and `"priority"` for one whose priority
    is not 0."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in trace:
            d = {"arrival_time": r.arrival_time, "prompt_tokens": int(r.prompt_tokens),
                 "output_tokens": int(r.output_tokens)}
            if r.prefix_id is not None:
                d.update(prefix_id=int(r.prefix_id), prefix_tokens=int(r.prefix_tokens))
            if r.priority != 0:
                d.update(priority=int(r.priority))
            f.write(json.dumps(d) + "\n")


def load_trace(path: str) -> list[TraceRequest]:
    """Reads a JSONL trace (see `save_trace`), sorted by arrival time. Blank lines are skipped; a line with
    missing or unknown keys is an error naming the line."""
    keys = {"arrival_time", "prompt_tokens", "output_tokens"}
    prefix_keys = keys | {"prefix_id", "prefix_tokens"}
    shapes = (keys, prefix_keys, keys | {"priority"}, prefix_keys | {"priority"})
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{i}: not JSON ({e}): {line!r}") from None
            if not isinstance(d, dict) or set(d) not in shapes:
                raise ValueError(f"{path}:{i}: expected an object with exactly the keys {sorted(keys)} (and "
                                 f"optionally prefix_id and prefix_tokens, and priority), got {line!r}")
            try:
                out.append(TraceRequest(d["arrival_time"], d["prompt_tokens"], d["output_tokens"],
                                        d.get("prefix_id"), d.get("prefix_tokens", 0), d.get("priority", 0)))
            except ValueError as e:
                raise ValueError(f"{path}:{i}: {e}") from None
    return sorted(out, key=lambda r: r.arrival_time)


# ------------------------------------------------------------------------------------------------ config
@dataclasses.dataclass(frozen=True)
class Workload:
    """The requests to serve: a trace file, or a synthetic mix (`mnemojax.sim.simulator.synthetic_trace`: Poisson
    arrivals, ShareGPT4-like short requests up to 8K tokens, a fraction of long ones)."""

    trace: str | None = None
    """JSONL trace (arrival_time, prompt_tokens, output_tokens per line); default: the synthetic mix below."""
    qps: float = 0.5
    """Synthetic mix: Poisson arrival rate (requests per second)."""
    duration_s: float = 600.0
    """Synthetic mix: seconds of arrivals."""
    long_fraction: float = 0.05
    """Synthetic mix: fraction of long requests."""
    long_min_tokens: int = 131072
    """Synthetic mix: shortest long prompt (long prompts are log-uniform between the two)."""
    long_max_tokens: int = 1048576
    """Synthetic mix: longest long prompt (up to 10M tokens and more)."""
    output_tokens: int = 0
    """Every request generates this many tokens; 0: the mix's or the trace's own output lengths."""
    seed: int = 0
    """Synthetic mix: random seed."""
    long_threshold_tokens: int = SHORT_MAX_TOKENS
    """Prompts longer than this are long requests (TTFT target ttft_long_s)."""

    def __post_init__(self):
        for name in ("long_min_tokens", "long_max_tokens", "long_threshold_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.output_tokens < 0:
            raise ValueError(f"output_tokens must be >= 0, got {self.output_tokens}")
        for name in ("qps", "duration_s"):  # an infinite one made the synthetic mix loop for ever
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")

    def requests(self, trace: Sequence[TraceRequest] | None = None) -> list[TraceRequest]:
        """The requests in arrival order: `trace` when given, else the trace file, else the synthetic mix; with
        `output_tokens`, every request's output length replaced."""
        if trace is None:
            trace = load_trace(self.trace) if self.trace else synthetic_trace(
                self.qps, self.duration_s, long_fraction=self.long_fraction, long_min_tokens=self.long_min_tokens,
                long_max_tokens=self.long_max_tokens, seed=self.seed)
        trace = sorted(trace, key=lambda r: r.arrival_time)
        if not trace:
            raise ValueError("the workload has no requests")
        if self.output_tokens:
            trace = [dataclasses.replace(r, output_tokens=self.output_tokens) for r in trace]
        return trace


@dataclasses.dataclass(frozen=True)
class SimConfig(SchedulerConfig, ParallelConfig):
    """A simulated deployment: model, hardware, mesh, scheduler and KV cache settings.

    The scheduling and mesh fields are `mnemojax.scheduling.config.SchedulerConfig`'s and `ParallelConfig`'s, the same as the
    engine's; only their defaults differ here (H100-sized: tp 8, chunks of 4096, adaptive to Mnemosyne's 30 ms TBT
    target, ILRS).
    """

    tp: int = 8
    chunk_size: int = 4096
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    scheduler_policy: str = dataclasses.field(default="ilrs", metadata={"choices": POLICIES})
    target_batch_time_ms: float | None = 30.0
    model: str = "llama3-8b"
    """A preset of `models.config.PRESETS`."""
    hardware: str = dataclasses.field(default="h100", metadata={"choices": tuple(sorted(HARDWARE))})
    """A preset of `mnemojax.scheduling.predictor.HARDWARE`."""
    page_size: int = 16
    """Tokens per KV page."""
    gpu_memory_utilization: float = 0.9
    """Fraction of each device's memory for weights and KV cache."""
    num_pages: int | None = None
    """KV pages per KVP rank; None: from the device memory (see `kv_pages_per_rank`)."""
    dtype_bytes: int = 2
    """Bytes per weight / activation / KV element (bf16)."""
    predictor_profile: str | None = None
    """Predictor profile (a shipped profile's name or a path); None: the predictor's default factors."""
    pipeline_padding: bool = True
    """Cost every micro-batch at the pipeline register's padded size (`bucket(max_num_batched_tokens)` token
    rows when spp > 1), as this repository's executor runs it and the engine's predictor prices it. Off: each
    micro-batch's own padded size (what an ideal ragged executor, as Medha's, would run)."""
    long_threshold_tokens: int = SHORT_MAX_TOKENS
    """Prompts longer than this are *long* in the metrics."""
    max_simulated_s: float | None = None
    """Stop the simulation this many simulated seconds after the first arrival (requests left unfinished are
    reported, and those arriving later counted as not_arrived); None: run until every request is done or a KV
    deadlock."""
    async_scheduling: bool = True
    """Model the engine's async scheduling (its default on one host; multi-host serving runs synchronously): step
    N+1 is scheduled and launched before step N's results are known, so the device is never idle between steps
    while there is work, and a request that arrives during step N is first scheduled in step N + 2. False: the
    synchronous loop (schedule, run, results, repeat). Either way a step takes the predictor's time: a profile
    calibrated online by an async engine measures steps as the interval between results, host work overlapped."""

    def __post_init__(self):
        SchedulerConfig.__post_init__(self)
        ParallelConfig.__post_init__(self)
        if self.hardware not in HARDWARE:
            raise ValueError(f"unknown hardware {self.hardware!r}; known: {sorted(HARDWARE)}")
        for name in ("page_size", "dtype_bytes", "long_threshold_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_simulated_s is not None and not self.max_simulated_s > 0:
            raise ValueError(f"max_simulated_s must be positive, got {self.max_simulated_s}")


def make_predictor(config: SimConfig, model: LlamaConfig | None = None) -> Predictor:
    """The predictor of `config`'s deployment (also the scheduler's), as the engine builds its own: the hardware's
    shipped profile unless `predictor_profile` names one, and the reference attention's blocks of the engine's 8
    pages (requests here have no `max_model_len` to make them fewer)."""
    return deployment_predictor(config, model or preset(config.model), hardware=config.hardware,
                                dtype_bytes=config.dtype_bytes,
                                profile=config.predictor_profile or default_profile(config.hardware),
                                pipeline_padding=config.pipeline_padding, block_tokens=8 * config.page_size)


def kv_pages_per_rank(config: SimConfig, model: LlamaConfig | None = None) -> int:
    """KV pages of one KVP rank (page 0, the reserved dummy page, included), from one device's memory.

    Every device of a rank holds its stage's layers' slice of each page (its tp share of the KV heads) and its
    weights: the stage's `ceil(L / spp)` layers (tp-sharded) plus the embedding and LM head (replicated on every
    device, as `shardings.specs` lays them out). So pages = (memory x utilization - weights) / bytes per page.
    """
    if config.num_pages is not None:
        return config.num_pages
    c = model or preset(config.model)
    p = make_predictor(config, c)
    b = config.dtype_bytes
    weights = (p.layers_per_stage * p.layer_params + c.vocab_size * c.hidden_size
               * (1 if c.tie_word_embeddings else 2)) * b
    page_bytes = c.kv_page_bytes(page_size=config.page_size, tp=config.tp, spp=config.spp, dtype_bytes=b)
    free = HARDWARE[config.hardware].memory_bytes * config.gpu_memory_utilization - weights
    if free < 2 * page_bytes:
        raise ValueError(f"{config.model} does not fit on {config.hardware} with tp={config.tp}, spp={config.spp}: "
                         f"{weights / 2**30:.1f} GiB of weights per device")
    return int(free // page_bytes)


# ------------------------------------------------------------------------------------------------ the loop
@dataclasses.dataclass(frozen=True)
class _MicroBatch:
    plan: StepPlan
    stage_time: float  # seconds one stage takes on it


@dataclasses.dataclass(frozen=True)
class _Launched:
    plan: StepPlan  # the micro-batch leaving the last stage in the step
    outputs: list[ChunkOutput]
    end: float  # when the step's results are ready


class PredictedExecutor:
    """The executor's interface with the predictor as its clock; nothing runs.

    `launch(plan)` feeds the plan's micro-batch into stage 0; the step starts when the device is free (or now) and
    takes the clocked step's predicted time (its slowest micro-batch's `stage_time`), times `wake_factor` plus
    `wake_overhead_s` when the device had gone idle before it (it finished its last step before now: the engine was
    waiting for a request).
    It returns the micro-batch leaving the last stage, with token 0 for each of its sampling chunks, as the
    executor returns it, and when those results are ready; `collect` waits for them (`now` moves to the step's
    end), `execute(plan)` does both.
    """

    def __init__(self, stage_time: Callable[[StepPlan], float], num_stages: int, now: float = 0.0,
                 wake_factor: float = 1.0, wake_overhead_s: float = 0.0):
        self.stage_time = stage_time
        self.wake_factor = wake_factor
        self.wake_overhead_s = wake_overhead_s
        self.now = now
        self.free_at = -math.inf  # when the device finishes the steps launched (it starts idle: a cold start)
        self.pipeline: Pipeline[_MicroBatch] = Pipeline(num_stages)
        empty = StepPlan([], [])
        self._padding = _MicroBatch(empty, stage_time(empty))

    def has_in_flight(self) -> bool:
        return any(mb.plan.chunks for mb in self.pipeline)

    def launch(self, plan: StepPlan) -> _Launched:
        self.pipeline.push(_MicroBatch(plan, self.stage_time(plan)), lambda: self._padding)
        took = max(mb.stage_time for mb in self.pipeline)
        if self.now > self.free_at:  # the device sat idle until now: a cold start
            took = took * self.wake_factor + self.wake_overhead_s
        self.free_at = max(self.now, self.free_at) + took
        done = self.pipeline.pop().plan
        return _Launched(done, [ChunkOutput(0 if ch.sample else None) for ch in done.chunks], self.free_at)

    def collect(self, launched: _Launched) -> tuple[StepPlan, list[ChunkOutput]]:
        self.now = max(self.now, launched.end)
        return launched.plan, launched.outputs

    def execute(self, plan: StepPlan) -> tuple[StepPlan, list[ChunkOutput]]:
        return self.collect(self.launch(plan))


@dataclasses.dataclass
class SimResult:
    """What a simulation returns: `metrics` (JSON-ready), one record per request, the active-requests timeline."""

    metrics: dict[str, Any]
    requests: list[dict[str, Any]]
    timeline: list[tuple[float, int, int]]  # (time, active requests (arrived, not done), running requests)

    def to_json(self, path: str, *, with_requests: bool = True) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        d = dict(self.metrics)
        if with_requests:
            d["requests"] = self.requests
        with open(path, "w", encoding="utf-8") as f:
            json.dump(d, f, indent=1)
            f.write("\n")


class Simulator:
    """Drives the engine's `Scheduler` and `KVCacheManager` over a trace with the predictor as the clock.

    `scheduler`, `kv` and `predictor` are the real objects (inspect them in tests), `executor` the predicted one;
    `run()` simulates once.
    """

    def __init__(self, config: SimConfig, trace: Sequence[TraceRequest], *, predictor: Predictor | None = None):
        self.config = config
        self.model = preset(config.model)
        self.predictor = predictor or make_predictor(config, self.model)
        self.num_pages = kv_pages_per_rank(config, self.model)
        # Prefix reuse is modelled for traces with shared prefixes (their prompts' tokens are then made up, see
        # `SimPrompt`); the others' prompts share nothing, so the cache is left out and their tokens never made.
        self.prefix_caching = config.enable_prefix_caching and any(t.prefix_id is not None for t in trace)
        self.kv = KVCacheManager(config.kvp, self.num_pages, config.page_size, config.max_tokens_per_kvp_rank,
                                 prefix_caching=self.prefix_caching)
        self._empty_time = self.predictor.stage_time([])
        self.executor = PredictedExecutor(self.stage_time, config.spp,
                                          wake_factor=self.predictor.profile.wake_factor,
                                          wake_overhead_s=self.predictor.profile.wake_overhead_s)
        # As in the engine, the scheduler gets the predictor with a target batch time (without one, its LRS /
        # ILRS remaining prefill time is its per-token fallback); also for predicted TTFT deadlines.
        self.scheduler = Scheduler(config, self.kv, self.predictor if config.uses_predictor else None,
                                   clock=lambda: self.now, spp=config.spp)
        self.trace = sorted(trace, key=lambda r: r.arrival_time)
        if config.scheduler_policy != "priority" and any(t.priority != 0 for t in self.trace):
            raise ValueError(f"the trace has requests of priority other than 0, which need scheduler_policy "
                             f"'priority' (the engine's rule); this simulation's is {config.scheduler_policy!r}")
        self.steps = 0

    @property
    def now(self) -> float:
        """The simulated clock (seconds): the predicted executor's."""
        return self.executor.now

    @now.setter
    def now(self, t: float) -> None:
        self.executor.now = t

    # One micro-batch's stage time: its busiest KVP rank.
    def stage_time(self, plan: StepPlan) -> float:
        if not plan.chunks:
            return self._empty_time
        return max(self.predictor.stage_time(shapes) for shapes in self.scheduler.plan_shapes(plan))

    def run(self) -> SimResult:
        cfg, sched, executor = self.config, self.scheduler, self.executor
        wall0, cpu0 = time.perf_counter(), time.process_time()
        pending = deque(self.trace)
        reqs: list[Request] = []
        kinds: list[str] = []
        rejected: list[tuple[TraceRequest, str]] = []
        prefixes: dict[int, int] = {}  # a trace's prefix id -> its index, in order of first arrival
        first_token_step: dict[int, int] = {}
        timeline: list[tuple[float, int, int]] = []
        active = 0
        in_flight = None  # async scheduling: the step launched and not yet collected
        stop_reason = "done"
        self.now = self.trace[0].arrival_time if self.trace else 0.0
        start = self.now
        horizon = start + cfg.max_simulated_s if cfg.max_simulated_s is not None else math.inf

        def note():
            timeline.append((self.now, active, len(sched.running)))

        while True:
            while pending and pending[0].arrival_time <= self.now:
                t = pending.popleft()
                why = self.kv.capacity_error(t.prompt_tokens + t.output_tokens)
                if why is not None:
                    rejected.append((t, why))
                    continue
                # a trace's prefix ids may be any integers; the token ids need small ones
                prefix = None if t.prefix_id is None else prefixes.setdefault(t.prefix_id, len(prefixes))
                tokens = SimPrompt(len(reqs), t.prompt_tokens, prefix, t.prefix_tokens) \
                    if self.prefix_caching else range(t.prompt_tokens)
                req = Request(str(len(reqs)), tokens, SamplingParams(max_tokens=t.output_tokens, ignore_eos=True),
                              t.arrival_time, seed=0, priority=t.priority)
                reqs.append(req)
                kinds.append("long" if t.prompt_tokens > cfg.long_threshold_tokens else "short")
                sched.add(req)
                active += 1
                note()
            if self.now >= horizon:
                stop_reason = "horizon"
                break
            plan = sched.schedule(self.now)
            if plan.is_empty and not executor.has_in_flight() and in_flight is None:
                if plan.preempted:
                    continue  # pages were freed while planning: plan again (as the engine's next step would)
                if not pending:
                    if sched.num_unfinished:
                        stop_reason = "deadlock"  # waiting requests that can never get KV pages
                    break
                self.now = max(self.now, min(pending[0].arrival_time, horizon))
                continue
            launched = None
            if not plan.is_empty or executor.has_in_flight():  # as `LLMEngine.step`
                launched = executor.launch(plan)
                self.steps += 1
                for ch in launched.plan.chunks:
                    ch.request.num_unfetched += ch.sample
            if cfg.async_scheduling:  # collect the step launched before this one (it ran while this was planned)
                launched, in_flight = in_flight, launched
            if launched is None:
                continue
            done, outputs = executor.collect(launched)
            for ch in done.chunks:
                ch.request.num_unfetched -= ch.sample
            running = len(sched.running)
            for req in sched.update_from_output(done, outputs):
                if len(req.output_token_ids) == 1:  # the collected step's number (launched and collected in order)
                    first_token_step[id(req)] = self.steps - (in_flight is not None)
                if req.is_finished:
                    active -= 1
                    running -= 1  # (the timeline counts the finished requests out one by one)
                    timeline.append((self.now, active, running))
        end = self.now
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        records = [self._record(r, k, first_token_step.get(id(r))) for r, k in zip(reqs, kinds)]
        for t, why in rejected:
            records.append({"id": None, "kind": "long" if t.prompt_tokens > cfg.long_threshold_tokens else "short",
                            "arrival": t.arrival_time, "prompt_tokens": t.prompt_tokens,
                            "output_tokens": t.output_tokens, "rejected": why})
        metrics = self._metrics(reqs, kinds, rejected, start, end)
        metrics.update(stop_reason=stop_reason, steps=self.steps, simulated_s=end - start, wall_s=wall, cpu_s=cpu,
                       kv_pages_per_rank=self.num_pages, not_arrived=len(pending))
        return SimResult(metrics, records, timeline)

    def _record(self, r: Request, kind: str, step: int | None) -> dict[str, Any]:
        gaps = np.diff(r.token_times) if len(r.token_times) > 1 else np.zeros(0)
        return {"id": r.request_id, "kind": kind, "arrival": r.arrival_time, "prompt_tokens": r.num_prompt_tokens,
                "output_tokens": r.params.max_tokens, "generated": len(r.output_token_ids),
                "first_scheduled": r.first_scheduled_time, "first_token": r.first_token_time,
                "first_token_step": step, "finished": r.finished_time, "priority": r.priority,
                "ttft": None if r.first_token_time is None else r.first_token_time - r.arrival_time,
                "tbt_mean": float(gaps.mean()) if gaps.size else None,
                "tbt_max": float(gaps.max()) if gaps.size else None,
                "preemptions": r.num_preemptions, "cached_tokens": r.num_cached_tokens or 0, "rejected": None}

    def _metrics(self, reqs, kinds, rejected, start, end) -> dict[str, Any]:
        cfg = self.config
        out: dict[str, Any] = {"policy": cfg.scheduler_policy}
        done = [r for r in reqs if r.is_finished]
        out["completed"] = len(done)
        for kind in ("short", "long"):
            rs = [r for r, k in zip(reqs, kinds) if k == kind]
            ttft = [(r.first_token_time if r.first_token_time is not None else end) - r.arrival_time for r in rs]
            tbt = np.concatenate([np.diff(r.token_times) for r in rs if len(r.token_times) > 1] or [np.zeros(0)])
            d: dict[str, Any] = {}
            for name, xs in (("ttft", np.asarray(ttft)), ("tbt", tbt)):
                for q in (50, 90, 99):
                    d[f"{name}_p{q}"] = float(np.percentile(xs, q)) if xs.size else None
            d.update(requests=len(rs), completed=sum(r.is_finished for r in rs),
                     no_first_token=sum(r.first_token_time is None for r in rs),
                     rejected=sum(1 for t, _ in rejected if (t.prompt_tokens > cfg.long_threshold_tokens)
                                  == (kind == "long")))
            out[kind] = d
        gaps = np.concatenate([np.diff(r.token_times) for r in reqs if len(r.token_times) > 1] or [np.zeros(0)])
        out["tbt_all"] = {f"p{q}": float(np.percentile(gaps, q)) if gaps.size else None for q in (50, 90, 99)}
        last = max((r.finished_time for r in done), default=start)
        makespan = last - start
        tokens = sum(r.num_prompt_tokens + len(r.output_token_ids) for r in done)
        out["throughput_tokens_per_s"] = tokens / makespan if makespan > 0 else 0.0
        out["output_tokens_per_s"] = (sum(len(r.output_token_ids) for r in done) / makespan if makespan > 0
                                      else 0.0)
        out["num_requests"] = len(reqs) + len(rejected)
        out["rejected"] = len(rejected)
        out["unfinished"] = len(reqs) - len(done)
        out["preemptions"] = sum(r.num_preemptions for r in reqs)
        out["config"] = dataclasses.asdict(cfg)
        return out


def simulate(config: SimConfig, trace: Sequence[TraceRequest], *, plot_dir: str | None = None) -> SimResult:
    """Runs one simulation of `trace` on `config`'s deployment; writes plots to `plot_dir` if given."""
    result = Simulator(config, trace).run()
    if plot_dir is not None:
        plot(result, plot_dir)
    return result


# ------------------------------------------------------------------------------------------------ plots
def _ttfts(result: SimResult, kind: str) -> np.ndarray:
    end = result.metrics["simulated_s"] + min((r["arrival"] for r in result.requests), default=0.0)
    return np.sort([r["ttft"] if r["ttft"] is not None else end - r["arrival"]
                    for r in result.requests if r["kind"] == kind and not r["rejected"]])


def plot_ttft_cdfs(results: dict[str, SimResult], path: str) -> str:
    """One TTFT CDF panel per request kind (short, long), a line per labelled result. Returns the path."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, kind in zip(axes, ("short", "long")):
        for label, res in results.items():
            xs = _ttfts(res, kind)
            if xs.size:  # from 0 at the smallest TTFT, so that even one request draws a step
                ax.step(np.r_[xs[0], xs], np.r_[0.0, np.arange(1, xs.size + 1) / xs.size], where="post",
                        label=f"{label} (n={xs.size})")
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{kind} requests")
    return save_figure(fig, path, axes)


def plot_timelines(results: dict[str, SimResult], path: str) -> str:
    """Active requests (arrived, not finished) over simulated time, a line per labelled result."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 4))
    for label, res in results.items():
        if res.timeline:
            t, a, _ = zip(*res.timeline)
            ax.step(t, a, where="post", label=label)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("active requests")
    return save_figure(fig, path, [ax])


def plot(result: SimResult, plot_dir: str) -> list[str]:
    """`ttft_cdf.png` and `active_requests.png` of one result, in `plot_dir`."""
    label = result.metrics["policy"]
    return [plot_ttft_cdfs({label: result}, os.path.join(plot_dir, "ttft_cdf.png")),
            plot_timelines({label: result}, os.path.join(plot_dir, "active_requests.png"))]


# ------------------------------------------------------------------------------------------------ printing
def summary_table(results: dict[str, dict[str, Any]]) -> str:
    """A fixed-width table of metrics dicts, one row per label: short TTFT p50/p90/p99 and long TTFT p50/p90/p99
    (s), TBT p50/p99 (ms, every request's token gaps pooled), completed, unfinished, rejected, throughput."""
    def f(x, scale=1.0, fmt="{:9.3f}"):
        return fmt.format(x * scale) if x is not None else f"{'-':>9}"

    head = (f"{'policy':<10} {'sTTFTp50':>9} {'sTTFTp90':>9} {'sTTFTp99':>9} {'lTTFTp50':>9} {'lTTFTp90':>9} "
            f"{'lTTFTp99':>9} {'TBTp50ms':>9} {'TBTp99ms':>9} {'done':>6} {'unfin':>6} {'rej':>4} {'tok/s':>8}")
    rows = [head]
    for label, m in results.items():
        s, lg, tbt = m["short"], m["long"], m["tbt_all"]
        rows.append(f"{label:<10} {f(s['ttft_p50'])} {f(s['ttft_p90'])} {f(s['ttft_p99'])} {f(lg['ttft_p50'])} "
                    f"{f(lg['ttft_p90'])} {f(lg['ttft_p99'])} {f(tbt['p50'], 1e3)} {f(tbt['p99'], 1e3)} "
                    f"{m['completed']:>6} {m['unfinished']:>6} {m['rejected']:>4} "
                    f"{m['throughput_tokens_per_s']:>8.0f}")
    return "\n".join(rows)
