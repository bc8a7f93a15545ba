"""A mock `EngineClient` whose outputs are computed by hand, so the HTTP server can be tested without a model
(JetStream's `mock_engine` habit).

The byte tokenizer; output token i (from 0) of a request is `(p + 1 + i) % 256`, where p is its last prompt token,
with log-prob `-(i + 1) / 10` and, as its only other top entry, token `(t + 1) % 256` at that log-prob minus 1.
It stops at `max_tokens` ("length"), at a stop token id, or at a stop string (the engine's own `Detokenizer`).
"""
from __future__ import annotations

import asyncio

from mnemojax.async_llm import EngineStats
from mnemojax.detokenizer import Detokenizer
from mnemojax.outputs import CompletionOutput, RequestMetrics, RequestOutput
from mnemojax.sampling_params import ParamError, SamplingParams
from models.tokenizer import ByteTokenizer


def mock_tokens(last_prompt_token: int, n: int) -> list[int]:
    return [(last_prompt_token + 1 + i) % 256 for i in range(n)]


class MockEngine:
    model = "mock"
    max_model_len = 64
    is_alive = True

    def __init__(self):
        self.tokenizer = ByteTokenizer()
        self.num_waiting = 0
        self.num_active = 0
        self.requests: list[tuple[list[int], SamplingParams]] = []  # what generate() was asked, in order
        self._listeners = []

    def validate(self, prompt, params: SamplingParams) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        params.validate(vocab_size=self.tokenizer.vocab_size)
        if not ids:
            raise ParamError("prompt", "prompt must not be empty")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ParamError("prompt", f"prompt + max_tokens exceeds max_model_len ({self.max_model_len})")
        return ids

    async def generate(self, prompt, params=None, request_id=None, *, prompt_token_ids=None):
        ids = prompt_token_ids if prompt_token_ids is not None else self.validate(prompt, params)
        self.requests.append((ids, params))
        detok = Detokenizer(self.tokenizer, params)
        out_ids, lps = [], []
        reason = stop_reason = None
        self.num_active += 1
        try:
            for i, t in enumerate(mock_tokens(ids[-1], params.max_tokens)):
                await asyncio.sleep(0)
                lp = -(i + 1) / 10
                out_ids.append(t)
                lps.append({t: lp, (t + 1) % 256: lp - 1})
                stop_reason = detok.add([t])
                if stop_reason is not None:
                    reason = "stop"
                elif t in params.stop_token_ids:
                    reason, stop_reason = "stop", t
                elif i + 1 == params.max_tokens:
                    reason = "length"
                if reason is not None:
                    detok.flush()
                out = RequestOutput(request_id, None, ids, None, [CompletionOutput(
                    0, detok.stable_text, list(out_ids), list(lps) if params.logprobs is not None else None,
                    reason, stop_reason)], reason is not None, RequestMetrics(0.0, 0.0, 0.0, None, []))
                if reason is not None:
                    for fn in self._listeners:
                        fn(out)
                yield out
                if reason is not None:
                    return
        finally:
            self.num_active -= 1

    def stats(self) -> EngineStats:
        return EngineStats()

    def add_finished_listener(self, fn) -> None:
        self._listeners.append(fn)

    def abort_all(self) -> None:
        pass
