"""Structured outputs' regex over a vocabulary: the tokens a request may generate next so that its output text can
still match the pattern whole (`mnemojax.scheduling.regex.Regex`), then EOS once it does.

- `token_texts`: the text each token adds to an output, from the tokenizer (after a fixed token, so SentencePiece's
  leading spaces count); special tokens, tokens holding part of a UTF-8 character and ids past the tokenizer are
  None: never allowed.
- `TokenVocabulary`: those texts grouped by their first character, which every pattern's walk reuses.
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
    """Token texts (`token_texts`) grouped by their first character, each group's ids and the rest of their texts: a
    state's walk reads a first character once for the whole group and drops the group when it dies there (most
    groups, in a narrow state). Built once per engine, shared by every pattern's guide."""

    def __init__(self, texts: Sequence[str | None]):
        self.texts = list(texts)
        self.size = len(self.texts)
        self.groups: dict[str, tuple[list[int], list[str]]] = {}
        for t, s in enumerate(self.texts):
            if s:
                ids, rests = self.groups.setdefault(s[0], ([], []))
                ids.append(t)
                rests.append(s[1:])


class TokenGuide:
    """One pattern over one vocabulary: the bitmask of the tokens allowed in each DFA state (cached), as uint32
    words [ceil(vocab / 32)], token t bit t % 32 of word t // 32: those whose text keeps a match possible, and the
    EOS tokens where the text so far matches whole."""

    def __init__(self, regex: Regex, vocab: TokenVocabulary | Sequence[str | None], eos_ids: Sequence[int]):
        self.regex = regex
        self.vocab = vocab if isinstance(vocab, TokenVocabulary) else TokenVocabulary(vocab)
        self.vocab_size = self.vocab.size
        self.eos_ids = tuple(eos_ids)
        self._masks: dict[int, np.ndarray] = {}

    @property
    def words(self) -> int:
        return -(-self.vocab_size // 32)

    def allowed(self, state: int) -> np.ndarray:
        """bool[vocab]: the tokens allowed in `state`: per group of texts with the same first character, the state
        after it, then each text's rest walked from there (a group whose first character dies is skipped whole).
        Measured against other walks in docs/benchmarks.md (`scripts/bench_structured.py`)."""
        rx = self.regex
        walk, step, nexts = rx.walk, rx.step, rx._next
        keep: list[int] = []
        for ch, (ids, rests) in self.vocab.groups.items():
            after = nexts[state].get(ch)
            if after is None:
                after = step(state, ch)
            if after:
                keep += [t for t, rest in zip(ids, rests) if not rest or walk(after, rest)]
        ok = np.zeros(self.vocab_size, bool)
        ok[keep] = True
        if rx.accepts(state):
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
