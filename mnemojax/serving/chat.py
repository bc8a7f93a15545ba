"""POST /v1/chat/completions: messages through the chat template (`--chat_template`, else the tokenizer's), a reply
message out (the assistant's, `--response_role`, or the last message's role without a generation prompt)."""
from __future__ import annotations

from fastapi import Request

from mnemojax.scheduling.outputs import CompletionOutput
from mnemojax.scheduling.sampling_params import ParamError, truncate_prompt
from mnemojax.serving.base import APIError, Choice, OpenAIServing, bad_request
from mnemojax.serving.protocol import ChatCompletionRequest
from mnemojax.engine.llm import render_chat



class ServingChat(OpenAIServing):
    object_name = "chat.completion"
    stream_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    async def create(self, body: ChatCompletionRequest, request: Request):
        self.check_model(body.model)
        try:
            body.check()
        except ParamError as e:
            raise bad_request(e) from None
        prompt_ids = self.render(body, body.add_special_tokens)
        try:  # before the room left is counted (the engine's `validate` truncates them the same way again)
            prompt_ids = truncate_prompt(prompt_ids, body.truncate_prompt_tokens, self.llm.max_model_len)
        except ParamError as e:
            raise bad_request(e) from None
        max_tokens = body.token_limit
        if max_tokens is None:  # the room left in what one request can hold (max_model_len, or the KV pages' tokens)
            max_tokens = max(self.llm.max_request_tokens - len(prompt_ids), 1)
        try:
            params = body.sampling_params(max_tokens, (body.top_logprobs or 0) if body.logprobs else None,
                                          defaults=self.llm.default_sampling)
            beam = body.beam_search_params(params) if body.use_beam_search else None
        except ValueError as e:
            raise bad_request(e) from None
        try:
            choices = self.admit([prompt_ids], params, body.n, show_prompt_logprobs=body.prompt_logprobs,
                                 role=self.reply_role(body), echoed=self.echoed(body),
                                 token_ids_as_text=self.token_ids_as_text(body),
                                 return_token_ids=bool(body.return_token_ids), priority=body.priority)
        except APIError as e:
            if e.param != "prompt":
                raise
            # the prompt is the messages through the chat template: name the field the client sent
            raise APIError(e.status, f"messages (through the chat template): {e.message}", "messages") from None
        return await self.respond(request, body.stream, body.include_usage, choices, body.continuous_usage, beam,
                                  body.request_id)

    def render(self, body, add_special_tokens: bool) -> list[int]:
        """The token ids of `body.messages` through the chat template (the request's `chat_template` where the
        server trusts it, else the server's `--chat_template`, else the tokenizer's), with `body`'s
        `add_generation_prompt`, `continue_final_message`, `documents` and `chat_template_kwargs` (vLLM's: more
        template variables); `add_special_tokens`: the tokenizer's special tokens (BOS) too. A failure is a 400
        naming `messages`, or `chat_template` when the request gave one."""
        if self.tokenizer is None:
            raise APIError(400, f"model {self.state.served_model_name!r} has no tokenizer, so no chat template; "
                                "use /v1/completions with token ids", "messages")
        template = self.state.chat_template
        if body.chat_template is not None:
            if not self.state.config.trust_request_chat_template:
                raise APIError(400, "chat_template: this server does not take a request's chat template (start it "
                                    "with --trust_request_chat_template)", "chat_template")
            template = body.chat_template
        try:
            return render_chat(self.tokenizer, [{"role": m.role, "content": m.text()} for m in body.messages],
                               add_generation_prompt=body.add_generation_prompt,
                               continue_final_message=body.continue_final_message, chat_template=template,
                               documents=body.documents, chat_template_kwargs=body.chat_template_kwargs,
                               add_special_tokens=add_special_tokens,
                               template_field="messages" if body.chat_template is None else "chat_template")
        except ParamError as e:
            raise bad_request(e) from None

    def reply_role(self, body: ChatCompletionRequest) -> str:
        """vLLM's: the reply's role is `--response_role` (the assistant's), or with `add_generation_prompt: false`
        the last message's."""
        return self.state.config.response_role if body.add_generation_prompt else body.messages[-1].role

    def echoed(self, body: ChatCompletionRequest) -> str:
        """vLLM's `echo`: the text a reply starts with, the last message's content when it has the reply's role."""
        last = body.messages[-1]
        return last.text() if body.echo and last.role == self.reply_role(body) else ""

    def response_fields(self, choices: list[Choice]) -> dict:
        """vLLM's chat response has `prompt_logprobs` once, beside the choices (their prompt is the same), and
        with `return_token_ids` the prompt's token ids."""
        ids = {"prompt_token_ids": choices[0].prompt_ids} if choices[0].return_token_ids else {}
        return {"prompt_logprobs": self.prompt_logprobs(choices[0]), **ids}

    def first_chunk_fields(self, c: Choice) -> dict:
        """vLLM's: with `return_token_ids`, a choice's role chunk carries the prompt's token ids."""
        return {"prompt_token_ids": c.prompt_ids} if c.return_token_ids else {}

    def logprobs(self, c: Choice, ids: list[int], lps: list[dict]) -> dict | None:
        if c.params.logprobs is None:
            return None
        top = c.params.logprobs  # top_logprobs

        def entry(t, lp):  # `bytes`: the token's own bytes (a piece of a character included), null without a tokenizer
            return {"token": self.token_text(t, c.token_ids_as_text), "logprob": lp,
                    "bytes": None if self.token_bytes is None else list(self.token_bytes(t))}

        return {"content": [{**entry(t, d[t]), "top_logprobs": [entry(k, v) for k, v in list(d.items())[:top]]}
                            for t, d in zip(ids, lps)]}

    def preamble(self, c: Choice) -> list[dict]:
        first = [{"index": c.index, "delta": {"role": c.role, "content": ""}, "logprobs": None, "finish_reason": None}]
        if c.echoed:  # vLLM's: the echoed content comes as a chunk of its own
            first.append({"index": c.index, "delta": {"content": c.echoed}, "logprobs": None, "finish_reason": None})
        return first

    def stream_choice(self, c: Choice, new: CompletionOutput, offset: int) -> dict:
        ids = {"token_ids": new.token_ids} if c.return_token_ids else {}
        return {"index": c.index, "delta": {"content": new.text} if new.text else {},
                "logprobs": self.logprobs(c, new.token_ids, new.logprobs or []),
                "finish_reason": new.finish_reason, "stop_reason": new.stop_reason, **ids}

    def whole_choice(self, c: Choice, whole: CompletionOutput) -> dict:
        ids = {"token_ids": whole.token_ids} if c.return_token_ids else {}
        return {"index": c.index, "message": {"role": c.role, "content": c.echoed + whole.text},
                "logprobs": self.logprobs(c, whole.token_ids, whole.logprobs or []),
                "finish_reason": whole.finish_reason, "stop_reason": whole.stop_reason, **ids}
