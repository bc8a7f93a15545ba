"""A request's state on the host: plain Python, no jax.

One budget rule (vLLM v1): a request knows `num_tokens` tokens (prompt + generated) and has `num_computed` of
them in the KV cache. Each step gives it some of the difference: a prefill chunk, or the one decode token.
When a step brings `num_computed` up to `num_tokens`, the step also samples the next token. There is no
separate prefill or decode phase.
"""
from __future__ import annotations

import dataclasses
import enum

from mnemojax.scheduling.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # no pages held (new, or preempted and waiting to recompute)
    RUNNING = "running"  # holds pages, is scheduled every step it has tokens to compute
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)  # identity: requests are looked up in lists every step
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seed: int  # the sampling seed, drawn by the engine when params.seed is None
    prompt: str | None = None
    priority: int = 0  # the `priority` policy's order: lower first (vLLM's); 0 under every other policy
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # tokens scheduled into the cache (their K/V written or in flight)
    # Where the KV lives: the KVP ranks holding it (contiguous token ranges, in order) and the pages on each.
    kv_ranks: list[int] = dataclasses.field(default_factory=list)
    pages: list[list[int]] = dataclasses.field(default_factory=list)
    # Prefix cache: chained hashes of its full pages (computed once), how many of the pages it holds are cached
    # (found cached or registered since), and the prompt tokens found cached when it was first admitted.
    page_hashes: list[bytes] = dataclasses.field(default_factory=list)
    num_registered_pages: int = 0
    num_cached_tokens: int | None = None
    pending_pages: tuple[int, int] = (0, 0)  # [start, end) of its prompt pages it computes and has not cached yet
    # Pipeline bookkeeping: chunks scheduled but not yet through `Scheduler.update_from_output`, how many of
    # them sample a token, and how many tokens it has sampled on the device that the host has not seen yet
    # (async scheduling: the engine collects a step's results after launching the next one). A request awaiting
    # a sample gets no further token scheduled, except one decode of the unseen token (read on the device).
    in_flight: int = 0
    awaiting_sample: int = 0
    num_unfetched: int = 0
    # Log-probs: prompt entries are filled as prefill chunks pass (index i scores prompt token i; entry 0 is
    # None); output entries as tokens are sampled.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    logprobs: list[dict[int, float]] | None = None
    output_text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)
    finished_time: float | None = None
    num_preemptions: int = 0
    # Sampling biases (`SamplingParams.logit_bias`, and -inf for the stop tokens `min_tokens` bans: EOS, even if
    # ignored, and stop_token_ids), as the (token ids, biases) arrays of every slot a logits row carries and whether
    # the row keeps only those tokens (`allowed_token_ids`): `bias` after min_tokens tokens, `bias_early` before;
    # None: no bias.
    bias: tuple | None = None
    bias_early: tuple | None = None
    # Bad words of more than one token (`LLMEngine.bad_words`): (prefix, last token) pairs, the token banned in a
    # step whose row follows generated tokens equal to the prefix (the executor checks it when it prepares the row).
    bad_words: list = dataclasses.field(default_factory=list)
    # Structured outputs' choices (`LLMEngine.choice_steps`): the tokens allowed after each sequence of generated
    # tokens that can start a choice (EOS after a whole one); None: no constraint. A constrained request's next row
    # depends on every token before it, so the scheduler never decodes a token that is not on the host yet.
    choices: dict[tuple[int, ...], tuple[int, ...]] | None = None
    # Structured outputs' regex: its walk along the generated tokens (`mnemojax.engine.structured.RegexState`), which gives each
    # row's allowed tokens as a bitmask; None: no regex. Decoded like `choices`: never a token not on the host.
    regex: object = None
    # TTFT deadline (same clock as arrival_time) and its duration; set by the scheduler when it is added.
    ttft_deadline: float | None = None
    deadline_duration: float | None = None

    def __post_init__(self):
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def in_decode(self) -> bool:
        """Generating: its prompt and every generated token but the newest are in the cache."""
        return bool(self.output_token_ids) and self.num_uncomputed == 1

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
