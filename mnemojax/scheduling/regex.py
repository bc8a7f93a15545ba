"""Structured outputs' regex (vLLM's `structured_outputs.regex`, the server's `guided_regex`) as an automaton over
characters; `mnemojax.engine.structured` turns its states into the tokens a request may generate next.

`Regex`: the pattern parsed (a subset of Python's `re` syntax, below) into a Thompson NFA, run as a DFA built
lazily: a DFA state is an interned set of NFA states, its transitions cached per character. NFA states from which
the end cannot be reached are pruned, so a DFA state is live exactly when it is not the empty set (state 0). Plain
Python: the request checks (`SamplingParams`) parse patterns with it.

The syntax: literals; `.` (any character but a newline); classes `[...]` with ranges and `^`; the escapes `\\d \\D \\w
\\W \\s \\S` (ASCII classes, as with `re.ASCII`), `\\n \\t \\r \\f \\v \\0`, `\\xhh`, `\\uhhhh` and
any escaped punctuation; groups `(...)`, `(?:...)`, `(?P<name>...)`; alternation `|`; quantifiers `* + ? {m} {m,}
{m,n} {,n}`, lazy or not (the same strings match whole); `^` at the start and `$` at the end (the output matches
whole anyway). Anything else (back-references, look-arounds, flags, anchors elsewhere, possessive quantifiers,
octal escapes) is a `RegexError` naming its position: refused, never approximated.
"""
from __future__ import annotations

import bisect
import functools
import threading

MAX_CODE = 0x10FFFF
MAX_NFA_STATES = 50_000
"""The most NFA states a pattern may build (counted repetitions are copies: `a{1000}` is 1000 states)."""
MAX_REPEAT = 1000

_DIGIT = ((0x30, 0x39),)
_WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
_SPACE = ((0x09, 0x0D), (0x20, 0x20))
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0", "a": "\a"}


class RegexError(ValueError):
    """A pattern this module cannot take: the message names the position and what is there."""


def _merged(ranges) -> tuple[tuple[int, int], ...]:
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def _negated(ranges) -> tuple[tuple[int, int], ...]:
    out, at = [], 0
    for lo, hi in _merged(ranges):
        if lo > at:
            out.append((at, lo - 1))
        at = hi + 1
    if at <= MAX_CODE:
        out.append((at, MAX_CODE))
    return tuple(out)


_CLASSES = {"d": _DIGIT, "D": _negated(_DIGIT), "w": _WORD, "W": _negated(_WORD), "s": _SPACE,
            "S": _negated(_SPACE)}
_ANY = _negated(((0x0A, 0x0A),))


class _Parser:
    """Recursive descent over the pattern: nodes ("set", ranges), ("cat", [nodes]), ("alt", [nodes]),
    ("rep", node, lo, hi or None)."""

    def __init__(self, pattern: str):
        self.p, self.i = pattern, 0

    def error(self, what: str, at: int | None = None) -> RegexError:
        at = self.i if at is None else at
        return RegexError(f"regex {self.p!r}: {what} at position {at}")

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    def parse(self):
        if self.peek() == "^":
            self.i += 1
        node = self.alt()
        if self.i != len(self.p):
            raise self.error(f"unbalanced {self.p[self.i]!r}")
        return node

    def alt(self):
        items = [self.cat()]
        while self.peek() == "|":
            self.i += 1
            items.append(self.cat())
        return items[0] if len(items) == 1 else ("alt", items)

    def cat(self):
        items = []
        while (c := self.peek()) is not None and c not in "|)":
            if c == "$":
                if self.i + 1 != len(self.p):
                    raise self.error("'$' before the pattern's end is not supported")
                self.i += 1
                break
            items.append(self.quantified(self.atom()))
        return items[0] if len(items) == 1 else ("cat", items)

    def quantified(self, node):
        """`node` under the quantifier that follows it, if one does (an atom: one that starts with a quantifier is
        refused by `atom`, so there is always something to repeat). A second quantifier is refused, as `re` does
        ("multiple repeat"); a lazy one's `?` is part of the first."""
        c = self.peek()
        if c is not None and c in "*+?":
            self.i += 1
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        elif c == "{":
            bounds = self.braces()
            if bounds is None:
                return node  # not a quantifier: a literal '{', read as an atom next
            lo, hi = bounds
        else:
            return node
        if self.peek() == "?":
            self.i += 1  # lazy: the same strings match the whole pattern
        elif self.peek() == "+":
            raise self.error("possessive quantifiers are not supported")
        at, c = self.i, self.peek()
        if c is not None and (c in "*+?" or (c == "{" and self.braces() is not None)):
            raise self.error("multiple repeat (a quantifier after a quantifier)", at)
        return ("rep", node, lo, hi)

    def braces(self):
        end = self.p.find("}", self.i)
        if end < 0:
            return None
        body = self.p[self.i + 1:end]
        lo_s, comma, hi_s = body.partition(",")
        if not (lo_s.isdigit() or (comma and not lo_s)) or not (hi_s.isdigit() or not hi_s) \
                or not (lo_s or hi_s) or not body.isascii():
            return None
        lo = int(lo_s) if lo_s else 0
        hi = lo if not comma else (int(hi_s) if hi_s else None)
        if lo > MAX_REPEAT or (hi is not None and hi > MAX_REPEAT):
            raise self.error(f"a repetition count above {MAX_REPEAT}")
        if hi is not None and hi < lo:
            raise self.error(f"repetition {{{body}}} has its maximum below its minimum")
        self.i = end + 1
        return lo, hi

    def atom(self):
        c, start = self.p[self.i], self.i
        self.i += 1
        if c == "(":
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif self.p.startswith("?P<", self.i):
                end = self.p.find(">", self.i)
                if end < 0 or not self.p[self.i + 3:end].isidentifier():
                    raise self.error("a bad group name", start)
                self.i = end + 1
            elif self.peek() == "?":
                raise self.error(f"'(?{self.p[self.i + 1:self.i + 2]}' (look-arounds, flags, back-references) is "
                                 f"not supported", start)
            node = self.alt()
            if self.peek() != ")":
                raise self.error("missing ')'", start)
            self.i += 1
            return node
        if c == "[":
            return ("set", self.char_class(start))
        if c == ".":
            return ("set", _ANY)
        if c == "\\":
            return ("set", self.escape(in_class=False))
        if c in "*+?":
            raise self.error("nothing to repeat", start)
        if c == "^":
            raise self.error("'^' after the pattern's start is not supported", start)
        return ("set", ((ord(c), ord(c)),))

    def escape(self, in_class: bool) -> tuple[tuple[int, int], ...]:
        c = self.peek()
        if c is None:
            raise self.error("a trailing backslash")
        self.i += 1
        if c in _CLASSES:
            return _CLASSES[c]
        if c == "0" and (self.peek() or "").isdigit():
            raise self.error("octal escapes are not supported", self.i - 2)
        if c in _ESCAPES:
            code = ord(_ESCAPES[c])
        elif c == "b" and in_class:
            code = 8
        elif c in "xu":
            n = 2 if c == "x" else 4
            digits = self.p[self.i:self.i + n]
            if len(digits) != n or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"\\{c} needs {n} hex digits")
            self.i += n
            code = int(digits, 16)
        elif c.isascii() and not c.isalnum():
            code = ord(c)
        else:
            raise self.error(f"the escape \\{c} is not supported", self.i - 2)
        return ((code, code),)

    def char_class(self, start: int) -> tuple[tuple[int, int], ...]:
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        ranges, first = [], True
        while True:
            c = self.peek()
            if c is None:
                raise self.error("missing ']'", start)
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            lo = self.class_item()
            if self.peek() == "-" and self.i + 1 < len(self.p) and self.p[self.i + 1] != "]":
                self.i += 1
                hi = self.class_item()
                if len(lo) != 1 or len(hi) != 1 or lo[0][0] != lo[0][1] or hi[0][0] != hi[0][1]:
                    raise self.error("a range with a class at an end", start)
                if hi[0][0] < lo[0][0]:
                    raise self.error("a range out of order", start)
                ranges.append((lo[0][0], hi[0][0]))
            else:
                ranges.extend(lo)
        return _negated(ranges) if negate else _merged(ranges)

    def class_item(self) -> tuple[tuple[int, int], ...]:
        c = self.p[self.i]
        self.i += 1
        if c == "\\":
            return self.escape(in_class=True)
        if c == "[" and self.peek() in (":", "=", "."):
            raise self.error("POSIX classes ([:alpha:]) are not supported")
        return ((ord(c), ord(c)),)


class Regex:
    """A pattern as a lazily built DFA over characters. States are ints: 0 the dead state (nothing can follow),
    `start` the initial one."""

    def __init__(self, pattern: str):
        if not isinstance(pattern, str):
            raise RegexError(f"regex must be a string, got {pattern!r}")
        self.pattern = pattern
        self._eps: list[list[int]] = []
        self._edges: list[list[tuple[tuple, int]]] = []
        try:
            start, end = self._build(_Parser(pattern).parse())
        except RecursionError:  # (the parser and the construction recurse per nested group)
            raise RegexError(f"regex {pattern!r} is nested too deeply") from None
        self._accept = end
        live = self._co_reachable(end)
        self._edges = [[(r, t) for r, t in e if t in live] for e in self._edges]
        self._eps = [[t for t in e if t in live] for e in self._eps]
        self._sets: list[frozenset] = [frozenset()]
        self._ids: dict[frozenset, int] = {frozenset(): 0}
        self._next: list[dict[str, int]] = [{}]
        self._lock = threading.Lock()  # new states are interned by one thread at a time (the server validates
        # requests beside the engine's thread, which walks the same cached patterns)
        self.start = self._intern(self._closure({start} & live))

    def _state(self) -> int:
        if len(self._eps) >= MAX_NFA_STATES:
            raise RegexError(f"regex {self.pattern!r} is too large (more than {MAX_NFA_STATES} NFA states)")
        self._eps.append([])
        self._edges.append([])
        return len(self._eps) - 1

    def _build(self, node) -> tuple[int, int]:
        """Thompson's construction: the fragment's (entry, exit)."""
        kind = node[0]
        if kind == "set":
            a, b = self._state(), self._state()
            if node[1]:
                self._edges[a].append((node[1], b))
            return a, b
        if kind == "cat":
            a = b = self._state()
            for item in node[1]:
                x, y = self._build(item)
                self._eps[b].append(x)
                b = y
            return a, b
        if kind == "alt":
            a, b = self._state(), self._state()
            for item in node[1]:
                x, y = self._build(item)
                self._eps[a].append(x)
                self._eps[y].append(b)
            return a, b
        _, inner, lo, hi = node
        a = b = self._state()
        for _ in range(lo):
            x, y = self._build(inner)
            self._eps[b].append(x)
            b = y
        if hi is None:  # a loop: any number more
            x, y = self._build(inner)
            self._eps[b].append(x)
            self._eps[y].append(x)
            end = self._state()
            self._eps[b].append(end)
            self._eps[y].append(end)
            return a, end
        end = self._state()
        for _ in range(hi - lo):
            self._eps[b].append(end)
            x, y = self._build(inner)
            self._eps[b].append(x)
            b = y
        self._eps[b].append(end)
        return a, end

    def _co_reachable(self, end: int) -> set[int]:
        back: list[list[int]] = [[] for _ in self._eps]
        for s, (eps, edges) in enumerate(zip(self._eps, self._edges)):
            for t in eps:
                back[t].append(s)
            for _, t in edges:
                back[t].append(s)
        seen, todo = {end}, [end]
        while todo:
            for s in back[todo.pop()]:
                if s not in seen:
                    seen.add(s)
                    todo.append(s)
        return seen

    def _closure(self, states) -> frozenset:
        seen, todo = set(states), list(states)
        while todo:
            for t in self._eps[todo.pop()]:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return frozenset(seen)

    def _intern(self, states: frozenset) -> int:
        sid = self._ids.get(states)
        if sid is None:
            sid = self._ids[states] = len(self._sets)
            self._sets.append(states)
            self._next.append({})
        return sid

    def step(self, state: int, ch: str) -> int:
        """The state after character `ch` from `state` (0: no match can follow)."""
        nxt = self._next[state]
        sid = nxt.get(ch)
        if sid is None:
            code, targets = ord(ch), set()
            for s in self._sets[state]:
                for ranges, t in self._edges[s]:
                    k = bisect.bisect_right(ranges, (code, MAX_CODE + 1)) - 1
                    if k >= 0 and ranges[k][0] <= code <= ranges[k][1]:
                        targets.add(t)
            closed = self._closure(targets)
            with self._lock:
                sid = nxt[ch] = self._intern(closed)
        return sid

    def walk(self, state: int, text: str) -> int:
        """The state after `text` from `state` (0: no match can follow)."""
        nexts = self._next
        for ch in text:
            nxt = nexts[state].get(ch)
            state = self.step(state, ch) if nxt is None else nxt
            if not state:
                return 0
        return state

    def class_starts(self) -> list[int]:
        """The first code point of each character class: the sets on the automaton's edges cut the code points into
        runs that every set takes or leaves alike, so one character of a run steps any state as all of them do."""
        starts = {0}
        for edges in self._edges:
            for ranges, _ in edges:
                for lo, hi in ranges:
                    starts.update((lo, hi + 1))
        return sorted(b for b in starts if b <= MAX_CODE)

    def accepts(self, state: int) -> bool:
        return self._accept in self._sets[state]

    def fullmatch(self, text: str) -> bool:
        return self.accepts(self.walk(self.start, text))


@functools.lru_cache(maxsize=64)
def compiled(pattern: str) -> Regex:
    """`Regex(pattern)`, kept for the next request with the same pattern (its DFA grows as requests walk it)."""
    return Regex(pattern)
