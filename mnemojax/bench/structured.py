"""Host cost of structured outputs' regex masks (`mnemojax.engine.structured`) on a vocabulary of Llama-3's size
(a JSON schema's, `structured_outputs.json`, are a regex's: the last pattern is one).

A regex request's logits row needs, per step, the bitmask of the tokens that keep a whole match possible. The mask
of each state of the pattern's automaton is computed once (the first request to reach that state pays it, on the
engine's thread, before the step is launched), then cached per pattern. This measures, on a synthetic vocabulary
of `--vocab` token texts shaped like a byte-level BPE one (single characters, words with and without a leading
space, capitalised words, numbers, punctuation runs; Llama-3's own cannot be downloaded here):

- per pattern, the ms to compute one new state's mask (mean over the states a walk through `--tokens` tokens of a
  match visits), against a side-by-side run of the same masks the plain way (each token's text walked whole from
  the state, where `TokenGuide` steps all live tokens a character at a time through numpy arrays, by character
  classes of the pattern), and the ratio between them;
- the ms per token of a request's walk once its states are cached (`RegexState.mask_after`), what every step
  pays per regex row;
- the mask's bytes per row sent with the step.

    python scripts/bench_structured.py [--vocab 128256] [--tokens 24] [--seed 0]
"""
from __future__ import annotations

import argparse
import random
import string
import time

import numpy as np

from mnemojax.bench import print_header
from mnemojax.engine.structured import RegexState, TokenGuide, TokenVocabulary
from mnemojax.scheduling.json_schema import schema_pattern
from mnemojax.scheduling.regex import Regex

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["admin", "staff", "guest"]}, "maxItems": 3}},
    "required": ["name", "age"]}
"""A JSON schema of the kind `structured_outputs.json` takes (written as a regex by `schema_pattern`)."""
LINK = {"type": "object", "properties": {
    "url": {"type": "string", "format": "uri"}, "host": {"type": "string", "format": "ipv6"},
    "ttl": {"type": "string", "format": "duration"}, "headers": {"type": "object",
                                                               "additionalProperties": {"type": "string"}}},
    "required": ["url", "host", "ttl"]}
"""One with formats (pydantic's AnyUrl, IPv6Address, timedelta) and a dict[str, str]."""
PATTERNS = {
    "phone": r"\(\d{3}\) \d{3}-\d{4}",
    "yes/no + reason": r"(yes|no), because [a-z ]{10,60}\.",
    "sentence": r"[A-Z][a-z]+( [a-z]+){3,12}\.",
    "anything, 80 chars": r"(.|\n){0,80}",
    "json schema: person": schema_pattern(PERSON, whitespace_pattern=" ?"),
    "json schema: link": schema_pattern(LINK, whitespace_pattern=" ?"),
}


def synthetic_vocab(size: int, seed: int = 0) -> list[str | None]:
    """`size` token texts shaped like a byte-level BPE vocabulary's (ids 0 and 1: None, two special tokens)."""
    rng = random.Random(seed)
    texts: list[str | None] = [None, None] + list(string.printable) + [str(i) for i in range(1000)]
    puncts = ".,;:!?()[]{}'\"-_/*=+<>#&%$@"
    while len(texts) < size:
        kind = rng.random()
        if kind < 0.85:
            word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.choice([2, 3, 4, 5, 6, 7, 8, 9])))
            word = word.capitalize() if rng.random() < 0.2 else word
            texts.append((" " if rng.random() < 0.6 else "") + word)
        else:
            texts.append("".join(rng.choice(puncts) for _ in range(rng.choice([1, 2, 3]))))
    return texts[:size]


def _plain_mask(guide: TokenGuide, texts: list[str | None], state: int) -> np.ndarray:
    """The allowed tokens the plain way: every token's text walked from `state` (the baseline)."""
    walk = guide.regex.walk
    ok = np.array([bool(s) and bool(walk(state, s)) for s in texts])
    if guide.regex.accepts(state):
        ok[list(guide.eos_ids)] = True
    return ok


def _match_tokens(guide: TokenGuide, tokens: int, seed: int) -> list[int]:
    """A greedy-ish walk: `tokens` tokens (or fewer, up to EOS), each a random allowed one (EOS last)."""
    rng = np.random.default_rng(seed)
    walk, out = RegexState(guide), []
    for _ in range(tokens):
        bits = walk.mask_after(out)
        allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little")[:guide.vocab_size])
        choice = [t for t in allowed if t not in guide.eos_ids] or list(allowed)
        t = int(rng.choice(choice))
        if t in guide.eos_ids:
            break
        out.append(t)
    return out


def measure(vocab: int, tokens: int, seed: int) -> list[tuple[str, int, float, float, float]]:
    """Per pattern: (name, states, ms per state's mask, ms per state the plain way, ms per token cached)."""
    texts = TokenVocabulary(synthetic_vocab(vocab, seed))
    rows = []
    for name, pattern in PATTERNS.items():
        regex = Regex(pattern)
        out = _match_tokens(TokenGuide(regex, texts, eos_ids=[1]), tokens, seed)  # a match's tokens
        guide = TokenGuide(regex, texts, eos_ids=[1])  # no mask computed yet (the automaton's states known)
        walk = RegexState(guide)
        guide_ms = 0.0
        for k in range(len(out) + 1):
            t = time.perf_counter()
            walk.mask_after(out[:k])  # a new state's mask, or one already seen in this walk
            guide_ms += (time.perf_counter() - t) * 1e3
        states = list(guide._masks)
        plain_ms = 0.0
        for state in states:
            t = time.perf_counter()
            plain = _plain_mask(guide, texts.texts, state)
            plain_ms += (time.perf_counter() - t) * 1e3
            if not np.array_equal(plain, guide.allowed(state)):
                raise AssertionError(f"{name}: the plain walk and the guide disagree in state {state}")
        t = time.perf_counter()
        for _ in range(5):
            walk = RegexState(guide)
            for k in range(len(out) + 1):
                walk.mask_after(out[:k])
        cached_ms = (time.perf_counter() - t) * 1e3 / (5 * (len(out) + 1))
        rows.append((name, len(states), guide_ms / len(states), plain_ms / len(states), cached_ms))
    return rows


def table(rows, vocab: int) -> str:
    lines = [f"{'pattern':<20} {'states':>6} {'ms/new state':>13} {'plain walk':>11} {'speed-up':>9} "
             f"{'ms/token cached':>16}"]
    for name, states, new, plain, cached in rows:
        lines.append(f"{name:<20} {states:>6} {new:>13.1f} {plain:>11.1f} {plain / new:>8.1f}x {cached:>16.4f}")
    lines.append(f"mask per regex row: {-(-vocab // 32) * 4} bytes ({vocab} tokens, one bit each)")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print_header(argv)
    print(table(measure(args.vocab, args.tokens, args.seed), args.vocab))
