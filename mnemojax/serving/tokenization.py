"""vLLM's tokenizer endpoints: POST /tokenize, POST /detokenize, GET /tokenizer_info (behind the API key, like
/v1). lm-eval's `local-completions` finds the server's tokenizer through them (`tokenizer_backend=remote`, or
`auto`, which asks GET /tokenizer_info first)."""
from __future__ import annotations

from mnemojax.scheduling.sampling_params import ParamError
from mnemojax.serving.base import APIError, OpenAIServing, bad_request
from mnemojax.serving.chat import ServingChat
from mnemojax.serving.protocol import DetokenizeRequest, TokenizeRequest

PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")


class ServingTokenization(OpenAIServing):
    def __init__(self, state, chat: ServingChat):
        super().__init__(state)
        self.chat = chat

    def _tokenizer(self, param: str):
        if self.tokenizer is None:
            raise APIError(400, f"model {self.state.served_model_name!r} has no tokenizer", param)
        return self.tokenizer

    def tokenize(self, body: TokenizeRequest) -> dict:
        """`{"count", "max_model_len", "tokens", "token_strs"}`; `token_strs` (the tokens as logprobs write them)
        only with `return_token_strs`."""
        self.check_model(body.model)
        try:
            body.check()
        except ParamError as e:
            raise bad_request(e) from None
        if body.messages is not None:
            ids = self.chat.render(body, body.special_tokens)
        else:
            ids = list(self._tokenizer("prompt").encode(body.prompt, add_special_tokens=body.special_tokens))
        return {"count": len(ids), "max_model_len": self.llm.max_model_len, "tokens": ids,
                "token_strs": [self.token_text(t) for t in ids] if body.return_token_strs else None}

    def detokenize(self, body: DetokenizeRequest) -> dict:
        """`{"prompt": text}`: the ids decoded with special tokens written out (vLLM's)."""
        self.check_model(body.model)
        tok = self._tokenizer("tokens")
        vocab = len(tok)
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens: token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": tok.decode(body.tokens, skip_special_tokens=False)}

    def tokenizer_info(self) -> dict:
        """The tokenizer's class, special tokens, vocabulary size, the model's length limit and the Jinja chat
        template: the server's `--chat_template`, else the tokenizer's (the byte tokenizer's too: its Jinja twin)."""
        tok = self._tokenizer("model")
        info = {"tokenizer_class": type(tok).__name__, "bos_token": getattr(tok, "bos_token", None),
                "eos_token": getattr(tok, "eos_token", None), "pad_token": getattr(tok, "pad_token", None),
                "vocab_size": len(tok), "model_max_length": self.llm.max_model_len}
        template = self.state.chat_template or getattr(tok, "chat_template", None)
        if isinstance(template, str):
            info["chat_template"] = template
        return info
