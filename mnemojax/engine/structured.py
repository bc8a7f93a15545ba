"""Structured outputs' regex over a vocabulary: the tokens a request may generate next so that its output text can
still match the pattern whole (`mnemojax.scheduling.regex.Regex`), then EOS once it does.

- `token_texts`: the text each token adds to an output, from the tokenizer (after a fixed token, so SentencePiece's
  leading spaces count); special tokens, tokens holding part of a UTF-8 character and ids past the tokenizer are
  None: never allowed.
- `TokenVocabulary`: those texts as flat arrays of code points, which every pattern's walk reuses.
- `TokenGuide`: per pattern, the allowed-token bitmask of each DFA state (cached), the sampler's `masks`.
- `RegexState`: one request's walk through its guide along its generated tokens.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from mnemojax.scheduling.regex import Regex, RegexError
from models.tokenizer import special_ids


def token_texts(tokenizer, vocab_size: int) -> list[str | None]:
    """The text each token id below `vocab_size` adds to an output: `decode([a, t])` less `decode([a])` for `a` the
    last token of the text "a" (so a SentencePiece token's leading space is kept); None for special tokens, ids past
    the tokenizer, tokens that add nothing and tokens holding part of a UTF-8 character (their text has U+FFFD
    where the engine's detokenizer would wait for the rest)."""
    anchor = tokenizer.encode("a", add_special_tokens=False)[-1:]
    base = tokenizer.decode(anchor) if anchor else ""
    if not base or "\ufffd" in base:
        raise RegexError("the tokenizer has no token with a text of its own for 'a', which token texts are read "
                         "after")
    n = min(len(tokenizer), vocab_size)
    special = special_ids(tokenizer)
    pairs = [[anchor[0], t] for t in range(n)]
    batch = getattr(tokenizer, "batch_decode", None)  # a Hugging Face tokenizer's (in Rust when fast)
    decoded = batch(pairs) if batch is not None else [tokenizer.decode(p) for p in pairs]
    out: list[str | None] = [None] * vocab_size
    for t, s in enumerate(decoded):
        if t in special or not s.startswith(base):
            continue
        text = s[len(base):]
        if text and "\ufffd" not in text:
            out[t] = text
    return out


class TokenVocabulary:
    """Token texts (`token_texts`) as flat arrays of their characters' code points, which every pattern's guide walks:
    built once per engine, shared by every guide."""

    def __init__(self, texts: Sequence[str | None]):
        self.texts = list(texts)
        self.size = len(self.texts)
        kept = [(t, s) for t, s in enumerate(self.texts) if s]
        self.ids = np.array([t for t, _ in kept], np.int64)  # the tokens that have a text
        self.lengths = np.array([len(s) for _, s in kept], np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64) if kept else \
            np.zeros(0, np.int64)
        joined = "".join(s for _, s in kept)
        self.codes = np.frombuffer(joined.encode("utf-32-le", "surrogatepass"), "<u4").astype(np.int32)


class TokenGuide:
    """One pattern over one vocabulary: the bitmask of the tokens allowed in each DFA state (cached), as uint32
    words [ceil(vocab / 32)], token t bit t % 32 of word t // 32: those whose text keeps a match possible, and the
    EOS tokens where the text so far matches whole.

    The walk is vectorized over tokens: the pattern's character sets cut the code points into classes whose
    characters every set takes or leaves alike (so one character of a class steps the DFA for all of them), each
    token's characters are read as classes once per guide, and a state's walk steps every live token one character
    at a time through a table (state, class) -> state filled as the walk meets new pairs."""

    def __init__(self, regex: Regex, vocab: TokenVocabulary | Sequence[str | None], eos_ids: Sequence[int]):
        self.regex = regex
        self.vocab = vocab if isinstance(vocab, TokenVocabulary) else TokenVocabulary(vocab)
        self.vocab_size = self.vocab.size
        self.eos_ids = tuple(eos_ids)
        self._masks: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()  # the server's thread checks a guide's start beside the engine's walks
        self._classes: np.ndarray | None = None  # built at the first mask

    @property
    def words(self) -> int:
        return -(-self.vocab_size // 32)

    def _build_classes(self) -> None:
        self._bounds = np.array(self.regex.class_starts(), np.int64)
        self._reps = [chr(b) for b in self._bounds.tolist()]  # a character of each class
        n = len(self._bounds)
        dtype = np.uint8 if n <= 256 else np.int16 if n <= 2 ** 15 else np.int32  # (a byte a character, mostly)
        self._classes = (np.searchsorted(self._bounds, self.vocab.codes, side="right") - 1).astype(dtype)
        first = self._classes[self.vocab.starts]  # each token's first class, and the tokens grouped by it
        self._by_first = np.argsort(first, kind="stable")
        self._first_at = np.searchsorted(first[self._by_first], np.arange(n + 1))
        self._table = np.full((64, n), -1, np.int64)

    def _step(self, states: np.ndarray, classes: np.ndarray) -> np.ndarray:
        """The DFA states after one character of each class from each state (the table filled where it lacks one)."""
        n = len(self._bounds)
        top = int(states.max())
        if top >= self._table.shape[0]:
            grown = np.full((max(2 * self._table.shape[0], top + 1), n), -1, np.int64)
            grown[:self._table.shape[0]] = self._table
            self._table = grown
        flat = self._table.reshape(-1)
        keys = states * n + classes
        out = flat[keys]
        missing = out < 0
        if missing.any():
            for k in np.unique(keys[missing]).tolist():
                flat[k] = self.regex.step(k // n, self._reps[k % n])
            out = flat[keys]
        return out

    def allowed(self, state: int) -> np.ndarray:
        """bool[vocab]: the tokens allowed in `state`: each token's text walked from it, the tokens of a first class
        that dies skipped whole, then all live tokens a character at a time. Measured against the plain walk (each
        text on its own) in docs/benchmarks.md (`scripts/bench_structured.py`)."""
        ok = np.zeros(self.vocab_size, bool)
        with self._lock:
            if self._classes is None:
                self._build_classes()
            v, n = self.vocab, len(self._bounds)
            row = self._step(np.full(n, state, np.int64), np.arange(n))
            live = np.flatnonzero(row)
            act = np.concatenate([self._by_first[self._first_at[c]:self._first_at[c + 1]] for c in live.tolist()]
                                 + [np.zeros(0, np.int64)])
            states, done = row[self._classes[v.starts[act]]], 1
            while act.size:  # every state here is live (a dead one was dropped)
                ended = v.lengths[act] == done
                ok[v.ids[act[ended]]] = True
                act, states = act[~ended], states[~ended]
                if not act.size:
                    break
                states = self._step(states, self._classes[v.starts[act] + done])
                live = states != 0
                act, states, done = act[live], states[live], done + 1
        if self.regex.accepts(state):
            ok[list(self.eos_ids)] = True
        return ok

    def mask(self, state: int) -> np.ndarray:
        """`allowed(state)` as the sampler's bits (cached per state)."""
        m = self._masks.get(state)
        if m is None:
            bits = np.packbits(self.allowed(state), bitorder="little")
            m = np.zeros(self.words * 4, np.uint8)
            m[:bits.size] = bits
            m = self._masks[state] = m.view("<u4").astype(np.uint32)
        return m


class RegexState:
    """One request's walk through its `TokenGuide`: the DFA state after each of its generated tokens."""

    def __init__(self, guide: TokenGuide):
        self.guide = guide
        self._states = [guide.regex.start]

    def mask_after(self, output_ids: Sequence[int]) -> np.ndarray:
        """The allowed tokens' bitmask after the generated tokens `output_ids` (they were drawn under this guide:
        each one's text is walked on from the state before it)."""
        rx = self.guide.regex
        texts = self.guide.vocab.texts
        for t in output_ids[len(self._states) - 1:]:
            text = texts[t] if 0 <= t < len(texts) else None
            state = rx.walk(self._states[-1], text) if text else 0
            if not state:
                raise RuntimeError(f"regex {rx.pattern!r}: token {t} leaves no match possible")
            self._states.append(state)
        m = self.guide.mask(self._states[len(output_ids)])
        if not m.any():
            raise RuntimeError(f"regex {rx.pattern!r}: after {len(output_ids)} tokens no token can go on (the match "
                               f"needs characters no token holds alone)")
        return m
