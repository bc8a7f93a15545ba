"""POST /v1/chat/completions: messages through the tokenizer's chat template, an assistant message out."""
from __future__ import annotations

from fastapi import Request

from mnemojax.scheduling.outputs import CompletionOutput
from mnemojax.scheduling.sampling_params import ParamError, truncate_prompt
from mnemojax.serving.base import APIError, Choice, OpenAIServing, bad_request
from mnemojax.serving.protocol import ChatCompletionRequest, ChatMessage

_RENDER_ARGUMENTS = frozenset({"conversation", "messages", "add_generation_prompt", "tokenize", "return_dict",
                               "chat_template", "tools", "documents", "continue_final_message", "tokenizer_kwargs",
                               "return_assistant_tokens_mask", "padding", "truncation", "max_length"})
"""`apply_chat_template`'s own arguments: not template variables, so not for `chat_template_kwargs` to set."""


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
        prompt_ids = self.render(body.messages, body.add_generation_prompt, body.chat_template_kwargs)
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
        except ValueError as e:
            raise bad_request(e) from None
        try:
            choices = self.admit([prompt_ids], params, body.n, show_prompt_logprobs=body.prompt_logprobs)
        except APIError as e:
            if e.param != "prompt":
                raise
            # the prompt is the messages through the chat template: name the field the client sent
            raise APIError(e.status, f"messages (through the chat template): {e.message}", "messages") from None
        return await self.respond(request, body.stream, body.include_usage, choices, body.continuous_usage)

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool,
               template_kwargs: dict | None = None) -> list[int]:
        """The token ids of `messages` through the tokenizer's chat template, `template_kwargs` (vLLM's
        `chat_template_kwargs`) as more template variables (400 naming `messages` if it fails)."""
        if self.tokenizer is None:
            raise APIError(400, f"model {self.state.served_model_name!r} has no tokenizer, so no chat template; "
                                "use /v1/completions with token ids", "messages")
        reserved = sorted(set(template_kwargs or ()) & _RENDER_ARGUMENTS)
        if reserved:
            raise APIError(400, f"chat_template_kwargs may not set {reserved}: the request's own fields do",
                           "chat_template_kwargs")
        try:
            text = self.tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in messages],
                                                      add_generation_prompt=add_generation_prompt, tokenize=False,
                                                      **(template_kwargs or {}))
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        except Exception as e:  # noqa: BLE001 - a template error is the caller's messages
            raise APIError(400, f"messages: the chat template failed: {e}", "messages") from None

    def response_fields(self, choices: list[Choice]) -> dict:
        """vLLM's chat response has `prompt_logprobs` once, beside the choices (their prompt is the same)."""
        return {"prompt_logprobs": self.prompt_logprobs(choices[0])}

    def logprobs(self, c: Choice, ids: list[int], lps: list[dict]) -> dict | None:
        if c.params.logprobs is None:
            return None
        top = c.params.logprobs  # top_logprobs

        def entry(t, lp):  # `bytes`: the token's own bytes (a piece of a character included), null without a tokenizer
            return {"token": self.token_text(t), "logprob": lp,
                    "bytes": None if self.token_bytes is None else list(self.token_bytes(t))}

        return {"content": [{**entry(t, d[t]), "top_logprobs": [entry(k, v) for k, v in list(d.items())[:top]]}
                            for t, d in zip(ids, lps)]}

    def preamble(self, c: Choice) -> list[dict]:
        return [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}]

    def stream_choice(self, c: Choice, new: CompletionOutput, offset: int) -> dict:
        return {"index": c.index, "delta": {"content": new.text} if new.text else {},
                "logprobs": self.logprobs(c, new.token_ids, new.logprobs or []),
                "finish_reason": new.finish_reason, "stop_reason": new.stop_reason}

    def whole_choice(self, c: Choice, whole: CompletionOutput) -> dict:
        return {"index": c.index, "message": {"role": "assistant", "content": whole.text},
                "logprobs": self.logprobs(c, whole.token_ids, whole.logprobs or []),
                "finish_reason": whole.finish_reason, "stop_reason": whole.stop_reason}
