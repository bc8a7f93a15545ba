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


def beam_search(generate: Callable, prompts: list[list[int]], params, eos_token_id: int | None,
                decode: Callable[[list[int]], str] | None = None, use_tqdm: bool = False) -> list[BeamSearchOutput]:
    """The beam search of each prompt (token ids). `generate(token_id_lists, sampling_params)` runs one step's
    requests and returns their `RequestOutput`s; `params` a `BeamSearchParams`; `decode` writes each returned
    sequence's text; `use_tqdm`: a progress bar over the `max_tokens` steps on stderr (vLLM's, with its warning)."""
    width = params.beam_width
    step = SamplingParams(max_tokens=1, temperature=params.temperature, logprobs=2 * width)

    def score(beam: BeamSearchSequence) -> float:
        return beam_search_score(beam.tokens, beam.cum_logprob, eos_token_id, params.length_penalty)

    beams = [[BeamSearchSequence(list(p), [])] for p in prompts]
    completed: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    steps = range(params.max_tokens)
    if use_tqdm:
        steps = tqdm(steps, desc="Beam search", unit="token", unit_scale=False)
        log.warning("The progress bar shows the upper bound on token steps and may finish early due to stopping "
                    "conditions. It does not reflect instance-level progress.")
    for _ in steps:
        live = [b for bs in beams for b in bs]
        if not live:
            break
        outputs = iter(generate([b.tokens for b in live], step))
        for i, bs in enumerate(beams):
            candidates = []
            for beam in bs:
                out = next(outputs).outputs[0]
                top = out.logprobs[0]
                for token, lp in top.items():
                    new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [top], beam.cum_logprob + lp)
                    if token == eos_token_id and not params.ignore_eos:
                        completed[i].append(new)
                    else:
                        candidates.append(new)
            beams[i] = sorted(candidates, key=score, reverse=True)[:width]
    if use_tqdm:
        steps.close()
    results = []
    for bs, done in zip(beams, completed):
        best = sorted(done + bs, key=score, reverse=True)[:width]
        if decode is not None:
            for beam in best:
                beam.text = decode(beam.tokens)
        results.append(BeamSearchOutput(best))
    return results
