"""Per-step outputs as deltas (`output_kind=DELTA`): each carries only what its step added, and they add up to
the cumulative output exactly; FINAL_ONLY: one output, the last, equal to the cumulative one; the offline
`LLM.generate` (which asks for FINAL_ONLY) returns the cumulative output, unchanged."""
import dataclasses

import pytest

from mnemojax import LLM, SamplingParams
from mnemojax.engine.llm_engine import EngineConfig, LLMEngine
from mnemojax.scheduling.sampling_params import RequestOutputKind

KW = dict(max_model_len=128, page_size=4, chunk_size=16, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model="tiny", **KW))


def _run(engine, prompts, params):
    """{request id: every output the engine gave it, the last from pop_finished}."""
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    outs = {rid: [] for rid in rids}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    return outs, {rid: engine.pop_finished(rid) for rid in rids}


def _mixed_requests():
    """Prompts longer than a chunk or not, text or ids, with log-probs of both kinds, greedy and seeded, stop
    strings."""
    prompts = ["a prompt longer than one chunk of sixteen tokens", [7, 8, 9], "stop here: xyz"]
    base = [SamplingParams(max_tokens=12, temperature=0.9, seed=3, logprobs=2, prompt_logprobs=1, ignore_eos=True),
            SamplingParams(max_tokens=9, temperature=0, logprobs=0),
            SamplingParams(max_tokens=20, temperature=1.0, seed=5, stop=["e", "ab"], ignore_eos=True)]
    return prompts, base


def test_deltas_add_up_to_the_cumulative_output(engine):
    prompts, base = _mixed_requests()
    cumulative, _ = _run(engine, prompts, base)
    deltas, finals = _run(engine, prompts, [dataclasses.replace(p, output_kind=RequestOutputKind.DELTA)
                                            for p in base])
    for (c_outs, d_outs, final) in zip(cumulative.values(), deltas.values(), finals.values()):
        whole = c_outs[-1]
        first, rest = d_outs[0], d_outs[1:]
        lps = whole.outputs[0].logprobs
        seen = 0
        for o in d_outs:  # vLLM's DELTA cumulative_logprob: the running sum over every token so far
            seen += len(o.outputs[0].token_ids)
            want = None if lps is None else sum(d[t] for d, t in zip(lps[:seen], whole.outputs[0].token_ids))
            assert o.outputs[0].cumulative_logprob == want
        assert first.prompt_token_ids == whole.prompt_token_ids
        assert all(o.prompt_token_ids == [] for o in rest)  # the prompt once, not every step
        assert all(len(o.outputs[0].token_ids) <= 1 for o in d_outs)  # a step adds at most one token
        for o in rest:
            first.add(o)
        got, ref = first.outputs[0], whole.outputs[0]
        assert (got.text, got.token_ids, got.logprobs, got.finish_reason, got.stop_reason) == \
               (ref.text, ref.token_ids, ref.logprobs, ref.finish_reason, ref.stop_reason)
        assert first.prompt_logprobs == whole.prompt_logprobs and got.cumulative_logprob == ref.cumulative_logprob
        assert len(first.metrics.token_times) == len(ref.token_ids) and first.finished
        # pop_finished gives the whole output (metrics read it), whatever the kind
        assert final.outputs[0].token_ids == ref.token_ids and len(final.metrics.token_times) == len(ref.token_ids)


def test_final_only_gives_one_output_equal_to_the_cumulative_last(engine):
    """The engine's steps give a FINAL_ONLY request nothing until it ends, then everything: the same text (decoded
    once at the end without stop strings, token by token with them), tokens, log-probs, reasons and metrics as
    the cumulative run's last output."""
    prompts, base = _mixed_requests()
    cumulative, _ = _run(engine, prompts, base)
    finals, popped = _run(engine, prompts, [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                                            for p in base])
    for c_outs, f_outs, whole in zip(cumulative.values(), finals.values(), popped.values()):
        assert len(c_outs) > 1 and len(f_outs) == 1 and f_outs[0].finished
        got, ref = f_outs[0], c_outs[-1]
        assert got.outputs[0] == ref.outputs[0] and got.outputs[0].text == ref.outputs[0].text
        assert got.prompt_token_ids == ref.prompt_token_ids and got.prompt_logprobs == ref.prompt_logprobs
        assert got.metrics.token_times and len(got.metrics.token_times) == len(ref.metrics.token_times)
        assert whole.outputs[0] == ref.outputs[0]


def test_offline_generate_builds_only_the_final_outputs(monkeypatch):
    """`LLM.generate` asks for FINAL_ONLY, as vLLM's does: outputs are built for a request only when it ends (by the
    step that ends it, and its result), none in the steps before (they used to copy every request's lists in every
    step: 7 tokens, 8 or more outputs each)."""
    llm = LLM("tiny", **KW)
    built = []
    output = llm.engine.output
    monkeypatch.setattr(llm.engine, "output", lambda req, kind=None: built.append(req.request_id) or output(req, kind))
    params = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    outs = llm.generate(["abc", [1, 2, 3, 4]], params)
    assert sorted(set(built)) == sorted(o.request_id for o in outs)
    assert all(built.count(o.request_id) <= 2 for o in outs), built
    assert [len(o.outputs[0].token_ids) for o in outs] == [7, 7] and params.output_kind is RequestOutputKind.CUMULATIVE


def test_offline_generate_is_unchanged_and_cumulative():
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=1)
    assert params.output_kind is RequestOutputKind.CUMULATIVE
    out = LLM("tiny", **KW).generate(["abc"], params)[0]
    assert len(out.outputs[0].token_ids) == 6 and out.prompt_token_ids[1:] == [97, 98, 99]


def test_output_kind_is_checked():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")
