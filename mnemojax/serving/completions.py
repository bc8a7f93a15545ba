"""POST /v1/completions: prompt strings or token ids in, text (and log-probs) out.

`echo` (OpenAI's): the text is the prompt (decoded from its token ids) followed by the completion, and `logprobs`
covers the prompt's tokens first (the first one's log-prob and top entries null), then the generated ones; the
prompt's come from the engine's prompt log-probs. `max_tokens: 0` (only with echo) returns the prompt alone: the
engine generates one token, which the response leaves out. Echo works with `n` (each choice echoes the prompt) but
not with `stream` (400). vLLM's `prompt_logprobs` adds each choice's `prompt_logprobs`.
"""
from __future__ import annotations

from fastapi import Request

from mnemojax.scheduling.outputs import CompletionOutput
from mnemojax.serving.base import APIError, Choice, OpenAIServing, bad_request, top_entries
from mnemojax.serving.protocol import CompletionRequest


class ServingCompletion(OpenAIServing):
    object_name = stream_object = "text_completion"
    id_prefix = "cmpl"

    async def create(self, body: CompletionRequest, request: Request):
        self.check_model(body.model)
        try:
            body.check()
            prompts = body.prompts()
            max_tokens = 16 if body.max_tokens is None else body.max_tokens
            # echo shows the prompt's log-probs with the request's `logprobs` top entries: the engine computes as
            # many as the larger of that and `prompt_logprobs` asks for.
            wanted = [k for k in (body.prompt_logprobs, body.logprobs if body.echo else None) if k is not None]
            params = body.sampling_params(max(max_tokens, 1), body.logprobs, max(wanted) if wanted else None)
        except ValueError as e:
            raise bad_request(e) from None
        if body.echo and self.tokenizer is None:
            raise APIError(400, f"echo needs a tokenizer to write the prompt as text; model "
                                f"{self.state.served_model_name!r} has none", "echo")
        choices = self.admit(prompts, params, body.n, show_prompt_logprobs=body.prompt_logprobs, echo=body.echo,
                             discard_output=max_tokens == 0)
        return await self.respond(request, body.stream, body.include_usage, choices)

    def logprobs(self, c: Choice, ids: list[int], lps: list[dict | None], offset: int,
                 widths: list[int] | None = None) -> dict | None:
        """OpenAI's completion logprobs of tokens `ids` whose text starts at `offset` of the choice's text; an entry
        of `lps` that is None (the prompt's first token) gives null log-prob and top entries. `widths`: each token's
        characters in the text (default: its `token_text`'s)."""
        if c.params.logprobs is None:
            return None
        tokens = [self.token_text(t) for t in ids]
        offsets = []
        for i, t in enumerate(tokens):
            offsets.append(offset)
            offset += len(t) if widths is None else widths[i]
        return {"tokens": tokens, "token_logprobs": [None if d is None else d[t] for t, d in zip(ids, lps)],
                "top_logprobs": [None if d is None else {self.token_text(k): v for k, v in d.items()} for d in lps],
                "text_offset": offsets}

    def stream_choice(self, c: Choice, new: CompletionOutput, offset: int) -> dict:
        lps = self.logprobs(c, new.token_ids, new.logprobs or [], offset)
        return {"index": c.index, "text": new.text, "logprobs": lps, "finish_reason": new.finish_reason,
                "stop_reason": new.stop_reason}

    def whole_choice(self, c: Choice, whole: CompletionOutput) -> dict:
        if not c.echo:
            return {**self.stream_choice(c, whole, 0), "prompt_logprobs": self.prompt_logprobs(c)}
        skip = c.params.skip_special_tokens
        prompt = self.tokenizer.decode(c.prompt_ids, skip_special_tokens=skip)
        lps = None
        if c.params.logprobs is not None:
            special = set(self.tokenizer.all_special_ids) if skip else set()
            widths = [0 if t in special else len(self.token_text(t)) for t in c.prompt_ids]
            # The engine may have computed more top entries for the prompt (`prompt_logprobs`) than `logprobs` shows.
            plps = [None if d is None else dict(top_entries(d, c.params.logprobs, t))
                    for t, d in zip(c.prompt_ids, c.prompt_logprobs)]
            lps = self.logprobs(c, c.prompt_ids, plps, 0, widths)
            gen = self.logprobs(c, whole.token_ids, whole.logprobs or [], len(prompt))
            lps = {k: lps[k] + gen[k] for k in lps}
        return {"index": c.index, "text": prompt + whole.text, "logprobs": lps, "finish_reason": whole.finish_reason,
                "stop_reason": whole.stop_reason, "prompt_logprobs": self.prompt_logprobs(c)}
