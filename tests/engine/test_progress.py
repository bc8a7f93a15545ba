"""vLLM's `use_tqdm` on `LLM.generate` and `LLM.chat` (a bar of the finished prompts, on by default), and
`LLM.beam_search`'s `use_tqdm` and `concurrency_limit` (prompts searched a group at a time)."""
import re

import numpy as np
import pytest

from mnemojax import LLM, BeamSearchParams, SamplingParams
from mnemojax.scheduling.sampling_params import ParamError

PARAMS = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]  # 9 prompt tokens, 6 generated


@pytest.fixture(scope="module")
def llm():
    return LLM(model="tiny", page_size=4, chunk_size=16, max_model_len=64, max_num_batched_tokens=64,
               precompile=False)


class Bar:
    """A progress bar as `use_tqdm`'s callable makes it: records what it was made with and shown."""

    def __init__(self, **kwargs):
        self.kwargs, self.updates, self.postfixes, self.closed = kwargs, [], [], False

    def update(self, n):
        self.updates.append(n)
        self.postfixes.append(self.postfix)

    def close(self):
        self.closed = True


@pytest.fixture
def bars():
    """(the bars made so far, a `use_tqdm` callable that makes a `Bar`)"""
    made = []

    def make(**kwargs):
        made.append(Bar(**kwargs))
        return made[-1]

    return made, make


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_generate_shows_a_bar_by_default_and_none_when_asked(llm, capfd):
    quiet = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert capfd.readouterr().err == ""
    shown = llm.generate(PROMPTS, PARAMS)
    err = capfd.readouterr().err
    assert "Processed prompts" in err and "3/3" in err and "est. speed input:" in err, err
    assert _tokens(shown) == _tokens(quiet)


def test_a_callable_makes_the_bar_which_counts_finished_prompts_and_their_tokens_per_second(llm, bars):
    bars, make = bars
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=make)
    (bar,) = bars
    assert bar.kwargs["total"] == 3 and bar.kwargs["desc"] == "Processed prompts"
    assert sum(bar.updates) == 3 and all(n > 0 for n in bar.updates) and bar.closed
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 6
    speeds = [float(x) for x in re.fullmatch(r"est\. speed input: ([\d.]+) toks/s, output: ([\d.]+) toks/s",
                                             bar.postfixes[-1]).groups()]
    # Both over the same time: the finished prompts' 9 input tokens against their 6 output tokens.
    assert speeds[1] > 0 and speeds[0] / speeds[1] == pytest.approx(9 / 6, rel=1e-2)

    bars.clear()
    llm.chat([{"role": "user", "content": "hi"}], PARAMS, make)  # third, as in vLLM's signature
    assert bars[0].kwargs["total"] == 1 and sum(bars[0].updates) == 1 and bars[0].closed


def test_the_bar_closes_when_generate_fails(llm, bars, monkeypatch):
    bars, make = bars

    def fail():
        raise KeyboardInterrupt

    monkeypatch.setattr(llm.engine, "step", fail)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, PARAMS, use_tqdm=make)
    assert bars[0].closed and bars[0].updates == []
    monkeypatch.undo()
    assert not llm.engine.has_unfinished() and llm.engine.kv.num_used == 0


def test_beam_search_with_a_concurrency_limit_searches_one_group_after_another(llm, monkeypatch, caplog, capfd):
    prompts = [[5, 77, 3], [200, 14], [9, 9, 9, 1]]
    params = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
    whole = llm.beam_search(prompts, params)
    assert capfd.readouterr().err == ""  # vLLM's default for beam search: no bar

    calls, generate = [], llm.generate

    def recording(token_lists, sampling_params, **kwargs):
        calls.append(({i for tokens in token_lists for i, p in enumerate(prompts) if tokens[:len(p)] == p}, kwargs))
        return generate(token_lists, sampling_params, **kwargs)

    monkeypatch.setattr(llm, "generate", recording)
    grouped = llm.beam_search(prompts, params, concurrency_limit=2)
    # Prompts 0 and 1 for the 3 steps, then prompt 2 for its 3; no step shows a bar of its own.
    assert [groups for groups, _ in calls] == [{0, 1}] * 3 + [{2}] * 3
    assert all(kwargs == {"use_tqdm": False} for _, kwargs in calls)
    for a, b in zip(whole, grouped):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        np.testing.assert_allclose([s.cum_logprob for s in a.sequences], [s.cum_logprob for s in b.sequences],
                                   atol=1e-5, rtol=0)

    calls.clear()
    with caplog.at_level("WARNING"):
        llm.beam_search(prompts, params, use_tqdm=True, concurrency_limit=5)  # vLLM's: the bar is turned off
    assert "Disabling progress bar" in caplog.text and "Beam search" not in capfd.readouterr().err
    assert [groups for groups, _ in calls] == [{0, 1, 2}] * 3
    caplog.clear()
    with caplog.at_level("WARNING"):
        llm.beam_search(prompts, params, use_tqdm=True)
    assert "Beam search" in capfd.readouterr().err and "upper bound on token steps" in caplog.text


@pytest.mark.parametrize("limit", [0, -1, 1.5, True, "2"])
def test_a_bad_concurrency_limit_names_it(llm, limit):
    with pytest.raises(ParamError, match="concurrency_limit must be None or an integer >= 1") as e:
        llm.beam_search([[1, 2]], BeamSearchParams(beam_width=2, max_tokens=2), concurrency_limit=limit)
    assert e.value.param == "concurrency_limit"
