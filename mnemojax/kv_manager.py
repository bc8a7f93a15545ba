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
