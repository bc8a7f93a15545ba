"""A mock `EngineClient` whose outputs are computed by hand, so the HTTP server can be tested without a model
(JetStream's `mock_engine` habit).

The byte tokenizer; output token i (from 0) of a request is `(p + 1 + i) % 256`, where p is its last prompt token,
with log-prob `-(i + 1) / 10` and, as its only other top entry, token `(t + 1) % 256` at that log-prob minus 1.
It stops at `max_tokens` ("length"), at a stop token id (its text left out unless `include_stop_str_in_output`, as
the engine does), or at a stop string (the engine's own `Detokenizer`).
Outputs are cumulative or deltas, as the request's `output_kind` asks. `token_delay_s` paces the tokens (a slow
engine); `fail_after` makes `generate` raise `failure` after that many tokens (a failing engine); `kv_tokens` makes
its KV pages hold fewer tokens of a request than `max_model_len` (prompt + max_tokens beyond it is a 400);
`tokenizer` and `tokens` (last prompt token, max_tokens -> the output's ids) replace the byte tokenizer and its
tokens.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from mnemojax.engine.async_llm import EngineStats
from mnemojax.engine.detokenizer import Detokenizer
from mnemojax.scheduling.outputs import CompletionOutput, RequestMetrics, RequestOutput
from mnemojax.scheduling.sampling_params import ParamError, RequestOutputKind, SamplingParams, truncate_prompt
from models.tokenizer import ByteTokenizer


def mock_tokens(last_prompt_token: int, n: int) -> list[int]:
    return [(last_prompt_token + 1 + i) % 256 for i in range(n)]


class MockEngine:
    model = "mock"
    is_alive = True

    def __init__(self, max_model_len: int = 64, token_delay_s: float = 0.0, fail_after: int | None = None,
                 failure: BaseException | None = None, kv_tokens: int | None = None, tokenizer=None,
                 tokens: Callable[[int, int], list[int]] = mock_tokens, default_sampling: dict | None = None):
        self.tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
        self.tokens = tokens  # (last prompt token, max_tokens) -> the output's tokens
        self.default_sampling = default_sampling or {}  # the model's generation_config.json defaults
        self.eos_token_id = getattr(self.tokenizer, "eos_token_id", None)
        self.max_model_len = max_model_len
        self.max_request_tokens = max_model_len if kv_tokens is None else min(max_model_len, kv_tokens)
        self.token_delay_s = token_delay_s
        self.fail_after, self.failure = fail_after, failure
        self.num_waiting = 0
        self.num_active = 0
        self.requests: list[tuple[list[int], SamplingParams]] = []  # what generate() was asked, in order
        self.finished: list[str] = []  # finish reasons of requests that ran to their end
        self.dropped = 0  # requests whose caller stopped listening before their end
        self._listeners = []

    def validate(self, prompt, params: SamplingParams, priority: int = 0) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        ids = truncate_prompt(ids, params.truncate_prompt_tokens, self.max_model_len)  # the engine's, as it is
        params.validate(vocab_size=self.tokenizer.vocab_size)
        # what the mock does not model
        for name, off in (("min_p", 0.0), ("min_tokens", 0), ("logit_bias", None), ("allowed_token_ids", None),
                          ("structured_outputs", None)):
            if getattr(params, name) != off:
                raise AssertionError(f"the mock engine ignores {name}: test it against a real engine")
        if priority != 0:
            raise AssertionError("the mock engine ignores priority: test it against a real engine")
        if not ids:
            raise ParamError("prompt", "prompt must not be empty")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ParamError("prompt", f"prompt + max_tokens exceeds max_model_len ({self.max_model_len})")
        if len(ids) + params.max_tokens > self.max_request_tokens:
            raise ParamError("prompt", f"prompt + max_tokens: {len(ids) + params.max_tokens} tokens exceed what the KV "
                                       f"pages hold ({self.max_request_tokens} tokens)")
        return ids

    async def generate(self, prompt, params=None, request_id=None, *, prompt_token_ids=None, priority=0):
        ids = prompt_token_ids if prompt_token_ids is not None else self.validate(prompt, params, priority)
        self.requests.append((ids, params))
        delta = params.output_kind is RequestOutputKind.DELTA
        detok = Detokenizer(self.tokenizer, params, ids)
        out_ids, lps = [], []
        reason = stop_reason = None
        sent_tokens = sent_text = 0
        self.num_active += 1
        self.num_waiting += 1  # as AsyncLLM: from the generator's first step to its first output
        waiting = True
        try:
            for i, t in enumerate(self.tokens(ids[-1], params.max_tokens)):
                await asyncio.sleep(self.token_delay_s)
                if self.fail_after is not None and i >= self.fail_after:
                    raise self.failure
                lp = -(i + 1) / 10
                out_ids.append(t)
                lps.append({t: lp, (t + 1) % 256: lp - 1})
                if t in params.stop_token_ids:  # as the engine: its text only with include_stop_str_in_output
                    reason = "stop"
                    stop_reason = (params.include_stop_str_in_output and detok.add([t])) or t
                elif (stop_reason := detok.add([t])) is not None:
                    reason = "stop"
                elif i + 1 == params.max_tokens:
                    reason = "length"
                if reason is not None:
                    detok.flush()
                out = self._output(request_id, ids, detok.stable_text, out_ids, lps, params, reason, stop_reason,
                                   *((sent_tokens, sent_text) if delta else (0, 0)))
                sent_tokens, sent_text = len(out_ids), len(detok.stable_text)
                if reason is not None:
                    self.finished.append(reason)
                    whole = self._output(request_id, ids, detok.text, out_ids, lps, params, reason, stop_reason)
                    for fn in self._listeners:
                        fn(whole)
                if waiting:
                    self.num_waiting -= 1
                    waiting = False
                yield out
                if reason is not None:
                    return
        finally:
            if waiting:
                self.num_waiting -= 1
            self.num_active -= 1
            if reason is None:
                self.dropped += 1

    @staticmethod
    def _output(rid, prompt_ids, text, ids, lps, params, reason, stop_reason, tokens=0, chars=0) -> RequestOutput:
        """The output from token `tokens` and character `chars` on (all of it by default; the prompt only in an
        output that starts at the beginning)."""
        return RequestOutput(rid, None, prompt_ids if tokens == 0 else [], None, [CompletionOutput(
            0, text[chars:], ids[tokens:], lps[tokens:] if params.logprobs is not None else None, reason, stop_reason)],
            reason is not None, RequestMetrics(0.0, 0.0, 0.0, None, []))

    def stats(self) -> EngineStats:
        return EngineStats()

    def add_finished_listener(self, fn) -> None:
        self._listeners.append(fn)

    def abort_all(self) -> None:
        pass

    async def reset_prefix_cache(self) -> int:
        self.num_cache_resets = getattr(self, "num_cache_resets", 0) + 1
        return 0
