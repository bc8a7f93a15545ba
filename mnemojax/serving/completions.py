"""POST /v1/completions: prompt strings or token ids in, text (and log-probs) out.

`echo` (OpenAI's): the text is the prompt (decoded from its token ids) followed by the completion, and `logprobs`
covers the prompt's tokens first (the first one's log-prob and top entries null), then the generated ones; the
prompt's come from the engine's prompt log-probs. `max_tokens: 0` (only with echo) returns the prompt alone: the
engine generates one token, which the response leaves out. Echo works with `n` (each choice echoes the prompt) and
with `stream` (each choice's first chunk leads with the prompt's text and log-probs, as vLLM's). vLLM's
`prompt_logprobs` adds each choice's `prompt_logprobs` (not with `stream`, as in vLLM).
"""
from __future__ import annotations

import math

from fastapi import Request

from mnemojax.scheduling.outputs import CompletionOutput
from mnemojax.serving.base import APIError, Choice, OpenAIServing, TextOffsets, bad_request, top_entries
from mnemojax.serving.protocol import CompletionRequest


class ServingCompletion(OpenAIServing):
    object_name = stream_object = "text_completion"
    id_prefix = "cmpl"

    async def create(self, body: CompletionRequest, request: Request):
        self.check_model(body.model)
        try:
            body.check()
            prompts = body.prompts()
            # absent: OpenAI's 16; an explicit null: the rest of what the request can hold (vLLM's), per prompt
            rest = body.max_tokens is None and "max_tokens" in body.model_fields_set
            max_tokens = 16 if body.max_tokens is None else body.max_tokens
            if rest:  # a stand-in until each prompt's room is known (`admit`), which min_tokens is checked against
                max_tokens = max(max_tokens, body.min_tokens or 0)
            # echo shows the prompt's log-probs with the request's `logprobs` top entries: the engine computes as
            # many as the larger of that and `prompt_logprobs` asks for.
            wanted = [k for k in (body.prompt_logprobs, body.logprobs if body.echo else None) if k is not None]
            params = body.sampling_params(max(max_tokens, 1), body.logprobs, max(wanted) if wanted else None,
                                          self.llm.default_sampling)
            beam = body.beam_search_params(params) if body.use_beam_search else None
        except ValueError as e:
            raise bad_request(e) from None
        if body.echo and self.tokenizer is None:
            raise APIError(400, f"echo needs a tokenizer to write the prompt as text; model "
                                f"{self.state.served_model_name!r} has none", "echo")
        if not body.add_special_tokens and self.tokenizer is not None:  # vLLM's: the text alone, without BOS
            prompts = [list(self.tokenizer.encode(p, add_special_tokens=False)) if isinstance(p, str) else p
                       for p in prompts]
        choices = self.admit(prompts, params, body.n, rest_of_context=rest, show_prompt_logprobs=body.prompt_logprobs,
                             echo=body.echo, discard_output=max_tokens == 0,
                             token_ids_as_text=self.token_ids_as_text(body),
                             return_token_ids=bool(body.return_token_ids), priority=body.priority)
        return await self.respond(request, body.stream, body.include_usage, choices, body.continuous_usage, beam,
                                  body.request_id)

    def logprobs(self, c: Choice, ids: list[int], lps: list[dict | None], offsets: list[int]) -> dict | None:
        """OpenAI's completion logprobs of tokens `ids`, whose text starts at `offsets` of the choice's text; an entry
        of `lps` that is None (the prompt's first token) gives null log-prob and top entries."""
        if c.params.logprobs is None:
            return None
        as_id = c.token_ids_as_text
        return {"tokens": [self.token_text(t, as_id) for t in ids],
                "token_logprobs": [None if d is None else d[t] for t, d in zip(ids, lps)],
                "top_logprobs": [None if d is None else {self.token_text(k, as_id): v for k, v in d.items()}
                                 for d in lps],
                "text_offset": offsets}

    @staticmethod
    def offsets(tracker: TextOffsets, ids: list[int], base: int, floor: int, end: int) -> list[int]:
        """Where tokens `ids` start in the choice's text: `base` (where their text starts) plus what `tracker`, which
        has read the tokens before them, says; never below `floor` (the previous token's) nor past `end` (the text
        so far: a stop string cut from the text, or held back, leaves its tokens at the end)."""
        out = []
        for t in ids:
            floor = min(max(base + tracker.add(t), floor), end)
            out.append(floor)
        return out

    def stream_choice(self, c: Choice, new: CompletionOutput, offset: int) -> dict:
        """A chunk's choice. Its log-probs are those of the tokens whose `text_offset` is settled: a token's offset
        is its start in the text, or the end of the final text when a stop string cut its text off; while its
        start lies past the text streamed so far (its text held back: an incomplete character, the start of a stop
        string) that is not known yet, so its entry waits for a later chunk, as held-back text does, and the
        stream's entries joined equal the whole response's. With echo the choice's first chunk leads with the
        prompt (by then the engine has sent all of the prompt's log-probs: a request's first token comes after
        its whole prompt)."""
        first, c.streamed = not c.streamed, True
        prompt = self.prompt_text(c) if first and c.echo else ""  # its text may be empty (special tokens only)
        if first:
            c.echo_chars = len(prompt)
        base = c.echo_chars  # where the completion starts in the choice's text
        lps = None
        if c.params.logprobs is not None:
            if c.offsets is None:
                c.offsets = self.text_offsets(c.params, c.prompt_ids)
            starts = self.offsets(c.offsets, new.token_ids, base, c.last_offset, math.inf)  # not clamped
            c.last_offset = starts[-1] if starts else c.last_offset
            c.held += zip(new.token_ids, new.logprobs or [None] * len(new.token_ids), starts)
            end = base + offset + len(new.text)  # the text streamed so far, this chunk's included
            # the starts never decrease: the settled ones are a prefix
            n = len(c.held) if new.finish_reason is not None else sum(at <= end for _, _, at in c.held)
            ready, c.held = c.held[:n], c.held[n:]
            lps = self.logprobs(c, [t for t, _, _ in ready], [d for _, d, _ in ready],
                                [min(at, end) for _, _, at in ready])
            if first and c.echo:
                echoed = self.echo_logprobs(c, prompt)
                lps = {k: echoed[k] + lps[k] for k in lps}
        out = {"index": c.index, "text": prompt + new.text, "logprobs": lps, "finish_reason": new.finish_reason,
               "stop_reason": new.stop_reason}
        if c.return_token_ids:  # vLLM's: the chunk's new ids, the prompt's in the choice's first chunk
            out["token_ids"] = new.token_ids
            if first:
                out["prompt_token_ids"] = c.prompt_ids
        return out

    def prompt_text(self, c: Choice) -> str:
        """Echo's text of the prompt: its token ids decoded."""
        return self.tokenizer.decode(c.prompt_ids, skip_special_tokens=c.params.skip_special_tokens)

    def echo_logprobs(self, c: Choice, prompt: str) -> dict:
        """Echo's logprobs of the prompt's tokens (`prompt`: their text), the first one's null. The engine may have
        computed more top entries for the prompt (`prompt_logprobs`) than `logprobs` shows."""
        plps = [None if d is None else dict(top_entries(d, c.params.logprobs, t))
                for t, d in zip(c.prompt_ids, c.prompt_logprobs)]
        at = self.offsets(self.text_offsets(c.params), c.prompt_ids, 0, 0, len(prompt))
        return self.logprobs(c, c.prompt_ids, plps, at)

    def whole_choice(self, c: Choice, whole: CompletionOutput) -> dict:
        prompt = self.prompt_text(c) if c.echo else ""
        text = prompt + whole.text
        lps = None
        if c.params.logprobs is not None:
            at = self.offsets(self.text_offsets(c.params, c.prompt_ids), whole.token_ids, len(prompt), len(prompt),
                             len(text))
            lps = self.logprobs(c, whole.token_ids, whole.logprobs or [], at)
            if c.echo:
                echoed = self.echo_logprobs(c, prompt)
                lps = {k: echoed[k] + lps[k] for k in lps}
        ids = {"token_ids": whole.token_ids, "prompt_token_ids": c.prompt_ids} if c.return_token_ids else {}
        return {"index": c.index, "text": text, "logprobs": lps, "finish_reason": whole.finish_reason,
                "stop_reason": whole.stop_reason, "prompt_logprobs": self.prompt_logprobs(c), **ids}
