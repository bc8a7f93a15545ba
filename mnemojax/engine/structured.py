"""Structured outputs' regex over a vocabulary: the tokens a request may generate next so that its output text can
still match the pattern whole (`mnemojax.scheduling.regex.Regex`), then EOS once it does.

- `token_texts`: the text each token adds to an output, from the tokenizer (after a fixed token, so SentencePiece's
  leading spaces count); special tokens, tokens holding part of a UTF-8 character and ids past the tokenizer are
  None: never allowed.
- `TokenVocabulary`: those texts sorted with their shared prefixes, which every pattern's walk reuses.
- `TokenGuide`: per pattern, the allowed-token bitmask of each DFA state (cached), the sampler's `masks`.
- `RegexState`: one request's walk through its guide along its generated tokens.
"""
from __future__ import annotations

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
    """Token texts (`token_texts`) sorted, each with the length of the prefix it shares with the one before: a walk
    over them re-reads only what differs from the previous text, and skips at once every text that starts with a
    prefix already found dead. Built once per engine, shared by every pattern's guide."""

    def __init__(self, texts: Sequence[str | None]):
        self.texts = list(texts)
        self.size = len(self.texts)
        order = sorted((t for t, s in enumerate(self.texts) if s), key=lambda t: self.texts[t])
        self.ids = order
        self.sorted = [self.texts[t] for t in order]
        lcp, prev = [], ""
        for s in self.sorted:
            n, most = 0, min(len(s), len(prev))
            while n < most and s[n] == prev[n]:
                n += 1
            lcp.append(n)
            prev = s
        self.lcp = lcp
        self.longest = max(map(len, self.sorted), default=0)


class TokenGuide:
    """One pattern over one vocabulary: the bitmask of the tokens allowed in each DFA state (cached), as uint32
    words [ceil(vocab / 32)], token t bit t % 32 of word t // 32: those whose text keeps a match possible, and the
    EOS tokens where the text so far matches whole."""

    def __init__(self, regex: Regex, vocab: TokenVocabulary | Sequence[str | None], eos_ids: Sequence[int]):
        self.regex = regex
        self.vocab = vocab if isinstance(vocab, TokenVocabulary) else TokenVocabulary(vocab)
        self.vocab_size = self.vocab.size
        self.eos_ids = tuple(eos_ids)
        self.texts = self.vocab.texts
        self._masks: dict[int, np.ndarray] = {}

    @property
    def words(self) -> int:
        return -(-self.vocab_size // 32)

    def allowed(self, state: int) -> np.ndarray:
        """bool[vocab]: the tokens allowed in `state`: the sorted texts walked from it, each from the states of the
        prefix it shares with the text before (a stack), the texts under a dead prefix skipped."""
        rx, v = self.regex, self.vocab
        step, nexts = rx.step, rx._next  # the cached transitions read inline (a call per character costs ~2x)
        most = v.longest
        stack = [state] * (most + 1)  # stack[k]: the state after the first k characters of the text walked last
        dead = most + 1  # the last walk died reading character `dead` (past any text: it did not die)
        keep, ids = [], v.ids
        for i, s, shared in zip(range(len(ids)), v.sorted, v.lcp):
            if shared > dead:
                continue  # starts with the prefix that died
            st, k = stack[shared], shared
            for ch in s[shared:]:
                nxt = nexts[st].get(ch)
                if nxt is None:
                    nxt = step(st, ch)
                if not nxt:
                    break
                k += 1
                stack[k] = st = nxt
            else:
                keep.append(ids[i])
                dead = most + 1
                continue
            dead = k
        ok = np.zeros(self.vocab_size, bool)
        ok[keep] = True
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
        texts = self.guide.texts
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
