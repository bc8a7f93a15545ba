"""`LLM.beam_search` (vLLM's): against vLLM's algorithm written here from its definition over transformers' logits,
and against transformers' own beam search where the two algorithms agree (no EOS)."""
import json
import math
import os
import shutil

import numpy as np
import pytest
import torch

from mnemojax import LLM, BeamSearchParams
from mnemojax.engine.beam_search import BeamSearch, beam_search_score
from mnemojax.scheduling.outputs import CompletionOutput
from mnemojax.scheduling.sampling_params import ParamError
from tests.hf_utils import load_hf_model, make_hf_checkpoint


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A checkpoint without a tokenizer (EOS 257, which the searches below do not meet)."""
    return make_hf_checkpoint(tmp_path_factory.mktemp("beam") / "plain", weight_scale=4.0, seed=5, tokenizer=False)


@pytest.fixture(scope="module")
def ckpt(plain, tmp_path_factory):
    """`plain` with another EOS: a token the search meets, the greedy second token of the first prompt below (so
    completed beams, and their length rule, are exercised)."""
    path = str(tmp_path_factory.mktemp("beam") / "eos")
    shutil.copytree(plain, path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    hf = load_hf_model(path)
    with torch.no_grad():
        greedy = hf.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=2, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, -1].item()
    config["eos_token_id"] = greedy
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


PROMPTS = [[5, 77, 3, 150, 9, 31], [200, 14, 14, 90]]


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(model=ckpt, page_size=4, chunk_size=16, max_model_len=64, max_num_batched_tokens=64,
               precompile=False)


def _reference(hf, prompt, width, max_tokens, eos, ignore_eos, length_penalty):
    """vLLM's `LLM.beam_search` over transformers' float32 log-softmax: [(tokens, cumulative log-prob)], best first."""
    def score(beam):
        tokens, cum = beam
        return cum / max(len(tokens) - (tokens[-1] == eos), 1) ** length_penalty

    beams, done = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        if not beams:
            break
        candidates = []
        for tokens, cum in beams:
            with torch.no_grad():
                lp = torch.log_softmax(hf(torch.tensor([tokens])).logits[0, -1].float(), -1)
            values, ids = torch.topk(lp, 2 * width)
            for t, v in zip(ids.tolist(), values.tolist()):
                (done if t == eos and not ignore_eos else candidates).append((tokens + [t], cum + v))
        beams = sorted(candidates, key=score, reverse=True)[:width]
    return sorted(done + beams, key=score, reverse=True)[:width]


@pytest.mark.parametrize("width, max_tokens, ignore_eos, length_penalty",
                         [(3, 6, False, 1.0), (2, 5, False, 0.3), (4, 4, True, 1.0)])
def test_beam_search_follows_vllms_algorithm(llm, ckpt, width, max_tokens, ignore_eos, length_penalty):
    """The sequences (tokens, in order) and their cumulative log-probs equal vLLM's algorithm on transformers'
    logits, for two prompts at once; with EOS (a token the search meets) some sequences end there."""
    hf = load_hf_model(ckpt)
    eos = llm.engine.model_config.eos_token_ids[0]
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=ignore_eos,
                              length_penalty=length_penalty)
    outs = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}, PROMPTS[1]], params)
    ended = 0
    for prompt, out in zip(PROMPTS, outs):
        want = _reference(hf, prompt, width, max_tokens, eos, ignore_eos, length_penalty)
        assert [s.tokens for s in out.sequences] == [t for t, _ in want]
        np.testing.assert_allclose([s.cum_logprob for s in out.sequences], [c for _, c in want], atol=1e-4, rtol=0)
        for s in out.sequences:
            assert len(s.logprobs) == len(s.tokens) - len(prompt) and s.text is None  # no tokenizer: no text
            assert s.cum_logprob == pytest.approx(sum(d[t] for d, t in zip(s.logprobs, s.tokens[len(prompt):])))
        ended += sum(s.tokens[-1] == eos and len(s.tokens) < len(prompt) + max_tokens for s in out.sequences)
    assert (ended > 0) == (not ignore_eos)


def test_beam_search_without_eos_equals_transformers(plain):
    """Where no candidate is EOS both algorithms keep the same beams (transformers takes the top 2 x width over all
    beams' tokens, vLLM each beam's top 2 x width: the best width are the same) and rank equal lengths alike. (A
    candidate ending in EOS counts one token less in vLLM's length, ignore_eos or not, so the two differ there.)"""
    hf = load_hf_model(plain)
    width, new = 3, 5
    llm = LLM(model=plain, page_size=4, chunk_size=16, max_model_len=64, max_num_batched_tokens=64, precompile=False)
    out = llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=width, max_tokens=new, ignore_eos=True))[0]
    with torch.no_grad():
        got = hf.generate(torch.tensor([PROMPTS[0]]), num_beams=width, num_return_sequences=width, do_sample=False,
                          max_new_tokens=new, eos_token_id=None, pad_token_id=0, early_stopping=False)
    assert [s.tokens for s in out.sequences] == got.tolist()
    assert llm.engine.model_config.eos_token_ids[0] not in {t for s in out.sequences for t in s.tokens}


def test_beam_search_text_and_bad_input():
    """The tiny model's sequences carry their text (prompt and special tokens included, vLLM's decode); a text prompt
    is tokenized with BOS; bad parameters and prompts with no room are errors naming them."""
    llm = LLM("tiny", max_model_len=32, page_size=4, precompile=False)
    tok = llm.get_tokenizer()
    ids = tok.encode("Hi")
    out = llm.beam_search(["Hi", {"prompt": "Hi"}, {"prompt": "x", "prompt_token_ids": ids}],
                          BeamSearchParams(beam_width=2, max_tokens=3))
    assert out[0] == out[1] == out[2] and len(out[0].sequences) == 2
    for s in out[0].sequences:
        assert s.tokens[:3] == [tok.bos_token_id, ord("H"), ord("i")]
        assert s.text == tok.decode(s.tokens, skip_special_tokens=False) and s.text.startswith("<|begin_of_text|>Hi")
    for kw, field in ((dict(beam_width=11), "beam_width"), (dict(beam_width=0), "beam_width"),
                      (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1.0), "temperature"),
                      (dict(length_penalty=math.inf), "length_penalty"), (dict(ignore_eos=1), "ignore_eos")):
        with pytest.raises(ParamError) as e:
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 2, **kw})
        assert e.value.param == field
    with pytest.raises(ParamError, match=r"prompts\[1\]: .*exceeds max_model_len \(32\)"):
        llm.beam_search(["a", list(range(30))], BeamSearchParams(beam_width=2, max_tokens=3))
    with pytest.raises(ParamError, match=r"prompts\[0\]: a dict prompt has 'prompt' \(text\) or 'prompt_token_ids'"):
        llm.beam_search([{"text": "a"}], BeamSearchParams(beam_width=2, max_tokens=3))
    assert llm.engine.kv.num_used == 0


def test_the_score_counts_the_prompt_and_not_a_final_eos():
    assert beam_search_score([1, 2, 3, 4], -2.0, eos_token_id=4) == pytest.approx(-2.0 / 3)
    assert beam_search_score([1, 2, 3, 4], -2.0, eos_token_id=9, length_penalty=0.5) == pytest.approx(-1.0)
    assert beam_search_score([4], -1.0, eos_token_id=4) == -1.0  # at least 1


def _step_output(top: dict[int, float], sampled: int) -> CompletionOutput:
    return CompletionOutput(0, "", [sampled], [top], "length")


def test_the_candidates_are_each_beams_top_2_x_width_and_its_sampled_token():
    """A step's requests may return more top log-probs than the search takes (the server's `logprobs`): the
    candidates are still each beam's top 2 x beam_width tokens and its sampled one, whatever else is there."""
    top = {10: -0.1, 11: -0.2, 12: -0.3, 13: -0.4, 14: -0.5}
    params = BeamSearchParams(beam_width=2, max_tokens=1)
    for eos, ended in ((13, True), (14, False)):  # EOS 4th (a candidate) or 5th (not one)
        s = BeamSearch([[1, 2]], params, eos, num_logprobs=5)
        assert s.step_params.logprobs == 5 and [b.tokens for b in s.live()] == [[1, 2]]
        s.advance([_step_output(top, 10)])
        assert s.done and [b.tokens[-1] for b in s.completed[0]] == ([13] if ended else [])
        assert [b.tokens[-1] for b in s.beams[0]] == [10, 11]
    s = BeamSearch([[1, 2]], params, 30)  # a sampled token (temperature > 0) outside the top entries
    assert s.step_params.logprobs == 4
    s.advance([_step_output({**top, 30: -7.0}, 30)])
    assert [(b.tokens, b.cum_logprob) for b in s.completed[0]] == [([1, 2, 30], -7.0)]
