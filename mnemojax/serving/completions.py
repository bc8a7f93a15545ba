"""POST /v1/completions: prompt strings or token ids in, text (and log-probs) out."""
from __future__ import annotations

from fastapi import Request

from mnemojax.scheduling.outputs import CompletionOutput
from mnemojax.serving.base import Choice, OpenAIServing, bad_request
from mnemojax.serving.protocol import CompletionRequest


class ServingCompletion(OpenAIServing):
    object_name = stream_object = "text_completion"
    id_prefix = "cmpl"

    async def create(self, body: CompletionRequest, request: Request):
        self.check_model(body.model)
        try:
            body.check()
            prompts = body.prompts()
            params = body.sampling_params(16 if body.max_tokens is None else body.max_tokens, body.logprobs)
        except ValueError as e:
            raise bad_request(e) from None
        choices = self.admit(prompts, params, body.n)
        return await self.respond(request, body.stream, body.include_usage, choices)

    def logprobs(self, c: Choice, ids: list[int], lps: list[dict], offset: int) -> dict | None:
        if c.params.logprobs is None:
            return None
        tokens = [self.token_text(t) for t in ids]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": [d[t] for t, d in zip(ids, lps)],
                "top_logprobs": [{self.token_text(k): v for k, v in d.items()} for d in lps], "text_offset": offsets}

    def stream_choice(self, c: Choice, new: CompletionOutput, offset: int) -> dict:
        lps = self.logprobs(c, new.token_ids, new.logprobs or [], offset)
        return {"index": c.index, "text": new.text, "logprobs": lps, "finish_reason": new.finish_reason,
                "stop_reason": new.stop_reason}

    def whole_choice(self, c: Choice, whole: CompletionOutput) -> dict:
        return self.stream_choice(c, whole, 0)
