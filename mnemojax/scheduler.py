"""The scheduler: plain data in, plain data out, no jax.

`Scheduler.schedule()` decides which requests run this step and how many of their uncomputed tokens each
computes (a decode token or a prefill chunk), grows their KV pages, and returns a `StepPlan`. It follows one
budget rule for every request (see `request.py`) under a per-step token budget.

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

from mnemojax.kv_manager import PageManager
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
    """What one step runs. Nothing in it is a device array."""

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
    max_num_batched_tokens: int = 512  # the per-step token budget
    max_num_seqs: int = 64  # requests per step (sequence rows of the batch)
    chunk_size: int = 256  # most prefill tokens of one request in a step

    def __post_init__(self):
        for name in ("max_num_batched_tokens", "max_num_seqs", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, pages: PageManager):
        self.config = config
        self.pages = pages
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Drops a finished or aborted request and frees its pages."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.pages.free(request.pages)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.pages.free(request.pages)
        request.num_computed = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        logger.warning("preempted request %s by recompute: out of KV pages (%d free of %d)",
                       request.request_id, self.pages.num_free, self.pages.num_usable)

    def schedule(self) -> StepPlan:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []

        # Running requests, in admission order. Preemption takes the most recently admitted first.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_uncomputed, self.config.chunk_size, budget)
            if n <= 0:
                i += 1
                continue
            while not self.pages.can_grow(req.pages, req.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # it preempted itself: everything after it is gone too
            self.pages.grow(req.pages, req.num_computed + n)
            chunks.append(ScheduledChunk(req, req.num_computed, n, req.num_computed + n == req.num_tokens))
            budget -= n
            i += 1

        # Waiting requests, first come first served, while budget, rows and pages last.
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req in preempted:
                break  # not in the same step it was preempted in
            n = min(req.num_uncomputed, self.config.chunk_size, budget)
            if not self.pages.can_grow(req.pages, n):
                logger.info("request %s waits: needs %d KV pages, %d free", req.request_id,
                            self.pages.pages_for(n), self.pages.num_free)
                break
            self.waiting.popleft()
            self.pages.grow(req.pages, n)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chunks.append(ScheduledChunk(req, 0, n, n == req.num_tokens))
            budget -= n
        return StepPlan(chunks, preempted)
