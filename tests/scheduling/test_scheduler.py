"""Scheduler: plain-Python unit tests (no jax, no model).

`Sim` drives the scheduler the way the engine does: `schedule()` (which marks the chunks' tokens computed and
in flight), then, when a micro-batch leaves the `spp`-stage pipeline (`mnemojax.scheduling.pipeline.Pipeline`, the
executor's), `update_from_output` with a fake sampled token for each chunk with `sample=True`: the same method
the engine calls, so these tests check the engine's update, not a copy of it. Aborts go through
`scheduler.finish(req, "abort")`. `Sim.schedule` asserts the invariants every plan must keep.
"""
import logging
import math
import random

import pytest

from mnemojax.scheduling.kv_manager import DUMMY_PAGE, KVCacheManager
from mnemojax.scheduling.pipeline import Pipeline
from mnemojax.scheduling.request import Request, RequestStatus
from mnemojax.scheduling.rows import layout
from mnemojax.scheduling.sampling_params import SamplingParams
from mnemojax.scheduling.scheduler import ChunkOutput, Scheduler, SchedulerConfig, StepPlan

FAKE_TOKEN = 7
EOS_TOKEN = 2  # the scheduler's end-of-sequence token in `Sim`
LOGGER = "mnemojax.scheduling.scheduler"


def make_request(rid, prompt_len, max_tokens=16, arrival=0.0, priority=0) -> Request:
    return Request(str(rid), list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=max_tokens),
                   arrival, seed=0, priority=priority)


def held(req: Request) -> int:
    return sum(len(p) for p in req.pages)


class Sim:
    """A scheduler, its KV pages, and a fake pipeline of `spp` stages standing in for the executor."""

    def __init__(self, *, budget=512, max_num_seqs=64, chunk_size=256, num_pages=1024, page_size=4, kvp=1,
                 max_tokens_per_rank=None, spp=1, policy="fcfs"):
        self.kv = KVCacheManager(kvp, num_pages, page_size, max_tokens_per_rank)
        self.sched = Scheduler(SchedulerConfig(budget, max_num_seqs, chunk_size, scheduler_policy=policy), self.kv,
                               eos_token_ids=[EOS_TOKEN])
        self.pipe: Pipeline[StepPlan] = Pipeline(spp)  # plans in flight
        self.zombies: list[Request] = []  # finished while in flight: their pages free when they drain
        self.num_preempted = 0

    def add(self, *reqs: Request) -> None:
        for r in reqs:
            self.sched.add(r)

    @property
    def busy(self) -> bool:
        return self.sched.num_unfinished > 0 or any(p.chunks for p in self.pipe)

    def finish(self, req: Request) -> None:
        """What the engine does when a request is aborted."""
        self.sched.finish(req, "abort")
        self.check_finished(req)
        self.check_pages()

    def check_finished(self, req: Request) -> None:
        assert req.is_finished and req not in self.sched.running and req not in self.sched.waiting
        if req.in_flight:
            assert held(req) or req.num_computed == 0  # still being written: not freed yet
            self.zombies.append(req)
        else:
            assert held(req) == 0

    def complete(self, plan, eos=None) -> list[Request]:
        """The executor takes `plan`; the micro-batch leaving the last stage comes back, with FAKE_TOKEN sampled
        (EOS_TOKEN where `eos(request)` says so, asked only when max_tokens is not reached anyway). Returns the
        requests it finished."""
        self.pipe.push(plan, lambda: StepPlan([], []))
        leaving = self.pipe.pop()
        outputs = []
        for c in leaving.chunks:
            r = c.request
            if c.sample and not r.is_finished:
                assert r.num_computed == r.num_tokens  # nothing else scheduled while its sample was out
                stop = eos is not None and len(r.output_token_ids) + 1 < r.params.max_tokens and eos(r)
                outputs.append(ChunkOutput(EOS_TOKEN if stop else FAKE_TOKEN))
            else:
                outputs.append(ChunkOutput())
        sampled = self.sched.update_from_output(leaving, outputs)
        for c in leaving.chunks:
            assert c.request.in_flight >= 0
        for r in [z for z in self.zombies if z.in_flight == 0]:
            assert held(r) == 0  # the last chunk in flight drained: pages back
            self.zombies.remove(r)
        done = [r for r in sampled if r.is_finished]
        for r in done:
            self.check_finished(r)
        self.check_pages()
        return done

    def step(self, eos=None):
        plan = self.schedule()
        return plan, self.complete(plan, eos)

    def run(self, max_steps=100_000, eos=None) -> int:
        steps = 0
        while self.busy:
            steps += 1
            assert steps < max_steps, "no progress: livelock?"
            self.step(eos)
        return steps

    # ------------------------------------------------------------------------------------- invariants
    def check_pages(self) -> None:
        """Held pages are disjoint per rank, never the dummy page, and exactly what each request needs."""
        kv = self.kv
        on_rank = [[] for _ in range(kv.num_ranks)]
        for r in self.sched.running + self.zombies:
            counts = kv.rank_tokens(r.num_computed)
            assert len(r.kv_ranks) == len(r.pages) == len(counts), (r.request_id, r.kv_ranks, counts)
            assert len(set(r.kv_ranks)) == len(r.kv_ranks), f"a rank holds two spans of {r.request_id}"
            for rank, pages, n in zip(r.kv_ranks, r.pages, counts):
                assert len(pages) == kv.ranks[rank].pages_for(n)
                on_rank[rank] += pages
        for rank, pages in enumerate(on_rank):
            assert len(pages) == len(set(pages)), f"a page of rank {rank} is held twice"
            assert DUMMY_PAGE not in pages
            assert all(1 <= p < kv.ranks[rank].num_pages for p in pages)
            assert kv.ranks[rank].num_used == len(pages)
        for r in self.sched.waiting:
            assert held(r) == 0 and r.num_computed == 0 and r.in_flight == 0
            assert r.status is RequestStatus.WAITING and not r.awaiting_sample

    def schedule(self):
        """`schedule()`, asserting every invariant of the plan against the state before it."""
        sched, kv, cfg = self.sched, self.kv, self.sched.config
        running_before, waiting_before = list(sched.running), list(sched.waiting)
        before = {r.request_id: (r.num_computed, r.in_flight, r.awaiting_sample, r.num_preemptions)
                  for r in running_before + waiting_before}

        plan = sched.schedule()

        ids = [c.request.request_id for c in plan.chunks]
        assert len(ids) == len(set(ids)), "a request appears twice in one step"
        assert len(sched.running) <= cfg.max_num_seqs
        assert len(plan.chunks) <= cfg.max_num_seqs
        # The executor's sequence slots: a request holds one while it runs or while a micro-batch still in the
        # pipeline reads its pages (finished or aborted meanwhile), and the plan's requests need one each.
        seats = {id(c.request) for mb in self.pipe for c in mb.chunks} | {id(r) for r in sched.running}
        seats |= {id(c.request) for c in plan.chunks}
        assert len(seats) <= cfg.max_num_seqs, f"{len(seats)} sequence slots needed, max_num_seqs {cfg.max_num_seqs}"

        # Each chunk: starts where the request's cache ended, within chunk_size, samples exactly at the end.
        rows = [0] * kv.num_ranks
        for c in plan.chunks:
            r = c.request
            computed, in_flight, awaiting, _ = before.get(r.request_id, (0, 0, False, 0))
            assert not awaiting, "scheduled while its sampled token is still in the pipeline"
            assert r.status is RequestStatus.RUNNING and r in sched.running
            assert c.start == computed and r.num_computed == c.start + c.num_tokens
            assert r.in_flight == in_flight + 1 and r.awaiting_sample == c.sample
            assert 1 <= c.num_tokens <= cfg.chunk_size
            assert c.start + c.num_tokens <= r.num_tokens
            assert c.sample == (c.start + c.num_tokens == r.num_tokens)
            assert r.kv_ranks == kv.ranks_for(r, c.start + c.num_tokens)  # its rows: on the ranks holding its KV
            for rank in r.kv_ranks:
                rows[rank] += 1
        # The token budget of each rank, in the rows the executor lays out (a request on several ranks has its
        # rows on each of them, and only there).
        _, used = layout(((c.request.kv_ranks, c.num_tokens) for c in plan.chunks), kv.num_ranks)
        assert max(used, default=0) <= cfg.max_num_batched_tokens, used
        assert plan.num_tokens <= cfg.max_num_batched_tokens * kv.num_ranks
        assert max(rows, default=0) <= cfg.max_num_seqs, rows
        scheduled = {c.request.request_id for c in plan.chunks}
        for r in sched.running:
            if r.request_id not in scheduled:
                computed, in_flight, awaiting, _ = before[r.request_id]
                assert (r.num_computed, r.in_flight, r.awaiting_sample) == (computed, in_flight, awaiting)

        # Preemption: only requests with nothing in flight, the last in the policy's order first (FCFS: the newest;
        # priority: the largest (priority, arrival, admission)); back to the front of the queue in that order's
        # reverse, without pages or cache, and not scheduled in this step.
        by_priority = cfg.scheduler_policy == "priority"
        rank = {id(r): (r.priority, r.arrival_time, i) if by_priority else i for i, r in enumerate(running_before)}
        survivors = [r for r in running_before if r not in plan.preempted]
        for v in plan.preempted:
            assert v in running_before and v.request_id not in scheduled and v not in sched.running
            assert before[v.request_id][1] == 0, "preempted a request with chunks in flight"
            assert v.num_preemptions == before[v.request_id][3] + 1
            assert v.num_computed == 0 and held(v) == 0 and v.status is RequestStatus.WAITING
            if kv.num_ranks == 1:  # (with several ranks, only requests on a rank short of pages are candidates)
                after = [s for s in survivors if rank[id(s)] > rank[id(v)]]
                # (decodes are committed first, so a later request already scheduled in this step is spared)
                assert all(before[s.request_id][1] > 0 or s.request_id in scheduled for s in after), \
                    "preempted a request while a later one (in the policy's order) with nothing in flight kept its pages"
        if kv.num_ranks == 1:  # the last first, so they are back in the queue in the policy's order
            keys = [rank[id(v)] for v in plan.preempted]
            assert keys == sorted(keys, reverse=True)
        for r in running_before + waiting_before:
            if r not in plan.preempted:
                assert r.num_preemptions == before[r.request_id][3]
        self.num_preempted += len(plan.preempted)

        # Decodes first, in admission order; then prefill chunks: FCFS takes the running requests' (in admission
        # order), then waiting ones in arrival order; priority takes both by (priority, arrival), running first
        # among equals, the waiting in that order.
        in_order = [r for r in survivors if r.request_id in scheduled]
        decodes = [r for r in in_order if r.output_token_ids and r.num_computed == r.num_tokens
                   and before[r.request_id][0] == r.num_tokens - 1]
        admitted = [c.request for c in plan.chunks if c.request not in running_before]
        queue = sorted(waiting_before, key=lambda r: (r.priority, r.arrival_time)) if by_priority else waiting_before
        assert admitted == queue[:len(admitted)]
        prefills = [r for r in in_order if r not in decodes] + admitted
        if by_priority:
            prefills.sort(key=lambda r: (r.priority, r.arrival_time))
        assert [c.request for c in plan.chunks] == decodes + prefills
        if plan.preempted and by_priority:  # a victim is overtaken only by requests before it in priority order
            assert all(rank[id(v)] > (a.priority, a.arrival_time, -1) for v in plan.preempted for a in admitted)
        elif plan.preempted:  # FCFS: a victim is not re-admitted in the step it was preempted, nor overtaken
            assert admitted == []
        assert sched.running == survivors + admitted
        assert list(sched.waiting) == plan.preempted[::-1] + [r for r in waiting_before if r not in admitted]

        self.check_pages()
        return plan


# ------------------------------------------------------------------------------------------------- basics
def test_config_rejects_non_positive():
    for kw in ({"max_num_batched_tokens": 0}, {"max_num_seqs": 0}, {"chunk_size": -1}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            SchedulerConfig(**kw)


@pytest.mark.parametrize("field, value", [
    ("ttft_slo_min_s", math.nan), ("ttft_slo_per_token_s", math.nan), ("ttft_slo_prefill_factor", math.nan),
    ("ttft_slo_min_s", math.inf), ("target_batch_time_ms", math.inf), ("target_batch_time_ms", math.nan)])
def test_config_rejects_nan_and_infinite_times(field, value):
    """Every deadline would be NaN (or inf), and the slack policies would sort on NaN."""
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: value})


def test_remaining_prefill_time_counts_the_outputs_a_preempted_request_recomputes():
    """The estimate was cached by (tokens computed, start, predictor version): a one-chunk request priced while
    waiting, then decoding and preempted, came back with the same key and kept its prompt-only estimate."""
    from mnemojax.scheduling.predictor import Predictor
    from models.config import preset

    pred = Predictor(preset("tiny"), "cpu", profile="cpu")
    cfg = SchedulerConfig(scheduler_policy="ilrs", chunk_size=256, max_num_batched_tokens=256)
    sched = Scheduler(cfg, KVCacheManager(1, 8, 16), pred, clock=lambda: 0.0)  # 7 usable pages of 16 tokens
    for i in range(2):
        sched.add(Request(str(i), [i + 1] * 16, SamplingParams(max_tokens=200, ignore_eos=True), 0.0, seed=i))
    for step in range(200):
        for r in sched.waiting:
            sched.remaining_prefill_time(r)  # as the ILRS priority does each step
        plan = sched.schedule(now=float(step))
        sched.update_from_output(plan, [ChunkOutput(token=7 if c.sample else None) for c in plan.chunks],
                                 now=float(step))
        if plan.preempted:
            break
    [victim] = plan.preempted
    assert victim.output_token_ids and victim.num_computed == 0
    want = pred.prefill_time(victim.num_tokens, cfg.chunk_size)  # prompt and outputs, from token 0
    assert want > pred.prefill_time(victim.num_prompt_tokens, cfg.chunk_size)
    assert sched.remaining_prefill_time(victim) == want


@pytest.mark.parametrize("policy", ["edf", "lrs", "ilrs"])
def test_ttft_deadline_of_zero_duration_is_rejected_and_one_just_above_schedules(policy):
    """Slack is measured in units of the deadline's duration, so both of its terms 0 is refused by name (it
    used to be accepted, then divided by zero in `schedule()`); a tiny positive duration still schedules."""
    with pytest.raises(ValueError, match="ttft_slo_min_s and ttft_slo_per_token_s"):
        SchedulerConfig(scheduler_policy=policy, ttft_slo_min_s=0.0, ttft_slo_per_token_s=0.0)
    kv = KVCacheManager(1, 64, 4)
    sched = Scheduler(SchedulerConfig(scheduler_policy=policy, ttft_slo_min_s=0.0, ttft_slo_per_token_s=1e-9), kv,
                      clock=lambda: 0.0)
    a, b = make_request("a", 8), make_request("b", 8)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert sorted((c.request.request_id, c.start, c.num_tokens) for c in plan.chunks) == [("a", 0, 8), ("b", 0, 8)]


def test_empty_scheduler_gives_empty_plan():
    sim = Sim()
    plan = sim.schedule()
    assert plan.is_empty and plan.num_tokens == 0 and plan.preempted == []
    assert sim.sched.num_unfinished == 0


def test_short_request_prefills_in_one_step_then_decodes_one_token_a_step():
    sim = Sim(page_size=4)
    req = make_request("a", 10, max_tokens=4)
    sim.add(req)
    assert sim.sched.num_unfinished == 1 and req.status is RequestStatus.WAITING
    plan, _ = sim.step()
    assert [(c.start, c.num_tokens, c.sample) for c in plan.chunks] == [(0, 10, True)]
    assert req.kv_ranks == [0] and len(req.pages[0]) == 3
    for i in range(3):
        plan, done = sim.step()
        assert [(c.start, c.num_tokens, c.sample) for c in plan.chunks] == [(10 + i, 1, True)]
    assert done == [req] and req.output_token_ids == [FAKE_TOKEN] * 4
    assert sim.sched.num_unfinished == 0 and sim.kv.num_used == 0
    assert sim.sched.schedule().is_empty


# ---------------------------------------------------------------------------------- budget and seq rows
def test_budget_never_exceeded_and_max_num_seqs_respected():
    sim = Sim(budget=100, max_num_seqs=3, chunk_size=64)
    reqs = [make_request(i, 50, max_tokens=3) for i in range(8)]
    sim.add(*reqs)
    plan, _ = sim.step()
    # 50 + 50 fill the budget; the third request does not get a row in this step.
    assert [(c.request, c.num_tokens) for c in plan.chunks] == [(reqs[0], 50), (reqs[1], 50)]
    plan, _ = sim.step()
    # Two decodes, then the third request takes what is left of the budget; a fourth has no row.
    assert [(c.request, c.num_tokens) for c in plan.chunks] == [(reqs[0], 1), (reqs[1], 1), (reqs[2], 50)]
    assert len(sim.sched.running) == 3 and list(sim.sched.waiting) == reqs[3:]
    while sim.busy:
        plan, _ = sim.step()
        assert 0 < plan.num_tokens <= 100 and len(plan.chunks) <= 3
    assert all(r.is_finished and len(r.output_token_ids) == 3 for r in reqs)


def test_budget_smaller_than_a_decode_batch_is_shared_in_admission_order():
    sim = Sim(budget=3, max_num_seqs=8, chunk_size=8)
    reqs = [make_request(i, 1, max_tokens=50) for i in range(5)]
    sim.add(*reqs)
    plan, _ = sim.step()
    assert [c.request for c in plan.chunks] == reqs[:3]
    plan, _ = sim.step()
    assert [c.request for c in plan.chunks] == reqs[:3]  # running first: the waiting ones get no budget
    assert list(sim.sched.waiting) == reqs[3:]


# ------------------------------------------------------------------------------------------ chunk sizes
@pytest.mark.parametrize("prompt_len, chunk_size", [(1000, 256), (1024, 256), (7, 3), (5, 1), (300, 512)])
def test_long_prompt_prefills_in_chunks_and_samples_only_at_the_last(prompt_len, chunk_size):
    sim = Sim(budget=4096, chunk_size=chunk_size, num_pages=512, page_size=4)
    req = make_request("long", prompt_len, max_tokens=3)
    sim.add(req)
    sizes, samples = [], []
    while req.num_computed < prompt_len:
        plan, _ = sim.step()
        (c,) = plan.chunks
        sizes.append(c.num_tokens)
        samples.append(c.sample)
    full, rest = divmod(prompt_len, chunk_size)
    assert sizes == [chunk_size] * full + ([rest] if rest else [])
    assert samples == [False] * (len(sizes) - 1) + [True]
    assert req.output_token_ids == [FAKE_TOKEN]
    plan, _ = sim.step()
    assert [(c.start, c.num_tokens, c.sample) for c in plan.chunks] == [(prompt_len, 1, True)]


def test_chunk_is_cut_by_the_remaining_budget():
    sim = Sim(budget=50, chunk_size=64)
    req = make_request("a", 120, max_tokens=1)
    sim.add(req)
    sizes = []
    while not req.is_finished:
        plan, _ = sim.step()
        sizes.append((plan.chunks[0].num_tokens, plan.chunks[0].sample))
    assert sizes == [(50, False), (50, False), (20, True)]


# ---------------------------------------------------------------------------------------------- FCFS
def test_waiting_requests_are_admitted_in_arrival_order():
    sim = Sim(budget=64, max_num_seqs=2, chunk_size=64)
    reqs = [make_request(i, 20, max_tokens=1, arrival=float(i)) for i in range(6)]
    sim.add(*reqs)
    first_scheduled = []
    while sim.busy:
        plan, _ = sim.step()
        first_scheduled += [c.request for c in plan.chunks if c.start == 0]
    assert first_scheduled == reqs


def test_decode_runs_every_step_next_to_a_long_prefill():
    """Mixed batch: a running request's decode token is in every step while a long prompt is prefilled."""
    sim = Sim(budget=65, chunk_size=64, num_pages=512)
    short = make_request("short", 5, max_tokens=100)
    long = make_request("long", 1000, max_tokens=2)
    sim.add(short)
    sim.step()  # short prefilled, has its first token
    sim.add(long)
    long_sizes = []
    while long.num_computed < 1000:
        plan, _ = sim.step()
        assert plan.chunks[0].request is short  # running first
        assert (plan.chunks[0].num_tokens, plan.chunks[0].sample) == (1, True)
        assert plan.chunks[1].request is long
        long_sizes.append(plan.chunks[1].num_tokens)
    assert long_sizes == [64] * 15 + [40]
    plan, _ = sim.step()
    assert [(c.request, c.num_tokens, c.sample) for c in plan.chunks] == [(short, 1, True), (long, 1, True)]


def test_new_prefill_does_not_take_the_budget_of_running_decodes():
    sim = Sim(budget=16, max_num_seqs=8, chunk_size=16)
    decoders = [make_request(i, 2, max_tokens=100) for i in range(4)]
    sim.add(*decoders)
    sim.step()
    big = make_request("big", 500, max_tokens=1)
    sim.add(big)
    for _ in range(5):
        plan, _ = sim.step()
        assert [c.request for c in plan.chunks] == decoders + [big]
        assert [c.num_tokens for c in plan.chunks] == [1, 1, 1, 1, 12]


# ----------------------------------------------------------------------------------------- preemption
def test_preempts_most_recent_then_recomputes(caplog):
    """page_size 4, 6 usable pages, chunk 4. A (4-token prompt) and B (12-token prompt) fill the pool; when A
    needs a third page, B (admitted last) is preempted by recompute and comes back afterwards."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    sim = Sim(budget=64, max_num_seqs=8, chunk_size=4, num_pages=7, page_size=4)
    a = make_request("A", 4, max_tokens=7)
    b = make_request("B", 12, max_tokens=5)
    sim.add(a, b)
    for _ in range(5):
        plan, _ = sim.step()
        assert plan.preempted == []
    assert (a.num_computed, held(a), b.num_computed, held(b)) == (8, 2, 14, 4)
    assert sim.kv.ranks[0].num_free == 0 and len(b.output_token_ids) == 3
    assert not any("preempted" in r.getMessage() for r in caplog.records)

    plan, _ = sim.step()  # A's 9th token needs a third page
    assert plan.preempted == [b]
    assert [(c.request, c.num_tokens) for c in plan.chunks] == [(a, 1)]
    assert b.status is RequestStatus.WAITING and held(b) == 0 and b.num_computed == 0
    assert b.num_preemptions == 1 and a.num_preemptions == 0
    assert list(sim.sched.waiting) == [b] and sim.sched.running == [a]
    assert len(b.output_token_ids) == 3  # generated tokens are kept and recomputed
    # B's first chunk would fit in the 3 free pages, but it is not re-admitted in the step it was preempted.
    assert sim.kv.ranks[0].num_free == 3 and sim.kv.ranks[0].can_grow([], 4)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "preempted" in r.getMessage()]
    assert len(warnings) == 1 and "B" in warnings[0].getMessage()

    plan, done = sim.step()  # B re-admitted; A's last token
    assert [(c.request, c.start, c.num_tokens, c.sample) for c in plan.chunks] == [(a, 9, 1, True),
                                                                                   (b, 0, 4, False)]
    assert done == [a]
    # B recomputes prompt + 3 generated tokens (15) in chunks; only the chunk reaching token 15 samples,
    # not the one that passes the end of the prompt.
    chunks = []
    while not b.is_finished:
        plan, _ = sim.step()
        chunks += [(c.start, c.num_tokens, c.sample) for c in plan.chunks]
    assert chunks == [(4, 4, False), (8, 4, False), (12, 3, True), (15, 1, True)]
    assert b.output_token_ids == [FAKE_TOKEN] * 5 and b.num_preemptions == 1
    assert sim.kv.num_used == 0 and sim.sched.num_unfinished == 0


def test_preemption_takes_the_newest_first_and_requeues_in_admission_order():
    """Three decoding requests fill the pool; the oldest needs a page: the newest goes first."""
    sim = Sim(budget=64, chunk_size=64, num_pages=4, page_size=4)  # 3 usable pages
    reqs = [make_request(i, 4, max_tokens=50) for i in range(3)]  # 1 page each after the prefill
    sim.add(*reqs)
    sim.step()
    assert sim.kv.ranks[0].num_free == 0
    plan, _ = sim.step()  # everyone needs a second page (token 5): req 0 preempts 2; req 1 has no newer
    # request left to preempt, so it waits with its cache rather than throwing it away
    assert plan.preempted == [reqs[2]]
    assert [c.request for c in plan.chunks] == [reqs[0]]
    assert list(sim.sched.waiting) == [reqs[2]]
    assert sim.sched.running == [reqs[0], reqs[1]]


def test_priority_preempts_the_lowest_priority_not_the_newest():
    """Under the priority policy (vLLM's victim): L (priority 2, a 12-token prompt in chunks of 4) runs; then H
    (priority 0) and M (priority 1) are admitted, M the newest, and the pool is full. When H's decode needs a page
    it preempts L, the lowest priority, where FCFS's rule (the newest request admitted after it) would take M.
    Prefill chunks go by priority too: H's and M's before L's."""
    sim = Sim(budget=64, chunk_size=4, num_pages=5, page_size=4, policy="priority")  # 4 usable pages
    low = make_request("L", 12, max_tokens=4, priority=2)
    sim.add(low)
    sim.step()
    high, mid = make_request("H", 4, max_tokens=4, arrival=1.0), make_request("M", 3, max_tokens=4, arrival=1.0,
                                                                              priority=1)
    sim.add(mid, high)
    plan, _ = sim.step()
    assert [c.request for c in plan.chunks] == [high, mid, low] and sim.kv.ranks[0].num_free == 0
    assert sim.sched.running == [low, high, mid]
    plan, _ = sim.step()  # H's 5th token needs a page
    assert plan.preempted == [low]
    assert [c.request for c in plan.chunks] == [high, mid]
    sim.run()
    assert [len(r.output_token_ids) for r in (low, high, mid)] == [4, 4, 4]


def test_priority_a_newer_request_of_higher_priority_preempts_an_older_one():
    """Two 3-token prompts, one page each of the 2 usable pages; the 5th token of each needs a second page. Under
    FCFS the older request preempts the newer one; under priority the older one, of a lower priority (a larger
    value), preempts nobody and waits, and the newer one then preempts it. Between equal priorities the later
    arrival goes, as under FCFS."""
    for policy in ("fcfs", "priority"):
        sim = Sim(budget=64, chunk_size=64, num_pages=3, page_size=4, policy=policy)
        old = make_request("old", 3, max_tokens=50, priority=1 if policy == "priority" else 0)
        new = make_request("new", 3, max_tokens=50, arrival=1.0)
        sim.add(old)
        sim.step()
        sim.add(new)
        sim.step()  # old's 4th token; new's prefill
        plan, _ = sim.step()  # old's 5th token needs a page
        if policy == "fcfs":
            assert plan.preempted == [new] and [c.request for c in plan.chunks] == [old]
            continue
        assert plan.preempted == [] and [c.request for c in plan.chunks] == [new]
        plan, _ = sim.step()  # new's 5th token needs a page
        assert plan.preempted == [old] and [c.request for c in plan.chunks] == [new]
    sim = Sim(budget=64, chunk_size=64, num_pages=3, page_size=4, policy="priority")
    first, second = make_request("first", 3, max_tokens=50), make_request("second", 3, max_tokens=50, arrival=1.0)
    sim.add(first, second)
    sim.step()
    sim.step()
    plan, _ = sim.step()
    assert plan.preempted == [second] and [c.request for c in plan.chunks] == [first]


def test_request_that_preempts_itself_is_not_scheduled():
    sim = Sim(budget=64, chunk_size=4, num_pages=5, page_size=4)  # 4 usable pages
    old = make_request("old", 4, max_tokens=9)
    new = make_request("new", 8, max_tokens=9)
    sim.add(old, new)
    while new.num_computed < 8:
        plan, _ = sim.step()
        assert plan.preempted == []
    # 'new' needs a third page for its 9th token but is the newest: it preempts itself.
    old_pages = list(old.pages[0])
    while not plan.preempted:
        plan, _ = sim.step()
    assert plan.preempted == [new]
    assert new not in [c.request for c in plan.chunks]
    assert old.pages[0][:len(old_pages)] == old_pages  # the older request keeps its cache
    sim.run()
    assert old.num_preemptions == 0 and new.num_preemptions >= 1
    assert len(old.output_token_ids) == len(new.output_token_ids) == 9


def test_a_prefill_without_victims_takes_the_free_pages_it_can_use():
    """page_size 4, 10 usable pages, chunk 16: D and R prefill 16 tokens each (8 pages). Then D takes a page for
    its last 4 prompt tokens and R, with nobody newer to preempt, needs 2 pages for its last 8: it computes the 4
    tokens the last free page holds rather than nothing (which left that page to a newer request, preempted for
    it a step later)."""
    sim = Sim(budget=64, max_num_seqs=8, chunk_size=16, num_pages=11, page_size=4)
    d = make_request("D", 20, max_tokens=12)
    r = make_request("R", 24, max_tokens=4)
    sim.add(d, r)
    sim.step()
    sim.add(make_request("W", 3, max_tokens=3, arrival=1.0))
    plan, _ = sim.step()
    assert [(c.request.request_id, c.start, c.num_tokens) for c in plan.chunks] == [("D", 16, 4), ("R", 16, 4)]
    assert plan.preempted == [] and sim.kv.ranks[0].num_free == 0
    assert [w.request_id for w in sim.sched.waiting] == ["W"]
    sim.run()
    assert sim.kv.num_used == 0


# ---------------------------------------------------------------------------------- waiting for pages
def test_request_without_pages_waits_and_is_admitted_when_pages_free(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    sim = Sim(budget=256, chunk_size=64, num_pages=9, page_size=4)  # 8 usable pages
    big = make_request("big", 28, max_tokens=4)  # 7 pages for the prompt, 8 by the end
    small = make_request("small", 8, max_tokens=1)  # 2 pages
    sim.add(big, small)
    for _ in range(3):
        plan, _ = sim.step()
        assert [c.request for c in plan.chunks] == [big]
        assert list(sim.sched.waiting) == [small] and small.status is RequestStatus.WAITING
    assert any("small waits" in r.getMessage() for r in caplog.records)
    plan, done = sim.step()
    assert done == [big] and list(sim.sched.waiting) == [small]
    plan, done = sim.step()
    assert [(c.request, c.num_tokens, c.sample) for c in plan.chunks] == [(small, 8, True)]
    assert done == [small] and small.num_preemptions == 0
    assert sim.kv.num_used == 0


def test_head_of_queue_blocks_later_requests_fcfs():
    """FCFS: a small request behind one that does not fit waits too (no overtaking)."""
    sim = Sim(budget=256, chunk_size=64, num_pages=9, page_size=4)
    hog = make_request("hog", 20, max_tokens=2)  # 5 pages, 6 by the end
    blocked = make_request("blocked", 16, max_tokens=1)  # 4 pages: does not fit next to hog
    tiny = make_request("tiny", 1, max_tokens=1)  # 1 page: would fit
    sim.add(hog, blocked, tiny)
    plan, _ = sim.step()
    assert [c.request for c in plan.chunks] == [hog]
    assert list(sim.sched.waiting) == [blocked, tiny]


def test_remove_aborts_waiting_and_running_requests():
    sim = Sim(budget=64, max_num_seqs=1, chunk_size=64)
    a, b, c = (make_request(x, 10) for x in "abc")
    sim.add(a, b, c)
    sim.step()
    assert sim.sched.running == [a] and held(a)
    sim.finish(b)  # aborted while waiting
    assert list(sim.sched.waiting) == [c]
    sim.finish(a)  # aborted while running: pages back
    assert sim.sched.running == [] and sim.kv.num_used == 0
    plan, _ = sim.step()
    assert [ch.request for ch in plan.chunks] == [c]


# -------------------------------------------------------------------------------- pipeline (spp > 1)
def test_pipeline_prefill_chunks_overlap_and_decode_waits_for_its_token():
    """spp = 3: chunk i+1 of a prompt enters the pipeline while chunk i is still in it; once the sampling
    chunk is in flight the request is not scheduled again until its token comes back (3 steps later)."""
    sim = Sim(budget=64, chunk_size=4, spp=3)
    req = make_request("a", 10, max_tokens=3)
    sim.add(req)
    timeline = []
    while sim.busy:
        plan, _ = sim.step()
        timeline.append([(c.start, c.num_tokens, c.sample) for c in plan.chunks])
    assert timeline == [[(0, 4, False)], [(4, 4, False)], [(8, 2, True)], [], [],
                        [(10, 1, True)], [], [],
                        [(11, 1, True)], [], []]
    assert req.output_token_ids == [FAKE_TOKEN] * 3 and sim.kv.num_used == 0


def test_requests_with_chunks_in_flight_are_not_preempted():
    """spp = 2, 3 usable pages. The newest request, B, has its sampling chunk in flight when the oldest, A,
    needs a page: B cannot be preempted, so A waits a step; when B's token is back, A preempts B."""
    sim = Sim(budget=64, chunk_size=4, num_pages=4, page_size=4, spp=2)
    a = make_request("A", 4, max_tokens=3)  # 1 page, needs a 2nd for token 5
    b = make_request("B", 8, max_tokens=2)  # 2 pages after its second chunk
    sim.add(a, b)
    plan, _ = sim.step()
    assert [(c.request, c.start, c.num_tokens, c.sample) for c in plan.chunks] == [(a, 0, 4, True),
                                                                                   (b, 0, 4, False)]
    plan, _ = sim.step()  # A awaits its token (it comes back at the end of this step); B [4, 8) samples
    assert [(c.request, c.start, c.num_tokens, c.sample) for c in plan.chunks] == [(b, 4, 4, True)]
    assert b.in_flight == 1 and held(a) + held(b) == 3 and sim.kv.ranks[0].num_free == 0
    plan, _ = sim.step()
    assert plan.preempted == [] and plan.chunks == []  # A waits: B is in flight
    assert b.status is RequestStatus.RUNNING and held(b) == 2 and held(a) == 1
    plan, _ = sim.step()
    assert plan.preempted == [b] and [c.request for c in plan.chunks] == [a]
    while sim.busy:
        plan, _ = sim.step()
        for v in plan.preempted:
            assert v.in_flight == 0
    assert len(a.output_token_ids) == 3 and len(b.output_token_ids) == 2


def test_abort_while_in_flight_frees_pages_when_the_chunk_drains():
    sim = Sim(budget=64, chunk_size=8, spp=3)
    req = make_request("a", 30, max_tokens=2)
    sim.add(req)
    sim.step()
    sim.step()
    assert req.in_flight == 2 and held(req) == 4
    sim.finish(req)  # aborted: its chunks are still being written, so the pages stay until they drain
    assert held(req) == 4 and sim.kv.num_used == 4
    sim.run()
    assert req.in_flight == 0 and held(req) == 0 and sim.kv.num_used == 0
    assert req.output_token_ids == []


def test_a_request_finished_in_flight_keeps_its_seat_until_it_drains():
    """spp = 2, max_num_seqs = 2: A and B run, C waits. A is aborted while its chunk is in the pipeline; that chunk
    still reads A's sequence slot on the device, so C is admitted only once it has drained, never into a third
    slot (the executor has max_num_seqs)."""
    sim = Sim(budget=64, chunk_size=4, max_num_seqs=2, spp=2)
    a, b, c = (make_request(r, 8, max_tokens=8) for r in "ABC")
    sim.add(a, b, c)
    sim.step()
    assert a.in_flight == 1 and sim.sched.running == [a, b] and list(sim.sched.waiting) == [c]
    sim.finish(a)
    assert sim.sched.num_seats_held == 2  # B runs; A's chunk is in flight
    plan, _ = sim.step()  # A's chunk leaves the pipeline at the end of this step
    assert c not in [ch.request for ch in plan.chunks] and c.status is RequestStatus.WAITING
    assert a.in_flight == 0 and held(a) == 0 and sim.sched.num_seats_held == 1
    plan, _ = sim.step()
    assert c in [ch.request for ch in plan.chunks]
    sim.run()
    assert len(b.output_token_ids) == len(c.output_token_ids) == 8 and sim.kv.num_used == 0


# ------------------------------------------------------------------------------------ KV parallelism
def test_kvp_requests_go_to_the_least_loaded_rank_and_budget_is_per_rank():
    sim = Sim(budget=10, chunk_size=10, num_pages=9, page_size=4, kvp=2)
    reqs = [make_request(i, 8, max_tokens=4) for i in range(4)]
    sim.add(*reqs)
    plan, _ = sim.step()
    # Rank 0 (a tie: the lowest), rank 1 (more free pages), rank 0 (a tie), rank 1 (more free pages); the
    # third and fourth get what is left of their rank's budget of 10.
    assert [r.kv_ranks for r in reqs] == [[0], [1], [0], [1]]
    assert [(c.request, c.num_tokens) for c in plan.chunks] == [(reqs[0], 8), (reqs[1], 8), (reqs[2], 2),
                                                                (reqs[3], 2)]
    assert plan.num_tokens == 20  # more than one rank's budget: each rank has its own


def test_kvp_long_request_onboards_the_next_rank_and_charges_both_ranks():
    sim = Sim(budget=16, chunk_size=16, num_pages=9, page_size=4, kvp=2, max_tokens_per_rank=16)
    long = make_request("long", 24, max_tokens=2)
    sim.add(long)
    plan, _ = sim.step()
    assert (plan.chunks[0].num_tokens, long.kv_ranks, [len(p) for p in long.pages]) == (16, [0], [4])
    plan, _ = sim.step()  # tokens 16..24 go to rank 1, which joins only now
    assert (plan.chunks[0].num_tokens, long.kv_ranks, [len(p) for p in long.pages]) == (8, [0, 1], [4, 2])
    short = make_request("short", 20, max_tokens=1)
    sim.add(short)
    plan, _ = sim.step()
    # long's decode row is on both ranks, so short (on rank 1, more free pages) gets 16 - 1 tokens, not 16.
    assert [(c.request, c.num_tokens) for c in plan.chunks] == [(long, 1), (short, 15)]
    assert short.kv_ranks == [1]
    sim.run()
    assert sim.kv.num_used == 0


def test_kvp_multi_rank_request_is_charged_only_to_the_ranks_holding_its_kv():
    """kvp = 3, a budget of 16 rows per rank. The long request's KV spans ranks 0 and 1; its 16-token chunk uses all
    of their rows. Rank 2 does not hold it: a short request there gets its whole 16-token prompt in the same step
    (charging the long chunk to every rank, as before, left rank 2 no room and deferred it). The predictor's
    shapes and the executor's rows say the same: rank 2 runs the short prompt alone, 16 rows, not 32."""
    sim = Sim(budget=16, chunk_size=16, num_pages=9, page_size=4, kvp=3, max_tokens_per_rank=16)
    long = make_request("long", 40, max_tokens=2)
    sim.add(long)
    sim.step()
    assert long.kv_ranks == [0]
    short = make_request("short", 16, max_tokens=2)
    sim.add(short)
    plan = sim.schedule()
    assert long.kv_ranks == [0, 1]  # rank 1 joined (a tie with rank 2: the lower index)
    assert [(c.request, c.num_tokens) for c in plan.chunks] == [(long, 16), (short, 16)]
    assert short.kv_ranks == [2]
    shapes = sim.sched.plan_shapes(plan)
    assert sorted((s.query_tokens, s.context_len, s.num_ranks) for shapes_r in shapes for s in shapes_r) == [
        (16, 16, 1), (16, 32, 2), (16, 32, 2)]  # the long chunk on ranks 0 and 1, the short prompt on rank 2
    assert layout([(c.request.kv_ranks, c.num_tokens) for c in plan.chunks], 3) == ([0, 0], [16, 16, 16])
    sim.complete(plan)
    sim.run()
    assert sim.kv.num_used == 0


def test_kvp_a_chunk_that_stays_on_its_rank_is_not_sized_by_the_rank_it_would_bring_in():
    """kvp = 2, 8 tokens per rank, a budget of 4 rows per rank. A decode holds a row of rank 0; a 12-token prompt
    starts on rank 1. Its largest chunk (12 tokens) would bring in rank 0 as well, which has 3 rows left: it was
    cut to 3 tokens (with a budget of 1: to none, rank 1 idle for 6 steps). A chunk that stays on rank 1 takes its
    4 rows."""
    sim = Sim(budget=4, chunk_size=16, num_pages=64, page_size=2, kvp=2, max_tokens_per_rank=8)
    decoder = make_request("decoder", 1, max_tokens=7)
    sim.add(decoder)
    sim.step()
    long = make_request("long", 12, max_tokens=2)
    sim.add(long)
    plan, _ = sim.step()
    assert [(c.request, c.start, c.num_tokens) for c in plan.chunks] == [(decoder, 1, 1), (long, 0, 4)]
    assert long.kv_ranks == [1]
    sim.run()
    assert sim.kv.num_used == 0


def test_kvp_preemption_only_takes_requests_on_the_rank_short_of_pages():
    """kvp = 2, 4 usable pages per rank. Rank 0 holds A and C, rank 1 holds D and B (admitted last). When C
    needs a page on the full rank 0, preempting B frees nothing there, and no request newer than C holds
    pages on rank 0: C waits; B, a decode with the pages it needs, keeps running."""
    sim = Sim(budget=64, chunk_size=64, num_pages=5, page_size=4, kvp=2)
    a = make_request("A", 4, max_tokens=12)  # rank 0: 1 page, 2 after step 2
    d = make_request("D", 8, max_tokens=8)   # rank 1: 2 pages, 3 after step 2
    c = make_request("C", 8, max_tokens=8)   # rank 0: 2 pages, needs a 3rd in step 2
    b = make_request("B", 2, max_tokens=14)  # rank 1: 1 page, enough for tokens 3 and 4
    sim.add(a, d, c, b)
    sim.step()
    assert [r.kv_ranks for r in (a, d, c, b)] == [[0], [1], [0], [1]]
    plan, _ = sim.step()
    assert plan.preempted == [], f"preempted {[r.request_id for r in plan.preempted]}"
    assert [ch.request for ch in plan.chunks] == [a, d, b]
    assert c.status is RequestStatus.RUNNING and held(c) == 2


@pytest.mark.parametrize("profile, seed", [("mixed", s) for s in range(20)] + [("kvp", s) for s in range(12)]
                         + [("priority", s) for s in range(10)])
def test_random_long_run_everyone_finishes(profile, seed):
    """Many requests arriving over time, random lengths, a small page pool, random early stops and aborts,
    random kvp/spp: every plan keeps the invariants, every request finishes, and the pools drain to 0.
    The "kvp" profile always splits long requests over ranks, under small per-rank budgets; "priority" is "mixed"
    under the priority policy, each request of a random priority."""
    rng = random.Random(seed)
    page_size = rng.choice([1, 2, 4, 8])
    num_pages = rng.randint(8, 24)
    if profile == "kvp":
        kvp, limit, budget = rng.choice([2, 3]), page_size * rng.randint(1, 4), rng.randint(1, 24)
    else:
        kvp, limit, budget = rng.choice([1, 2, 3]), None, rng.randint(1, 96)
        if kvp > 1 and rng.random() < 0.5:
            limit = page_size * rng.randint(2, num_pages - 1)
    sim = Sim(budget=budget, max_num_seqs=rng.randint(1, 12), chunk_size=rng.randint(1, 48),
              num_pages=num_pages, page_size=page_size, kvp=kvp, max_tokens_per_rank=limit,
              spp=rng.choice([1, 2, 3]), policy="priority" if profile == "priority" else "fcfs")
    cap = max(t for t in range(1, 2000) if sim.kv.capacity_error(t) is None)

    pending = []
    for i in range(60):
        max_tokens = rng.randint(1, max(1, min(20, cap // 3)))
        prompt_len = rng.randint(1, cap - max_tokens)  # prompt + max_tokens fits, as the engine checks
        pending.append(make_request(i, prompt_len, max_tokens=max_tokens,
                                    priority=rng.randint(-2, 2) if profile == "priority" else 0))
    all_reqs = list(pending)
    stopped, aborted = set(), set()

    def eos(r):  # an early stop, like EOS
        return rng.random() < 0.05

    steps = 0
    while pending or sim.busy:
        steps += 1
        assert steps < 20_000, "no progress: livelock?"
        while pending and rng.random() < 0.3:
            sim.add(pending.pop(0))
        if sim.sched.num_unfinished and rng.random() < 0.01:  # abort a random unfinished request
            victim = rng.choice(list(sim.sched.waiting) + sim.sched.running)
            sim.finish(victim)
            aborted.add(victim.request_id)
        _, done = sim.step(eos)
        for r in done:
            if len(r.output_token_ids) < r.params.max_tokens:
                stopped.add(r.request_id)

    assert sim.kv.num_used == 0 and not sim.zombies
    assert all(rank.num_free == rank.num_usable for rank in sim.kv.ranks)
    assert not sim.sched.running and not sim.sched.waiting
    for r in all_reqs:
        assert r.is_finished and held(r) == 0 and r.in_flight == 0
        if r.request_id not in stopped | aborted:
            assert len(r.output_token_ids) == r.params.max_tokens
            assert r.num_computed == r.num_tokens - 1  # the last sampled token is never computed


def test_random_runs_do_preempt():
    """The randomized runs are not vacuous: tight pools really make the scheduler preempt."""
    sim = Sim(budget=32, max_num_seqs=6, chunk_size=8, num_pages=13, page_size=2)
    rng = random.Random(0)
    reqs = [make_request(i, rng.randint(1, 12), max_tokens=rng.randint(4, 12)) for i in range(30)]
    sim.add(*reqs)
    sim.run()
    assert sim.num_preempted > 0
    assert sum(r.num_preemptions for r in reqs) == sim.num_preempted
    assert all(len(r.output_token_ids) == r.params.max_tokens for r in reqs)
    assert sim.kv.num_used == 0


# ---------------------------------------------------------------------------- the update half of a step
def _update_fixture(max_model_len=None, **params):
    """A scheduler (page_size 4, EOS token 2) and one 10-token request prefilled and sampled in one step."""
    kv = KVCacheManager(1, 64, 4)
    sched = Scheduler(SchedulerConfig(64, 8, 64), kv, clock=lambda: 99.0, max_model_len=max_model_len,
                      eos_token_ids=[EOS_TOKEN])
    req = Request("r", list(range(100, 110)), SamplingParams(**{"max_tokens": 16, **params}), 0.0, seed=0)
    sched.add(req)
    return sched, kv, req


def _decode(sched, req, token, now):
    """One step of `req` alone: schedule it, the token comes back; returns what update_from_output returned."""
    plan = sched.schedule(now=now)
    assert [c.request for c in plan.chunks] == [req] and plan.chunks[0].sample
    return sched.update_from_output(plan, [ChunkOutput(token)], now=now + 0.5)


def test_update_appends_stamps_and_stops_at_max_tokens_freeing_pages():
    sched, kv, req = _update_fixture(max_tokens=3)
    assert _decode(sched, req, 40, now=1.0) == [req]
    # The 10-token prompt and its first token: 3 pages of 4; nothing in flight, the next token may be scheduled.
    assert (req.output_token_ids, held(req), req.in_flight, req.awaiting_sample) == ([40], 3, 0, False)
    assert (req.first_scheduled_time, req.first_token_time, req.token_times) == (1.0, 1.5, [1.5])
    assert _decode(sched, req, 41, now=2.0) == [req] and not req.is_finished
    assert _decode(sched, req, 42, now=3.0) == [req]
    assert req.output_token_ids == [40, 41, 42] and req.token_times == [1.5, 2.5, 3.5]
    assert (req.status, req.finish_reason, req.stop_reason, req.finished_time) == \
        (RequestStatus.FINISHED, "length", None, 3.5)
    assert held(req) == 0 and kv.num_used == 0 and sched.num_unfinished == 0


def test_update_stops_at_max_model_len():
    sched, kv, req = _update_fixture(max_model_len=12)  # 10 prompt tokens: room for 2 generated
    _decode(sched, req, 40, now=1.0)
    assert not req.is_finished and req.num_tokens == 11
    _decode(sched, req, 41, now=2.0)
    assert (req.num_tokens, req.finish_reason, held(req), kv.num_used) == (12, "length", 0, 0)


@pytest.mark.parametrize("params, token, want", [
    ({}, EOS_TOKEN, ("stop", None)),  # EOS: stop, no stop reason
    ({"stop_token_ids": [55]}, 55, ("stop", 55)),  # a stop token id names itself
    ({"stop_token_ids": [EOS_TOKEN]}, EOS_TOKEN, ("stop", None)),  # EOS is checked first
    ({"ignore_eos": True, "stop_token_ids": [EOS_TOKEN]}, EOS_TOKEN, ("stop", EOS_TOKEN)),
    ({"ignore_eos": True}, EOS_TOKEN, None),  # generation goes on
    ({"max_tokens": 2, "stop_token_ids": [55]}, 55, ("stop", 55)),  # a stop token before the length limit
    # at the length limit, the limit names the reason (vLLM's `check_stop` checks it first)
    ({"max_tokens": 1, "stop_token_ids": [55]}, 55, ("length", None)),
    ({"max_tokens": 1}, EOS_TOKEN, ("length", None)),
    ({"max_tokens": 1}, 56, ("length", None)),
], ids=str)
def test_update_token_stops(params, token, want):
    sched, kv, req = _update_fixture(**params)
    _decode(sched, req, token, now=1.0)
    assert req.output_token_ids == [token]  # the stopping token is part of the output
    if want is None:
        assert not req.is_finished and req.finish_reason is None and held(req) == 3
    else:
        assert (req.finish_reason, req.stop_reason, req.finished_time) == (*want, 1.5)
        assert req.is_finished and held(req) == 0 and kv.num_used == 0 and not sched.running


def test_update_appends_log_probs_and_returns_sampled_requests_in_plan_order():
    kv = KVCacheManager(1, 64, 4)
    sched = Scheduler(SchedulerConfig(64, 8, 4), kv, clock=lambda: 5.0)
    a = Request("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=4, prompt_logprobs=1), 0.0, seed=0)
    b = Request("b", [7, 8], SamplingParams(max_tokens=4, logprobs=1), 0.0, seed=0)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule(now=0.0)  # a's first chunk of 4 (no sample), b's whole prompt (sample)
    assert [(c.request, c.num_tokens, c.sample) for c in plan.chunks] == [(a, 4, False), (b, 2, True)]
    scored = tuple({t: -0.5} for t in (2, 3, 4))  # a's chunk scores prompt tokens 1..3
    got = sched.update_from_output(plan, [ChunkOutput(prompt_logprobs=scored), ChunkOutput(9, {9: -0.1, 3: -2.0})])
    assert got == [b]
    assert a.prompt_logprobs == [None, {2: -0.5}, {3: -0.5}, {4: -0.5}] and a.output_token_ids == []
    assert b.output_token_ids == [9] and b.logprobs == [{9: -0.1, 3: -2.0}] and b.token_times == [5.0]
    with pytest.raises(ValueError, match="0 outputs for a plan of 2 chunks"):
        sched.update_from_output(sched.schedule(now=1.0), [])


def test_update_frees_a_request_aborted_in_flight_and_skips_its_token():
    sched, kv, req = _update_fixture()
    plan = sched.schedule(now=1.0)
    sched.finish(req, "abort", now=1.2)
    assert held(req) == 3  # its chunk is still being computed: the pages stay until it comes back
    assert sched.update_from_output(plan, [ChunkOutput(40)], now=2.0) == []
    assert req.output_token_ids == [] and held(req) == 0 and kv.num_used == 0
    assert (req.finish_reason, req.finished_time, req.in_flight) == ("abort", 1.2, 0)


def test_update_without_a_sampled_token_raises():
    sched, _, req = _update_fixture()
    plan = sched.schedule(now=1.0)
    with pytest.raises(ValueError, match="no sampled token for request r"):
        sched.update_from_output(plan, [ChunkOutput()])
    assert (req.in_flight, req.awaiting_sample) == (1, True)  # checked before anything changed
