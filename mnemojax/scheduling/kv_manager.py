"""KV page manager: plain Python, no jax.

A pool of `num_pages` pages of `page_size` slots. Page 0 is reserved: padding rows of a step write their K/V
there, and nothing ever reads it as a valid key. A request holds its pages in token order; it grows them one
chunk at a time and gives them all back when it finishes, is aborted, or is preempted.
"""
from __future__ import annotations

from collections import deque

DUMMY_PAGE = 0


class PageManager:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is reserved), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(1, num_pages))

    @property
    def num_usable(self) -> int:
        """Pages a request may hold (all but the reserved dummy page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_usable - len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_grow(self, pages: list[int], num_tokens: int) -> bool:
        return self.pages_for(num_tokens) - len(pages) <= len(self._free)

    def grow(self, pages: list[int], num_tokens: int) -> None:
        """Appends pages to `pages` (in place) until they hold `num_tokens` tokens. Raises if out of pages."""
        need = self.pages_for(num_tokens) - len(pages)
        if need > len(self._free):
            raise RuntimeError(f"out of KV pages: need {need}, {len(self._free)} free")
        for _ in range(max(need, 0)):
            pages.append(self._free.popleft())

    def free(self, pages: list[int]) -> None:
        """Returns all of `pages` to the pool and empties the list."""
        self._free.extend(pages)
        pages.clear()


class KVCacheManager:
    """The page pools of all KVP ranks, and where each request's KV lives.

    A request's KV occupies contiguous token ranges on a list of ranks (`request.kv_ranks`): tokens
    [i * max_tokens_per_rank, (i + 1) * max_tokens_per_rank) on its i-th rank. It starts on one rank, the
    least loaded when it is placed, and the next rank joins only once the previous one holds
    `max_tokens_per_rank` tokens (dynamic onboarding, during prefill or decode). With one rank, or no limit,
    a request stays on its first rank.
    """

    def __init__(self, num_ranks: int, num_pages: int, page_size: int, max_tokens_per_rank: int | None = None):
        if num_ranks < 1:
            raise ValueError(f"kvp must be at least 1, got {num_ranks}")
        if max_tokens_per_rank is not None and (max_tokens_per_rank < 1 or max_tokens_per_rank % page_size):
            raise ValueError(f"max_tokens_per_kvp_rank must be a positive multiple of page_size ({page_size}), "
                             f"got {max_tokens_per_rank}")
        self.ranks = [PageManager(num_pages, page_size) for _ in range(num_ranks)]
        self.page_size = page_size
        self.max_tokens_per_rank = max_tokens_per_rank

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def num_used(self) -> int:
        return sum(r.num_used for r in self.ranks)

    @property
    def num_usable(self) -> int:
        return sum(r.num_usable for r in self.ranks)

    def span(self) -> int:
        """Most tokens one rank holds of one request."""
        cap = self.ranks[0].num_usable * self.page_size
        return cap if self.max_tokens_per_rank is None else min(cap, self.max_tokens_per_rank)

    def capacity_error(self, num_tokens: int) -> str | None:
        """Why a request of `num_tokens` tokens can never fit, or None."""
        span, n = self.span(), self.num_ranks
        if self.max_tokens_per_rank is None:
            need = self.ranks[0].pages_for(num_tokens)
            if need > self.ranks[0].num_usable:
                return (f"{num_tokens} tokens needs {need} KV pages of {self.page_size} tokens; num_pages allows "
                        f"only {self.ranks[0].num_usable}")
            return None
        if num_tokens > span * n:
            return (f"{num_tokens} tokens exceeds kvp ({n}) x max_tokens_per_kvp_rank ({span}) = {span * n}")
        return None

    def rank_tokens(self, num_tokens: int) -> list[int]:
        """How many of a request's first `num_tokens` tokens each of its ranks holds, in rank-list order."""
        if self.max_tokens_per_rank is None:
            return [num_tokens]
        m = self.max_tokens_per_rank
        return [min(m, num_tokens - i * m) for i in range(-(-num_tokens // m))] or [0]

    def place(self, req) -> None:
        """Chooses the first rank of a request with no KV yet: the one with the most free pages."""
        req.kv_ranks = [max(range(self.num_ranks), key=lambda r: (self.ranks[r].num_free, -r))]
        req.pages = [[]]

    def _targets(self, req, num_tokens):
        counts = self.rank_tokens(num_tokens)
        ranks = list(req.kv_ranks)
        while len(ranks) < len(counts):
            ranks.append((ranks[-1] + 1) % self.num_ranks)
        return ranks, counts

    def short_ranks(self, req, num_tokens: int) -> set[int]:
        """The ranks without enough free pages for `req` to hold `num_tokens` tokens."""
        ranks, counts = self._targets(req, num_tokens)
        need = [0] * self.num_ranks
        for i, (r, n) in enumerate(zip(ranks, counts)):
            have = len(req.pages[i]) if i < len(req.pages) else 0
            need[r] += max(self.ranks[r].pages_for(n) - have, 0)
        return {r for r in range(self.num_ranks) if need[r] > self.ranks[r].num_free}

    def can_grow(self, req, num_tokens: int) -> bool:
        return not self.short_ranks(req, num_tokens)

    def grow(self, req, num_tokens: int) -> None:
        """Gives `req` pages for its first `num_tokens` tokens, onboarding ranks as needed."""
        if not self.can_grow(req, num_tokens):
            raise RuntimeError(f"out of KV pages for request {req.request_id}")
        ranks, counts = self._targets(req, num_tokens)
        for i, (r, n) in enumerate(zip(ranks, counts)):
            if i == len(req.kv_ranks):
                req.kv_ranks.append(r)
                req.pages.append([])
            self.ranks[r].grow(req.pages[i], n)

    def free(self, req) -> None:
        for r, pages in zip(req.kv_ranks, req.pages):
            self.ranks[r].free(pages)
        req.kv_ranks, req.pages = [], []
