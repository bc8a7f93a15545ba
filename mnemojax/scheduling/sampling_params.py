"""Per-request sampling parameters, vLLM-shaped.

Plain Python (no jax): the scheduler and the HTTP front end import this. The device-side counterpart is
`mnemojax.engine.sampler`, which receives these values as per-row arrays.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import json as _json
import math
import numbers

from mnemojax.scheduling.json_schema import SchemaError, object_pattern, schema_pattern
from mnemojax.scheduling.regex import RegexError, compiled

MAX_LOGPROBS = 20
"""Most top log-probs a request may ask for, per token; the step always computes this many."""

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are treated as 0 (greedy argmax), as in vLLM (`_SAMPLING_EPS`)."""

MAX_SEED = 2**63

REPETITION_PENALTY_RANGE = (2.0 ** -126, 2.0 ** 127)
"""The repetition penalties accepted: float32's normal numbers (the sampler's column is float32; a value outside
would become 0 or inf there, and a logit times 0 or inf can be NaN), powers of two so that the bounds are exact."""


class RequestOutputKind(enum.Enum):
    """What each of a request's per-step outputs holds (vLLM's `RequestOutputKind`)."""

    CUMULATIVE = "cumulative"
    """Everything so far: each output copies the request's lists (the default, as vLLM's)."""
    DELTA = "delta"
    """Only what is new since the previous output (the server streams these): a step costs what it added."""
    FINAL_ONLY = "final_only"
    """One output, when the request ends, holding everything (what `LLM.generate` asks for, as vLLM's): no output
    is built in the steps before, and without stop strings the text is decoded once, at the end."""


class ParamError(ValueError):
    """A bad request field: `param` names it (the HTTP server puts it in the OpenAI error body)."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@functools.lru_cache(maxsize=64)
def _json_pattern(schema_text: str | None, disable_any_whitespace: bool, whitespace_pattern: str | None) -> str:
    """The regex of a JSON schema (its JSON text), or of `json_object` (None)."""
    if schema_text is None:
        return object_pattern(disable_any_whitespace=disable_any_whitespace, whitespace_pattern=whitespace_pattern)
    return schema_pattern(schema_text, disable_any_whitespace=disable_any_whitespace,
                          whitespace_pattern=whitespace_pattern)


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's structured outputs (`SamplingParams.structured_outputs`); exactly one kind. mnemojax honours:
    - `choice`: the output is one of these strings, generated as that string's own tokens (the tokenizer's encoding
      of it, without special tokens), then EOS;
    - `regex`: the output text matches the pattern whole (`re.fullmatch`), then EOS: each step allows only the tokens
      whose text keeps a match possible, and EOS once the text matches. The syntax is a subset of Python's `re`
      (`mnemojax.scheduling.regex`: no back-references, look-arounds or flags; `\\d \\w \\s` are ASCII);
    - `json`: a JSON schema (a dict or its JSON text); the output is a JSON text the schema accepts, then EOS. The
      schema is written as a regex (`mnemojax.scheduling.json_schema`, which says what it supports and how it writes
      JSON) and guided as `regex` is. `disable_any_whitespace` and `whitespace_pattern` say what whitespace may come
      between its tokens (default: any run of spaces, newlines and tabs); `disable_additional_properties` and
      `disable_fallback` are accepted and change nothing (an absent `additionalProperties`, which vLLM's option
      makes false, generates no other properties here; there is no other backend to fall back to);
    - `json_object=True`: the output is a JSON object, then EOS, its objects and arrays nested at most 4 deep
      (`json_schema.JSON_OBJECT_DEPTH`: a bound makes it a regular language), whitespace as for `json`.
    The other kinds (`grammar`, `structural_tag`) are refused, naming `structured_outputs`, never ignored."""

    json: object = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def validate(self) -> None:
        for name in ("grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and value is not False:  # (0 or "" is a value: `in (None, False)` let 0 pass)
                raise ParamError("structured_outputs", f"structured_outputs.{name} is not supported (only choice, "
                                                       f"regex, json and json_object)")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ParamError("structured_outputs", f"structured_outputs.json_object must be true or false, got "
                                                   f"{self.json_object!r}")
        for name in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ParamError("structured_outputs", f"structured_outputs.{name} must be true or false, got "
                                                       f"{getattr(self, name)!r}")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise ParamError("structured_outputs", f"structured_outputs.whitespace_pattern must be a string, got "
                                                   f"{self.whitespace_pattern!r}")
        c = self.choice
        if sum(x is not None for x in (c, self.regex, self.json)) + bool(self.json_object) != 1:
            raise ParamError("structured_outputs", "structured_outputs needs exactly one of choice, regex, json and "
                                                   "json_object (the kinds supported)")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ParamError("structured_outputs", f"structured_outputs.regex must be a string, got {self.regex!r}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ParamError("structured_outputs", f"structured_outputs.json must be a JSON schema (a dict or its "
                                                   f"JSON text), got {self.json!r}")
        if self.kind != "choice":
            try:
                compiled(self.pattern)
            except SchemaError as e:
                raise ParamError("structured_outputs", f"structured_outputs.{self.kind}: {e}") from None
            except RegexError as e:
                if self.regex is not None:
                    raise ParamError("structured_outputs", f"structured_outputs.{e}") from None
                raise ParamError("structured_outputs", f"structured_outputs.{self.kind}: " + str(e).replace(
                    f"regex {self.pattern!r}", "the schema's regex")) from None
            return
        if isinstance(c, str) or not isinstance(c, (list, tuple)) or not c \
                or not all(isinstance(x, str) and x for x in c):
            raise ParamError("structured_outputs", f"structured_outputs.choice must be a non-empty list of non-empty "
                                                   f"strings, got {c!r}")

    @property
    def kind(self) -> str:
        """Which kind this is: 'choice', 'regex', 'json' or 'json_object'."""
        return ("choice" if self.choice is not None else "regex" if self.regex is not None else "json"
                if self.json is not None else "json_object")

    @property
    def pattern(self) -> str | None:
        """The regex the output must match whole: `regex`'s, `json`'s schema written as one, or `json_object`'s
        (None for choice). Raises SchemaError for a schema `mnemojax.scheduling.json_schema` cannot take."""
        if self.json is None and not self.json_object:
            return self.regex
        text = None if self.json is None else self.json if isinstance(self.json, str) else _json.dumps(self.json)
        return _json_pattern(text, self.disable_any_whitespace, self.whitespace_pattern)  # (dumps keeps the order
        # of the properties)


@dataclasses.dataclass
class SamplingParams:
    """How to pick the tokens of one request. Checked on construction (`ValueError` naming the field)."""

    max_tokens: int = 16
    """Most tokens to generate; at least 1."""
    min_tokens: int = 0
    """Fewest tokens to generate before a stop token (EOS, `stop_token_ids`) or stop string may end the request,
    0..max_tokens (vLLM's): until then the stop tokens' logits are -inf (EOS's even with `ignore_eos`, as vLLM
    bans it), and a stop string ending in those tokens' text is not a stop."""
    temperature: float = 1.0
    """Softmax temperature, >= 0; below `GREEDY_TEMPERATURE` (e.g. 0) means greedy argmax."""
    top_p: float = 1.0
    """Nucleus sampling: keep the fewest most-likely tokens whose probability reaches top_p, in (0, 1]."""
    top_k: int = -1
    """Keep only the top_k most likely tokens (ties with the k-th kept); -1 or 0 disables it."""
    min_p: float = 0.0
    """Keep only tokens at least min_p times as likely as the most likely one, in [0, 1]; 0 disables it. Applied
    (as in vLLM) after the temperature and before top-k / top-p."""
    presence_penalty: float = 0.0
    """vLLM's (OpenAI's): subtracted from the logit of every token generated so far, in [-2, 2]; 0 disables it."""
    frequency_penalty: float = 0.0
    """vLLM's (OpenAI's): times how often each token has been generated so far, subtracted from its logit, in
    [-2, 2]; 0 disables it."""
    repetition_penalty: float = 1.0
    """vLLM's (transformers'): the logit of every token of the prompt or generated so far is divided by it where
    positive, multiplied by it where not; > 0 (within float32's normal range, `REPETITION_PENALTY_RANGE`), 1
    disables it."""
    seed: int | None = None
    """Seed for this request's draws, in [0, 2**63); None lets the engine pick one."""
    stop: str | list[str] | None = None
    """Strings that end generation; normalized to a list (empty when None)."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation (besides EOS); normalized to a list (empty when None)."""
    ignore_eos: bool = False
    """Keep generating past EOS (until max_tokens or a stop condition)."""
    logit_bias: dict[int, float] | None = None
    """Token id -> a number in [-100, 100] (OpenAI's range) added to its logit before sampling (greedy too) and
    before the temperature, as vLLM and OpenAI do; log-probs stay those of the raw model distribution. None: no
    bias."""
    logprobs: int | None = None
    """Number of top log-probs to return per generated token, 0..MAX_LOGPROBS (the sampled token's
    log-prob is always included); None returns none."""
    prompt_logprobs: int | None = None
    """Same as `logprobs`, for the prompt tokens."""
    skip_special_tokens: bool = True
    """Drop special tokens when detokenizing the output."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the output text."""
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    """Whether each per-step output holds everything so far (CUMULATIVE) or only what is new (DELTA)."""
    allowed_token_ids: list[int] | None = None
    """vLLM's: only these token ids may be generated (every other logit is -inf, greedy rows too; `logit_bias` and
    min_tokens' bans apply among them); None: any. At most the engine's `max_logit_bias` distinct ids."""
    bad_words: list[str] | None = None
    """vLLM's: words that may not be generated. The engine's tokenizer turns each into token sequences as vLLM
    does (the word with its leading spaces stripped, and with one space before it where that gives as many tokens,
    the first another: the word inside a text), and the sampler bans a sequence's last token wherever the tokens
    generated just before it are the rest of the sequence (the prompt's tokens do not count: vLLM's rule)."""
    bad_words_token_ids: list[list[int]] | None = None
    """Token sequences banned the same way, as token ids (transformers' `bad_words_ids`, with vLLM's rule that only
    generated tokens match); beside those of `bad_words`."""
    truncate_prompt_tokens: int | None = None
    """vLLM's: keep only the prompt's last k tokens (left truncation), k >= 1, or -1 for the model's length
    (`max_model_len`); None keeps the whole prompt. The engine truncates before it checks the prompt's length
    (`truncate_prompt`); usage and `prompt_token_ids` count what is left."""
    n: int = 1
    """vLLM's: how many sequences to generate for the prompt, each sampled on its own; `LLM.generate` returns them
    as one `RequestOutput`'s outputs (indexes 0..n-1). With a seed, sequence j draws with seed + j, so sequence 0
    is the request with n = 1 (the server's `n` makes its choices the same way). One engine request
    (`LLMEngine.add_request`, `AsyncLLM.generate`) makes one sequence: there n must be 1."""
    detokenize: bool = True
    """vLLM's: False leaves the output text empty (token ids and log-probs only) and takes no stop strings."""
    spaces_between_special_tokens: bool = True
    """vLLM's: whether the text puts spaces between special tokens. Only slow (Python) tokenizers under
    transformers 4 do; with one of those the engine refuses False, since its text and log-prob offsets are written
    with the tokenizer's default. With every other tokenizer (fast ones, the byte tokenizer) False changes nothing,
    as in vLLM, whose fast detokenizer ignores it too."""
    structured_outputs: StructuredOutputsParams | None = None
    """vLLM's: `StructuredOutputsParams(choice=[...])` makes the output one of the strings, `regex=...` a text that
    matches the pattern whole (see there). Needs the model's EOS and a tokenizer; not with `ignore_eos`, `min_tokens`, `logit_bias`, `allowed_token_ids` or bad
    words. Such a request decodes a token only once the one before is on the host (its next allowed tokens depend
    on it), so with async scheduling it takes a token every other step."""

    def __post_init__(self):
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        self.validate()
        # Canonical Python types (numpy scalars pass the checks above).
        self.max_tokens = int(self.max_tokens)
        self.min_tokens = int(self.min_tokens)
        if self.logit_bias is not None:
            self.logit_bias = {int(t): float(v) for t, v in self.logit_bias.items()}
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        self.top_k = int(self.top_k)
        self.min_p = float(self.min_p)
        self.presence_penalty = float(self.presence_penalty)
        self.frequency_penalty = float(self.frequency_penalty)
        self.repetition_penalty = float(self.repetition_penalty)
        self.seed = None if self.seed is None else int(self.seed)
        self.n = int(self.n)
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        self.logprobs = None if self.logprobs is None else int(self.logprobs)
        self.prompt_logprobs = None if self.prompt_logprobs is None else int(self.prompt_logprobs)
        if self.truncate_prompt_tokens is not None:
            self.truncate_prompt_tokens = int(self.truncate_prompt_tokens)
        if self.allowed_token_ids is not None:  # distinct, in the order given
            self.allowed_token_ids = list(dict.fromkeys(int(t) for t in self.allowed_token_ids))
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
        if self.bad_words_token_ids is not None:
            self.bad_words_token_ids = [[int(t) for t in seq] for seq in self.bad_words_token_ids]

    @property
    def penalized(self) -> bool:
        """True when a presence, frequency or repetition penalty is on: the engine keeps the request's token
        counts on the device."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def sequences(self) -> list[SamplingParams]:
        """vLLM's `n` as the params of n requests (n = 1 each): sequence j draws with seed + j when seeded, so
        sequence 0 is the request with n = 1. The fields are checked first (they may have changed since)."""
        self.validate()
        if self.n == 1:
            return [self]
        return [dataclasses.replace(self, n=1, seed=None if self.seed is None else self.seed + j)
                for j in range(self.n)]

    @property
    def greedy(self) -> bool:
        """True when the temperature is (near) zero: the next token is the argmax."""
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self, *, vocab_size: int | None = None) -> None:
        """Raise `ValueError` if a field is out of range; with `vocab_size`, also check token ids."""
        if not _is_int(self.max_tokens):
            raise ParamError("max_tokens", f"max_tokens must be an int, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ParamError("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ParamError("min_tokens", f"min_tokens must be an int from 0 to max_tokens ({self.max_tokens}), got "
                                           f"{self.min_tokens!r}")

        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ParamError("temperature", f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:  # also rejects nan
            raise ParamError("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ParamError("top_k", f"top_k must be -1 or 0 (disabled), or at least 1, got {self.top_k!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:  # also rejects nan
            raise ParamError("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:  # also rejects nan
                raise ParamError(name, f"{name} must be in [-2, 2], got {value!r}")
        lo, hi = REPETITION_PENALTY_RANGE
        if not _is_real(self.repetition_penalty) or not lo <= self.repetition_penalty <= hi:  # also refuses nan
            raise ParamError("repetition_penalty", f"repetition_penalty must be a number > 0, from 2**-126 to 2**127 "
                                                   f"(float32's normal range), got {self.repetition_penalty!r}")

        if not _is_int(self.n) or self.n < 1:
            raise ParamError("n", f"n must be an int >= 1, got {self.n!r}")
        if self.seed is not None:
            if not _is_int(self.seed):
                raise ParamError("seed", f"seed must be an int or None, got {self.seed!r}")
            if not 0 <= self.seed < MAX_SEED:
                raise ParamError("seed", f"seed must be in [0, 2**63), got {self.seed}")
            if self.seed + self.n - 1 >= MAX_SEED:
                raise ParamError("seed", f"seed: with n = {self.n}, sequence j draws with seed + j, which must be "
                                         f"below 2**63, so seed must be at most 2**63 - {self.n}; got {self.seed}")

        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ParamError("stop", f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise ParamError("stop", f"stop strings must be non-empty, got {self.stop!r}")
        if self.stop and self.detokenize is False:
            raise ParamError("stop", "stop strings are matched in the text, so they need detokenize=True (vLLM's "
                                     "rule); stop_token_ids need no text")

        if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) for t in self.stop_token_ids):
            raise ParamError("stop_token_ids", f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ParamError("stop_token_ids", f"stop_token_ids must be >= 0, got {self.stop_token_ids!r}")
        if vocab_size is not None:
            if not _is_int(vocab_size) or vocab_size < 1:
                raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
            bad = [t for t in self.stop_token_ids if t >= vocab_size]
            if bad:
                raise ParamError("stop_token_ids",
                                 f"stop_token_ids must be in [0, {vocab_size}) (the vocabulary), got {bad}")

        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    _is_int(t) and t >= 0 and _is_real(v) for t, v in self.logit_bias.items()):
                raise ParamError("logit_bias", f"logit_bias must map token ids (ints >= 0) to numbers, got "
                                               f"{self.logit_bias!r}")
            bad = {t: v for t, v in self.logit_bias.items() if not -100 <= v <= 100}  # also refuses nan
            if bad:
                raise ParamError("logit_bias", f"logit_bias values must be in [-100, 100], got {bad}")
            if vocab_size is not None and any(t >= vocab_size for t in self.logit_bias):
                bad = sorted(t for t in self.logit_bias if t >= vocab_size)
                raise ParamError("logit_bias", f"logit_bias token ids must be in [0, {vocab_size}) (the vocabulary), "
                                               f"got {bad}")

        allowed = self.allowed_token_ids
        if allowed is not None:
            if not isinstance(allowed, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in allowed):
                raise ParamError("allowed_token_ids", f"allowed_token_ids must be a list of token ids (ints >= 0), "
                                                      f"got {allowed!r}")
            if not allowed:
                raise ParamError("allowed_token_ids", "allowed_token_ids must not be empty (None allows every token)")
            if vocab_size is not None and any(t >= vocab_size for t in allowed):
                bad = sorted({t for t in allowed if t >= vocab_size})
                raise ParamError("allowed_token_ids", f"allowed_token_ids must be in [0, {vocab_size}) (the "
                                                      f"vocabulary), got {bad}")

        words = self.bad_words
        if words is not None:
            if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
                raise ParamError("bad_words", f"bad_words must be a list of strings, got {words!r}")
            if any(not w.strip() for w in words):  # vLLM's tokenization of one fails (an IndexError)
                raise ParamError("bad_words", f"bad_words must not be empty or only spaces, got {words!r}")
        seqs = self.bad_words_token_ids
        if seqs is not None:
            if not isinstance(seqs, (list, tuple)) or not all(
                    isinstance(q, (list, tuple)) and q and all(_is_int(t) and t >= 0 for t in q) for q in seqs):
                raise ParamError("bad_words_token_ids", f"bad_words_token_ids must be a list of non-empty lists of "
                                                        f"token ids (ints >= 0), got {seqs!r}")
            if vocab_size is not None and any(t >= vocab_size for q in seqs for t in q):
                bad = sorted({t for q in seqs for t in q if t >= vocab_size})
                raise ParamError("bad_words_token_ids", f"bad_words_token_ids must be in [0, {vocab_size}) (the "
                                                        f"vocabulary), got {bad}")

        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "detokenize",
                     "spaces_between_special_tokens"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ParamError(name, f"{name} must be a bool, got {value!r}")

        if not isinstance(self.output_kind, RequestOutputKind):
            raise ParamError("output_kind", f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")

        check_truncate_prompt_tokens(self.truncate_prompt_tokens)

        so = self.structured_outputs
        if so is not None:
            if not isinstance(so, StructuredOutputsParams):
                raise ParamError("structured_outputs", f"structured_outputs must be a StructuredOutputsParams, got "
                                                       f"{type(so).__name__}")
            so.validate()
            for name, off in (("ignore_eos", False), ("min_tokens", 0), ("logit_bias", None),
                              ("allowed_token_ids", None), ("bad_words", None), ("bad_words_token_ids", None)):
                if getattr(self, name) not in (off, {}, []):
                    raise ParamError("structured_outputs", f"structured_outputs is not supported with {name}")

        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            if not _is_int(value) or not 0 <= value <= MAX_LOGPROBS:
                raise ParamError(name, f"{name} must be between 0 and {MAX_LOGPROBS}, got {value!r}")


@dataclasses.dataclass
class BeamSearchParams:
    """vLLM's `BeamSearchParams`, for `LLM.beam_search`: keep the `beam_width` best sequences of up to `max_tokens`
    generated tokens. Each step extends every beam by the top 2 x beam_width tokens of its next-token distribution
    (the raw model's log-probs), sampled with `temperature` (0: greedy, whose token is among them; a sampled token
    outside them is a candidate too, as in vLLM). A beam ends at EOS unless `ignore_eos`; sequences rank by
    cumulative log-prob / length ** `length_penalty`, the length counting the prompt's tokens and not a final EOS
    (vLLM's `get_beam_search_score`). `include_stop_str_in_output` is vLLM's field, for its server; the library
    returns every token."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        if not _is_int(self.beam_width) or not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            raise ParamError("beam_width", f"beam_width must be an int from 1 to {MAX_LOGPROBS // 2} (each step asks "
                                           f"for 2 x beam_width log-probs, at most {MAX_LOGPROBS}), got "
                                           f"{self.beam_width!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ParamError("max_tokens", f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ParamError("temperature", f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.length_penalty) or not math.isfinite(self.length_penalty):
            raise ParamError("length_penalty", f"length_penalty must be a finite number, got {self.length_penalty!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ParamError(name, f"{name} must be a bool, got {getattr(self, name)!r}")
        self.beam_width, self.max_tokens = int(self.beam_width), int(self.max_tokens)
        self.temperature, self.length_penalty = float(self.temperature), float(self.length_penalty)


def check_truncate_prompt_tokens(k) -> None:
    """Raises a ParamError unless `k` is None, -1 or an int >= 1 (vLLM's `truncate_prompt_tokens`)."""
    if k is not None and (not _is_int(k) or not (k == -1 or k >= 1)):
        raise ParamError("truncate_prompt_tokens", f"truncate_prompt_tokens must be an int >= 1, or -1 (the model's "
                                                   f"max_model_len), got {k!r}")


def truncate_prompt(prompt_ids: list[int], k: int | None, max_model_len: int) -> list[int]:
    """`prompt_ids` as `truncate_prompt_tokens` k cuts them (vLLM's): the last k tokens, k = max_model_len for -1;
    unchanged for None. A k past `max_model_len` raises (vLLM's check: no prompt that long could run)."""
    check_truncate_prompt_tokens(k)
    if k is None:
        return prompt_ids
    if k == -1:
        k = max_model_len
    elif k > max_model_len:
        raise ParamError("truncate_prompt_tokens", f"truncate_prompt_tokens ({k}) is greater than max_model_len "
                                                   f"({max_model_len}); choose a smaller one, or -1")
    return prompt_ids[-k:] if len(prompt_ids) > k else prompt_ids
