"""PageManager and KVCacheManager: plain-Python unit tests (no jax, no model).

A pool hands out pages 1..num_pages-1 (page 0 is the reserved dummy page), keeps exact free/used counts, and
never gives one page to two holders. The cache manager keeps one pool per KVP rank and lays a request's KV
out as contiguous token ranges on distinct ranks, each chosen by load (pending prefill work, free pages) when the
request is placed or outgrows the rank before.
"""
import random

import pytest

from mnemojax.scheduling.kv_manager import DUMMY_PAGE, KVCacheManager, PageManager
from mnemojax.scheduling.request import Request
from mnemojax.scheduling.rows import StepRows
from mnemojax.scheduling.sampling_params import SamplingParams


def test_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_pages"):
        PageManager(1, 4)
    with pytest.raises(ValueError, match="page_size"):
        PageManager(8, 0)
    pm = PageManager(2, 1)  # the smallest pool: one usable page
    assert (pm.num_usable, pm.num_free, pm.num_used) == (1, 1, 0)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_page_zero_is_never_handed_out(page_size):
    pm = PageManager(9, page_size)
    held = []
    pm.grow(held, 8 * page_size)  # the whole pool
    assert DUMMY_PAGE not in held
    assert sorted(held) == list(range(1, 9))
    assert (pm.num_free, pm.num_used) == (0, 8)
    with pytest.raises(RuntimeError, match="out of KV pages"):
        pm.grow(held, 8 * page_size + 1)  # the dummy page is not a spare


@pytest.mark.parametrize("page_size, num_tokens, pages", [
    (4, 0, 0), (4, 1, 1), (4, 3, 1), (4, 4, 1), (4, 5, 2), (4, 8, 2), (4, 9, 3),
    (1, 0, 0), (1, 1, 1), (1, 7, 7),
    (16, 15, 1), (16, 16, 1), (16, 17, 2), (16, 1_000_000, 62_500), (16, 1_000_001, 62_501),
])
def test_pages_for_rounds_up(page_size, num_tokens, pages):
    assert PageManager(2, page_size).pages_for(num_tokens) == pages


def test_grow_and_free_accounting():
    pm = PageManager(11, 4)  # 10 usable pages
    a, b = [], []
    pm.grow(a, 5)  # 2 pages
    assert len(a) == 2 and (pm.num_free, pm.num_used) == (8, 2)
    pm.grow(a, 8)  # still 2 pages: growing to a size already held takes nothing
    assert len(a) == 2 and (pm.num_free, pm.num_used) == (8, 2)
    pm.grow(a, 3)  # a smaller target neither takes nor gives back pages
    assert len(a) == 2 and (pm.num_free, pm.num_used) == (8, 2)
    first_two = list(a)
    pm.grow(a, 9)  # one more, appended after the pages already held (token order)
    assert a[:2] == first_two and len(a) == 3 and (pm.num_free, pm.num_used) == (7, 3)
    pm.grow(b, 16)
    assert len(b) == 4 and (pm.num_free, pm.num_used) == (3, 7)
    assert not set(a) & set(b)

    pages_of_a = list(a)
    pm.free(a)
    assert a == []  # emptied in place
    assert (pm.num_free, pm.num_used) == (6, 4)
    pm.free(a)  # freeing the emptied list again is harmless
    assert (pm.num_free, pm.num_used) == (6, 4)

    # The freed pages are reusable: the pool can be filled again exactly.
    c = []
    pm.grow(c, 6 * 4)
    assert set(pages_of_a) <= set(c)
    assert (pm.num_free, pm.num_used) == (0, 10)
    assert sorted(b + c) == list(range(1, 11))
    pm.free(b)
    pm.free(c)
    assert (pm.num_free, pm.num_used) == (10, 0)


def test_grow_out_of_pages_raises_and_takes_nothing():
    pm = PageManager(5, 4)  # 4 usable pages
    a, b = [], []
    pm.grow(a, 9)  # 3 pages
    assert not pm.can_grow(b, 5)  # needs 2, 1 free
    with pytest.raises(RuntimeError, match="out of KV pages: need 2, 1 free"):
        pm.grow(b, 5)
    assert b == [] and (pm.num_free, pm.num_used) == (1, 3)  # no partial grow
    assert not pm.can_grow(a, 17)
    with pytest.raises(RuntimeError, match="out of KV pages"):
        pm.grow(a, 17)
    assert len(a) == 3 and (pm.num_free, pm.num_used) == (1, 3)
    assert pm.can_grow(a, 16)  # exactly the last page
    pm.grow(a, 16)
    assert (pm.num_free, pm.num_used) == (0, 4)
    assert pm.can_grow(a, 16) and pm.can_grow([], 0)  # needing nothing always fits


@pytest.mark.parametrize("seed", range(5))
def test_random_grow_free_never_shares_a_page(seed):
    """Random grow/free sequences: every page is held by at most one holder or is free, never both."""
    rng = random.Random(seed)
    num_pages, page_size = rng.randint(2, 40), rng.randint(1, 8)
    pm = PageManager(num_pages, page_size)
    holders: list[list[int]] = [[] for _ in range(rng.randint(1, 10))]
    tokens = [0] * len(holders)  # the size each holder last grew to
    for _ in range(400):
        h = rng.randrange(len(holders))
        if rng.random() < 0.25:
            pm.free(holders[h])
            assert holders[h] == []
            tokens[h] = 0
        else:
            target = tokens[h] + rng.randint(0, 3 * page_size)
            need = pm.pages_for(target) - len(holders[h])
            fits = need <= pm.num_free
            assert pm.can_grow(holders[h], target) == fits
            before = list(holders[h])
            if fits:
                pm.grow(holders[h], target)
                tokens[h] = target
                assert len(holders[h]) == pm.pages_for(target)
                assert holders[h][:len(before)] == before  # grows by appending
            else:
                with pytest.raises(RuntimeError):
                    pm.grow(holders[h], target)
                assert holders[h] == before
        held = [p for pages in holders for p in pages]
        assert len(held) == len(set(held)), "a page is held twice"
        assert DUMMY_PAGE not in held
        assert all(1 <= p < num_pages for p in held)
        assert pm.num_used == len(held)
        assert pm.num_free == pm.num_usable - len(held)
        # Free and held pages partition the usable pages: drain the pool into a spare holder and look.
        spare = []
        pm.grow(spare, pm.num_free * page_size)
        assert pm.num_free == 0
        assert sorted(spare + held) == list(range(1, num_pages))
        pm.free(spare)


# ---------------------------------------------------------------------------------------- KVCacheManager
def _req(rid="r") -> Request:
    return Request(str(rid), [1, 2, 3], SamplingParams(), 0.0, seed=0)


def _spans(req) -> list[int]:
    return [len(p) for p in req.pages]


def _prompt(rid, n, computed=0, outputs=0) -> Request:
    """A request with an `n`-token prompt, `outputs` tokens generated, `computed` of its tokens scheduled."""
    req = Request(str(rid), list(range(n)), SamplingParams(), 0.0, seed=0)
    req.output_token_ids = [7] * outputs
    req.num_computed = computed
    return req


def _hold(kv, req, num_tokens):
    kv.place(req)
    kv.grow(req, num_tokens)
    return req.kv_ranks


def test_cache_manager_rejects_bad_config():
    with pytest.raises(ValueError, match="kvp"):
        KVCacheManager(0, 8, 4)
    with pytest.raises(ValueError, match="multiple of page_size"):
        KVCacheManager(2, 8, 4, max_tokens_per_rank=6)
    with pytest.raises(ValueError, match="max_tokens_per_kvp_rank"):
        KVCacheManager(2, 8, 4, max_tokens_per_rank=0)


def test_cache_manager_counts_span_and_capacity():
    kv = KVCacheManager(3, 9, 4)  # 8 usable pages (32 tokens) per rank
    assert (kv.num_ranks, kv.num_usable, kv.num_used) == (3, 24, 0)
    assert kv.span() == 32
    assert kv.capacity_error(32) is None and kv.max_request_tokens() == 32
    assert "needs 9 KV pages" in kv.capacity_error(33)  # no limit: a request stays on one rank
    kv = KVCacheManager(3, 9, 4, max_tokens_per_rank=12)
    assert kv.span() == 12
    assert kv.capacity_error(36) is None and kv.max_request_tokens() == 36
    assert "exceeds" in kv.capacity_error(37)
    # a limit above a rank's pool is refused: the first rank would be filled to it, which it can never hold (a
    # request of 15 tokens was accepted, put on one rank of 8 tokens' pages, and waited forever)
    with pytest.raises(ValueError, match=r"max_tokens_per_kvp_rank \(40\) exceeds what one KVP rank's KV pages "
                                         r"hold: 8 tokens \(2 usable pages of 4\)"):
        KVCacheManager(2, 3, 4, max_tokens_per_rank=40)


@pytest.mark.parametrize("limit, num_tokens, counts", [
    (None, 0, [0]), (None, 1000, [1000]),
    (8, 0, [0]), (8, 1, [1]), (8, 8, [8]), (8, 9, [8, 1]), (8, 16, [8, 8]), (8, 20, [8, 8, 4]),
])
def test_rank_tokens_fills_each_rank_before_the_next(limit, num_tokens, counts):
    assert KVCacheManager(3, 9, 4, max_tokens_per_rank=limit).rank_tokens(num_tokens) == counts


def test_place_picks_the_rank_with_most_free_pages_lowest_on_ties():
    kv = KVCacheManager(3, 9, 4)
    a, b, c, d = (_req(x) for x in "abcd")
    kv.place(a)
    assert (a.kv_ranks, a.pages) == ([0], [[]])
    kv.grow(a, 8)  # rank 0: 2 pages
    kv.place(b)
    assert b.kv_ranks == [1]
    kv.grow(b, 12)  # rank 1: 3 pages
    kv.place(c)
    assert c.kv_ranks == [2]
    kv.grow(c, 4)  # rank 2: 1 page
    kv.place(d)
    assert d.kv_ranks == [2]
    assert [r.num_used for r in kv.ranks] == [2, 3, 1] and kv.num_used == 6


def test_grow_onboards_the_next_rank_only_when_the_previous_is_full():
    kv = KVCacheManager(3, 9, 4, max_tokens_per_rank=8)
    filler = _req("filler")
    kv.place(filler)
    kv.grow(filler, 8)  # rank 0
    req = _req()
    kv.place(req)  # rank 1 (a tie with rank 2)
    kv.grow(req, 5)
    assert (req.kv_ranks, _spans(req)) == ([1], [2])
    kv.grow(req, 8)
    assert (req.kv_ranks, _spans(req)) == ([1], [2])  # full, but the next rank joins only when needed
    kv.grow(req, 9)  # rank 2: rank 0 holds filler's uncomputed prompt (pending prefill work)
    assert (req.kv_ranks, _spans(req)) == ([1, 2], [2, 1])
    kv.grow(req, 17)  # the one rank left
    assert (req.kv_ranks, _spans(req)) == ([1, 2, 0], [2, 2, 1])
    assert [r.num_used for r in kv.ranks] == [3, 2, 2]
    kv.free(req)
    assert (req.kv_ranks, req.pages) == ([], [])
    assert [r.num_used for r in kv.ranks] == [2, 0, 0]


def test_first_rank_by_free_pages_and_pending_prefill_work():
    """Medha's placement: among the ranks with free pages for the prompt, the one with the least pending prefill
    work (prompt tokens still to compute of the requests it holds), then the most free pages. The old rule (most
    free pages) would pick rank 0, which holds a long prompt still prefilling."""
    kv = KVCacheManager(3, 9, 4)  # 8 usable pages per rank
    long = _prompt("long", 40, computed=8)
    assert _hold(kv, long, 8) == [0]  # 6 pages free, 32 tokens of prefill pending
    decode = _prompt("decode", 20, computed=23, outputs=4)  # decoding: no prefill pending
    assert _hold(kv, decode, 24) == [1]  # the least pending work (0, a tie with rank 2), lowest index
    short = _prompt("short", 12, computed=12, outputs=1)
    assert _hold(kv, short, 12) == [2]  # no pending work on 1 or 2; rank 2 has more free pages
    assert [r.num_free for r in kv.ranks] == [6, 2, 5]
    assert [kv.pending_prefill(r) for r in range(3)] == [32, 0, 0]

    kv.place(x := _prompt("x", 8))
    assert x.kv_ranks == [2]  # no pending prefill; of ranks 1 and 2, the most free pages
    assert [kv.pending_prefill(r) for r in range(3)] == [32, 0, 8]  # x's prompt is pending on rank 2 now
    kv.place(y := _prompt("y", 8))
    assert y.kv_ranks == [1]  # rank 2 has x's 8 tokens pending now
    kv.place(z := _prompt("z", 24))
    assert z.kv_ranks == [0]  # 6 pages: only rank 0 has room for its prompt, whatever its pending work
    for r in (x, y, z):
        kv.free(r)

    long.num_computed = 40  # the long prompt is scheduled: rank 0's pending work is gone
    kv.place(w := _prompt("w", 8))
    assert w.kv_ranks == [0]  # no pending work anywhere: the most free pages


def test_first_rank_counts_the_rows_of_the_step_being_planned():
    """Tokens a step already schedules on a rank count as pending work there, and a rank with no room left in the
    step is passed over, so a new request can start in this step."""
    kv = KVCacheManager(2, 9, 4)
    rows = StepRows(2, budget=16)
    rows.add([0], 16)  # rank 0's rows are used up
    kv.place(a := _prompt("a", 8), rows)
    assert a.kv_ranks == [1]  # without the step, rank 0 (a tie, the lowest index)
    assert kv.pending_prefill(1) == 8
    kv.place(b := _prompt("b", 4))
    assert b.kv_ranks == [0]  # no pending work on rank 0
    kv.free(b)
    rows = StepRows(2, budget=16)
    rows.add([0], 12)
    kv.place(b, rows)
    assert b.kv_ranks == [1]  # 12 rows scheduled on rank 0 in this step weigh more than a's 8 pending tokens


def test_later_ranks_join_by_load_not_in_cycle_order():
    """A request outgrowing its rank onboards the least loaded rank it is not on: rank 2 (idle), not rank 1
    (the next in cycle order, busy prefilling); then the only rank left. A rank without free pages for the tokens
    the request keeps there is passed over. `ranks_for` says which ranks `grow` will take, reading only."""
    kv = KVCacheManager(3, 9, 4, max_tokens_per_rank=8)
    long = _prompt("long", 24)
    assert _hold(kv, long, 8) == [0]
    busy = _prompt("busy", 8, computed=4)
    assert _hold(kv, busy, 4) == [1]  # 4 tokens of prefill pending on rank 1
    before = [r.num_free for r in kv.ranks]
    assert kv.ranks_for(long, 8) == [0]
    assert kv.ranks_for(long, 12) == [0, 2] and kv.ranks_for(long, 24) == [0, 2, 1]
    assert [r.num_free for r in kv.ranks] == before and long.kv_ranks == [0]  # read only
    kv.grow(long, 12)
    assert (long.kv_ranks, _spans(long)) == ([0, 2], [2, 1])
    kv.grow(long, 20)
    assert (long.kv_ranks, _spans(long)) == ([0, 2, 1], [2, 2, 1])
    kv.free(long)


    # Memory first: rank 1 has nothing pending but 1 free page, short of the 2 the second span needs; rank 2 has
    # them.
    kv = KVCacheManager(3, 4, 4, max_tokens_per_rank=8)  # 3 usable pages per rank
    long = _prompt("long", 16)
    assert _hold(kv, long, 8) == [0]
    assert _hold(kv, _prompt("hog", 8, computed=8), 8) == [1]  # 2 of rank 1's 3 pages, nothing pending
    assert _hold(kv, _prompt("busy", 8, computed=4), 4) == [2]  # (its prompt needs 2 pages: rank 1 has 1)
    assert kv.pending_prefill(1) == 0 < kv.pending_prefill(2) == 4
    kv.grow(long, 16)
    assert long.kv_ranks == [0, 2]


def test_cache_grow_out_of_pages_raises_and_takes_nothing_on_any_rank():
    kv = KVCacheManager(2, 3, 4, max_tokens_per_rank=8)  # 2 usable pages per rank
    hog = _req("hog")
    kv.place(hog)
    kv.grow(hog, 4)  # rank 0: 1 page
    kv.place(hog2 := _req("hog2"))  # rank 1
    kv.grow(hog2, 8)  # rank 1 full
    req = _req()
    kv.place(req)  # rank 0, 1 page free
    assert req.kv_ranks == [0]
    assert kv.can_grow(req, 4) and not kv.can_grow(req, 5)
    assert not kv.can_grow(req, 12)  # rank 0 would do, rank 1 (onboarded at token 9) is full
    with pytest.raises(RuntimeError, match="out of KV pages"):
        kv.grow(req, 12)
    assert (req.kv_ranks, req.pages) == ([0], [[]]) and [r.num_used for r in kv.ranks] == [1, 2]
    kv.free(hog2)
    assert kv.can_grow(req, 12) is False  # rank 0 needs 2 pages for tokens 0..8, has 1
    kv.free(hog)
    kv.grow(req, 12)
    assert (req.kv_ranks, _spans(req)) == ([0, 1], [2, 1])


@pytest.mark.parametrize("num_ranks, limit", [(1, 8), (2, 8), (3, 4), (1, None), (3, None)])
def test_a_request_that_fits_holds_at_most_one_span_per_rank(num_ranks, limit):
    """Every request that `capacity_error` admits can be laid out with at most one contiguous range per rank
    (the executor gives a request one sequence row, and one page table, per rank). With one rank, the
    docstring says, a request stays on its first rank."""
    kv = KVCacheManager(num_ranks, 9, 4, max_tokens_per_rank=limit)  # 8 usable pages per rank
    n = 1
    while kv.capacity_error(n) is None:
        req = _req(n)
        kv.place(req)
        kv.grow(req, n)
        assert len(set(req.kv_ranks)) == len(req.kv_ranks), (n, req.kv_ranks)
        kv.free(req)
        n += 1
    assert n > 1


@pytest.mark.parametrize("seed", range(8))
def test_cache_random_grow_free_keeps_ranks_disjoint(seed):
    """Random requests grow and free over several ranks: per rank, no page is held twice or is the dummy
    page, counts add up, and each request's spans are on distinct ranks with exactly the pages they need."""
    rng = random.Random(seed)
    num_ranks, page_size = rng.randint(2, 4), rng.choice([1, 2, 4])
    num_pages = rng.randint(4, 20)
    limit = rng.choice([None, page_size * rng.randint(1, num_pages - 1)])
    kv = KVCacheManager(num_ranks, num_pages, page_size, max_tokens_per_rank=limit)
    reqs = [_req(i) for i in range(rng.randint(1, 8))]
    tokens = {r.request_id: 0 for r in reqs}
    for _ in range(300):
        r = rng.choice(reqs)
        if rng.random() < 0.2 or (not r.kv_ranks and rng.random() < 0.5):
            kv.free(r)
            tokens[r.request_id] = 0
            if rng.random() < 0.7:
                kv.place(r)
        elif r.kv_ranks:
            target = tokens[r.request_id] + rng.randint(0, 3 * page_size)
            if kv.capacity_error(target) is not None:
                continue
            if kv.can_grow(r, target):
                kv.grow(r, target)
                tokens[r.request_id] = target
            else:
                before = (list(r.kv_ranks), [list(p) for p in r.pages], kv.num_used)
                with pytest.raises(RuntimeError):
                    kv.grow(r, target)
                assert (r.kv_ranks, r.pages, kv.num_used) == before
        on_rank = [[] for _ in range(num_ranks)]
        for q in reqs:
            if not q.kv_ranks:
                assert q.pages == []
                continue
            counts = kv.rank_tokens(tokens[q.request_id])
            assert len(q.kv_ranks) == len(q.pages) == len(counts)
            assert len(set(q.kv_ranks)) == len(q.kv_ranks)  # one span per rank
            for rank, pages, n in zip(q.kv_ranks, q.pages, counts):
                assert len(pages) == kv.ranks[rank].pages_for(n)
                on_rank[rank] += pages
        for rank, pages in enumerate(on_rank):
            assert len(pages) == len(set(pages)) and DUMMY_PAGE not in pages
            assert kv.ranks[rank].num_used == len(pages)
        assert kv.num_used == sum(map(len, on_rank))
    for q in reqs:
        kv.free(q)
    assert kv.num_used == 0
