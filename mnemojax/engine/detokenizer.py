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

Other tokenizers (SentencePiece-style decoders, Llama-2's) drop the space that starts the first token of any run
they decode, so a window decoded alone would lose its words' spaces. As vLLM's incremental detokenizer does, each
window is then decoded after the window before it (the prompt's last tokens before the first) and only what it
adds is new text: the text is what the output adds to the prompt's text, `decode(prompt + output)` less
`decode(prompt)`, so "The capital is" continues with " Paris" (a whole decode of the output alone drops that
space).
"""
from __future__ import annotations

from collections.abc import Sequence

from mnemojax.scheduling.sampling_params import RequestOutputKind, SamplingParams
from models.tokenizer import is_byte_level

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5
"""How many of the prompt's last tokens a context-dependent tokenizer decodes the first window after (vLLM's)."""


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

    def feed(self, text: str, report: bool = True) -> int:
        """Reads `text` on; returns where in it the first complete match ends, or -1. Not `report`: matches do not
        count (read on past them; a later one that overlaps them still does)."""
        stop, fail, k = self.stop, self._fail, self.held
        for i, c in enumerate(text):
            while k and stop[k] != c:
                k = fail[k - 1]
            if stop[k] == c:
                k += 1
                if k == len(stop):
                    if report:
                        return i + 1
                    k = fail[k - 1]
        self.held = k
        return -1


class Detokenizer:
    """Turns one request's generated token ids into text and finds its stop strings."""

    def __init__(self, tokenizer, params: SamplingParams, prompt_ids: Sequence[int] = ()):
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stops = [_StopMatcher(s) for s in params.stop]
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens, self._num_added = params.min_tokens, 0  # a stop string counts after min_tokens tokens
        # nobody reads the text before the end and no stop string needs it: decode it all at once then
        self._at_end = params.output_kind is RequestOutputKind.FINAL_ONLY and not self._stops
        self._ids: list[int] = []
        # A byte-level tokenizer decodes a window alone; any other decodes it after the window before it, whose
        # text it then leaves out: ids[_prefix:_start] is that context (the prompt's last tokens at first, unless
        # they end inside a character: without those last tokens), ids[_start:] the undecoded window (it starts
        # at a character boundary).
        self._in_context = not is_byte_level(tokenizer)
        if self._in_context:
            context = [int(t) for t in prompt_ids[-_PROMPT_CONTEXT:]]
            while context and self._decode(context).endswith(_REPLACEMENT):
                context.pop()
            self._ids = context
        self._prefix = 0
        self._start = len(self._ids)
        self.text = ""  # the text of the output's tokens in ids[:_start]
        self.finished = False

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _new_text(self) -> str:
        """The text the window adds: decoded after its context, that context's own text left out. Where the
        context decodes otherwise before the window (a byte-fallback run that the window makes invalid UTF-8 turns
        all its bytes into U+FFFD, the shown character too), the window is decoded alone."""
        window = self._decode(self._ids[self._prefix:])
        if self._prefix == self._start:
            return window
        context = self._decode(self._ids[self._prefix:self._start])
        return window[len(context):] if window.startswith(context) else self._decode(self._ids[self._start:])

    def add(self, token_ids: list[int]) -> str | None:
        """Appends generated tokens; returns the stop string they completed (the text is then cut at it and
        the detokenizer is finished), else None."""
        if self.finished:
            raise RuntimeError("tokens added to a finished detokenizer")
        self._ids.extend(token_ids)
        self._num_added += len(token_ids)
        if self._at_end:
            return None
        new = self._new_text()
        if new.endswith(_REPLACEMENT):
            return None  # an incomplete character, or invalid bytes: decided when a complete character follows
        return self._append(new)

    def flush(self) -> None:
        """The request ended without a stop string: whatever is still undecoded becomes text as it is (invalid
        or incomplete bytes as U+FFFD, as a whole decode writes them)."""
        if not self.finished:
            if self._start < len(self._ids):
                self._append(self._new_text())
            self.finished = True

    def _append(self, new: str) -> str | None:
        before = len(self.text)
        self.text += new
        if not self._in_context:
            self._prefix = len(self._ids)
            self._start = len(self._ids)
        elif new:  # the next window's context is this one (one that added no text stays in the window)
            self._prefix, self._start = self._start, len(self._ids)
        report = self._num_added > self._min_tokens  # vLLM's: not in the text of the first min_tokens tokens
        for m in self._stops:  # the first stop string (in the request's order) that the new text completes
            end = m.feed(new, report)
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
