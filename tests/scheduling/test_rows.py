"""The row layout of a step over KVP ranks (`mnemojax.scheduling.rows`): plain Python, no jax.

A shared chunk (its request's KV on several ranks) has the same rows on each rank holding it, and no row in
common with another shared chunk; a local chunk follows the last shared range its rank holds, so a rank that holds
no shared chunk uses those rows itself. The scheduler's budgets (`StepRows`) and the executor's arrays (`layout`)
follow the same rule.
"""
import random

import pytest

from mnemojax.scheduling.rows import StepRows, layout


def test_a_rank_not_holding_a_shared_request_starts_its_own_rows_at_zero():
    # long on ranks 0 and 1 (8 rows), short requests on 1, 2 and 3.
    starts, used = layout([([0, 1], 8), ([2], 5), ([1], 3), ([3], 8), ([2], 2)], 4)
    assert starts == [0, 0, 8, 0, 5]
    assert used == [8, 11, 7, 8]  # the old layout: every local row after the shared range, 8 + 8 = 16 rows


def test_shared_chunks_never_share_a_row():
    # a on ranks 0, 1; b on ranks 2, 3; c on ranks 1, 2: disjoint ranges in plan order.
    starts, used = layout([([0, 1], 4), ([2, 3], 6), ([1, 2], 2), ([0], 3), ([3], 1)], 4)
    assert starts[:3] == [0, 4, 10]
    assert starts[3:] == [4, 10]  # rank 0 holds a only; rank 3 holds b, which ends at 10
    assert used == [7, 12, 12, 11]


@pytest.mark.parametrize("seed", range(20))
def test_layout_is_exact_and_steprows_room_keeps_every_rank_within_budget(seed):
    """Random chunks added while `room` allows: on every rank the rows of its chunks never overlap, the rows of two
    shared chunks never overlap on any rank, and no rank needs more rows than the budget; `used` is exactly the
    end of each rank's last row."""
    rng = random.Random(seed)
    K, budget = rng.randint(2, 5), rng.randint(4, 40)
    rows, chunks = StepRows(K, budget), []
    for _ in range(rng.randint(1, 12)):
        ranks = rng.sample(range(K), rng.choice([1, 1, 2, min(3, K)]))
        room = rows.room(ranks)
        if room <= 0:
            continue
        n = rng.randint(1, room)
        rows.add(ranks, n)
        chunks.append((ranks, n))
    starts, used = layout(chunks, K)
    assert used == [rows.used(r) for r in range(K)]
    assert max(used) <= budget
    taken = [set() for _ in range(K)]
    shared_rows = set()
    for (ranks, n), s in zip(chunks, starts):
        span = set(range(s, s + n))
        if len(ranks) > 1:
            assert not span & shared_rows, "two shared chunks in one row"
            shared_rows |= span
        for r in ranks:
            assert not span & taken[r], f"rank {r} has two chunks in one row"
            taken[r] |= span
    for r in range(K):
        assert max(taken[r], default=-1) + 1 == used[r]


def test_room_of_a_shared_chunk_counts_the_local_rows_of_its_ranks():
    rows = StepRows(3, budget=16)
    rows.add([2], 10)
    assert rows.room([0, 1]) == 16 and rows.room([1, 2]) == 6 and rows.room([2]) == 6
    rows.add([0, 1], 6)
    assert [rows.used(r) for r in range(3)] == [6, 6, 10]
    assert rows.room([2]) == 6  # rank 2 does not pay for the shared rows it does not hold
    assert rows.room([1, 2]) == 0  # a new shared range starts after the first: rank 2 would need 6 + 6 + 10
