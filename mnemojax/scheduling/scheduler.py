"""The scheduler: plain data in, plain data out, no jax. It takes a clock, so deadlines are testable.

`Scheduler.schedule(now)` decides which requests run this step and how many of their uncomputed tokens each
computes (a decode token or a prefill chunk), grows their KV pages, and returns a `StepPlan`. One budget rule
holds for every request (see `request.py`).

A step is packed in this order (Medha, section 4.2):
1. Decodes of running requests, in admission order. A decode is never preempted, except when KV pages run
   out (then by recompute).
2. Prefill chunks, highest priority first. The policy orders them: `fcfs` (arrival), `edf` (earliest TTFT
   deadline), `lrs` (least remaining slack: deadline - now - predicted remaining prefill time), `ilrs`
   (that slack divided by the deadline's duration, so long and short prompts compare fairly) or `priority`
   (vLLM's: each request's `priority`, lower first, then arrival). A prefill not scheduled in a step keeps its
   pages and resumes later: preemption at chunk boundaries. Under `fcfs` and `priority` a waiting request that
   cannot start blocks the waiting requests after it (no overtaking); the running ones still get their chunks.
3. With `target_batch_time_ms` and a runtime predictor, chunks are adaptive: each is the largest whose
   predicted step time stays under the target, so chunks shrink as a long prompt's context grows. Without
   them the step's cost is its token count under `max_num_batched_tokens`.
4. Prefill-prefill batching (any policy but fcfs, `ppb_max_share` > 0): when several prefills wait, those
   after the most urgent one share the step's room in proportion to their urgency (1 / relative slack), in
   total at most `ppb_max_share` of it; the most urgent takes what they leave.

TTFT deadlines: arrival + max(`ttft_slo_min_s` + `ttft_slo_per_token_s` x prompt tokens, `ttft_slo_prefill_factor`
x the predicted time to prefill the prompt alone).

With KV parallelism each KVP rank has its own token budget (rows) and page pool. A request whose KV spans several
ranks computes its query tokens on each rank holding its KV (the same rows on each), so its chunk counts against
those ranks' budgets and costs, and only theirs: the other ranks use those rows for their own requests
(`rows.py`, the executor's layout). A step's cost is its busiest rank's. Where a request's KV goes, its first rank
and each rank that joins later, is the KV manager's choice by load (pending prefill work and free pages). With a pipeline (spp > 1) a scheduled chunk is in flight for
several steps: `num_computed` counts tokens scheduled, a request waits for its sampled token before it can be
scheduled again, a request with chunks in flight is never preempted, and a step's target is the batch time
divided by spp (a decode crosses every stage).

The update half of a step is `update_from_output(plan, outputs)`, called when a plan's micro-batch leaves the
last stage, with what the step gave back for each chunk (`ChunkOutput`): the chunks stop being in flight, sampled
tokens and log-probs are appended and stamped, the token-level stop conditions are checked (EOS, stop token ids,
`max_tokens`, `max_model_len`), and stopped requests are finished, their pages freed. The engine, the simulator and
the tests all call it; stop strings, which need text, are the engine's detokenizer's.

Prefix caching (the KV manager's `prefix_caching`): a waiting request being placed takes its cached prefix pages
and starts with `num_computed` at their end; a placed request that is not admitted gives them back. Its deadline
and remaining prefill time count only the tokens it computes (estimated when it is added), so a mostly cached long
prompt is a short request for every policy and for adaptive chunking. `update_from_output` caches the full pages
a leaving chunk completed (their K/V is then written on every pipeline stage).

Memory pressure: a request that cannot get a page preempts, by recompute, the most recently admitted request
that was admitted after it (under `priority`: the last in (priority, arrival, admission) order of those after it
in that order), holds pages on a rank that is short, and has nothing in flight; with none, a prefill
chunk shrinks to what the free pages hold (rather than leave them to newer requests), and a decode waits. A preempted request returns to the front of the queue and computes its prompt and generated tokens
again; results do not change (the sampler is keyed by (seed, token index); prompt log-probs already
reported are kept).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence

from mnemojax.scheduling.config import SchedulerConfig
from mnemojax.scheduling.kv_manager import KVCacheManager
from mnemojax.scheduling.predictor import ChunkShape
from mnemojax.scheduling.request import Request, RequestStatus
from mnemojax.scheduling.rows import StepRows

logger = logging.getLogger(__name__)

# Without a runtime predictor, remaining prefill time is estimated at this many seconds per token.
DEFAULT_SECONDS_PER_TOKEN = 1e-4
_MIN_SLACK = 0.05  # relative slack floor in the prefill-prefill sharing weights (1 / slack)


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
class ChunkOutput:
    """What a step gave back for one chunk of its plan, as plain values (the executor converts its device results;
    a model-free caller, the simulator or a test, gives tokens only)."""

    token: int | None = None  # the token sampled after the chunk (a chunk with `sample`); None for the others
    logprobs: dict[int, float] | None = None  # that token's top log-probs and its own, when the request asks
    prompt_logprobs: tuple[dict[int, float], ...] = ()  # entries of the prompt tokens the chunk scored, in order


class Scheduler:
    """`eos_token_ids`: the model's end-of-sequence tokens (a sampled one finishes a request not ignoring EOS)."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, predictor=None,
                 clock: Callable[[], float] = time.perf_counter, eos_token_ids: Collection[int] = (), *,
                 spp: int = 1, max_model_len: int | None = None):
        if config.target_batch_time_ms is not None and predictor is None:
            raise ValueError("target_batch_time_ms needs a runtime predictor")
        if spp < 1:
            raise ValueError(f"spp must be at least 1, got {spp}")
        if max_model_len is not None and max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {max_model_len}")
        self.config = config
        self.spp = spp  # pipeline stages: a step's target is the batch time / spp
        self.max_model_len = max_model_len  # a request whose prompt + output reaches this finishes; None: no limit
        self.target_s = config.target_batch_time_s
        self.kv = kv
        self.predictor = predictor
        self.clock = clock
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        # Finished requests with chunks still in flight, by id: each keeps its sequence slot on the device (the
        # executor hands a slot on only when nothing in the pipeline reads it), so each still takes a seat.
        self._draining: dict[int, Request] = {}
        self._order = itertools.count()
        self.num_preemptions = 0  # since start, for the server's metrics
        self._prefill_cache: dict[int, tuple[int, int, int, float]] = {}  # id: (num_computed, start, predictor version, s)
        self._target_unmet_logged = False

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def num_seats_held(self) -> int:
        """Sequence slots held: the running requests and the finished ones still in flight (at most
        `max_num_seqs`)."""
        return len(self.running) + len(self._draining)

    # ---------------------------------------------------------------- requests in and out
    def add(self, request: Request) -> None:
        c = self.config
        n = request.num_prompt_tokens
        # With prefix caching the deadline and priority count only the tokens to compute: a mostly cached long
        # prompt is a short request (the estimate made now; admission finds what is cached then).
        request.num_cached_tokens = cached = self.kv.num_cached_tokens(request)
        duration = c.ttft_slo_min_s + c.ttft_slo_per_token_s * (n - cached)
        if self.predictor is not None and c.ttft_slo_prefill_factor > 0:
            duration = max(duration, c.ttft_slo_prefill_factor * self.predictor.prefill_time(
                n, c.chunk_size, context_start=cached))
        request.deadline_duration = duration
        request.ttft_deadline = request.arrival_time + duration
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Drops a finished or aborted request; frees its pages unless chunks of it are still in flight."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._prefill_cache.pop(id(request), None)
        if request.in_flight == 0:
            self.kv.free(request)
        else:
            self._draining[id(request)] = request  # until its last chunk leaves the pipeline

    def finish(self, request: Request, reason: str, stop_reason: str | int | None = None,
               now: float | None = None) -> None:
        """Ends `request`: `reason` "stop" (`stop_reason`: the stop string or token id, None for EOS), "length",
        "abort" or "error" (vLLM's: the engine's failed steps ended it). It leaves the queues; its pages are freed
        once nothing of it is in flight."""
        request.finish_reason, request.stop_reason = reason, stop_reason
        request.status = RequestStatus.FINISHED
        request.finished_time = self.clock() if now is None else now
        self.remove(request)

    # ---------------------------------------------------------------- the update half of a step
    def update_from_output(self, plan: StepPlan, outputs: Sequence[ChunkOutput],
                           now: float | None = None) -> list[Request]:
        """`plan`'s micro-batch has left the last pipeline stage; `outputs[i]` is what the step gave back for
        `plan.chunks[i]`.

        First every chunk stops being in flight (a request aborted meanwhile gets its pages back). Then, for each
        request still running, in plan order: its prompt log-probs are appended; a sampling chunk appends its
        token (and log-probs), stamped `now` (default: the clock), and the request stops at the first of: an EOS
        token (unless `ignore_eos`), a stop token id (either only once `min_tokens` are generated), `max_tokens`
        generated, `max_model_len` tokens in all.

        Returns the requests that got a token, in plan order (what the detokenizer reads next).
        """
        if len(outputs) != len(plan.chunks):
            raise ValueError(f"{len(outputs)} outputs for a plan of {len(plan.chunks)} chunks")
        for ch, out in zip(plan.chunks, outputs):
            if ch.sample and out.token is None and not ch.request.is_finished:
                raise ValueError(f"no sampled token for request {ch.request.request_id}'s sampling chunk")
        now = self.clock() if now is None else now
        for ch in plan.chunks:
            req = ch.request
            req.in_flight -= 1
            if ch.sample:
                req.awaiting_sample -= 1
            if req.kv_ranks:
                self.kv.cache_computed(req, ch.start + ch.num_tokens)  # its K/V is written on every stage now
            if req.is_finished and req.in_flight == 0:
                self.kv.free(req)  # finished or aborted while in flight
                self._draining.pop(id(req), None)
        sampled = []
        for ch, out in zip(plan.chunks, outputs):
            req = ch.request
            if req.is_finished:
                continue
            if out.prompt_logprobs:
                req.prompt_logprobs.extend(out.prompt_logprobs)
            if ch.sample:
                self._append_token(req, out, now)
                sampled.append(req)
        return sampled

    def _append_token(self, req: Request, out: ChunkOutput, now: float) -> None:
        p = req.params
        req.output_token_ids.append(out.token)
        req.token_times.append(now)
        if req.first_token_time is None:
            req.first_token_time = now
        if req.logprobs is not None:
            req.logprobs.append(out.logprobs)
        max_len = self.max_model_len
        stops = len(req.output_token_ids) >= p.min_tokens  # vLLM's: before, the sampler bans the stop tokens
        # vLLM's order (`check_stop`): the length limits first, so a stop token that is also the last token allowed
        # ends the request with "length" (and, as not a stop, its text is kept); a stop string it completes still
        # makes it "stop" (`LLMEngine._detokenize`)
        if len(req.output_token_ids) >= p.max_tokens or (max_len is not None and req.num_tokens >= max_len):
            self.finish(req, "length", None, now)
        elif stops and out.token in self.eos_token_ids and not p.ignore_eos:
            self.finish(req, "stop", None, now)
        elif stops and out.token in p.stop_token_ids:
            self.finish(req, "stop", out.token, now)

    def _preempt(self, request: Request, why: str = "out of KV pages") -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        logger.warning("preempted request %s by recompute: %s (%d of %d pages in use)",
                       request.request_id, why, self.kv.num_used, self.kv.num_usable)

    def preempt_all(self) -> list[Request]:
        """Every running request back to the queue to be computed again, and every finished one still in flight
        gives its pages back: what the engine does when a step failed and what the device held is lost. Returns
        the requests preempted."""
        for req in self._draining.values():
            req.in_flight = req.awaiting_sample = 0
            self.kv.free(req)
        self._draining.clear()
        preempted = list(self.running)
        for req in reversed(preempted):  # the newest first: each goes to the queue's front, so they keep their order
            req.in_flight = req.awaiting_sample = 0
            self._preempt(req, "a step failed")
        return preempted

    # ---------------------------------------------------------------- priorities
    def remaining_prefill_time(self, req: Request) -> float:
        """Predicted seconds to compute the rest of `req`'s known tokens alone."""
        key = id(req)
        version = getattr(self.predictor, "version", 0)  # online calibration changes the predictor
        hit = self._prefill_cache.get(key)
        # a waiting request is expected to find its cached pages (estimated when it was added)
        start = req.num_computed if req.status is RequestStatus.RUNNING else (req.num_cached_tokens or 0)
        # keyed by the tokens known too: a request preempted after decoding recomputes its outputs as well
        if hit is not None and hit[:4] == (req.num_computed, start, req.num_tokens, version):
            return hit[4]
        if self.predictor is None:
            t = (req.num_tokens - start) * DEFAULT_SECONDS_PER_TOKEN
        else:
            t = self.predictor.prefill_time(req.num_tokens, self.config.chunk_size, context_start=start)
        self._prefill_cache[key] = (req.num_computed, start, req.num_tokens, version, t)
        return t

    def relative_slack(self, req: Request, now: float) -> float:
        """Medha's ILRS priority: (deadline - now - remaining prefill time) / deadline duration."""
        return (req.ttft_deadline - now - self.remaining_prefill_time(req)) / req.deadline_duration

    def _priority(self, req: Request, now: float):
        p = self.config.scheduler_policy
        if p == "fcfs":
            return 0.0  # a stable sort keeps running-then-waiting, each in order
        if p == "priority":
            return req.priority, req.arrival_time  # ties: running-then-waiting, each in order
        if p == "edf":
            return req.ttft_deadline
        if p == "lrs":
            return req.ttft_deadline - now - self.remaining_prefill_time(req)
        return self.relative_slack(req, now)

    # ---------------------------------------------------------------- packing
    def _ranks_of(self, req: Request, n: int, start: int | None = None) -> list[int]:
        """Ranks whose rows a chunk of `n` tokens of `req` from `start` (default: `num_computed`) occupies: the
        ranks holding its KV once the chunk is in (a rank that would join for it included)."""
        return self.kv.ranks_for(req, (req.num_computed if start is None else start) + n)

    def _rank_shapes(self, items) -> dict[int, list[ChunkShape]]:
        """Per KVP rank, the chunk shapes of `items` ((request, start, tokens)) that occupy its rows."""
        by_rank: dict[int, list[ChunkShape]] = {}
        for req, start, n in items:
            shape = ChunkShape(n, start + n, max(1, len(self.kv.rank_tokens(start + n))))
            for r in self._ranks_of(req, n, start):
                by_rank.setdefault(r, []).append(shape)
        return by_rank

    def plan_shapes(self, plan: StepPlan) -> list[list[ChunkShape]]:
        """The chunk shapes of `plan` on each KVP rank that has rows in it, as the predictor costs them (call it
        before the plan's requests move on: ranks are read from their current pages)."""
        return list(self._rank_shapes((ch.request, ch.start, ch.num_tokens) for ch in plan.chunks).values())

    def _cost(self, entries: list[tuple[Request, int, int]]) -> float:
        """A step's cost, its chunks as (request, start, tokens): its busiest rank's predicted time, or its token
        count without a predictor."""
        by_rank = self._rank_shapes(entries)
        if not by_rank:
            return 0.0
        if self.target_s is None:
            return float(max(sum(ch.query_tokens for ch in es) for es in by_rank.values()))
        return max(self.predictor.step_time(es) for es in by_rank.values())

    def _limit(self) -> float:
        c = self.config
        return self.target_s / self.spp if self.target_s is not None else float(c.max_num_batched_tokens)

    def _fit(self, entries, req: Request, rows: StepRows, cap: float, floor: int) -> int:
        """Largest chunk of `req` within the ranks' token budgets whose step cost stays under `cap` (at least
        `floor` tokens when the budgets allow, so a prefill always makes progress)."""
        hi = min(req.num_uncomputed, self.config.chunk_size)
        if hi > 0:  # (a smaller chunk spans the same ranks or fewer, with as much room or more)
            hi = self._room_for(req, hi, rows)
        if hi <= 0:
            return 0
        if self.kv.num_ranks > 1:
            # The step lasts as long as its busiest rank: a chunk that leaves that as it is (on an idle rank) is
            # free, even when the busiest rank is already over the cap.
            cap = max(cap, self._cost(entries))
        if self._cost(entries + [(req, req.num_computed, hi)]) <= cap:
            return hi
        if self._cost(entries + [(req, req.num_computed, 1)]) > cap:
            if floor > 0:
                self._log_target_unmet(entries, req, min(floor, hi), cap)
            return min(floor, hi)  # not even one token fits
        best, a, b = 1, 2, hi - 1  # the cost grows with the chunk: binary search for the largest that fits
        while a <= b:
            mid = (a + b) // 2
            if self._cost(entries + [(req, req.num_computed, mid)]) <= cap:
                best, a = mid, mid + 1
            else:
                b = mid - 1
        if best < min(floor, hi):
            self._log_target_unmet(entries, req, min(floor, hi), cap)
        return max(best, min(floor, hi))

    def _room_for(self, req: Request, most: int, rows: StepRows) -> int:
        """The largest chunk of `req`, up to `most` tokens, that every rank it occupies has rows for. A chunk that
        brings in the request's next KVP rank needs rows there too; one that stays on the ranks it has may fit
        where that one does not."""
        fit = min(most, rows.room(self._ranks_of(req, most)))
        m = self.kv.max_tokens_per_rank
        if fit < most and m is not None and req.kv_ranks:
            stay = len(req.kv_ranks) * m - req.num_computed  # tokens left on the ranks it has
            if 0 < stay < most:
                fit = max(fit, min(stay, rows.room(self._ranks_of(req, stay))))
        return fit

    def _fits_in_free_pages(self, req: Request, most: int) -> int:
        """The largest chunk of `req`, up to `most` tokens, whose pages are free now (0: none)."""
        lo, hi = 0, most
        while lo < hi:  # the pages a chunk needs grow with it
            mid = (lo + hi + 1) // 2
            if self.kv.short_ranks(req, req.num_computed + mid):
                hi = mid - 1
            else:
                lo = mid
        return lo

    def _log_target_unmet(self, entries, req: Request, n: int, cap: float) -> None:
        """Says once that a step's least work (its decodes and the most urgent prefill's smallest chunk) is
        predicted over the target."""
        if self._target_unmet_logged or getattr(self.predictor, "calibrating", False):
            return
        entries = [(r, s, k) for r, s, k in entries if k == 1 and r.output_token_ids]  # decodes: no packing choice
        if self._cost(entries + [(req, req.num_computed, n)]) <= cap:
            return  # other prefills took the room: a packing choice, not the step's least work
        self._target_unmet_logged = True
        logger.warning(
            "target_batch_time_ms=%g cannot be met: a step's least work, %d decodes and %d tokens "
            "of request %s's prefill (min_chunk_size %d, context %d), is predicted at %.1f ms per stage (%.1f ms "
            "without the prefill) against %.1f ms (target / spp %d); such steps run over the target (logged once)",
            self.config.target_batch_time_ms, len(entries), n, req.request_id,
            self.config.min_chunk_size, req.num_computed + n, 1e3 * self._cost(entries + [(req, req.num_computed, n)]),
            1e3 * self._cost(entries), 1e3 * cap, self.spp)

    def _schedule(self, req: Request, n: int, rows: StepRows, chunks: list[ScheduledChunk],
                  preempted: list[Request]) -> bool:
        """Grows `req`'s pages for `n` more tokens (preempting newer requests if needed; a prefill chunk shrinks to
        what the free pages hold when nobody is left to preempt, rather than leave them to newer requests) and adds
        its chunk."""
        while short := self.kv.short_ranks(req, req.num_computed + n):
            if req.status is not RequestStatus.RUNNING:
                return False  # a waiting request preempts nobody
            scheduled = {id(c.request) for c in chunks}
            victims = [r for r in self._below(req) if r.in_flight == 0 and id(r) not in scheduled
                       and short & set(r.kv_ranks)]
            if not victims:
                n = self._fits_in_free_pages(req, n - 1)
                if n == 0:
                    return False
                break
            self._preempt(victims[-1])
            preempted.append(victims[-1])
        ranks = self._ranks_of(req, n)
        if rows.room(ranks) < n:
            return False  # freeing the victims' pages changed which rank would join, and it has no room
        self.kv.grow(req, req.num_computed + n)
        rows.add(ranks, n)
        return self._add_chunk(req, n, chunks)

    def _below(self, req: Request) -> list[Request]:
        """The running requests `req` may preempt, the first to go last: those admitted after it, or under the
        priority policy those after it in (priority, arrival, admission) order (vLLM's victim: the largest)."""
        if self.config.scheduler_policy != "priority":
            return self.running[self.running.index(req) + 1:]
        order = {id(r): (r.priority, r.arrival_time, k) for k, r in enumerate(self.running)}
        return sorted((r for r in self.running if order[id(r)] > order[id(req)]), key=lambda r: order[id(r)])

    def _decodes_unseen(self, req: Request) -> bool:
        """`req`'s only sample in flight is a token already sampled on the device (its step launched, its result
        not collected): decode that token, unless it ends the request by length. (A token that turns out to be
        EOS or a stop token ends the request when it is seen; the decode then computed one token for nothing.)"""
        if not (req.num_unfetched == 1 and req.awaiting_sample == 1 and req.num_uncomputed == 0):
            return False
        if req.choices is not None or req.regex is not None:
            return False  # what its next row allows depends on that token
        max_len = self.max_model_len
        return len(req.output_token_ids) + 1 < req.params.max_tokens and (
            max_len is None or req.num_tokens + 1 < max_len)

    def _fits_in_last_page(self, req: Request) -> bool:
        """One more token of a single-rank request fits in the pages it holds, within its rank's span."""
        mt = self.kv.max_tokens_per_rank
        return (len(req.kv_ranks) == 1 and len(req.pages[0]) * self.kv.page_size > req.num_computed
                and (mt is None or req.num_computed < mt))

    def _add_chunk(self, req: Request, n: int, chunks: list[ScheduledChunk]) -> bool:
        # a chunk samples when it computes every token known (or the one sampled on the device, not yet seen)
        chunk = ScheduledChunk(req, req.num_computed, n, req.num_computed + n >= req.num_tokens)
        req.num_computed += n
        req.in_flight += 1
        req.awaiting_sample += chunk.sample
        chunks.append(chunk)
        return True

    def _admit(self, req: Request) -> None:
        self.kv.count_lookup(req, req.num_computed)
        self.kv.mark_pending(req)
        if req.num_preemptions == 0:
            req.num_cached_tokens = req.num_computed  # what it found cached (usage reports this)
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def _unplace(self, req: Request) -> None:
        """A request placed in this step but not admitted gives back the cached pages it took."""
        if req.status is RequestStatus.WAITING:
            self.kv.free(req)
            req.num_computed = 0

    def schedule(self, now: float | None = None) -> StepPlan:
        c, p = self.config, self.config.scheduler_policy
        now = self.clock() if now is None else now
        rows = StepRows(self.kv.num_ranks, c.max_num_batched_tokens)  # each rank's token budget
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []
        limit = self._limit()

        def entries():
            return [(ch.request, ch.start, ch.num_tokens) for ch in chunks]

        # 1. Decodes, in admission order (with async scheduling, also of a token sampled but not yet seen).
        for req in list(self.running):
            if req.status is RequestStatus.RUNNING and (not req.awaiting_sample and req.in_decode
                                                       or self._decodes_unseen(req)):
                if self._fits_in_last_page(req):  # the common decode: no page to find
                    if rows.room(req.kv_ranks) >= 1:
                        rows.add(req.kv_ranks, 1)
                        self._add_chunk(req, 1, chunks)
                elif rows.room(self._ranks_of(req, 1)) >= 1:
                    self._schedule(req, 1, rows, chunks, preempted)

        # 2. Prefill candidates: running ones with tokens to compute, then waiting ones that could be admitted.
        running = [r for r in self.running if r.status is RequestStatus.RUNNING and not r.awaiting_sample
                   and r.num_uncomputed > 0 and not r.in_decode]
        slots = c.max_num_seqs - self.num_seats_held
        waiting = []
        queue = sorted(self.waiting, key=lambda r: self._priority(r, now)) if p == "priority" else self.waiting
        for r in queue:
            if r in preempted or r.in_flight:
                if c.in_order:
                    break  # first come (or first in priority), first served: nobody overtakes a preempted request
                continue
            waiting.append(r)
        # Only as many waiting requests as there are free slots: one that cannot be admitted must not take the
        # most urgent prefill's place (FCFS and priority take them in order; the others by urgency below).
        if c.in_order:
            waiting = waiting[:max(slots, 0)]
        elif slots <= 0:
            waiting = []
        cands = sorted(running + waiting, key=lambda r: self._priority(r, now))

        # 3. Prefill-prefill batching: the prefills after the most urgent one get cost caps that leave it at
        #    least (1 - share) of the room after the decodes; then it takes the rest; then a work-conserving
        #    pass offers what is left to the others.
        floor = min(c.min_chunk_size, c.chunk_size) if self.target_s is not None else 1
        passes = [(r, limit) for r in cands]
        if not c.in_order and c.ppb_max_share > 0 and len(cands) > 1:
            base = self._cost(entries())
            weights = [1.0 / max(self.relative_slack(r, now), _MIN_SLACK) for r in cands]
            rest = sum(weights[1:])
            share = min(c.ppb_max_share, rest / (rest + weights[0]))
            caps, acc = [], 0.0
            for r, w in zip(cands[1:], weights[1:]):
                acc += w / rest
                caps.append((r, base + (limit - base) * share * acc))
            passes = caps + [(cands[0], limit)] + [(r, limit) for r in cands[1:]]

        closed = False  # an in-order policy's waiting request could not start: no waiting request after it does

        def not_now(req: Request) -> None:
            """`req` does not run in this step: gives back what placing it took; under FCFS or priority a waiting
            request that cannot start blocks the waiting ones after it (no overtaking)."""
            nonlocal closed
            closed |= c.in_order and req.status is RequestStatus.WAITING
            self._unplace(req)

        scheduled = {id(ch.request) for ch in chunks}
        primary = cands[0] if cands else None
        # the most urgent request, waiting, keeps a seat for its own pass: the capped passes of the others come first
        seat_kept = primary is not None and primary.status is RequestStatus.WAITING
        full: set[int] = set()  # ranks where not even one token of a fresh prompt fits under the limit
        for req, cap in passes:
            if req is primary:
                seat_kept = False
            if all(rows.room([r]) <= 0 for r in range(self.kv.num_ranks)) or len(full) == self.kv.num_ranks:
                break
            if id(req) in scheduled or req in preempted:
                continue  # one chunk per request per step; a victim is not re-admitted in the same step
            if req.status is RequestStatus.WAITING:
                if closed or self.num_seats_held + seat_kept >= c.max_num_seqs or (c.in_order and preempted):
                    continue
                req.num_computed = self.kv.place(req, rows)  # its cached prefix, if any
                if self.kv.waits_for_pending(req, req.num_computed):
                    self._unplace(req)
                    continue  # its next page is being computed by another request: take it cached later
            if req.kv_ranks[0] in full and req is not primary:
                not_now(req)
                continue  # a longer context only costs more
            # Only the most urgent prefill is sure to progress; the others fit under the cap or wait.
            # Before the most urgent prefill is placed, the others are costed with its smallest chunk in the step:
            # a step's cost is not a sum (the reference kernel runs every row over the longest context), so room
            # they take could otherwise leave it none.
            reserve = [(primary, primary.num_computed, min(floor, primary.num_uncomputed))] if (
                floor and req is not primary and id(primary) not in scheduled and primary.kv_ranks) else []
            n = self._fit(entries() + reserve, req, rows, cap, floor if req is primary else 0)
            if n <= 0:
                if cap == limit and req.num_computed == 0 and len(req.kv_ranks) == 1:
                    full.add(req.kv_ranks[0])
                not_now(req)
                continue
            if req.status is RequestStatus.WAITING:
                if not self.kv.can_grow(req, n):
                    logger.debug("request %s waits: not enough free KV pages (%d of %d in use)", req.request_id,
                                self.kv.num_used, self.kv.num_usable)
                    not_now(req)  # under FCFS or priority nobody waiting overtakes it
                    continue
                self._admit(req)
            if self._schedule(req, n, rows, chunks, preempted):
                scheduled.add(id(req))
        for ch in chunks:
            if ch.request.first_scheduled_time is None:
                ch.request.first_scheduled_time = now
        return StepPlan(chunks, preempted)
