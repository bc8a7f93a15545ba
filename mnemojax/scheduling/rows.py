"""Where a step's query tokens sit in the rows of each KVP rank: the one rule the scheduler's token budgets and
the executor's arrays share. Plain Python, no jax.

A chunk of a request whose KV lives on one rank (a *local* chunk) has rows on that rank only. A chunk of a request
whose KV spans several ranks (a *shared* chunk) has the same rows on each rank holding its KV, where every one of
them computes attention over its own KV; the step's KVP merge (`shardings.collectives.kvp_merge`) combines a row
over the ranks where it is marked shared, and every other rank keeps its own result for that row. So:

- shared chunks take consecutive, disjoint row ranges from row 0, in plan order: two shared chunks never have a
  row in common on any rank (their rows would be merged together);
- on each rank, its local chunks follow, in plan order, the end of the last shared range that rank holds. A rank
  holding no shared chunk starts its local chunks at row 0: the rows of shared chunks it does not hold are its
  own to use (it marks them unshared, so it adds weight 0 to their merge and keeps its own result).

A rank pays the rows of its shared ranges, of its local chunks, and of the shared ranges laid before its last one
that it does not hold (with one request spanning ranks at a time, none).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence


class StepRows:
    """The rows used on each rank by the chunks added so far, each chunk as (the ranks holding its request's KV,
    its tokens); `room` says how many tokens a chunk may add within `budget` rows per rank."""

    def __init__(self, num_ranks: int, budget: int = 0):
        self.budget = budget
        self.shared_end = 0  # rows taken by the shared chunks
        self.shared_upto = [0] * num_ranks  # per rank: end of the last shared range it holds
        self.local = [0] * num_ranks  # per rank: rows of its local chunks

    def used(self, rank: int) -> int:
        """Rows `rank` needs: up to the end of its last shared range, then its local chunks."""
        return self.shared_upto[rank] + self.local[rank]

    def room(self, ranks: Sequence[int]) -> int:
        """Most tokens a chunk held by `ranks` can add with every rank staying within the budget."""
        if len(ranks) == 1:
            return self.budget - self.used(ranks[0])
        return min(self.budget - self.shared_end - self.local[r] for r in ranks)

    def add(self, ranks: Sequence[int], n: int) -> int:
        """Adds a chunk of `n` tokens held by `ranks`; returns its first row if it is shared (a local chunk's row
        is known only once every shared chunk is in: `layout`)."""
        if len(ranks) == 1:
            self.local[ranks[0]] += n
            return -1
        start = self.shared_end
        self.shared_end += n
        for r in ranks:
            self.shared_upto[r] = self.shared_end
        return start


def layout(chunks: Iterable[tuple[Sequence[int], int]], num_ranks: int) -> tuple[list[int], list[int]]:
    """Rows of a step's chunks, each (the ranks holding its request's KV, its tokens), in plan order: (each chunk's
    first row, on every rank holding it; the rows each rank needs)."""
    chunks = list(chunks)
    rows = StepRows(num_ranks)
    starts = [rows.add(ranks, n) if len(ranks) > 1 else -1 for ranks, n in chunks]
    for i, (ranks, n) in enumerate(chunks):
        if len(ranks) == 1:  # after every shared chunk is in
            starts[i] = rows.used(ranks[0])
            rows.add(ranks, n)
    return starts, [rows.used(r) for r in range(num_ranks)]
