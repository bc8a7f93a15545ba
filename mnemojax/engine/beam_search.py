"""Beam search as vLLM's `LLM.beam_search` does it: on top of `generate`, one token per step for every beam.

Each step asks every live beam's next-token distribution for its top 2 x beam_width log-probs (one request per
beam, its prompt the beam's tokens, `max_tokens=1`; with prefix caching, on by default, the pages its parent's
step filled are not computed again), makes a candidate of each, puts every candidate ending in EOS aside as
completed (unless `ignore_eos`) and keeps the beam_width best of the others of a prompt by `beam_search_score`.
After `max_tokens` steps (or when no beam is left), the completed and live beams of each prompt are ranked once
more and the beam_width best returned. Sorting is Python's stable sort, so equal scores keep the order the
candidates were made in: beam by beam, each beam's tokens by descending log-prob (lower id first on ties), then the
sampled token if it is not among them. At temperature 0 that is vLLM's order; at a higher temperature vLLM puts the
sampled token first, which only matters for exactly equal scores.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

from tqdm import tqdm

from mnemojax.scheduling.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclasses.dataclass
class BeamSearchSequence:
    """One beam (vLLM's): its tokens (the prompt's, then the generated ones), for each generated token the log-probs
    its step returned ({token id: log-prob}: the top 2 x beam_width and the sampled token), and the sum of the
    generated tokens' log-probs. `text` is the decoded tokens, the prompt's included and special tokens written
    out (vLLM's `tokenizer.decode(tokens)`); None without a tokenizer."""

    tokens: list[int]
    logprobs: list[dict[int, float]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclasses.dataclass
class BeamSearchOutput:
    """A prompt's best sequences, best first (vLLM's): at most beam_width."""

    sequences: list[BeamSearchSequence]


def beam_search_score(tokens: Sequence[int], cum_logprob: float, eos_token_id: int | None,
                      length_penalty: float = 1.0) -> float:
    """vLLM's `get_beam_search_score`: the cumulative log-prob over the sequence's length (prompt included, a final
    EOS not counted; at least 1) to the power `length_penalty`."""
    length = len(tokens) - (bool(tokens) and tokens[-1] == eos_token_id)
    return cum_logprob / max(length, 1) ** length_penalty


class BeamSearch:
    """The search of some prompts (token ids), one step at a time, for a caller that runs the steps itself (the
    library's `beam_search` below; the server's `use_beam_search`, which awaits them): `live()` is the beams whose
    next-token log-probs the next step needs, prompt by prompt; each is one request of `token_ids()` with
    `step_params`, and `advance(outputs)` takes their `CompletionOutput`s in that order. `done` once `max_tokens`
    steps have run or no beam is left; `results()` then ranks them. `num_logprobs`: each step's requests also
    return that many top log-probs (a server request's `logprobs` that exceed 2 x beam_width); the candidates are
    still each beam's top 2 x beam_width tokens (and the sampled one)."""

    def __init__(self, prompts: list[list[int]], params, eos_token_id: int | None, num_logprobs: int = 0):
        self.params, self.eos_token_id = params, eos_token_id
        self.step_params = SamplingParams(max_tokens=1, temperature=params.temperature,
                                          logprobs=max(2 * params.beam_width, num_logprobs))
        self.beams = [[BeamSearchSequence(list(p), [])] for p in prompts]
        self.completed: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.steps = 0

    def score(self, beam: BeamSearchSequence) -> float:
        return beam_search_score(beam.tokens, beam.cum_logprob, self.eos_token_id, self.params.length_penalty)

    @property
    def done(self) -> bool:
        return self.steps >= self.params.max_tokens or not any(self.beams)

    def live(self) -> list[BeamSearchSequence]:
        return [b for bs in self.beams for b in bs]

    def advance(self, outputs: Sequence) -> None:
        """One step: `outputs[k]` is the `CompletionOutput` of `live()[k]`'s request."""
        width, outputs = self.params.beam_width, iter(outputs)
        for i, bs in enumerate(self.beams):
            candidates = []
            for beam in bs:
                out = next(outputs)
                top = out.logprobs[0]
                tokens = list(top)[:2 * width]  # the top entries come first, in order
                if out.token_ids[0] not in tokens:  # the sampled token (at temperature 0 among them)
                    tokens.append(out.token_ids[0])
                for token in tokens:
                    new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [top],
                                             beam.cum_logprob + top[token])
                    if token == self.eos_token_id and not self.params.ignore_eos:
                        self.completed[i].append(new)
                    else:
                        candidates.append(new)
            self.beams[i] = sorted(candidates, key=self.score, reverse=True)[:width]
        self.steps += 1

    def results(self, decode: Callable[[list[int]], str] | None = None) -> list[BeamSearchOutput]:
        """Each prompt's beam_width best of its completed and live beams, best first; `decode` writes their text."""
        results = []
        for bs, done in zip(self.beams, self.completed):
            best = sorted(done + bs, key=self.score, reverse=True)[:self.params.beam_width]
            if decode is not None:
                for beam in best:
                    beam.text = decode(beam.tokens)
            results.append(BeamSearchOutput(best))
        return results


def beam_search(generate: Callable, prompts: list[list[int]], params, eos_token_id: int | None,
                decode: Callable[[list[int]], str] | None = None, use_tqdm: bool = False) -> list[BeamSearchOutput]:
    """The beam search of each prompt (token ids). `generate(token_id_lists, sampling_params)` runs one step's
    requests and returns their `RequestOutput`s; `params` a `BeamSearchParams`; `decode` writes each returned
    sequence's text; `use_tqdm`: a progress bar over the `max_tokens` steps on stderr (vLLM's, with its warning)."""
    search = BeamSearch(prompts, params, eos_token_id)
    bar = None
    if use_tqdm:
        bar = tqdm(total=params.max_tokens, desc="Beam search", unit="token", unit_scale=False)
        log.warning("The progress bar shows the upper bound on token steps and may finish early due to stopping "
                    "conditions. It does not reflect instance-level progress.")
    try:
        while not search.done:
            outputs = generate([b.tokens for b in search.live()], search.step_params)
            search.advance([out.outputs[0] for out in outputs])
            if bar is not None:
                bar.update()
    finally:
        if bar is not None:
            bar.close()
    return search.results(decode)
