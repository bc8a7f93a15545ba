"""Prefix caching in the page manager and the scheduler (plain Python, no model).

The workload test keeps a fake KV memory: every scheduled token writes, at its (rank, page, slot), a value that
stands for its K/V (its position and every token up to it, which is what K/V at a position depends on); every
chunk then checks that each earlier position of its request reads the value its own tokens imply. A cached page
reused at the wrong place, rank or content, or overwritten while shared, fails that check.
"""
import random
import zlib

import pytest

from mnemojax.scheduling.kv_manager import KVCacheManager, PageManager
from mnemojax.scheduling.pipeline import Pipeline
from mnemojax.scheduling.request import Request
from mnemojax.scheduling.sampling_params import SamplingParams
from mnemojax.scheduling.scheduler import ChunkOutput, Scheduler, SchedulerConfig, StepPlan


def test_page_manager_shares_counts_and_evicts_least_recently_released():
    pm = PageManager(7, 4)  # 6 usable pages
    a = []
    pm.grow(a, 12)  # pages 1, 2, 3
    for i, p in enumerate(a):
        pm.register(p, b"h%d" % i)
    pm.acquire(a[0])  # a second request holds the first page
    b = [a[0]]
    pm.free(a)
    assert (pm.num_free, pm.num_used, pm.num_cached) == (5, 1, 3)  # pages 2, 3 cached and free; 1 held
    assert pm.lookup(b"h0") == 1 and pm.lookup(b"h2") == 3
    c = []
    pm.grow(c, 16)  # three never-used pages, then the least recently released cached page: 3 (released first)
    assert c == [4, 5, 6, 3] and pm.lookup(b"h2") is None and pm.lookup(b"h1") == 2 and pm.num_evictions == 1
    with pytest.raises(RuntimeError, match="out of KV pages"):
        pm.grow(c, 24)  # page 1 is held: never evicted
    pm.register(2, b"h0")  # a second page with the same tokens is not cached twice
    assert pm.lookup(b"h0") == 1
    pm.free(b)
    pm.free(c)
    assert pm.reset_cache() == 2 and pm.num_cached == 0 and (pm.num_free, pm.num_used) == (6, 0)
    assert pm.lookup(b"h0") is None


def _req(rid, tokens, max_tokens=4, **kw):
    return Request(str(rid), list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw), 0.0, 0)


def test_match_takes_full_pages_and_never_the_last_token():
    kv = KVCacheManager(1, 64, 4, prefix_caching=True)
    first = _req(0, range(12))
    kv.place(first)
    kv.grow(first, 12)
    kv.cache_computed(first, 11)  # two full pages written
    assert kv.num_cached_tokens(_req(1, range(20))) == 8
    kv.cache_computed(first, 12)
    assert kv.num_cached_tokens(_req(1, range(20))) == 12
    assert kv.num_cached_tokens(_req(1, range(12))) == 8  # 12 tokens: the last is computed, so page 3 is not
    assert kv.num_cached_tokens(_req(1, [0, 1, 2, 9] + list(range(4, 20)))) == 0  # differs in page 1
    assert kv.num_cached_tokens(_req(1, list(range(6)) + [99] * 10)) == 4  # differs mid page 2
    assert kv.num_cached_tokens(_req(1, range(20), prompt_logprobs=0)) == 0  # needs every position's logits
    second = _req(1, list(range(8)) + [5] * 8)
    assert kv.place(second) == 8 and second.pages == [first.pages[0][:2]]
    kv.free(first)
    kv.free(second)
    assert kv.num_used == 0


def _tok_value(req, pos):
    return pos, tuple(req.token_at(i) for i in range(pos + 1))


class Driver:
    """The engine loop over a fake pipeline, checking every chunk against the fake KV memory."""

    def __init__(self, kv, config, spp):
        self.kv = kv
        self.sched = Scheduler(config, kv, spp=spp)
        self.pipe: Pipeline[StepPlan] = Pipeline(spp)
        self.mem: dict[tuple[int, int, int], tuple] = {}

    def _at(self, req, pos):
        mt, S = self.kv.max_tokens_per_rank, self.kv.page_size
        i, local = (pos // mt, pos % mt) if mt else (0, pos)
        return req.kv_ranks[i], req.pages[i][local // S], local % S

    def step(self, rng, abort_p):
        plan = self.sched.schedule()
        for ch in plan.chunks:
            req = ch.request
            for pos in range(ch.start):  # what the chunk attends to was written for exactly these tokens
                assert self.mem.get(self._at(req, pos)) == _tok_value(req, pos), (req.request_id, pos)
            for pos in range(ch.start, ch.start + ch.num_tokens):
                self.mem[self._at(req, pos)] = _tok_value(req, pos)
        self.pipe.push(plan, lambda: StepPlan([], []))
        leaving = self.pipe.pop()
        outs = [ChunkOutput(rng.randrange(50) if c.sample else None) for c in leaving.chunks]
        self.sched.update_from_output(leaving, outs)
        if self.sched.running and rng.random() < abort_p:
            victim = rng.choice(self.sched.running)
            self.sched.finish(victim, "abort")


@pytest.mark.parametrize("policy,kvp,mt,spp,num_pages", [
    ("fcfs", 1, None, 1, 40), ("ilrs", 1, None, 2, 40), ("edf", 3, 16, 1, 30), ("lrs", 3, 16, 2, 24),
    ("ilrs", 1, None, 1, 400)])
def test_workload_reads_only_what_its_own_tokens_wrote(policy, kvp, mt, spp, num_pages):
    rng = random.Random(zlib.crc32(repr((policy, kvp, mt, spp, num_pages)).encode()))  # not hash(): per process
    kv = KVCacheManager(kvp, num_pages, 4, mt, prefix_caching=True)
    d = Driver(kv, SchedulerConfig(64, 6, 16, policy), spp)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(5, 40))] for _ in range(3)]
    reqs = []
    for i in range(60):
        tokens = rng.choice(prefixes)[:rng.randrange(1, 40)] + [rng.randrange(50) for _ in range(rng.randrange(0, 9))]
        if not tokens:
            tokens = [1]
        max_tokens = rng.randrange(1, 8)
        while kv.capacity_error(len(tokens) + max_tokens):  # what the engine's validation refuses
            tokens.pop()
        reqs.append(_req(i, tokens, max_tokens=max_tokens))
    pending = list(reqs)
    steps = 0
    while pending or d.sched.num_unfinished or any(p.chunks for p in d.pipe):
        steps += 1
        assert steps < 20_000
        if pending and rng.random() < 0.5:
            d.sched.add(pending.pop(0))
        d.step(rng, abort_p=0.02)
    assert kv.num_used == 0 and all(not r._refs for r in kv.ranks)
    assert kv.prefix_hits > 0
    assert sum(r.num_cached_tokens or 0 for r in reqs) > 0


def test_cached_tokens_make_a_long_prompt_short_for_deadlines_and_priority():
    kv = KVCacheManager(1, 1000, 4, prefix_caching=True)
    config = SchedulerConfig(scheduler_policy="ilrs", ttft_slo_min_s=0.0, ttft_slo_per_token_s=1e-3)
    sched = Scheduler(config, kv, clock=lambda: 0.0)
    long = _req(0, range(1000), max_tokens=1)
    sched.add(long)
    while sched.num_unfinished:
        plan = sched.schedule()
        sched.update_from_output(plan, [ChunkOutput(1 if c.sample else None) for c in plan.chunks])
    follow_up, fresh = _req(1, list(range(1000)) + [7] * 8), _req(2, range(2000, 2100))
    sched.add(follow_up)
    sched.add(fresh)
    assert follow_up.num_cached_tokens == 1000 and fresh.num_cached_tokens == 0
    assert follow_up.deadline_duration == pytest.approx(8e-3) and fresh.deadline_duration == pytest.approx(0.1)
    assert sched.remaining_prefill_time(follow_up) < sched.remaining_prefill_time(fresh)
    plan = sched.schedule()
    assert ("1", 1000, 8) in [(c.request.request_id, c.start, c.num_tokens) for c in plan.chunks]
