"""The OpenAI-compatible request bodies the server accepts (pydantic models; they also make its OpenAPI schema).

Field names, types and defaults follow the OpenAI API (`logit_bias` included: token ids to biases in [-100, 100]),
plus vLLM's extensions (`top_k`, `min_p`, `min_tokens`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`,
`skip_special_tokens`, `include_stop_str_in_output`, `truncate_prompt_tokens`, `allowed_token_ids`,
`return_tokens_as_token_ids`, `return_token_ids`, `add_special_tokens`, `use_beam_search` with
`length_penalty`, `guided_choice`, `guided_regex`, `guided_json` with `guided_whitespace_pattern` and
`structured_outputs` with `choice`, `regex`, `json` or `json_object`, and chat's `continue_final_message`,
`chat_template`, `documents`, `echo`); OpenAI's `response_format` takes `text`, `json_schema` and `json_object`.
Types are strict: a wrong type is a 400 naming the field, never coerced ("2" is not
2, true is not 1; an int is a valid float). Strings must be Unicode (JSON's `\\ud800` escapes can spell a lone
surrogate, which no tokenizer takes). Unknown fields are ignored, as OpenAI-compatible servers do; fields we cannot
honour (`suffix`, `best_of`, completions' `prompt_logprobs` with `stream`, vLLM's guided grammar and
the other fields in `_UNHONOURED`, with `use_beam_search` the fields in `_NOT_WITH_BEAMS` that vLLM's beam search
ignores, `length_penalty` without it, `tools`, a `tool_choice` other than
none or auto) are accepted in the schema and rejected with a 400 naming them when set, never silently dropped; so
is `stream_options` without `stream`. Range checks live in
`SamplingParams` and the engine, so the server and the library share one set of limits and messages.
"""
from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

from mnemojax.scheduling.sampling_params import (MAX_LOGPROBS, BeamSearchParams, ParamError, SamplingParams,
                                                 StructuredOutputsParams)

MAX_N = 8
"""Most choices (`n`) one request may ask for."""

ROLES = ("system", "developer", "user", "assistant", "tool")
"""Chat roles (OpenAI's); a role goes into the chat template, so no other string may."""


def _unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError("lone_surrogate", "contains a lone surrogate (U+{code:04X} at index {index}), "
                                  "which is not a Unicode character",
                                  {"code": ord(text[e.start]), "index": e.start}) from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]
"""A string of Unicode characters (one that UTF-8 can encode)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


def _refuse_unhonoured(body: BaseModel, fields: dict[str, tuple], where: str = "") -> None:
    """400 (a `ParamError` naming it) for the first of `fields` set to something other than its neutral values: a
    field that would change the output is refused, never silently dropped. `where`: the case it is refused in
    (" with use_beam_search")."""
    for name, neutral in fields.items():
        value = getattr(body, name)
        if not any(value is n or (type(value) is type(n) and value == n) for n in neutral):
            shown = ", ".join(repr(n) for n in neutral if n is not None) or "unset"
            raise ParamError(name, f"{name} is not supported{where} (only {shown})")


_UNHONOURED = {  # vLLM's request fields mnemojax does not implement, and the values that change nothing
    "guided_grammar": (None,), "logits_processors": (None,),
}

_NOT_WITH_BEAMS = {  # what beam search does not honour (vLLM's ignores them), and the values that change nothing
    "stream": (False,), "seed": (None,), "top_p": (None, 1.0, 1), "top_k": (None, -1, 0), "min_p": (None, 0.0, 0),
    "presence_penalty": (None, 0.0, 0), "frequency_penalty": (None, 0.0, 0), "repetition_penalty": (None, 1.0, 1),
    "min_tokens": (None, 0), "stop": (None, []), "stop_token_ids": (None, []), "logit_bias": (None, {}),
    "allowed_token_ids": (None,), "bad_words": ([],), "prompt_logprobs": (None,), "guided_choice": (None,),
    "guided_regex": (None,), "guided_json": (None,), "structured_outputs": (None,),
    "response_format": (None, {"type": "text"}),
}

_STRUCTURED_KEYS = {f.name for f in dataclasses.fields(StructuredOutputsParams)}


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(default=False, description="vLLM's: with include_usage, every chunk "
                                                                    "carries its choice's usage so far")


class _SamplingRequest(_Strict):
    model: Text | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = Field(default=True, description="vLLM's; false changes nothing but with "
                                                                          "a slow tokenizer under transformers 4, "
                                                                          "where it is refused")
    include_stop_str_in_output: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    user: Text | None = None
    prompt_logprobs: int | None = Field(default=None, description=f"vLLM's: top log-probs per prompt token, "
                                                                  f"0..{MAX_LOGPROBS}; not with stream")
    response_format: dict | None = Field(default=None, description='OpenAI\'s: {"type": "text"}, {"type": '
                                                                  '"json_schema", "json_schema": {"name": ..., '
                                                                  '"schema": {...}}} (as guided_json) or {"type": '
                                                                  '"json_object"} (nested at most 4 deep)')
    truncate_prompt_tokens: int | None = Field(default=None, description="vLLM's: keep only the prompt's last k "
                                                                         "tokens (k >= 1, or -1: max_model_len)")
    allowed_token_ids: list[int] | None = Field(default=None, description="vLLM's: only these token ids may be "
                                                                          "generated")
    return_tokens_as_token_ids: bool | None = Field(default=None, description="vLLM's: logprobs write each token "
                                                                              "as 'token_id:<id>' (default: the "
                                                                              "server's flag)")
    bad_words: list[Text] = Field(default_factory=list, description="vLLM's: words that may not be generated "
                                                                    "(each as vLLM tokenizes it)")
    request_id: Text | None = Field(default=None, description="vLLM's: the response's id is '<cmpl or chatcmpl>-"
                                                              "<request_id>' (an X-Request-Id header wins)")
    return_token_ids: bool | None = Field(default=None, description="vLLM's: each choice's generated token ids "
                                                                    "(`token_ids`) and the prompt's "
                                                                    "(`prompt_token_ids`); streamed, each chunk's "
                                                                    "new ids, the prompt's in a choice's first "
                                                                    "chunk")
    use_beam_search: bool = Field(default=False, description="vLLM's: beam search with n beams, the n best "
                                                             "sequences the choices (not with stream or the "
                                                             "sampling fields; see the README)")
    length_penalty: float = Field(default=1.0, description="vLLM's, with use_beam_search: sequences rank by "
                                                           "cumulative log-prob / length ** length_penalty")
    priority: int = Field(default=0, description="vLLM's: under --scheduler_policy priority (vLLM's "
                                                 "--scheduling-policy), lower runs first; 0 under any other policy")
    guided_choice: list[Text] | None = Field(default=None, description="vLLM's: the output is one of these strings "
                                                                       "(their own tokens, then EOS)")
    guided_regex: Text | None = Field(default=None, description="vLLM's: the output text matches this regex "
                                                                "whole, then EOS (a subset of Python's re: see the "
                                                                "README)")
    guided_json: dict | Text | None = Field(default=None, description="vLLM's: the output is a JSON text that this "
                                                                      "JSON schema accepts, then EOS (the schemas "
                                                                      "supported: see the README)")
    guided_whitespace_pattern: Text | None = Field(default=None, description="vLLM's, with guided_json or a JSON "
                                                                             "response_format: the "
                                                                             "whitespace allowed between JSON's "
                                                                             "tokens, a regex")
    structured_outputs: dict | None = Field(default=None, description="vLLM's: {\"choice\": [...]}, {\"regex\": "
                                                                      "\"...\"}, {\"json\": {...}} (as the "
                                                                      "guided_ fields) or {\"json_object\": true}, "
                                                                      "with vLLM's options")
    # vLLM's fields that mnemojax does not implement: refused when set to anything that would change the output
    guided_grammar: Any = None
    logits_processors: Any = None

    def _check_unsupported(self) -> None:
        _refuse_unhonoured(self, _UNHONOURED)
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise ParamError("n", f"n must be between 1 and {MAX_N}, got {self.n}")
        if self.prompt_logprobs is not None and self.stream:
            raise ParamError("prompt_logprobs", "prompt_logprobs is not supported with stream (as in vLLM)")
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed with stream: true (as in vLLM)")
        if self.response_format is not None and self.response_format.get("type", "text") not in (
                "text", "json_schema", "json_object"):
            raise ParamError("response_format", f"response_format {self.response_format.get('type')!r} is not "
                                                f"supported (only 'text', 'json_schema' and 'json_object')")
        if self.use_beam_search:
            _refuse_unhonoured(self, _NOT_WITH_BEAMS, " with use_beam_search")
        elif self.length_penalty != 1:
            raise ParamError("length_penalty", f"length_penalty only applies with use_beam_search, got "
                                               f"{self.length_penalty}")

    def beam_search_params(self, params: SamplingParams) -> BeamSearchParams:
        """vLLM's `to_beam_search_params`: `n` beams of up to `params.max_tokens` tokens at `params.temperature`
        (this request's `sampling_params`: the request's, else the model's default)."""
        return BeamSearchParams(beam_width=self.n, max_tokens=params.max_tokens, ignore_eos=self.ignore_eos,
                                temperature=params.temperature, length_penalty=self.length_penalty,
                                include_stop_str_in_output=self.include_stop_str_in_output)

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                        defaults: dict | None = None) -> SamplingParams:
        """The request's `SamplingParams` (ValueError names the bad field and its limit); `prompt_logprobs`: how
        many top log-probs per prompt token the engine computes (None: the request's `prompt_logprobs`);
        `defaults`: the model's sampling defaults (`EngineClient.default_sampling`) for what the request leaves
        out, its `max_tokens` a cap (vLLM's)."""
        self._check_unsupported()
        prompt_logprobs = self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs
        defaults = defaults or {}

        def given(name: str, default):
            value = getattr(self, name)
            return defaults.get(name, default) if value is None else value

        return SamplingParams(
            max_tokens=min(max_tokens, defaults.get("max_tokens", max_tokens)), temperature=given("temperature", 1.0),
            top_p=given("top_p", 1.0), top_k=given("top_k", -1), min_p=given("min_p", 0.0),
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=given("repetition_penalty", 1.0), min_tokens=self.min_tokens or 0,
            logit_bias=self._logit_bias(), structured_outputs=self._structured_outputs(),
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            truncate_prompt_tokens=self.truncate_prompt_tokens, allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words or None)

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """vLLM's `structured_outputs` (its keys those of `StructuredOutputsParams`), its older `guided_choice` /
        `guided_regex` / `guided_json`, or OpenAI's `response_format` of type `json_schema` or `json_object`; one of
        them. A bad one is a ParamError naming the field given."""
        rf = self.response_format
        response = ("json_object", True) if rf is not None and rf.get("type") == "json_object" else (None, None)
        if rf is not None and rf.get("type") == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
                raise ParamError("response_format", "response_format json_schema needs json_schema.schema, a JSON "
                                                    "schema (an object)")
            response = ("json", js["schema"])
        sources = {name: (kind, value) for name, kind, value in (  # field -> (the kind it gives, its value)
            ("guided_choice", "choice", self.guided_choice), ("guided_regex", "regex", self.guided_regex),
            ("guided_json", "json", self.guided_json), ("response_format", *response),
            ("structured_outputs", None, self.structured_outputs)) if value is not None}
        if len(sources) > 1:
            given = [*sources]
            raise ParamError(given[0], f"give {' or '.join(given)}, not {'both' if len(given) == 2 else 'several'}")
        ws = self.guided_whitespace_pattern
        if ws is not None and not sources.keys() & {"guided_json", "response_format"}:
            raise ParamError("guided_whitespace_pattern", "guided_whitespace_pattern only applies with guided_json or "
                                                          "a json_schema or json_object response_format")
        if not sources:
            return None
        (name, (kind, value)), = sources.items()
        if name == "structured_outputs":
            unknown = sorted(set(value) - _STRUCTURED_KEYS)
            if unknown:
                raise ParamError("structured_outputs", f"structured_outputs.{unknown[0]} is not supported (only "
                                                       f"choice, regex, json and json_object, with vLLM's "
                                                       f"options)")
            return StructuredOutputsParams(**value)
        params = StructuredOutputsParams(**{kind: value}, whitespace_pattern=ws)
        try:
            params.validate()
        except ParamError as e:
            raise ParamError(name, str(e).replace(f"structured_outputs.{kind}", name)) from None
        return params

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's `logit_bias`: token ids (as strings) to biases (`SamplingParams` checks them)."""
        if not self.logit_bias:
            return None
        for key in self.logit_bias:
            if not key.isascii() or not key.isdigit() or len(key) > 18:  # int() refuses > 4300 digits itself
                raise ParamError("logit_bias", f"logit_bias keys must be token ids (decimal integers), got "
                                               f"{key[:40]!r}")
        return {int(key): value for key, value in self.logit_bias.items()}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """vLLM's `continuous_usage_stats`, which counts only with `include_usage`."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: Text | list[Text] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, description=f"top log-probs per token, 0..{MAX_LOGPROBS}")
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = Field(default=True, description="vLLM's: a text prompt gets the tokenizer's special "
                                                                "tokens (BOS); token ids are taken as they are")

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            p = [p]
        elif not p:
            raise ParamError("prompt", "prompt must not be empty")
        elif all(isinstance(x, int) for x in p):
            p = [list(p)]
        if any(len(x) == 0 for x in p):
            raise ParamError("prompt", "prompt must not be empty")
        return list(p)

    def check(self) -> None:
        least = 0 if self.echo else 1
        if self.max_tokens is not None and self.max_tokens < least:
            raise ParamError("max_tokens", f"max_tokens must be at least 1 (0 only with echo), got {self.max_tokens}")
        if self.suffix:
            raise ParamError("suffix", "suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ParamError("best_of", "best_of is not supported (only equal to n)")
        if self.use_beam_search and self.echo:
            raise ParamError("echo", "echo is not supported with use_beam_search (only False)")


class ContentPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal[ROLES]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None

    def text(self) -> str:
        """The content as the chat template gets it: text parts joined by newlines (vLLM's)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, description=f"top log-probs per token, 0..{MAX_LOGPROBS} (with "
                                                               f"logprobs)")
    add_generation_prompt: bool = True
    tools: list | None = None
    tool_choice: str | dict | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, description="vLLM's: more variables for the "
                                                                                   "chat template")
    continue_final_message: bool = Field(default=False, description="vLLM's: the last message stays open and the "
                                                                    "reply continues it (with add_generation_prompt "
                                                                    "false)")
    add_special_tokens: bool = Field(default=False, description="vLLM's: the templated text also gets the "
                                                                "tokenizer's special tokens (BOS), on top of the "
                                                                "template's own")
    chat_template: Text | None = Field(default=None, description="vLLM's: a Jinja chat template for this request "
                                                                 "(only with the server's "
                                                                 "--trust_request_chat_template)")
    documents: list[dict[str, Text]] | None = Field(default=None, description="vLLM's: documents for a template "
                                                                              "that takes them (RAG)")
    echo: bool = Field(default=False, description="vLLM's: the reply starts with the last message's content when "
                                                  "that message has the reply's role")

    def check(self) -> None:
        if not self.messages:
            raise ParamError("messages", "messages must not be empty")
        if self.tools:
            raise ParamError("tools", "tools are not supported (no tool calling)")
        if self.tool_choice not in (None, "none", "auto"):
            raise ParamError("tool_choice", "tool_choice is not supported (no tool calling; only 'none' or 'auto')")
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs needs logprobs to be true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ParamError("top_logprobs",
                             f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.top_logprobs}")
        for name in ("max_completion_tokens", "max_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ParamError(name, f"{name} must be at least 1, got {value}")

    @property
    def token_limit(self) -> int | None:
        """`max_completion_tokens` (OpenAI's newer name), else `max_tokens`; None: the rest of what a request can
        hold (`EngineClient.max_request_tokens`)."""
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens


class TokenizeRequest(_Strict):
    """POST /tokenize (vLLM's): a `prompt`, or chat `messages` through the chat template; not both. With messages,
    the chat request's template fields too."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = Field(default=None, description="default: true with a prompt, false with "
                                                                      "messages (vLLM's)")
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # with messages, as in a chat request
    continue_final_message: bool = False
    chat_template: Text | None = None
    documents: list[dict[str, Text]] | None = None

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ParamError("prompt", "give exactly one of prompt and messages")
        if self.messages is not None and not self.messages:
            raise ParamError("messages", "messages must not be empty")
        if self.messages is None:
            for name in ("chat_template_kwargs", "continue_final_message", "chat_template", "documents"):
                value = getattr(self, name)
                if value is not None and value is not False and value != {} and value != []:  # not left neutral
                    raise ParamError(name, f"{name} needs messages (it is for the chat template)")

    @property
    def special_tokens(self) -> bool:
        """Whether the tokenizer adds its special tokens: `add_special_tokens`, by default true for a prompt and
        false for messages (the chat template writes its own)."""
        return self.messages is None if self.add_special_tokens is None else self.add_special_tokens


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM's)."""

    model: Text | None = None
    tokens: list[int]


FIELD_NAMES = frozenset(name for model in (CompletionRequest, ChatCompletionRequest, ChatMessage, ContentPart,
                                           StreamOptions, TokenizeRequest, DetokenizeRequest) for name in model.model_fields)
"""Every field name of a request body: what a validation error's location may name (the rest of a location is
pydantic's tags for the members of a union of types)."""

_UNION_EXPECTS = {
    "prompt": "a string, a list of strings, a list of token ids, or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": 'a string or a list of text parts ({"type": "text", "text": "..."}); only text is supported',
}


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def describe_validation_error(errors: list[dict]) -> tuple[str, str]:
    """(param, message) for a request body that failed validation: `param` is the field's path
    ("messages.0.content") without pydantic's tags for the members of a union; a field that may have one of
    several types says which."""
    err = next((e for e in errors if e["type"] == "lone_surrogate"), errors[0])
    if err["type"] == "json_invalid":
        return "body", f"malformed JSON in the request body: {err.get('msg')}"
    loc = [x for x in err.get("loc", ()) if x != "body"]
    names = [isinstance(x, int) or x in FIELD_NAMES for x in loc]
    param = ".".join(str(x) for x, named in zip(loc, names) if named) or "body"
    if err["type"] == "lone_surrogate":
        return param, f"{param} {err['msg']}"
    if not all(names):  # the field has several types, and the value is none of them
        field = next((x for x in reversed(loc[:names.index(False)]) if isinstance(x, str)), None)
        if field in _UNION_EXPECTS:
            return param, f"{param} must be {_UNION_EXPECTS[field]} (got {_short(err.get('input'))})"
    return param, f"{param}: {err.get('msg')} (got {_short(err.get('input'))})"
