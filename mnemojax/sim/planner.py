"""Deployment planner: which layout serves a workload within its latency targets on a given cluster.

`plan(PlanConfig(...))` answers Medha's practical question by simulation: given a model, a device type and
count (hosts and their links), a workload (a trace, or a synthetic mix of short requests and a long tail) and
SLOs (TTFT of short and of long requests, TBT P99), it searches the (tp, spp, kvp, replicas,
max_tokens_per_kvp_rank, chunk_size, target_batch_time_ms, scheduler_policy) candidates, simulates each with
the engine's own scheduler and KV page manager and the runtime predictor as the clock (`mnemojax.sim.simulator`),
and ranks them. `python -m mnemojax.plan` is the command (`mnemojax/plan.py`).

**Feasibility.** A candidate that cannot run is rejected with the reason, before any simulation: an axis or
a product of axes larger than the cluster, tp not dividing the attention heads or spanning hosts, spp above the
layer count, weights that do not fit a device, and the workload's longest request (prompt + output) that can
never fit the KV pages (`KVCacheManager.capacity_error`, the engine's own rule: with kvp > 1, a request longer
than kvp x max_tokens_per_kvp_rank).

**Replicas.** A layout uses tp x spp x kvp devices; `replicas` copies of it share the cluster behind a
round-robin load balancer (request i goes to replica i mod replicas), each simulated on its share of the trace.

**SLOs.** A request is *within SLO* when its TTFT is at most `ttft_short_s` (prompt up to
`long_threshold_tokens`) or `ttft_long_s` (longer), and the 99th percentile of its own token gaps is at most
`tbt_p99_ms`. Attainment = the fraction of requests within SLO; goodput = requests within SLO per second of the
arrival window. A candidate *meets the SLOs* when its attainment is at least `min_attainment`. A request
without a first token when the simulation stops (the horizon: the last arrival + 2 x `ttft_long_s` + 60 s)
counts at its lower bound and is not within SLO. The table also gives the pooled TTFT P99 of short and of long
requests and the TBT P99 over every token gap. The engine's scheduler gets TTFT deadlines from the SLOs:
`ttft_slo_min_s` = `ttft_short_s` and `ttft_slo_per_token_s` such that the longest prompt's deadline is
`ttft_long_s`.

**Ranking.** Candidates that meet the SLOs first, fewest devices first, then higher goodput; then the others by
goodput. The best ones come with their exact `python -m mnemojax.serve` command line (`ServeCommand`).

**Search.** Candidates are simulated fewest devices first, in a pool of worker processes. Each simulation
checks, every 1/20 of its arrival window (simulated time), whether a finished candidate with no more devices
already *dominates* it: the simulator is causal, so what happened by simulated time t is final, and it bounds
the rest. Goodput at most (requests - those already past their TTFT target) / window; each P99 at least the
value that enough known lower bounds exceed (TTFT of a waiting request >= now - arrival; every gap seen is
final). A candidate whose bounds are all no better than a finished one's, and one strictly worse, can neither
rank above it nor lie on the Pareto front: its simulation stops early, reported as such. The outcome may depend
on the worker count (which candidates have finished when another starts); the ranking of those that finish
does not.

Plots: `plot_pareto` (TTFT P99 against TBT P99 of every simulated candidate, coloured by device count) and
`plot_capacity` (goodput against arrival rate of the best candidates: the trace's arrivals compressed or
stretched).

Shared prefixes of a trace (`prefix_id`, `prefix_tokens`) are served by the KV page manager's prefix cache in
the simulation, as in the engine. Not modelled: the server's admission limit (`--max_queue`), the HTTP front
end, and routers smarter than round-robin.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import multiprocessing
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Any

import numpy as np

from mnemojax.scheduling.config import POLICIES
from mnemojax.scheduling.kv_manager import KVCacheManager
from mnemojax.scheduling.predictor import HARDWARE, Predictor, default_profile, make_predictor
from mnemojax.scheduling.request import Request
from mnemojax.sim.reports import pyplot, save_figure
from mnemojax.sim.simulator import (SimConfig, Simulator, TraceRequest, Workload,  # noqa: F401 (Workload: re-export)
                                    kv_pages_per_rank)
from models.config import PRESETS, LlamaConfig, preset

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


# ------------------------------------------------------------------------------------------------ configs
@dataclasses.dataclass(frozen=True)
class Cluster:
    """The devices a deployment may use."""

    hardware: str = dataclasses.field(default="h100", metadata={"choices": tuple(sorted(HARDWARE))})
    """Device type: a runtime predictor preset."""
    num_gpus: int = 8
    """Devices available in all; a candidate's layout x replicas never uses more."""
    gpus_per_host: int = 8
    """Devices per host: tp stays within a host; a replica larger than a host runs multi-host."""
    intra_node_gbps: float | None = None
    """GB/s per device, one direction, between devices of one host (NVLink); default: the preset's."""
    inter_node_gbps: float | None = None
    """GB/s per device between hosts (InfiniBand): spp and kvp traffic of a replica larger than a host; a
    replica within one host uses intra_node_gbps for it. Default: the preset's."""
    memory_utilization: float = 0.9
    """Fraction of each device's memory for the weights and the KV cache (the rest: activations)."""

    def __post_init__(self):
        _positive(self, "num_gpus", "gpus_per_host")
        if not 0 < self.memory_utilization <= 1:
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        for name in ("intra_node_gbps", "inter_node_gbps"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be positive, got {v}")


@dataclasses.dataclass(frozen=True)
class SLO:
    """Latency targets."""

    ttft_short_s: float = 2.0
    """TTFT target of short requests, seconds."""
    ttft_long_s: float = 120.0
    """TTFT target of long requests, seconds."""
    tbt_p99_ms: float = 50.0
    """Target of the 99th percentile of each request's time between tokens, milliseconds."""
    min_attainment: float = 0.99
    """A candidate meets the SLOs when at least this fraction of requests is within them."""

    def __post_init__(self):
        for name in ("ttft_short_s", "ttft_long_s", "tbt_p99_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 < self.min_attainment <= 1:
            raise ValueError(f"min_attainment must be in (0, 1], got {self.min_attainment}")


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """The candidates: every combination of the comma-separated lists (an empty list: the default range)."""

    tp: str = ""
    """Tensor parallel degrees; default: the powers of two up to gpus_per_host that divide the heads."""
    spp: str = ""
    """Pipeline stages; default: the powers of two up to min(16, layers, num_gpus)."""
    kvp: str = ""
    """KV-parallel ranks; default: 1, 2, 4 (up to num_gpus)."""
    replicas: str = "all"
    """Copies of a layout: a list, 'max' (as many as fit) or 'all' (powers of two up to the most that fit, and
    the most)."""
    max_tokens_per_kvp_rank: str = "auto"
    """Most tokens of one request per KVP rank (kvp > 1), multiples of page_size; 'auto': the longest request
    split evenly over the ranks; 'none': no split."""
    chunk_size: str = "4096"
    """Largest prefill chunks."""
    target_batch_time_ms: str = "auto"
    """Adaptive chunking targets; 'none': fixed chunks; 'auto': 0.5 and 0.9 x tbt_p99_ms."""
    scheduler_policy: str = "ilrs"
    """Prefill orders (fcfs, edf, lrs, ilrs)."""
    max_num_batched_tokens: str = "8192"
    """Token budgets of a step per KVP rank (raised to the chunk size if smaller). With spp > 1 this engine pads
    every micro-batch to it (pipeline_padding), so a pipeline wants a small one."""
    max_num_seqs: int = 256
    """Requests running at once per replica."""
    page_size: int = 16
    """Tokens per KV page."""
    num_pages: int | None = None
    """KV pages per KVP rank; default: what each device's memory holds after the weights."""
    ppb_max_share: float = 0.5
    """Prefill-prefill batching share (0: off)."""
    pipeline_padding: bool = True
    """With spp > 1, cost every micro-batch at the pipeline register's size, as this repository's executor runs
    it; off: each micro-batch at its own size (an ideal ragged executor, as Medha's)."""

    def __post_init__(self):
        _positive(self, "max_num_seqs", "page_size")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is reserved), got {self.num_pages}")
        for name in ("tp", "spp", "kvp", "chunk_size", "max_num_batched_tokens"):
            _ints(getattr(self, name), name)
        if self.replicas not in ("all", "max"):
            _ints(self.replicas, "replicas")
        if self.max_tokens_per_kvp_rank != "auto":
            _optional_ints(self.max_tokens_per_kvp_rank, "max_tokens_per_kvp_rank")
        if self.target_batch_time_ms != "auto":
            _optional_floats(self.target_batch_time_ms, "target_batch_time_ms")
        for p in _words(self.scheduler_policy):
            if p not in POLICIES:
                raise ValueError(f"scheduler_policy: {p!r} is not one of {POLICIES}")


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """What to plan: model, cluster, workload, SLOs, search space, and how to search."""

    model: str = "llama3-8b"
    """A model preset, or a Hugging Face Llama directory (priced as the preset with its shapes)."""
    dtype: str = dataclasses.field(default="bfloat16", metadata={"choices": tuple(DTYPE_BYTES)})
    """Weights, activations and KV cache."""
    predictor_profile: str | None = None
    """Runtime predictor profile (a shipped profile's name or a path); default: the hardware's shipped profile
    if there is one, else the predictor's default factors."""
    cluster: Cluster = dataclasses.field(default_factory=Cluster)
    workload: Workload = dataclasses.field(default_factory=Workload)
    slo: SLO = dataclasses.field(default_factory=SLO)
    space: SearchSpace = dataclasses.field(default_factory=SearchSpace)
    workers: int = 0
    """Simulations in parallel (processes); 0: one per CPU core; 1: in this process."""
    early_stop: bool = True
    """Stop simulating a candidate once a finished one dominates it."""
    top: int = 3
    """Serve command lines for this many of the best candidates."""
    capacity_scales: str = "0.5,1,2,4"
    """Capacity plot: the workload's arrival rate times each of these, for the `top` best; empty: none."""
    max_simulated_s: float | None = None
    """Stop each simulation this many simulated seconds after the first arrival; default: until the last arrival
    + 2 x ttft_long_s + 60 s."""
    output_dir: str | None = None
    """Write plan.json, pareto.png and capacity.png here."""
    progress: bool = True
    """Show a progress bar (stderr)."""

    def __post_init__(self):
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {tuple(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.workers < 0 or self.top < 0:
            raise ValueError("workers and top must be >= 0")
        _optional_floats(self.capacity_scales, "capacity_scales")


def _positive(obj, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


def _words(s: str) -> list[str]:
    return [w.strip() for w in s.split(",") if w.strip()]


def _ints(s: str, name: str) -> list[int]:
    try:
        out = [int(w) for w in _words(s)]
    except ValueError:
        raise ValueError(f"{name}: expected comma-separated integers, got {s!r}") from None
    if any(v < 1 for v in out):
        raise ValueError(f"{name}: values must be positive, got {s!r}")
    return out


def _optional_ints(s: str, name: str) -> list[int | None]:
    return [None if w.lower() == "none" else _ints(w, name)[0] for w in _words(s)]


def _optional_floats(s: str, name: str) -> list[float | None]:
    out = []
    for w in _words(s):
        try:
            v = None if w.lower() == "none" else float(w)
        except ValueError:
            raise ValueError(f"{name}: expected comma-separated numbers, got {s!r}") from None
        if v is not None and not v > 0:
            raise ValueError(f"{name}: values must be positive, got {s!r}")
        out.append(v)
    return out


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(max(limit, 1).bit_length()) if 1 << i <= limit]


# ------------------------------------------------------------------------------------------------ candidates
@dataclasses.dataclass(frozen=True)
class Candidate:
    """One deployment to simulate."""

    tp: int
    spp: int
    kvp: int
    replicas: int
    max_tokens_per_kvp_rank: int | None
    chunk_size: int
    max_num_batched_tokens: int
    target_batch_time_ms: float | None
    scheduler_policy: str

    @property
    def gpus_per_replica(self) -> int:
        return self.tp * self.spp * self.kvp

    @property
    def gpus(self) -> int:
        return self.gpus_per_replica * self.replicas

    @property
    def label(self) -> str:
        split = "" if self.max_tokens_per_kvp_rank is None else f" m{_tokens(self.max_tokens_per_kvp_rank)}"
        target = "fixed" if self.target_batch_time_ms is None else f"t{self.target_batch_time_ms:g}ms"
        reps = f" x{self.replicas}" if self.replicas > 1 else ""
        return (f"tp{self.tp} spp{self.spp} kvp{self.kvp}{reps}{split} c{self.chunk_size} "
                f"b{_tokens(self.max_num_batched_tokens)} {target} {self.scheduler_policy}")


def _tokens(n: int) -> str:
    """1048576 -> '1M', 131072 -> '128K', others as they are."""
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


@dataclasses.dataclass
class Outcome:
    """What became of one candidate: `status` "ok" (simulated; `metrics`), "infeasible" or "dominated" (stopped
    early), with the `reason` for the last two."""

    candidate: Candidate
    status: str
    reason: str | None = None
    metrics: dict[str, Any] | None = None

    @property
    def meets_slo(self) -> bool:
        return self.status == "ok" and self.metrics["meets_slo"]

    def objectives(self) -> tuple:
        """(devices, -goodput, short TTFT P99, long TTFT P99, TBT P99): lower is better in each; None where the
        workload has no such request."""
        m = self.metrics
        return (self.candidate.gpus, -m["goodput_rps"], m["ttft_p99_short_s"], m["ttft_p99_long_s"],
                m["tbt_p99_ms"])

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.candidate.label, **dataclasses.asdict(self.candidate), "gpus": self.candidate.gpus,
                "status": self.status, "reason": self.reason, "metrics": self.metrics}


def dominates(a: Sequence, b: Sequence) -> bool:
    """Objective vector `a` is no worse than `b` everywhere and better somewhere (None entries are skipped)."""
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    return all(x <= y for x, y in pairs) and any(x < y for x, y in pairs)


def _rank_key(o: Outcome):
    """Meeting the SLOs first, fewest devices first, then higher goodput; the others by goodput. Ties: higher
    attainment, then lower TBT P99, short and long TTFT P99, then the label (so the order never depends on which
    simulation finished first)."""
    m = o.metrics
    rest = (-m["attainment"], *(m[k] if m[k] is not None else 0.0
                                for k in ("tbt_p99_ms", "ttft_p99_short_s", "ttft_p99_long_s")), o.candidate.label)
    if m["meets_slo"]:
        return (0, o.candidate.gpus, -m["goodput_rps"], *rest)
    return (1, -m["goodput_rps"], o.candidate.gpus, *rest)


# ------------------------------------------------------------------------------------------------ set-up
@dataclasses.dataclass(frozen=True)
class Setup:
    """A `PlanConfig` resolved: the model's shapes, the trace and the values derived from them."""

    config: PlanConfig
    model_name: str  # the preset the simulator prices
    model: LlamaConfig
    profile: str | None
    trace: tuple[TraceRequest, ...]
    window_s: float  # arrival window: goodput's denominator
    horizon_s: float  # simulated seconds from the first arrival at which simulations stop
    longest: int  # prompt + output tokens of the longest request
    max_model_len: int  # the longest request's tokens (prompt and output)
    deadline_min_s: float  # the scheduler's TTFT deadlines (ttft_slo_min_s, ttft_slo_per_token_s)
    deadline_per_token_s: float
    notes: tuple[str, ...]

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.config.dtype]

    def scaled(self, factor: float) -> Setup:
        """The same requests arriving `factor` times as fast."""
        if factor == 1:
            return self
        t0 = self.trace[0].arrival_time
        trace = tuple(dataclasses.replace(r, arrival_time=t0 + (r.arrival_time - t0) / factor) for r in self.trace)
        return dataclasses.replace(self, trace=trace, window_s=self.window_s / factor,
                                   horizon_s=_horizon(self.config, trace))


def _horizon(config: PlanConfig, trace: Sequence[TraceRequest]) -> float:
    """Simulated seconds from the first arrival (the simulator's `max_simulated_s`)."""
    if config.max_simulated_s is not None:
        return config.max_simulated_s
    return trace[-1].arrival_time - trace[0].arrival_time + 2 * config.slo.ttft_long_s + 60.0


_SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "tie_word_embeddings")


def resolve_model(model: str) -> tuple[str, LlamaConfig]:
    """(the preset the simulator prices, the model's config) of a preset name or a Hugging Face directory. The
    simulator takes presets; a directory is priced as the preset with the same shapes (every Llama 3 size)."""
    if model in PRESETS:
        return model, preset(model)
    if not os.path.isdir(model):
        raise ValueError(f"model {model!r} is neither a preset ({sorted(PRESETS)}) nor a directory")
    mc = LlamaConfig.from_pretrained(model)
    shape = {f: getattr(mc, f) for f in _SHAPE_FIELDS}
    for name, p in PRESETS.items():
        if all(getattr(p, f) == v for f, v in shape.items()):
            return name, mc
    raise ValueError(f"{model}: no model preset has its shapes {shape}; the simulator prices presets only")


def resolve(config: PlanConfig, trace: Sequence[TraceRequest] | None = None) -> Setup:
    """Resolves model, trace, horizon and deadlines. `trace`, when given, replaces the workload's."""
    wl, slo = config.workload, config.slo
    model_name, mc = resolve_model(config.model)
    synthetic = trace is None and not wl.trace
    trace = wl.requests(trace)
    # Goodput's denominator: a synthetic mix's duration; a given trace's first to last arrival (at least 1 s).
    window = wl.duration_s if synthetic else max(trace[-1].arrival_time - trace[0].arrival_time, 1.0)
    longest = max(r.prompt_tokens + r.output_tokens for r in trace)
    max_model_len = longest  # the engine rounds its pages up itself
    longest_prompt = max(r.prompt_tokens for r in trace)
    per_token = 0.0
    if longest_prompt > wl.long_threshold_tokens:
        per_token = max(0.0, slo.ttft_long_s - slo.ttft_short_s) / longest_prompt
    notes = []
    if max_model_len > mc.max_position_embeddings:
        notes.append(f"the longest request ({longest:,} tokens) exceeds {config.model}'s max_position_embeddings "
                     f"({mc.max_position_embeddings:,}): the serve commands need a checkpoint with RoPE scaled to "
                     f"at least {max_model_len:,} positions (as Medha serves 10M tokens): give its directory as "
                     f"--model")
    profile = config.predictor_profile or default_profile(config.cluster.hardware)
    if profile is None:
        notes.append(f"no fitted predictor profile for {config.cluster.hardware}: the predictor's default "
                     f"efficiency factors price every step (fit one with scripts/profile_predictor.py)")
    return Setup(config, model_name, mc, profile, tuple(trace), window, _horizon(config, trace), longest,
                 max_model_len, slo.ttft_short_s, per_token, tuple(notes))


def candidates(setup: Setup) -> list[Candidate]:
    """Every combination of the search space's lists (replicas and KV splits depend on the layout)."""
    cfg, mc = setup.config, setup.model
    sp, cl = cfg.space, cfg.cluster
    tps = _ints(sp.tp, "tp") or [t for t in _powers_of_two(cl.gpus_per_host) if mc.num_heads % t == 0]
    spps = _ints(sp.spp, "spp") or _powers_of_two(min(16, mc.num_layers, cl.num_gpus))
    kvps = _ints(sp.kvp, "kvp") or [k for k in (1, 2, 4) if k <= cl.num_gpus]
    chunks = _ints(sp.chunk_size, "chunk_size")
    budgets = _ints(sp.max_num_batched_tokens, "max_num_batched_tokens")
    if sp.target_batch_time_ms == "auto":
        targets = [round(f * cfg.slo.tbt_p99_ms, 3) for f in (0.5, 0.9)]
    else:
        targets = _optional_floats(sp.target_batch_time_ms, "target_batch_time_ms")
    policies = _words(sp.scheduler_policy)
    out = []
    for tp in tps:
        for spp in spps:
            for kvp in kvps:
                per_replica = tp * spp * kvp
                most = replicas_that_fit(per_replica, cl)
                if sp.replicas == "max":
                    reps = [max(most, 1)]
                elif sp.replicas == "all":
                    reps = sorted(set(_powers_of_two(most)) | {most}) if most else [1]
                else:
                    reps = _ints(sp.replicas, "replicas")
                if kvp == 1:
                    splits = [None]
                elif sp.max_tokens_per_kvp_rank == "auto":
                    page = sp.page_size
                    splits = [-(-setup.longest // (kvp * page)) * page]
                else:
                    splits = _optional_ints(sp.max_tokens_per_kvp_rank, "max_tokens_per_kvp_rank")
                for r in reps:
                    for m in splits:
                        for c in chunks:
                            for b in sorted({max(b, c) for b in budgets}):
                                for t in targets:
                                    for p in policies:
                                        out.append(Candidate(tp, spp, kvp, r, m, c, b, t, p))
    return out


def sim_config(c: Candidate, setup: Setup) -> SimConfig:
    """The simulator's config of one replica of `c`."""
    cfg = setup.config
    sp = cfg.space
    return SimConfig(
        model=setup.model_name, hardware=cfg.cluster.hardware, tp=c.tp, spp=c.spp, kvp=c.kvp,
        scheduler_policy=c.scheduler_policy, target_batch_time_ms=c.target_batch_time_ms, chunk_size=c.chunk_size,
        max_num_batched_tokens=c.max_num_batched_tokens, max_num_seqs=sp.max_num_seqs,
        ppb_max_share=sp.ppb_max_share, ttft_slo_min_s=setup.deadline_min_s,
        ttft_slo_per_token_s=setup.deadline_per_token_s, page_size=sp.page_size,
        gpu_memory_utilization=cfg.cluster.memory_utilization, num_pages=sp.num_pages,
        max_tokens_per_kvp_rank=c.max_tokens_per_kvp_rank, dtype_bytes=setup.dtype_bytes,
        predictor_profile=setup.profile,
        pipeline_padding=sp.pipeline_padding, long_threshold_tokens=cfg.workload.long_threshold_tokens,
        max_simulated_s=setup.horizon_s,
        # the engine schedules asynchronously on one host; a replica over several hosts runs synchronously
        async_scheduling=c.gpus_per_replica <= cfg.cluster.gpus_per_host)


def predictor(c: Candidate, setup: Setup, sim: SimConfig) -> Predictor:
    """`sim`'s predictor with the cluster's links: tp over intra_node_gbps; spp and kvp over intra_node_gbps
    when a replica fits in one host, else over inter_node_gbps. Its reference attention's block is the engine's
    (8 pages, or fewer when a request has fewer)."""
    cl = setup.config.cluster
    hw = HARDWARE[cl.hardware]
    intra = hw.tp_bandwidth if cl.intra_node_gbps is None else cl.intra_node_gbps * 1e9
    inter = hw.net_bandwidth if cl.inter_node_gbps is None else cl.inter_node_gbps * 1e9
    hw = dataclasses.replace(hw, tp_bandwidth=intra,
                             net_bandwidth=intra if c.gpus_per_replica <= cl.gpus_per_host else inter)
    page = sim.page_size
    return make_predictor(sim, setup.model, hardware=hw, dtype_bytes=sim.dtype_bytes, profile=sim.predictor_profile,
                          pipeline_padding=sim.pipeline_padding,
                          block_tokens=min(8, -(-setup.max_model_len // page)) * page)


def replicas_that_fit(per_replica: int, cl: Cluster) -> int:
    """How many replicas of `per_replica` devices the cluster's hosts hold: a replica within a host takes its share
    of one host (several share a host, none spans two); a larger one takes whole hosts (its processes each use all
    their host's devices)."""
    hosts, rest = divmod(cl.num_gpus, cl.gpus_per_host)
    if per_replica <= cl.gpus_per_host:
        return hosts * (cl.gpus_per_host // per_replica) + rest // per_replica
    return hosts // -(-per_replica // cl.gpus_per_host)


def infeasibility(c: Candidate, setup: Setup) -> str | None:
    """Why `c` cannot serve the workload, or None."""
    cl, mc = setup.config.cluster, setup.model
    if mc.num_heads % c.tp:
        return f"tp ({c.tp}) does not divide the model's {mc.num_heads} attention heads"
    if c.spp > mc.num_layers:
        return f"spp ({c.spp}) exceeds the model's {mc.num_layers} layers"
    if c.tp > cl.gpus_per_host:
        return (f"tp ({c.tp}) spans hosts ({cl.gpus_per_host} devices each): its two all-reduces per layer need "
                f"the links within a host")
    if c.gpus > cl.num_gpus:
        return (f"needs {c.gpus} devices (tp x spp x kvp = {c.gpus_per_replica}, x {c.replicas} replicas); the "
                f"cluster has {cl.num_gpus}")
    fit = replicas_that_fit(c.gpus_per_replica, cl)
    if c.replicas > fit:
        return (f"{c.replicas} replicas of {c.gpus_per_replica} devices do not fit on hosts of {cl.gpus_per_host} "
                f"({cl.num_gpus} devices): at most {fit} (a replica larger than a host takes whole hosts, each "
                f"process all its host's devices; smaller ones share a host without splitting)")
    try:
        sim = sim_config(c, setup)
        pages = kv_pages_per_rank(sim, mc)
        kv = KVCacheManager(c.kvp, pages, sim.page_size, c.max_tokens_per_kvp_rank)
    except ValueError as e:
        return f"does not fit in memory: {e}" if "does not fit" in str(e) else str(e)
    why = kv.capacity_error(setup.longest)
    if why is not None:
        return f"the longest request (prompt + output) can never fit: {why}"
    return None


# ------------------------------------------------------------------------------------------------ simulation
class Dominated(Exception):
    """A simulation stopped early: a finished candidate dominates it."""


class _Probe(Simulator):
    """The simulator, also keeping the requests it makes (their token times) and the peak of KV pages in use on
    the busiest rank; `check(self)` runs before every micro-batch is priced (and may raise `Dominated`)."""

    def __init__(self, config: SimConfig, trace: Sequence[TraceRequest], predictor: Predictor,
                 check: Callable[[_Probe], None] | None = None):
        self.admitted: list[Request] = []
        self.peak_pages = 0
        self._check = None
        super().__init__(config, trace, predictor=predictor)
        self._check = check
        add = self.scheduler.add

        def add_and_keep(req: Request) -> None:  # run() makes the Request objects: keep them as they arrive
            self.admitted.append(req)
            add(req)

        self.scheduler.add = add_and_keep

    def stage_time(self, plan) -> float:
        used = max(r.num_used for r in self.kv.ranks)
        if used > self.peak_pages:
            self.peak_pages = used
        if self._check is not None:
            self._check(self)
        return super().stage_time(plan)


@dataclasses.dataclass(frozen=True)
class Served:
    """One request as served: long or short, TTFT (a lower bound when it got no first token) and its token gaps
    (seconds). The validation against the engine builds these from measured requests."""

    long: bool
    ttft: float
    first_token: bool
    gaps: np.ndarray


def _served(reqs: Sequence[Request], now: float, long_threshold: int) -> list[Served]:
    return [Served(r.num_prompt_tokens > long_threshold,
                    (r.first_token_time if r.first_token_time is not None else now) - r.arrival_time,
                    r.first_token_time is not None, np.diff(np.asarray(r.token_times, dtype=float)))
            for r in reqs]


def _p99_lower_bound(known: np.ndarray, n: int) -> float | None:
    """A lower bound of np.percentile(values, 99) over `n` values when `known` holds lower bounds of some of them
    (the others are >= 0): the percentile is at least the value at its lower interpolation index, the
    (n - i)-th largest, which is at least the (n - i)-th largest of the known lower bounds."""
    if n == 0:
        return None
    need = n - math.floor(0.99 * (n - 1))
    if known.size < need:
        return 0.0
    return float(np.partition(known, known.size - need)[known.size - need])


class _Bound:
    """The early-stop check of one candidate (see the module docstring): bounds its final objectives from what
    has happened so far and raises `Dominated` when a finished candidate beats them."""

    def __init__(self, c: Candidate, setup: Setup, incumbents: Sequence[tuple[tuple, str]]):
        cfg = setup.config
        self.gpus, self.window = c.gpus, setup.window_s
        self.targets = (cfg.slo.ttft_short_s, cfg.slo.ttft_long_s)
        self.long_threshold = cfg.workload.long_threshold_tokens
        self.n = len(setup.trace)
        self.n_long = sum(r.prompt_tokens > self.long_threshold for r in setup.trace)
        self.n_gaps = sum(r.output_tokens - 1 for r in setup.trace)
        self.incumbents = [(obj, label) for obj, label in incumbents if obj[0] <= c.gpus]
        self.every = setup.window_s / c.replicas / 20
        self.prior: list[Served] = []  # the replicas already simulated (final)
        self.prior_bad = 0
        self.next_check = -math.inf

    def __call__(self, sim: _Probe) -> None:
        if not self.incumbents or sim.now < self.next_check:
            return
        self.next_check = sim.now + self.every
        served = self.prior + _served(sim.admitted, sim.now, self.long_threshold)
        late = sum(s.ttft > self.targets[s.long] for s in served[len(self.prior):])
        goodput_ub = (self.n - self.prior_bad - late) / self.window
        bound = [self.gpus, -goodput_ub]
        for long, n in ((False, self.n - self.n_long), (True, self.n_long)):
            bound.append(_p99_lower_bound(np.asarray([s.ttft for s in served if s.long == long]), n))
        gaps = np.concatenate([s.gaps for s in served] or [np.zeros(0)])
        tbt = _p99_lower_bound(gaps, self.n_gaps)
        bound.append(None if tbt is None else tbt * 1e3)
        for obj, label in self.incumbents:
            if dominates(obj, bound):
                raise Dominated(f"stopped at {sim.now - sim.trace[0].arrival_time:.0f} s of simulated time: "
                                f"goodput <= {goodput_ub:.3g} req/s, TTFT P99 >= {_fmt(bound[2])} s (short) / "
                                f"{_fmt(bound[3])} s (long), TBT P99 >= {_fmt(bound[4])} ms; dominated by {label}")

    def replica_done(self, served: list[Served], bad: int) -> None:
        self.prior += served
        self.prior_bad += bad


def _fmt(x: float | None, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def _within(s: Served, ttft_targets: tuple[float, float], tbt_s: float) -> bool:
    return (s.first_token and s.ttft <= ttft_targets[s.long]
            and (s.gaps.size == 0 or float(np.percentile(s.gaps, 99)) <= tbt_s))


def served_requests(c: Candidate, setup: Setup, bound: _Bound | None = None) -> tuple[list[Served], dict]:
    """Simulates every replica of a feasible candidate: (its requests as served, totals over the replicas).
    Raises `Dominated` when `bound` says so."""
    cfg = setup.config
    targets, tbt_s = (cfg.slo.ttft_short_s, cfg.slo.ttft_long_s), cfg.slo.tbt_p99_ms / 1e3
    sim = sim_config(c, setup)
    served: list[Served] = []
    totals = {"completed": 0, "preemptions": 0, "kv_peak": 0.0, "kv_pages_per_rank": 0, "steps": 0,
              "sim_cpu_s": 0.0}
    for i in range(c.replicas):
        share = setup.trace[i::c.replicas]
        if not share:
            continue
        probe = _Probe(sim, share, predictor(c, setup, sim), bound)
        with _quiet("mnemojax.scheduling.scheduler"):  # preemptions are counted in the metrics, not logged one by one
            m = probe.run().metrics
        mine = _served(probe.admitted, probe.now, cfg.workload.long_threshold_tokens)
        if bound is not None:
            bound.replica_done(mine, sum(not _within(s, targets, tbt_s) for s in mine))
        served += mine
        totals["kv_pages_per_rank"] = probe.num_pages
        totals["kv_peak"] = max(totals["kv_peak"], probe.peak_pages / max(1, probe.kv.ranks[0].num_usable))
        for k, key in (("completed", "completed"), ("preemptions", "preemptions"), ("steps", "steps"),
                       ("sim_cpu_s", "cpu_s")):
            totals[k] += m[key]
    return served, totals


@contextlib.contextmanager
def _quiet(logger_name: str):
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def latency_percentiles(served: Sequence[Served]) -> dict[str, float | None]:
    """TTFT (s) P50 / P90 / P99 of all, short and long requests, and TBT (ms) P50 / P90 / P99 over every gap."""
    out: dict[str, float | None] = {}
    groups = (("all", served), ("short", [s for s in served if not s.long]), ("long", [s for s in served if s.long]))
    for name, group in groups:
        xs = [s.ttft for s in group]
        for q in (50, 90, 99):
            out[f"ttft_p{q}_{name}_s"] = float(np.percentile(xs, q)) if xs else None
    gaps = np.concatenate([s.gaps for s in served] or [np.zeros(0)])
    for q in (50, 90, 99):
        out[f"tbt_p{q}_ms"] = float(np.percentile(gaps, q)) * 1e3 if gaps.size else None
    return out


def simulate(c: Candidate, setup: Setup, incumbents: Sequence[tuple[tuple, str]] = ()) -> Outcome:
    """Simulates a feasible candidate; stops early (status "dominated") when `incumbents`, the (objectives,
    label) of finished candidates, dominate it."""
    cfg = setup.config
    slo = cfg.slo
    try:
        served, totals = served_requests(c, setup, _Bound(c, setup, incumbents) if incumbents else None)
    except Dominated as e:
        return Outcome(c, "dominated", str(e))
    good = sum(_within(s, (slo.ttft_short_s, slo.ttft_long_s), slo.tbt_p99_ms / 1e3) for s in served)
    n = len(served)
    pct = latency_percentiles(served)
    page_bytes = setup.model.kv_page_bytes(page_size=cfg.space.page_size, tp=c.tp, spp=c.spp,
                                           dtype_bytes=setup.dtype_bytes)
    metrics = {
        "requests": n, "short_requests": sum(not s.long for s in served),
        "long_requests": sum(s.long for s in served), "within_slo": good, "attainment": good / n,
        "goodput_rps": good / setup.window_s, "offered_rps": n / setup.window_s,
        **{k: pct[k] for k in ("ttft_p50_short_s", "ttft_p99_short_s", "ttft_p50_long_s", "ttft_p99_long_s",
                               "tbt_p50_ms", "tbt_p99_ms")},
        "no_first_token": sum(not s.first_token for s in served), **totals,
        "kv_gib_per_device": totals["kv_pages_per_rank"] * page_bytes / 2**30,
    }
    metrics["meets_slo"] = metrics["attainment"] >= slo.min_attainment
    return Outcome(c, "ok", metrics=metrics)


# ------------------------------------------------------------------------------------------------ the search
_WORKER_SETUP: Setup | None = None  # a worker process's copy of the set-up, sent once when the pool starts


def _init_worker(setup: Setup) -> None:
    global _WORKER_SETUP
    _WORKER_SETUP = setup


def _work(c: Candidate, incumbents: tuple, scale: float) -> Outcome:
    return simulate(c, _WORKER_SETUP.scaled(scale), incumbents)


class _Runner:
    """Runs simulations in this process (workers=1) or in a pool of spawned processes (no fork: the caller may
    have jax's threads running), at most one pending task per worker so each starts with the latest incumbents."""

    def __init__(self, setup: Setup, workers: int):
        self.setup, self.workers = setup, workers
        self.pool = None
        if workers > 1:
            self.pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=_init_worker, initargs=(setup,))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)

    def run(self, jobs: Sequence[tuple[Candidate, float]], incumbents: Callable[[Candidate], tuple] = lambda c: (),
            done: Callable[[int, Outcome], None] = lambda i, o: None) -> list[Outcome]:
        """Simulates each (candidate, arrival-rate scale) in order; `incumbents(c)` when its task starts,
        `done(index, outcome)` as each finishes."""
        out: list[Outcome | None] = [None] * len(jobs)
        if self.pool is None:
            for i, (c, scale) in enumerate(jobs):
                out[i] = simulate(c, self.setup.scaled(scale), incumbents(c))
                done(i, out[i])
            return out
        todo, pending = iter(enumerate(jobs)), {}

        def submit():
            for i, (c, scale) in todo:
                pending[self.pool.submit(_work, c, incumbents(c), scale)] = i
                return

        for _ in range(self.workers):
            submit()
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for f in finished:
                i = pending.pop(f)
                out[i] = f.result()
                done(i, out[i])
                submit()
        return out


@dataclasses.dataclass
class PlanResult:
    """The search's outcome: every candidate (ranked simulated ones first, then those stopped early, then the
    infeasible ones), the capacity curves of the best, and what was planned."""

    setup: Setup
    outcomes: list[Outcome]
    capacity: dict[str, list[tuple[float, float]]]  # label -> [(arrival rate, goodput)], req/s

    @property
    def config(self) -> PlanConfig:
        return self.setup.config

    @property
    def ranked(self) -> list[Outcome]:
        """The simulated candidates, best first."""
        return [o for o in self.outcomes if o.status == "ok"]

    @property
    def best(self) -> Outcome | None:
        return self.ranked[0] if self.ranked else None

    def of_status(self, status: str) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == status]

    def serve_command(self, outcome: Outcome) -> ServeCommand:
        return serve_command(outcome, self.setup)

    def table(self, limit: int | None = None) -> str:
        """The ranked candidates: layout, devices, KV split, chunk size and token budget, adaptive chunking target,
        policy, SLO attainment, goodput, TTFT P99 (s) of short and long requests, TBT P99 (ms), KV pages in use at
        the peak (busiest rank), SLOs met."""
        head = (f"{'#':>3} {'layout':<22} {'GPUs':>4} {'KV split':>8} {'chunk/budget':>12} {'target':>7} "
                f"{'policy':<6} {'attain':>7} {'goodput':>8} {'sTTFT99':>8} {'lTTFT99':>8} {'TBT99ms':>8} "
                f"{'KVpeak':>6} {'SLO':>4}")
        rows = [head]
        for i, o in enumerate(self.ranked[:limit], 1):
            c, m = o.candidate, o.metrics
            layout = f"tp{c.tp} spp{c.spp} kvp{c.kvp}" + (f" x{c.replicas}" if c.replicas > 1 else "")
            split = "-" if c.max_tokens_per_kvp_rank is None else _tokens(c.max_tokens_per_kvp_rank)
            target = "fixed" if c.target_batch_time_ms is None else f"{c.target_batch_time_ms:g}ms"
            chunk = f"{c.chunk_size}/{_tokens(c.max_num_batched_tokens)}"
            rows.append(f"{i:>3} {layout:<22} {c.gpus:>4} {split:>8} {chunk:>12} {target:>7} "
                        f"{c.scheduler_policy:<6} {m['attainment']:>7.1%} {m['goodput_rps']:>8.3f} "
                        f"{_fmt(m['ttft_p99_short_s'], '8.2f'):>8} {_fmt(m['ttft_p99_long_s'], '8.1f'):>8} "
                        f"{_fmt(m['tbt_p99_ms'], '8.1f'):>8} {m['kv_peak']:>6.0%} "
                        f"{'yes' if m['meets_slo'] else 'no':>4}")
        return "\n".join(rows)

    def report(self) -> str:
        """What the command prints: the set-up, the ranked table, serve commands of the best, the candidates
        stopped early and the infeasible ones with their reasons."""
        s, cfg = self.setup, self.config
        cl, slo = cfg.cluster, cfg.slo
        n_long = sum(r.prompt_tokens > cfg.workload.long_threshold_tokens for r in s.trace)
        lines = [
            f"{cfg.model} ({cfg.dtype}) on {cl.num_gpus} x {cl.hardware} ({cl.gpus_per_host} per host); predictor "
            f"profile: {s.profile or 'defaults'}",
            f"workload: {len(s.trace)} requests over {s.window_s:.0f} s ({len(s.trace) / s.window_s:.3g} req/s), "
            f"{n_long} long (> {cfg.workload.long_threshold_tokens:,} tokens); longest prompt "
            f"{max(r.prompt_tokens for r in s.trace):,} tokens",
            f"SLOs: TTFT <= {slo.ttft_short_s:g} s (short) / {slo.ttft_long_s:g} s (long), each request's TBT P99 <= "
            f"{slo.tbt_p99_ms:g} ms; met when >= {slo.min_attainment:.0%} of requests are within them",
            f"candidates: {len(self.outcomes)}: {len(self.ranked)} simulated, "
            f"{len(self.of_status('dominated'))} stopped early (dominated), "
            f"{len(self.of_status('infeasible'))} infeasible",
            *(f"note: {n}" for n in s.notes), "",
            self.table(), ""]
        best = self.ranked[:cfg.top]
        if best:
            lines.append("serve commands (one per replica process; replicas behind a round-robin load balancer):")
            for i, o in enumerate(best, 1):
                cmd = self.serve_command(o)
                lines += [f"#{i} {o.candidate.label}: {cmd.describe()}", *(f"  {sh}" for sh in cmd.shells())]
            lines.append("")
        for status, title in (("dominated", "stopped early"), ("infeasible", "infeasible")):
            group = self.of_status(status)
            if group:
                lines.append(f"{title} ({len(group)}):")
                lines += [f"  {o.candidate.label}: {o.reason}" for o in group]
        return "\n".join(lines).rstrip() + "\n"

    def to_dict(self) -> dict[str, Any]:
        s = self.setup
        return {"config": dataclasses.asdict(self.config), "model_priced_as": s.model_name,
                "profile": s.profile, "requests": len(s.trace), "window_s": s.window_s, "notes": list(s.notes),
                "candidates": [dict(o.to_dict(), **({"serve": self.serve_command(o).to_dict()}
                                                    if o.status == "ok" else {})) for o in self.outcomes],
                "capacity": {k: [list(p) for p in v] for k, v in self.capacity.items()}}

    def save(self, output_dir: str) -> list[str]:
        """plan.json, pareto.png and (with capacity curves) capacity.png in `output_dir`; returns the paths."""
        os.makedirs(output_dir, exist_ok=True)
        path = os.path.join(output_dir, "plan.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")
        paths = [path, plot_pareto(self, os.path.join(output_dir, "pareto.png"))]
        if self.capacity:
            paths.append(plot_capacity(self, os.path.join(output_dir, "capacity.png")))
        return paths


def plan(config: PlanConfig, *, trace: Sequence[TraceRequest] | None = None, setup: Setup | None = None
         ) -> PlanResult:
    """Searches `config`'s candidates (see the module docstring); `trace` replaces the workload's requests, and
    `setup` is `resolve(config, trace)` when the caller has it already."""
    from tqdm import tqdm

    if setup is None:
        setup = resolve(config, trace)
    elif trace is not None or setup.config != config:
        raise ValueError("give plan() a setup resolved from its own config, and no trace beside it")
    outcomes: list[Outcome] = []
    feasible = []
    for c in candidates(setup):
        why = infeasibility(c, setup)
        if why is None:
            feasible.append(c)
        else:
            outcomes.append(Outcome(c, "infeasible", why))
    # Fewest devices first: the cheap candidates finish first and bound the larger ones.
    feasible.sort(key=lambda c: (c.gpus, c.gpus_per_replica, c.spp, c.kvp))
    workers = config.workers or os.cpu_count() or 1
    workers = min(workers, max(1, len(feasible)))
    incumbents: list[tuple[tuple, str]] = []
    bar = tqdm(total=len(feasible), desc="plan", unit="config", disable=not config.progress, file=sys.stderr)
    simulated: list[Outcome] = []

    def done(i: int, o: Outcome) -> None:
        simulated.append(o)
        if o.status == "ok":
            incumbents.append((o.objectives(), o.candidate.label))
        ok = [x for x in simulated if x.status == "ok"]
        if ok:
            bar.set_postfix_str(f"best: {min(ok, key=_rank_key).candidate.label}", refresh=False)
        bar.update()

    with _Runner(setup, workers) as runner:
        runner.run([(c, 1.0) for c in feasible],
                   (lambda c: tuple(incumbents)) if config.early_stop else (lambda c: ()), done)
        bar.close()
        ranked = sorted((o for o in simulated if o.status == "ok"), key=_rank_key)
        stopped = [o for o in simulated if o.status == "dominated"]
        capacity = {}
        scales = [f for f in _optional_floats(config.capacity_scales, "capacity_scales") if f is not None]
        best = ranked[:config.top]
        if scales and best:
            jobs = [(o.candidate, f) for o in best for f in scales if f != 1]
            curves = runner.run(jobs)
            for o in best:
                pts = [(1.0, o.metrics)] + [(f, r.metrics) for (c, f), r in zip(jobs, curves) if c == o.candidate]
                capacity[o.candidate.label] = sorted((f * o.metrics["offered_rps"], m["goodput_rps"])
                                                     for f, m in pts)
    return PlanResult(setup, ranked + stopped + outcomes, capacity)


# ------------------------------------------------------------------------------------------------ serve commands
BASE_PORT = 8000
"""The server's default --port (`ServerConfig.port`): the first replica on a host listens there, the next one up."""


@dataclasses.dataclass(frozen=True)
class ServeCommand:
    """`python -m mnemojax.serve` for one replica of a candidate: `argv` (the flags, `--name=value`) and `env`.
    A replica larger than a host runs on `processes` hosts: the same command on each, with the multi-host flags
    (`multi_host_argv`). Replicas smaller than a host share it, `replicas_per_host` at most: each on its own
    `devices_per_replica` devices (CUDA_VISIBLE_DEVICES, on NVIDIA GPUs) and port (`replica_argv`)."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    replicas: int
    processes: int
    replicas_per_host: int = 1
    devices_per_replica: int = 1
    nvidia_gpu: bool = False

    def multi_host_argv(self, coordinator_address: str, process_id: int) -> tuple[str, ...]:
        if self.processes == 1:
            return self.argv
        return (*self.argv, f"--coordinator_address={coordinator_address}", f"--num_processes={self.processes}",
                f"--process_id={process_id}")

    def replica_env(self, slot: int) -> tuple[tuple[str, str], ...]:
        """The environment of the `slot`-th replica on a host: its own GPUs when several replicas share one."""
        if self.replicas_per_host == 1 or not self.nvidia_gpu:
            return self.env
        first = slot * self.devices_per_replica
        devices = ",".join(str(d) for d in range(first, first + self.devices_per_replica))
        return (*self.env, ("CUDA_VISIBLE_DEVICES", devices))

    def replica_argv(self, slot: int) -> tuple[str, ...]:
        """The flags of the `slot`-th replica on a host: its own port when several replicas share one."""
        return self.argv if self.replicas_per_host == 1 else (*self.argv, f"--port={BASE_PORT + slot}")

    def shell(self, slot: int = 0) -> str:
        """The command line (of the `slot`-th replica on a host); a multi-host one names $COORDINATOR (host:port
        of process 0) and $PROCESS_ID."""
        argv = [shlex.quote(a) for a in self.replica_argv(slot)]
        if self.processes > 1:
            argv += ["--coordinator_address=$COORDINATOR", f"--num_processes={self.processes}",
                     "--process_id=$PROCESS_ID"]
        env = self.replica_env(slot)
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env), "python -m mnemojax.serve", *argv])

    def shells(self) -> list[str]:
        """The command lines of one host: one per replica it runs."""
        return [self.shell(j) for j in range(self.replicas_per_host)]

    def describe(self) -> str:
        if self.processes > 1:
            where = f"{self.processes} hosts per replica, the same command on each"
        elif self.replicas_per_host > 1:
            where = (f"{self.replicas_per_host} per host, each on its own devices and port: on each host, the "
                     f"commands below")
        else:
            where = "one process per replica"
        return f"{self.replicas} replica(s), {where}"

    def to_dict(self) -> dict[str, Any]:
        return {"argv": list(self.argv), "env": dict(self.env), "replicas": self.replicas,
                "processes": self.processes, "replicas_per_host": self.replicas_per_host, "shell": self.shell(),
                "shells": self.shells()}


def serve_command(outcome: Outcome, setup: Setup) -> ServeCommand:
    """The serve command of a simulated candidate: its layout, KV split and pages (`--num_pages`, what the plan
    assumed), chunking, policy, the SLO-derived TTFT deadlines, and `max_model_len` for the longest request. On
    NVIDIA GPUs JAX is given 95% of the memory (XLA_CLIENT_MEM_FRACTION; its default is 75%): the weights and KV
    pages fill `memory_utilization` of it, activations the rest."""
    c, cfg = outcome.candidate, setup.config
    sp, cl = cfg.space, cfg.cluster
    predicts = sim_config(c, setup).uses_predictor  # else the server builds no predictor, and refuses its flags
    flags: dict[str, Any] = {
        "model": cfg.model, "dtype": cfg.dtype, "hardware": cl.hardware if predicts else None,
        "tp": c.tp, "spp": c.spp, "kvp": c.kvp, "max_tokens_per_kvp_rank": c.max_tokens_per_kvp_rank,
        "max_model_len": setup.max_model_len, "page_size": sp.page_size,
        "num_pages": outcome.metrics["kv_pages_per_rank"], "chunk_size": c.chunk_size,
        "max_num_batched_tokens": c.max_num_batched_tokens, "max_num_seqs": sp.max_num_seqs,
        "scheduler_policy": c.scheduler_policy,
        # the server's default target is 50 ms: a candidate without one says so
        "target_batch_time_ms": "none" if c.target_batch_time_ms is None else c.target_batch_time_ms,
        "ppb_max_share": sp.ppb_max_share, "ttft_slo_min_s": setup.deadline_min_s,
        "ttft_slo_per_token_s": setup.deadline_per_token_s,
        "predictor_profile": cfg.predictor_profile if predicts else None,
    }
    argv = tuple(f"--{k}={v!r}" if isinstance(v, float) else f"--{k}={v}"
                 for k, v in flags.items() if v is not None)
    gpu = HARDWARE[cl.hardware].nvidia_gpu
    env = (("XLA_CLIENT_MEM_FRACTION", "0.95"),) if gpu else ()
    per_host = min(c.replicas, max(cl.gpus_per_host // c.gpus_per_replica, 1))
    return ServeCommand(argv, env, c.replicas, -(-c.gpus_per_replica // cl.gpus_per_host), per_host,
                        c.gpus_per_replica, gpu)


# ------------------------------------------------------------------------------------------------ plots
def pareto_front(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats in both coordinates (lower is better), by the first coordinate."""
    front, best_y = [], math.inf
    for x, y in sorted(points):
        if y < best_y:
            front.append((x, y))
            best_y = y
    return front


def plot_pareto(result: PlanResult, path: str) -> str:
    """TTFT P99 (short requests; long ones in a second panel when there are any) against TBT P99 of every
    simulated candidate, coloured by device count, with the Pareto front, the SLO targets and the best one."""
    plt = pyplot()
    ranked, slo = result.ranked, result.config.slo
    kinds = [("short", "ttft_p99_short_s", slo.ttft_short_s)]
    if any(o.metrics["ttft_p99_long_s"] is not None for o in ranked):
        kinds.append(("long", "ttft_p99_long_s", slo.ttft_long_s))
    fig, axes = plt.subplots(1, len(kinds), figsize=(6.5 * len(kinds), 4.6), squeeze=False)
    gpus = sorted({o.candidate.gpus for o in ranked})
    cmap = plt.get_cmap("viridis", max(len(gpus), 2))
    for ax, (kind, key, target) in zip(axes[0], kinds):
        pts = [(o.metrics[key], o.metrics["tbt_p99_ms"], o) for o in ranked
               if o.metrics[key] is not None and o.metrics["tbt_p99_ms"] is not None]
        for j, g in enumerate(gpus):
            xs = [(x, y) for x, y, o in pts if o.candidate.gpus == g]
            if xs:
                ax.scatter(*zip(*xs), color=cmap(j), s=28, alpha=0.85, label=f"{g} GPU{'s' if g > 1 else ''}")
        front = pareto_front([(x, y) for x, y, _ in pts])
        if front:
            ax.step(*zip(*front), where="post", color="0.3", lw=1, label="Pareto front")
        best = result.best
        if best is not None and best.metrics[key] is not None:
            ax.scatter([best.metrics[key]], [best.metrics["tbt_p99_ms"]], marker="*", s=220, color="red",
                       zorder=5, label=f"best: {best.candidate.label}")
        ax.axvline(target, color="red", ls="--", lw=0.8)
        ax.axhline(slo.tbt_p99_ms, color="red", ls="--", lw=0.8)
        _log_axes(ax)
        ax.set_xlabel(f"TTFT P99 of {kind} requests (s)")
        ax.set_ylabel("TBT P99 (ms)")
        ax.set_title(f"{kind} requests (dashed: SLO targets)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    return save_figure(fig, path, dpi=110)


def plot_capacity(result: PlanResult, path: str) -> str:
    """Goodput (requests per second within SLO) against arrival rate of the best candidates."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.6))
    top = 0.0
    for label, pts in result.capacity.items():
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o", label=label)
        top = max(top, *xs)
    ax.plot([0, top], [0, top], color="0.5", ls=":", lw=1, label="every request within SLO")
    ax.axvline(len(result.setup.trace) / result.setup.window_s, color="red", ls="--", lw=0.8, label="workload")
    ax.set_xlabel("arrival rate (requests/s)")
    ax.set_ylabel("goodput (requests/s within SLO)")
    ax.set_title(f"capacity on {result.config.cluster.num_gpus} x {result.config.cluster.hardware}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, path, dpi=110)


def _log_axes(ax) -> None:
    """Log scales labelled with plain numbers (1, 2, 5 per decade) instead of powers of ten."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for axis, scale in ((ax.xaxis, ax.set_xscale), (ax.yaxis, ax.set_yscale)):
        scale("log")
        axis.set_major_formatter(plain)
        axis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
        axis.set_minor_formatter(plain)
