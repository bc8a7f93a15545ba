"""Incremental detokenization with stop strings: one request's output text, grown token by token.

The shape of vLLM's `v1/engine/detokenizer.py`: each new token decodes only a short window of the newest
tokens (not the whole output again), stop strings are matched only over the new text (Knuth-Morris-Pratt: a new
character costs the same whatever a stop string's length), and the text that a later token could still take back
is held back here, nowhere else:
- an incomplete UTF-8 character (its bytes decode to U+FFFD until the last one arrives) is not text yet;
- the longest tail of the text that is the start of a stop string is held back, since a stop string that
  completes later is cut from the output.
`text` is everything decoded so far; `stable_text` is what may be shown while the request runs (all of it once
finished). The stable text only ever grows, so streaming its deltas gives exactly the final text. A request that
shows nothing before it ends (`RequestOutputKind.FINAL_ONLY`) and has no stop string to find decodes nothing
while it runs: its text is decoded once, when it is flushed.

For byte-level tokenizers (the built-in byte tokenizer, Llama-3's byte-level BPE) the text equals
`tokenizer.decode(all output ids)`: the window is cut only after a complete character, where UTF-8 decoding
starts afresh.
"""
from __future__ import annotations

from mnemojax.scheduling.sampling_params import RequestOutputKind, SamplingParams

_REPLACEMENT = "\ufffd"


class _StopMatcher:
    """One stop string, matched as the text grows (Knuth-Morris-Pratt). `held` is the length of the longest end of
    the text so far that is a start of the string: what a later token could still complete."""

    def __init__(self, stop: str):
        self.stop = stop
        self._fail = [0] * len(stop)  # [i]: the longest proper start of stop[:i + 1] that also ends it
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self._fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self._fail[i] = k
        self.held = 0

    def feed(self, text: str) -> int:
        """Reads `text` on; returns where in it the first complete match ends, or -1."""
        stop, fail, k = self.stop, self._fail, self.held
        for i, c in enumerate(text):
            while k and stop[k] != c:
                k = fail[k - 1]
            if stop[k] == c:
                k += 1
                if k == len(stop):
                    return i + 1
        self.held = k
        return -1


class Detokenizer:
    """Turns one request's generated token ids into text and finds its stop strings."""

    def __init__(self, tokenizer, params: SamplingParams):
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stops = [_StopMatcher(s) for s in params.stop]
        self._include_stop = params.include_stop_str_in_output
        # nobody reads the text before the end and no stop string needs it: decode it all at once then
        self._at_end = params.output_kind is RequestOutputKind.FINAL_ONLY and not self._stops
        self._ids: list[int] = []
        self._start = 0  # the undecoded window starts at this token (a character boundary)
        self.text = ""  # the decoded text of ids[:_start]
        self.finished = False

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def add(self, token_ids: list[int]) -> str | None:
        """Appends generated tokens; returns the stop string they completed (the text is then cut at it and
        the detokenizer is finished), else None."""
        if self.finished:
            raise RuntimeError("tokens added to a finished detokenizer")
        self._ids.extend(token_ids)
        if self._at_end:
            return None
        window = self._decode(self._ids[self._start:])
        if window.endswith(_REPLACEMENT):
            return None  # an incomplete character, or invalid bytes: decided when a complete character follows
        return self._append(window, len(self._ids))

    def flush(self) -> None:
        """The request ended without a stop string: whatever is still undecoded becomes text as it is (invalid
        or incomplete bytes as U+FFFD, as a whole decode writes them)."""
        if not self.finished:
            if self._start < len(self._ids):
                self._append(self._decode(self._ids[self._start:]), len(self._ids))
            self.finished = True

    def _append(self, new: str, upto: int) -> str | None:
        before = len(self.text)
        self.text += new
        self._start = upto
        for m in self._stops:  # the first stop string (in the request's order) that the new text completes
            end = m.feed(new)
            if end >= 0:
                at = before + end - len(m.stop)
                self.text = self.text[:at + len(m.stop) if self._include_stop else at]
                self.finished = True
                return m.stop
        return None

    @property
    def stable_text(self) -> str:
        """The text no later token can change (all of it once finished): without the longest end of the text that
        could still be the start of a stop string."""
        held = max((m.held for m in self._stops), default=0)
        return self.text if self.finished or not held else self.text[:len(self.text) - held]
