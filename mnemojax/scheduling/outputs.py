"""What `LLM.generate` returns, in vLLM's shapes."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class RequestMetrics:
    """Wall-clock times (seconds, `time.perf_counter`) of one request."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    token_times: list[float]  # when each generated token became known

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tbt(self) -> list[float]:
        """Time between consecutive generated tokens."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # per generated token; always contains the sampled token
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" (failed steps ended it); None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    _running_logprob: float | None = dataclasses.field(default=None, repr=False, compare=False)
    """A DELTA output's `cumulative_logprob`: the sum over every token the request has generated so far."""

    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        """vLLM's: the sum of the generated tokens' log-probs (the raw model's), None without `logprobs`: the whole
        sequence's so far, in every output kind (a DELTA output's too, as vLLM's: the running sum, not its own
        tokens')."""
        if self.logprobs is None:
            return None
        if self._running_logprob is not None:
            return self._running_logprob
        return sum(d[t] for d, t in zip(self.logprobs, self.token_ids))


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, float] | None] | None  # aligned with the prompt; first entry None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV the prefix cache gave it when first admitted

    def add(self, later: RequestOutput) -> None:
        """Appends `later`, the next DELTA output of the same request, to this one (vLLM's `RequestOutput.add`):
        what a caller has not taken yet is kept as one output that grows, not a queue of outputs."""
        mine, new = self.outputs[0], later.outputs[0]
        mine.text += new.text
        mine.token_ids.extend(new.token_ids)
        if new.logprobs is not None:
            mine.logprobs = mine.logprobs if mine.logprobs is not None else []
            mine.logprobs.extend(new.logprobs)
        mine.finish_reason, mine.stop_reason = new.finish_reason, new.stop_reason
        mine._running_logprob = new._running_logprob
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = self.prompt_logprobs if self.prompt_logprobs is not None else []
            self.prompt_logprobs.extend(later.prompt_logprobs)
        self.finished = later.finished
        m, n = self.metrics, later.metrics
        m.first_scheduled_time, m.first_token_time, m.finished_time = \
            n.first_scheduled_time, n.first_token_time, n.finished_time
        m.token_times.extend(n.token_times)
        self.num_preemptions = later.num_preemptions
        self.num_cached_tokens = later.num_cached_tokens
