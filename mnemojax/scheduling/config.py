"""The deployment settings that the engine and the simulator share, each name defined once (no jax).

`SchedulerConfig` (how steps are packed) and `ParallelConfig` (the mesh) are bases of both `EngineConfig`
(`mnemojax.engine.llm_engine`) and `SimConfig` (`mnemojax.sim.simulator`), so a field means the same in the library, in
`python -m mnemojax.serve` and in `python -m mnemojax.sim`, and its flag's help is the docstring under it
(`mnemojax.cli`). A command may change a default (the simulator's are H100-sized), never a name.
"""
from __future__ import annotations

import dataclasses
import math

POLICIES = ("fcfs", "edf", "lrs", "ilrs", "priority")
"""Prefill orders (see `mnemojax.scheduling.scheduler`)."""


def _positive_ints(obj, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler packs a step (Medha, section 4.2)."""

    max_num_batched_tokens: int = 512
    """Token budget of a step, per KVP rank."""
    max_num_seqs: int = 16
    """Requests running at once (sequence rows of each rank's batch)."""
    chunk_size: int = 256
    """Largest prefill chunk of one request per step."""
    scheduler_policy: str = dataclasses.field(default="fcfs", metadata={"choices": POLICIES})
    """Prefill order: fcfs (arrival), edf (TTFT deadline), lrs (least slack), ilrs (least relative slack), priority
    (vLLM's: each request's priority, lower first, then arrival; the only policy that takes priorities other than
    0). vLLM's name: scheduling_policy."""
    target_batch_time_ms: float | None = None
    """Adaptive chunking: a step's predicted time stays under this (divided by spp per stage; needs the runtime
    predictor); default: fixed chunks under the token budget."""
    min_chunk_size: int = 32
    """Adaptive chunks never go below this (nor above chunk_size), unless the prompt's rest is shorter."""
    ppb_max_share: float = 0.5
    """Prefill-prefill batching: most of a step for prefills after the most urgent one (0: off; not with fcfs or
    priority)."""
    ttft_slo_min_s: float = 1.0
    """TTFT deadline of a request: this + ttft_slo_per_token_s x its prompt tokens ..."""
    ttft_slo_per_token_s: float = 1e-3
    """TTFT deadline seconds per prompt token."""
    ttft_slo_prefill_factor: float = 0.0
    """... and at least this x the predicted time to prefill the prompt alone (0: off)."""
    enable_prefix_caching: bool = True
    """Reuse the KV pages of prompt prefixes computed before (full pages, matched by a chained hash of their tokens;
    exact); deadlines and priorities count only the tokens left to compute. A request asking for prompt_logprobs
    computes its whole prompt. The simulator models it for traces with shared prefixes (prefix_id)."""

    def __post_init__(self):
        _positive_ints(self, "max_num_batched_tokens", "max_num_seqs", "chunk_size", "min_chunk_size")
        if self.scheduler_policy not in POLICIES:
            raise ValueError(f"scheduler_policy must be one of {POLICIES}, got {self.scheduler_policy!r}")
        if self.target_batch_time_ms is not None and not 0 < self.target_batch_time_ms < math.inf:
            raise ValueError(f"target_batch_time_ms must be positive and finite, got {self.target_batch_time_ms}")
        if not 0.0 <= self.ppb_max_share < 1.0:
            raise ValueError(f"ppb_max_share must be in [0, 1), got {self.ppb_max_share}")
        for name in ("ttft_slo_min_s", "ttft_slo_per_token_s", "ttft_slo_prefill_factor"):
            if not 0 <= getattr(self, name) < math.inf:  # NaN too: every deadline would be NaN
                raise ValueError(f"{name} must be finite and >= 0, got {getattr(self, name)}")
        if self.ttft_slo_min_s == 0 and self.ttft_slo_per_token_s == 0:
            # every deadline would be its arrival: slack is measured in units of the deadline's duration
            raise ValueError("ttft_slo_min_s and ttft_slo_per_token_s must not both be 0 (a TTFT deadline needs a "
                             "positive duration)")

    @property
    def in_order(self) -> bool:
        """The policy takes prefills in a fixed order (fcfs, priority): nobody overtakes a request that cannot
        start, and steps are not shared by prefill-prefill batching."""
        return self.scheduler_policy in ("fcfs", "priority")

    @property
    def target_batch_time_s(self) -> float | None:
        return None if self.target_batch_time_ms is None else self.target_batch_time_ms / 1e3

    @property
    def uses_predictor(self) -> bool:
        """Whether the scheduler needs the runtime predictor: to size chunks to the target batch time, or to price
        TTFT deadlines by the prefill factor (the engine and the simulator build it by this one rule)."""
        return self.target_batch_time_ms is not None or self.ttft_slo_prefill_factor > 0


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """The (kvp, spp, tp) mesh and how far a request's KV may spread."""

    tp: int = 1
    """Tensor parallelism: attention heads and MLP columns split over this many devices."""
    spp: int = 1
    """Sequence pipeline parallelism: layers split into this many pipeline stages."""
    kvp: int = 1
    """KV-cache parallelism: ranks, each with its own page pool and a full model replica."""
    max_tokens_per_kvp_rank: int | None = None
    """Most tokens of one request on one KVP rank (a multiple of page_size; default: no split)."""

    def __post_init__(self):
        _positive_ints(self, "tp", "spp", "kvp")
        if self.max_tokens_per_kvp_rank is not None:
            _positive_ints(self, "max_tokens_per_kvp_rank")
