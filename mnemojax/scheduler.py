"""The scheduler: plain data in, plain data out, no jax.

`Scheduler.schedule()` decides which requests run this step and how many of their uncomputed tokens each
computes (a decode token or a prefill chunk), grows their KV pages, and returns a `StepPlan`. It follows one
budget rule for every request (see `request.py`) under a per-step token budget.

With KV parallelism each KVP rank has its own token budget and page pool; a request whose KV spans several
ranks computes its tokens on all of them (its rows are replicated), so its chunk counts against every rank's
budget. With a pipeline (spp > 1) a scheduled chunk is in flight for several steps: `num_computed` counts
tokens scheduled, a request waits for its sampled token before it can be scheduled again, and a request with
chunks in flight is never preempted.

This is the first-come-first-served policy: running requests first, in the order they were admitted, then
waiting ones in arrival order while the budget, the sequence slots and the pages last. When a running request
cannot get a page, the most recently admitted running request is preempted by recompute: its pages are freed
and it goes back to the front of the queue to compute its prompt and generated tokens again (results are
unchanged: the sampler is keyed by (seed, token index), and prompt log-probs already reported are kept).
"""
from __future__ import annotations

import dataclasses
import logging
from collections import deque

from mnemojax.kv_manager import KVCacheManager
from mnemojax.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ScheduledChunk:
    """One request's share of a step."""

    request: Request
    start: int  # index of its first token in the step (== request.num_computed when scheduled)
    num_tokens: int  # tokens of this request computed in this step
    sample: bool  # the chunk reaches the last known token, so the step samples the next one


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What one step feeds into the first pipeline stage. Nothing in it is a device array."""

    chunks: list[ScheduledChunk]  # in row order of the step's batch
    preempted: list[Request]  # requests preempted (pages freed) while making this plan

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512  # the per-step token budget of each KVP rank
    max_num_seqs: int = 64  # requests running at once (sequence rows of each rank's batch)
    chunk_size: int = 256  # most prefill tokens of one request in a step

    def __post_init__(self):
        for name in ("max_num_batched_tokens", "max_num_seqs", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Drops a finished or aborted request; frees its pages unless chunks of it are still in flight."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if request.in_flight == 0:
            self.kv.free(request)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        logger.warning("preempted request %s by recompute: out of KV pages (%d of %d pages in use)",
                       request.request_id, self.kv.num_used, self.kv.num_usable)

    def _size(self, req: Request, budgets: list[int]) -> tuple[int, list[int]]:
        """Tokens `req` may compute now under the budgets, and the ranks whose budget it uses."""
        n = min(req.num_uncomputed, self.config.chunk_size)
        if req.kv_ranks:
            n = min(n, budgets[req.kv_ranks[0]])
        if len(self.kv.rank_tokens(req.num_computed + n)) > 1:  # multi-rank: its rows are on every rank
            n = min(n, *budgets)
            return n, list(range(len(budgets)))
        return n, req.kv_ranks[:1]

    def _schedule(self, req: Request, n: int, ranks: list[int], budgets: list[int]) -> ScheduledChunk:
        self.kv.grow(req, req.num_computed + n)
        chunk = ScheduledChunk(req, req.num_computed, n, req.num_computed + n == req.num_tokens)
        req.num_computed += n
        req.in_flight += 1
        req.awaiting_sample = chunk.sample
        for r in ranks:
            budgets[r] -= n
        return chunk

    def schedule(self) -> StepPlan:
        budgets = [self.config.max_num_batched_tokens] * self.kv.num_ranks
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []

        # Running requests, in admission order. A request short of pages preempts the most recently admitted
        # request that was admitted after it, holds pages on a rank that is short, and has nothing in flight;
        # when there is none it waits a step (requests in flight come back and become preemptable).
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING or req.awaiting_sample:
                continue
            n, ranks = self._size(req, budgets)
            if n <= 0:
                continue
            while short := self.kv.short_ranks(req, req.num_computed + n):
                newer = self.running[self.running.index(req) + 1:]
                victims = [r for r in newer if r.in_flight == 0 and short & set(r.kv_ranks)]
                if not victims:
                    break
                self._preempt(victims[-1])
                preempted.append(victims[-1])
            if not short:
                chunks.append(self._schedule(req, n, ranks, budgets))

        # Waiting requests, first come first served, while budget, rows and pages last.
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req in preempted or req.in_flight:
                break  # not in the step it was preempted in
            self.kv.place(req)
            n, ranks = self._size(req, budgets)
            if n <= 0:
                break
            if not self.kv.can_grow(req, n):
                logger.info("request %s waits: not enough free KV pages (%d of %d in use)", req.request_id,
                            self.kv.num_used, self.kv.num_usable)
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chunks.append(self._schedule(req, n, ranks, budgets))
        return StepPlan(chunks, preempted)
