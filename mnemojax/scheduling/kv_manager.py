"""KV page manager: plain Python, no jax.

A pool of `num_pages` pages of `page_size` slots. Page 0 is reserved: padding rows of a step write their K/V
there, and nothing ever reads it as a valid key. A request holds its pages in token order; it grows them one
chunk at a time and gives them all back when it finishes, is aborted, or is preempted.

Prefix caching (`prefix_caching=True`): once a full page's K/V is written on every layer (`cache_computed`), the
page is cached under a chained hash of its tokens and of all tokens before it. A request being placed takes the
longest run of its full pages found cached, on the same KVP ranks, instead of computing them, and starts
computing after them; at least its last token is always computed. Shared pages are held by a count; a cached page
nobody holds is counted free and is evicted, least recently released first, only when a new page is needed.
"""
from __future__ import annotations

import hashlib
import logging
from array import array
from collections import OrderedDict, deque

DUMMY_PAGE = 0

logger = logging.getLogger(__name__)


class PageManager:
    """One rank's pool. Without prefix caching a page is free or held by one request. With it, a full page also
    carries the hash of its tokens and of everything before them (`page_hash`): several requests may hold it
    (a count per page), and when none does it stays cached, counted free, until a new page is needed; then the
    least recently released cached page is evicted (its hash forgotten). A held page is never evicted."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is reserved), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(1, num_pages))  # no hash, nobody holds them
        self._refs: dict[int, int] = {}  # held pages: how many requests hold each
        self._cached: dict[bytes, int] = {}  # page hash -> page (held or not)
        self._hash_of: dict[int, bytes] = {}  # the inverse
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, held by nobody; least recent first
        self.num_evictions = 0

    @property
    def num_usable(self) -> int:
        """Pages a request may hold (all but the reserved dummy page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages a request can get: never used, or cached and held by nobody."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_grow(self, pages: list[int], num_tokens: int) -> bool:
        return self.pages_for(num_tokens) - len(pages) <= self.num_free

    def _take(self) -> int:
        if self._free:
            page = self._free.popleft()
        else:  # evict the least recently released cached page
            page, _ = self._evictable.popitem(last=False)
            del self._cached[self._hash_of.pop(page)]
            self.num_evictions += 1
        self._refs[page] = 1
        return page

    def grow(self, pages: list[int], num_tokens: int) -> None:
        """Appends pages to `pages` (in place) until they hold `num_tokens` tokens. Raises if out of pages."""
        need = self.pages_for(num_tokens) - len(pages)
        if need > self.num_free:
            raise RuntimeError(f"out of KV pages: need {need}, {self.num_free} free")
        for _ in range(max(need, 0)):
            pages.append(self._take())

    def free(self, pages: list[int]) -> None:
        """Releases all of `pages` and empties the list. A page nobody holds any more returns to the pool; a
        cached one stays cached (the last pages first in line for eviction: they are the least shared)."""
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                del self._refs[page]
                if page in self._hash_of:
                    self._evictable[page] = None
                else:
                    self._free.append(page)
        pages.clear()

    # ---------------------------------------------------------------- prefix cache
    def lookup(self, page_hash: bytes) -> int | None:
        return self._cached.get(page_hash)

    def acquire(self, page: int) -> None:
        """One more request holds cached `page`."""
        if page in self._evictable:
            del self._evictable[page]
        self._refs[page] = self._refs.get(page, 0) + 1

    def register(self, page: int, page_hash: bytes) -> None:
        """Caches held, full `page` under `page_hash`, unless another page already holds those tokens."""
        if page_hash not in self._cached and page not in self._hash_of:
            self._cached[page_hash] = page
            self._hash_of[page] = page_hash

    def reset_cache(self) -> int:
        """Forgets every page hash; cached pages nobody holds return to the pool. Returns how many were cached."""
        n = len(self._cached)
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._cached.clear()
        self._hash_of.clear()
        return n


class KVCacheManager:
    """The page pools of all KVP ranks, and where each request's KV lives.

    A request's KV occupies contiguous token ranges on a list of distinct ranks (`request.kv_ranks`): tokens
    [i * max_tokens_per_rank, (i + 1) * max_tokens_per_rank) on its i-th rank. It starts on one rank and the
    next rank joins only once the previous one holds `max_tokens_per_rank` tokens (dynamic onboarding, during
    prefill or decode). With one rank, or no limit, a request stays on its first rank.

    Placement (Medha's KVP load balancing, section 4.3: by pending prefill work and memory): its first rank, and
    each rank that joins later, is the least loaded of the ranks it is not on yet (`_least_loaded`): among those
    with free pages for the known tokens it would keep there (all of them if none has), the one with the least
    pending prefill work, i.e. the fewest prompt tokens still to compute of the requests whose KV it holds
    (`pending_prefill`), then the one with the most free pages, then the lowest index. A request found in the
    prefix cache goes where its cached pages are.
    """

    def __init__(self, num_ranks: int, num_pages: int, page_size: int, max_tokens_per_rank: int | None = None,
                 prefix_caching: bool = False):
        if num_ranks < 1:
            raise ValueError(f"kvp must be at least 1, got {num_ranks}")
        if max_tokens_per_rank is not None and (max_tokens_per_rank < 1 or max_tokens_per_rank % page_size):
            raise ValueError(f"max_tokens_per_kvp_rank must be a positive multiple of page_size ({page_size}), "
                             f"got {max_tokens_per_rank}")
        self.ranks = [PageManager(num_pages, page_size) for _ in range(num_ranks)]
        # a request fills its ranks max_tokens_per_rank at a time: more than a rank's pages hold would never fit
        held = self.ranks[0].num_usable * page_size
        if max_tokens_per_rank is not None and max_tokens_per_rank > held:
            raise ValueError(f"max_tokens_per_kvp_rank ({max_tokens_per_rank}) exceeds what one KVP rank's KV pages "
                             f"hold: {held} tokens ({self.ranks[0].num_usable} usable pages of {page_size})")
        self.page_size = page_size
        self.max_tokens_per_rank = max_tokens_per_rank
        self.prefix_caching = prefix_caching
        self.prefix_queries = 0  # tokens of admitted requests that looked up the cache, since start
        self.prefix_hits = 0  # of those, tokens found cached
        self._evictions_logged = 0  # evictions at the last eviction-pressure log line
        self._pending: dict[bytes, int] = {}  # hashes of prompt pages admitted requests are computing: how many
        self._holders: list[dict[int, object]] = [{} for _ in range(num_ranks)]  # per rank: id -> request on it

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

    def max_request_tokens(self) -> int:
        """Most tokens one request can hold (the largest that `capacity_error` accepts)."""
        return self.span() if self.max_tokens_per_rank is None else self.span() * self.num_ranks

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

    def place(self, req, step_rows=None) -> int:
        """Chooses the ranks of a request with no KV yet and gives it the longest run of its pages already cached
        (never its last token: the step that computes it samples). Without a cached page it starts on the least
        loaded rank (see the class docstring). `step_rows` (a `rows.StepRows`), the rows of the step being planned:
        the tokens already scheduled on a rank count as pending work there, and a rank with room left in the step
        is preferred, so that the request can start now. Returns the tokens found cached."""
        ranks, pages = self._match(req) if self._looks_up(req) else (None, [])
        if not pages:
            req.kv_ranks = [self._least_loaded(req, [], step_rows)]
            req.pages = [[]]
            self._hold(req)
            return 0
        req.kv_ranks, req.pages = [], []
        for j, page in enumerate(pages):
            i, _ = self._where(j)
            if i == len(req.kv_ranks):
                req.kv_ranks.append(ranks[i])
                req.pages.append([])
            self.ranks[ranks[i]].acquire(page)
            req.pages[i].append(page)
        req.num_registered_pages = len(pages)
        self._hold(req)
        return len(pages) * self.page_size

    # ---------------------------------------------------------------- load balancing
    def pending_prefill(self, rank: int) -> int:
        """Pending prefill work on `rank`: the tokens still to compute (not yet scheduled) of the requests whose
        KV it holds and that are not decoding. A request spanning several ranks counts on each: its query rows
        are computed on all of them."""
        return sum(q.num_uncomputed for q in self._holders[rank].values() if not q.in_decode)

    def _least_loaded(self, req, taken: list[int], step_rows=None) -> int:
        """The rank for `req`'s span number len(taken) (its first rank when `taken` is empty), chosen among the
        ranks not in `taken`: those with free pages for the known tokens that span would hold (all of them if
        none has), of those the ones with room in `step_rows` if given (all of them if none has), then the least
        pending prefill work (plus the rows used in `step_rows`), the most free pages, the lowest index."""
        counts = self.rank_tokens(req.num_tokens)
        want = max(counts[len(taken)] if len(taken) < len(counts) else 0, 1)
        cands = [r for r in range(self.num_ranks) if r not in taken]
        if not cands:
            raise ValueError(f"request {req.request_id} needs a KVP rank more than the {self.num_ranks} there are "
                             f"({self.capacity_error(req.num_tokens)})")
        if len(cands) == 1:
            return cands[0]  # (kvp = 1, or the last rank left: nothing to weigh)
        cands = [r for r in cands if self.ranks[r].pages_for(want) <= self.ranks[r].num_free] or cands
        busy = [0] * self.num_ranks
        if step_rows is not None:
            cands = [r for r in cands if step_rows.room([r]) > 0] or cands
            busy = [step_rows.used(r) for r in range(self.num_ranks)]
        return min(cands, key=lambda r: (self.pending_prefill(r) + busy[r], -self.ranks[r].num_free, r))

    def _hold(self, req) -> None:
        for r in req.kv_ranks:
            self._holders[r][id(req)] = req

    # ---------------------------------------------------------------- prefix cache
    def _looks_up(self, req) -> bool:
        # Prompt log-probs need the logits of every prompt position, so such a request computes its whole prompt.
        return self.prefix_caching and req.params.prompt_logprobs is None

    def page_hashes(self, req, num_pages: int) -> list[bytes]:
        """The chained hashes of `req`'s pages, at least its first `num_pages` (each: sha256 of the previous page's
        hash and of the page's tokens), computed once per page: the request's own list (`req.page_hashes`), not a
        copy, as a decode reads one page's hash per step of a context that may hold 65,536 pages."""
        hashes, S = req.page_hashes, self.page_size
        while len(hashes) < num_pages:
            j = len(hashes)
            if (j + 1) * S <= len(req.prompt_token_ids):
                tokens = array("q", req.prompt_token_ids[j * S:(j + 1) * S])
            else:
                tokens = array("q", (req.token_at(i) for i in range(j * S, (j + 1) * S)))
            hashes.append(hashlib.sha256((hashes[-1] if hashes else b"") + tokens.tobytes()).digest())
        return hashes

    def _where(self, j: int) -> tuple[int, int]:
        """(index in the request's rank list, index in that rank's page list) of a request's page j."""
        if self.max_tokens_per_rank is None:
            return 0, j
        return divmod(j, self.max_tokens_per_rank // self.page_size)

    def _match(self, req) -> tuple[list[int] | None, list[int]]:
        """The rank list and cached pages of the longest cached run of `req`'s full pages (at most all but its
        last token). Span by span, the rank (not yet in the list) holding the longest cached run of that span's
        pages, ties to the most free pages then the lowest index (ranks join a request by load, not in a fixed
        order, so each span is looked up on every rank). Reads only."""
        n = (req.num_tokens - 1) // self.page_size
        hashes = self.page_hashes(req, n)[:n]
        per_span = len(hashes) if self.max_tokens_per_rank is None else self.max_tokens_per_rank // self.page_size
        ranks: list[int] = []
        pages: list[int] = []
        while len(pages) < len(hashes):
            span = hashes[len(pages):len(pages) + per_span]
            best: tuple | None = None
            for r in range(self.num_ranks):
                if r in ranks:
                    continue
                run = []
                for h in span:
                    page = self.ranks[r].lookup(h)
                    if page is None:
                        break
                    run.append(page)
                key = (len(run), self.ranks[r].num_free, -r)
                if run and (best is None or key > best[0]):
                    best = key, r, run
            if best is None:
                break
            _, r, run = best
            ranks.append(r)
            pages += run
            if len(run) < len(span):
                break  # the run ends inside this span
        return (ranks, pages) if pages else (None, [])

    def mark_pending(self, req) -> None:
        """`req` is admitted: the full pages of its prompt it will compute are pending until cached or freed."""
        if not self.prefix_caching:
            return
        end = req.num_prompt_tokens // self.page_size
        hashes = self.page_hashes(req, end)
        for j in range(req.num_registered_pages, end):
            h = hashes[j]
            self._pending[h] = self._pending.get(h, 0) + 1
        req.pending_pages = (req.num_registered_pages, end)

    def _unmark_pending(self, req, upto: int) -> None:
        start, end = req.pending_pages
        for h in req.page_hashes[start:min(upto, end)]:
            self._pending[h] -= 1
            if not self._pending[h]:
                del self._pending[h]
        req.pending_pages = (max(start, min(upto, end)), end)

    def waits_for_pending(self, req, num_cached: int) -> bool:
        """The page of `req` after its `num_cached` cached tokens is being computed by an admitted request: `req`
        should wait for it rather than compute it again (the choices of an n > 1 request, or several requests
        sent with one new context at once)."""
        j = num_cached // self.page_size
        if not self._pending or not self._looks_up(req) or j >= (req.num_tokens - 1) // self.page_size:
            return False
        return self.page_hashes(req, j + 1)[j] in self._pending

    def count_lookup(self, req, num_cached: int) -> None:
        """Counts an admitted request's lookup (its known tokens) and its hit (`num_cached` tokens)."""
        if self._looks_up(req):
            self.prefix_queries += req.num_tokens
            self.prefix_hits += num_cached

    def num_cached_tokens(self, req) -> int:
        """Tokens `req` would find cached if it were placed now (reads only)."""
        return len(self._match(req)[1]) * self.page_size if self._looks_up(req) else 0

    def cache_computed(self, req, num_tokens: int) -> None:
        """`req`'s first `num_tokens` tokens are in the cache (their K/V written on every layer): caches its full
        pages among them."""
        if not self.prefix_caching:
            return
        full = num_tokens // self.page_size
        hashes = self.page_hashes(req, full)
        for j in range(req.num_registered_pages, full):
            i, k = self._where(j)
            self.ranks[req.kv_ranks[i]].register(req.pages[i][k], hashes[j])
        req.num_registered_pages = max(req.num_registered_pages, full)
        self._unmark_pending(req, full)

    @property
    def num_evictions(self) -> int:
        return sum(r.num_evictions for r in self.ranks)

    def reset_cache(self) -> int:
        """Forgets every cached page (pages requests hold stay theirs). Returns how many were cached."""
        n = sum(r.reset_cache() for r in self.ranks)
        logger.info("prefix cache reset: %d cached pages forgotten", n)
        return n

    def _targets(self, req, num_tokens):
        """(The ranks `req` would hold once it holds `num_tokens` tokens, how many tokens on each). Reads only."""
        counts = self.rank_tokens(num_tokens)
        ranks = req.kv_ranks[:len(counts)]
        while len(ranks) < len(counts):
            ranks.append(self._least_loaded(req, ranks))
        return ranks, counts

    def ranks_for(self, req, num_tokens: int) -> list[int]:
        """The ranks that hold `req`'s KV once it holds `num_tokens` tokens (the ranks that would join chosen as
        `grow` would choose them now), in span order. A step computes the query rows of `req`'s chunk ending at
        `num_tokens` on exactly these ranks. Reads only."""
        return self._targets(req, num_tokens)[0]

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
                self._holders[r][id(req)] = req
            self.ranks[r].grow(req.pages[i], n)
        n = self.num_evictions
        if n and (self._evictions_logged == 0 or n - self._evictions_logged >= self.num_usable):
            self._evictions_logged = n  # the first eviction, then once per pool's worth of evicted pages
            logger.info("prefix cache under eviction pressure: %d cached pages evicted since start (pool: %d pages); "
                        "hit rate %.1f%% of %d queried tokens", self.num_evictions, self.num_usable,
                        100.0 * self.prefix_hits / max(self.prefix_queries, 1), self.prefix_queries)

    def free(self, req) -> None:
        for r, pages in zip(req.kv_ranks, req.pages):
            self.ranks[r].free(pages)
            self._holders[r].pop(id(req), None)
        req.kv_ranks, req.pages = [], []
        req.num_registered_pages = 0
        self._unmark_pending(req, len(req.page_hashes))
