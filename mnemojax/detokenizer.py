"""Incremental detokenization with stop strings: one request's output text, grown token by token.

The shape of vLLM's `v1/engine/detokenizer.py`: each new token decodes only a short window of the newest
tokens (not the whole output again), stop strings are searched only where new text could complete them, and
the text that a later token could still take back is held back here, nowhere else:
- an incomplete UTF-8 character (its bytes decode to U+FFFD until the last one arrives) is not text yet;
- the longest tail of the text that is the start of a stop string is held back, since a stop string that
  completes later is cut from the output.
`text` is everything decoded so far; `stable_text` is what may be shown while the request runs (all of it once
finished). The stable text only ever grows, so streaming its deltas gives exactly the final text.

For byte-level tokenizers (the built-in byte tokenizer, Llama-3's byte-level BPE) the text equals
`tokenizer.decode(all output ids)`: the window is cut only after a complete character, where UTF-8 decoding
starts afresh.
"""
from __future__ import annotations

from mnemojax.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"


class Detokenizer:
    """Turns one request's generated token ids into text and finds its stop strings."""

    def __init__(self, tokenizer, params: SamplingParams):
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stop = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
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
        for s in self._stop:
            at = self.text.find(s, max(0, before - len(s) + 1))
            if at >= 0:
                self.text = self.text[:at + len(s) if self._include_stop else at]
                self.finished = True
                return s
        return None

    def _held_back(self) -> int:
        """Characters at the end of the text that could still be the start of a stop string."""
        held = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self.text)), held, -1):
                if self.text.endswith(s[:k]):
                    held = k
                    break
        return held

    @property
    def stable_text(self) -> str:
        """The text no later token can change: all of it once finished."""
        return self.text if self.finished else self.text[:len(self.text) - self._held_back()]
