"""Engine invariances on one device: chunked == one-shot, batched == alone, preempted == not, long contexts
against HF, sampling by seed, stop conditions, log-prob shapes, bad input, bfloat16."""
import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from mnemojax import LLM, SamplingParams, StructuredOutputsParams
from models.tokenizer import spaces_between_special_tokens_matter
from mnemojax.scheduling.sampling_params import ParamError
from tests.hf_utils import EOS_ID, load_hf_model, make_hf_checkpoint

GREEDY = SamplingParams(max_tokens=12, temperature=0, prompt_logprobs=0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("engine") / "gqa", weight_scale=8.0, seed=2,
                              num_heads=4, num_kv_heads=2, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(model=ckpt, page_size=4, chunk_size=16, max_model_len=256, max_num_batched_tokens=64)


def _prompts(lens, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n).tolist() for n in lens]


def _prompt_lps(out):
    return np.array([d[t] for d, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])])


@pytest.fixture(scope="module")
def alone(llm):
    """Each prompt run alone with the default chunk size: the reference for the invariance tests."""
    prompts = _prompts((5, 37, 70))
    return prompts, [llm.generate([p], GREEDY)[0] for p in prompts]


@pytest.mark.parametrize("chunk_size", [1, 3, 16, 64, 256])
def test_chunk_size_does_not_change_results(ckpt, alone, chunk_size):
    prompts, ref = alone
    llm = LLM(model=ckpt, page_size=4, chunk_size=chunk_size, max_model_len=256, max_num_batched_tokens=256)
    for p, r in zip(prompts, ref):
        out = llm.generate([p], GREEDY)[0]
        np.testing.assert_allclose(_prompt_lps(out), _prompt_lps(r), atol=1e-5, rtol=0)
        assert out.outputs[0].token_ids == r.outputs[0].token_ids


def test_batched_equals_alone(llm, alone):
    prompts, ref = alone
    outs = llm.generate(prompts, GREEDY)
    for out, r in zip(outs, ref):
        np.testing.assert_allclose(_prompt_lps(out), _prompt_lps(r), atol=1e-5, rtol=0)
        assert out.outputs[0].token_ids == r.outputs[0].token_ids


def test_preemption_by_recompute_gives_same_results(ckpt, alone, caplog):
    """With pages for barely one request, requests preempt each other and recompute; results are unchanged."""
    prompts, ref = alone
    small = LLM(model=ckpt, page_size=4, chunk_size=16, max_model_len=96, num_pages=26,
                max_num_batched_tokens=64)
    with caplog.at_level("WARNING"):
        outs = small.generate(prompts, GREEDY)
    assert sum(o.num_preemptions for o in outs) > 0
    assert "preempted request" in caplog.text
    for out, r in zip(outs, ref):
        np.testing.assert_allclose(_prompt_lps(out), _prompt_lps(r), atol=1e-5, rtol=0)
        assert out.outputs[0].token_ids == r.outputs[0].token_ids
    assert small.engine.kv.num_used == 0


def test_penalties_survive_preemption_and_prefix_cache_hits(llm, ckpt, caplog, monkeypatch):
    """A preempted request with penalties recomputes into a new sequence slot, whose counts the host sets up again
    from the tokens it has generated; a request whose prompt hits the prefix cache still has its whole prompt in
    its repetition penalty: the tokens are those of an engine with room for everyone, without a prefix cache."""
    prompts = _prompts((20, 24, 70), seed=9)
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, **kw)
              for kw in (dict(repetition_penalty=1.4), dict(frequency_penalty=0.9, presence_penalty=0.3),
                         dict(repetition_penalty=0.8, frequency_penalty=-0.5))]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    from mnemojax.engine.executor import Executor
    set_up = []  # the generated tokens of each request when its slot was set up
    real = Executor._penalty_init
    monkeypatch.setattr(Executor, "_penalty_init",
                        lambda self, b, req: set_up.append(len(req.output_token_ids)) or real(self, b, req))
    small = LLM(model=ckpt, page_size=4, chunk_size=16, max_model_len=96, num_pages=26, max_num_batched_tokens=64)
    with caplog.at_level("WARNING"):
        outs = small.generate(prompts[:2] * 2, params[:2] * 2)  # 4 x 11-12 pages of 4 for 26 pages
    assert sum(o.num_preemptions for o in outs) > 0 and "preempted request" in caplog.text
    assert max(set_up) > 0  # a request preempted after it had generated tokens: their counts set up again
    assert [o.outputs[0].token_ids for o in outs] == want[:2] * 2
    cached = LLM(model=ckpt, page_size=4, chunk_size=16, max_model_len=96, max_num_batched_tokens=64,
                 enable_prefix_caching=True)
    cached.generate([prompts[2][:64]], SamplingParams(max_tokens=1, temperature=0))  # its first 64 tokens cached
    out = cached.generate([prompts[2]], params[2])[0]
    assert out.num_cached_tokens > 0 and out.outputs[0].token_ids == want[2]


@pytest.mark.slow  # ~10 s on 2 cores
def test_penalty_set_ups_larger_than_an_update_are_split(ckpt, monkeypatch):
    """Requests with a repetition penalty set up in one step (each its prompt's ~290 distinct tokens of the
    320-token vocabulary) need more entries than the largest update holds (two vocabularies, 1,024): they go in two
    updates, the slots cleared with the first, and each request's tokens are those it gets alone."""
    from mnemojax.engine.executor import Executor

    calls = []  # per update: (slots it clears, entries it holds)
    real = Executor.apply_penalty_updates

    def apply(self, clear, entries, broadcast=True):
        calls.append((int(clear.sum()), int((entries[:, 0] < clear.shape[1]).sum())))
        return real(self, clear, entries, broadcast)

    llm = LLM(model=ckpt, page_size=16, chunk_size=16, max_model_len=1024, max_num_batched_tokens=256)
    prompts = _prompts((800,) * 6, seed=31)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, repetition_penalty=1.3)
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    monkeypatch.setattr(Executor, "apply_penalty_updates", apply)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert together == alone
    first = [i for i, (cleared, n) in enumerate(calls) if n == 1024]  # a full update, then the rest of its step's
    assert first and calls[first[0]][0] >= 4 and calls[first[0] + 1][0] == 0 < calls[first[0] + 1][1], calls


def test_long_context_many_pages_matches_hf(ckpt):
    """A 2000-token context over 125 pages of 16, prefilled in chunks of 256, against HF."""
    llm = LLM(model=ckpt, page_size=16, chunk_size=256, max_model_len=2048, max_num_batched_tokens=256)
    prompt = _prompts((2000,), seed=5)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=0,
                                                ignore_eos=True))[0]
    hf = load_hf_model(ckpt)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        lp = torch.log_softmax(hf(ids).logits[0].double(), -1)
        hf_tokens = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
    ref = lp[torch.arange(len(prompt) - 1), ids[0, 1:]].numpy()
    np.testing.assert_allclose(_prompt_lps(out), ref, atol=1e-4, rtol=0)
    assert out.outputs[0].token_ids == hf_tokens


def test_seed_gives_same_sample_regardless_of_batch(llm):
    prompts = _prompts((9, 30))
    params = SamplingParams(max_tokens=10, temperature=1.0, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    a = llm.generate([prompts[0]], params)[0].outputs[0].token_ids
    b = llm.generate(prompts, [params, SamplingParams(max_tokens=5, temperature=0.7, seed=7)])[0]
    assert b.outputs[0].token_ids == a
    other = llm.generate([prompts[0]], SamplingParams(max_tokens=10, temperature=1.0, top_k=50, top_p=0.9,
                                                      seed=4321, ignore_eos=True))[0].outputs[0].token_ids
    assert other != a


def test_truncate_prompt_tokens_runs_the_prompts_last_tokens(llm):
    """vLLM's truncate_prompt_tokens: the request runs the prompt's last k tokens, exactly as if they were the
    prompt (the same greedy tokens and prompt log-probs), and reports them as its prompt; -1 keeps a prompt shorter
    than max_model_len whole; a k past max_model_len is refused before anything runs."""
    (prompt,) = _prompts((40,), seed=11)
    params = dict(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=2)
    want = llm.generate([prompt[-9:]], SamplingParams(**params))[0]
    got = llm.generate([prompt], SamplingParams(**params, truncate_prompt_tokens=9))[0]
    assert got.prompt_token_ids == prompt[-9:] and got.outputs[0].token_ids == want.outputs[0].token_ids
    np.testing.assert_array_equal(_prompt_lps(got), _prompt_lps(want))
    whole = llm.generate([prompt], SamplingParams(**params, truncate_prompt_tokens=-1))[0]
    assert whole.prompt_token_ids == prompt
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens \(257\) is greater than max_model_len \(256\)"):
        llm.generate([prompt], SamplingParams(**params, truncate_prompt_tokens=257))


def test_min_p_reaches_each_requests_rows(llm):
    """min_p 1 keeps only the most likely token, so a hot seeded request beside others decodes greedily; min_p 0
    leaves its draws as they were."""
    prompts = _prompts((9, 30, 4), seed=5)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    hot = dict(max_tokens=8, temperature=1.5, seed=99, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    mixed = [SamplingParams(**hot, min_p=1.0), SamplingParams(**hot), SamplingParams(**hot, min_p=1.0)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, mixed)]
    assert got[0] == want[0] and got[2] == want[2]
    free = llm.generate([prompts[1]], SamplingParams(**hot, min_p=0.0))[0].outputs[0].token_ids
    assert got[1] == free != want[1]


def test_min_tokens_and_logit_bias_match_hf_generate(llm, ckpt):
    """Greedy with min_tokens equals HF's `min_new_tokens` (its stop tokens banned until then) and logit_bias equals
    HF's `sequence_bias` on single tokens; a stop token the greedy run would pick at once is chosen, so the ban
    matters. Log-probs stay the raw model's (HF's log_softmax of the unbiased logits)."""
    hf = load_hf_model(ckpt)
    prompt = _prompts((11,), seed=7)[0]
    ids = torch.tensor([prompt])
    plain = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].outputs[0]
    stop = plain.token_ids[1]

    def hf_generate(**kw):
        with torch.no_grad():
            return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                               pad_token_id=0, **kw)[0, len(prompt):].tolist()

    early = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop]))[0].outputs[0]
    assert early.token_ids == hf_generate(eos_token_id=[EOS_ID, stop]) == plain.token_ids[:2]
    got = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop],
                                                min_tokens=4))[0].outputs[0]
    assert got.token_ids == hf_generate(eos_token_id=[EOS_ID, stop], min_new_tokens=4)
    assert len(got.token_ids) > 4 and stop not in got.token_ids[:4]
    bias = {plain.token_ids[0]: -4.0, 17: 6.5, 200: -100.0}
    got = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logit_bias=bias,
                                                logprobs=0))[0].outputs[0]
    want = hf_generate(eos_token_id=None, sequence_bias=[[[t], b] for t, b in bias.items()])
    assert got.token_ids == want != plain.token_ids
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([prompt + want])).logits[0].double(), -1)
    raw = lp[torch.arange(len(prompt) - 1, len(prompt) + 9), torch.tensor(want)].numpy()
    np.testing.assert_allclose([d[t] for d, t in zip(got.logprobs, got.token_ids)], raw, atol=1e-4, rtol=0)
    # min_tokens bans EOS even with ignore_eos (vLLM's): EOS, made the greedy choice by its bias, comes only after
    # the first 3 tokens (HF stops there: its first 4 tokens are ours), and then goes on (ignored)
    pushed = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, min_tokens=3, logit_bias={EOS_ID: 100})
    got = llm.generate([prompt], pushed)[0].outputs[0].token_ids
    want = hf_generate(eos_token_id=[EOS_ID], min_new_tokens=3, sequence_bias=[[[EOS_ID], 100.0]])
    assert got[:4] == want and want[3] == EOS_ID and got[3:] == [EOS_ID] * 5 and EOS_ID not in got[:3]


class _OpenAIPenalties:
    """OpenAI's presence and frequency penalties as a transformers logits processor, written from their definition
    (the logit of each token generated so far, less frequency x its count and presence once): the reference the
    engine's penalties are checked against (transformers has a repetition penalty, not these two)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        generated = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def test_penalties_match_hf_generate(llm, ckpt):
    """vLLM's presence, frequency and repetition penalties, alone and together, greedy: the tokens equal HF's
    `generate` with its `repetition_penalty` (over the prompt and the generated tokens) and OpenAI's two penalties
    as a logits processor after it (vLLM's order), for requests batched with each other and with one without
    penalties (whose tokens stay its own); a negative frequency penalty favours repeats."""
    import transformers

    hf = load_hf_model(ckpt)
    prompts = _prompts((13, 7, 21), seed=22)
    cases = [dict(repetition_penalty=1.3), dict(presence_penalty=0.8, frequency_penalty=0.6),
             dict(repetition_penalty=0.7, presence_penalty=-0.5, frequency_penalty=1.5), dict(frequency_penalty=-2.0),
             {}]
    requests = [(prompt, kw) for kw in cases for prompt in prompts]
    outs = llm.generate([p for p, _ in requests], [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, **kw)
                                                   for _, kw in requests])
    for (prompt, kw), out in zip(requests, outs):
        ids = torch.tensor([prompt])
        extra = transformers.LogitsProcessorList([_OpenAIPenalties(len(prompt), kw.get("presence_penalty", 0.0),
                                                                   kw.get("frequency_penalty", 0.0))])
        with torch.no_grad():
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                               pad_token_id=0, eos_token_id=None, logits_processor=extra,
                               repetition_penalty=kw.get("repetition_penalty", 1.0))[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == want, (kw, prompt)
    plain = {tuple(p): o.outputs[0].token_ids for (p, kw), o in zip(requests, outs) if not kw}
    for i, kw in enumerate(cases[:-1]):  # each case changed some prompt's tokens: the test sees its penalties
        mine = outs[i * len(prompts):(i + 1) * len(prompts)]
        assert any(o.outputs[0].token_ids != plain[tuple(p)] for p, o in zip(prompts, mine)), kw


def test_allowed_token_ids_match_hf_generate_banning_every_other_token(llm, ckpt):
    """vLLM's allowed_token_ids: greedy output equals HF's `generate` with every other token a bad word (-inf); with
    logit_bias among the allowed tokens, HF's `sequence_bias` beside it; with min_tokens, the allowed stop token
    only after that many tokens. A request that allows a token beside one it biases keeps the bias only where
    allowed. Seeded sampling draws only allowed tokens, in a batch with unrestricted requests."""
    hf = load_hf_model(ckpt)
    vocab = hf.config.vocab_size
    prompt = _prompts((13,), seed=21)[0]
    ids = torch.tensor([prompt])
    plain = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0]
    allowed = [plain.token_ids[1], 17, 99, EOS_ID, 250]  # not the first greedy token: the restriction matters

    def hf_generate(**kw):
        with torch.no_grad():
            return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                               pad_token_id=0, bad_words_ids=[[t] for t in range(vocab) if t not in allowed],
                               **kw)[0, len(prompt):].tolist()

    got = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                allowed_token_ids=allowed))[0].outputs[0].token_ids
    assert got == hf_generate(eos_token_id=None) and set(got) <= set(allowed) and got != plain.token_ids
    bias = {17: 3.0, 99: -2.0, 5: 50.0}  # 5 is not allowed: its bias changes nothing
    got = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logit_bias=bias,
                                                allowed_token_ids=allowed))[0].outputs[0].token_ids
    assert got == hf_generate(eos_token_id=None, sequence_bias=[[[t], b] for t, b in bias.items() if t != 5])
    pushed = dict(max_tokens=8, temperature=0, logit_bias={EOS_ID: 100.0}, allowed_token_ids=allowed)
    got = llm.generate([prompt], SamplingParams(**pushed, min_tokens=3))[0].outputs[0]
    assert got.token_ids == hf_generate(eos_token_id=[EOS_ID], min_new_tokens=3,
                                        sequence_bias=[[[EOS_ID], 100.0]])
    assert got.token_ids[3] == EOS_ID and got.finish_reason == "stop" and len(got.token_ids) == 4
    hot = [SamplingParams(max_tokens=12, temperature=1.3, seed=s, ignore_eos=True, allowed_token_ids=allowed[:3])
           for s in range(6)]
    free = SamplingParams(max_tokens=12, temperature=1.3, seed=0, ignore_eos=True)
    outs = llm.generate([prompt] * 7, hot + [free])
    drawn = [t for o in outs[:6] for t in o.outputs[0].token_ids]
    assert set(drawn) <= set(allowed[:3]) and len(set(drawn)) > 1
    assert not set(outs[6].outputs[0].token_ids) <= set(allowed[:3])
    assert outs[6].outputs[0].token_ids == llm.generate([prompt], free)[0].outputs[0].token_ids


class _VllmBadWords:
    """vLLM's bad words as a transformers logits processor, written from its rule: a sequence's last token is -inf
    where the tokens generated so far (not the prompt's) end with the rest of the sequence."""

    def __init__(self, prompt_len: int, sequences: list[list[int]]):
        self.prompt_len, self.sequences = prompt_len, sequences

    def __call__(self, input_ids, scores):
        generated = input_ids[0, self.prompt_len:].tolist()
        scores = scores.clone()
        for seq in self.sequences:
            prefix = seq[:-1]
            if len(prefix) <= len(generated) and generated[len(generated) - len(prefix):] == prefix:
                scores[0, seq[-1]] = -torch.inf
        return scores


def test_bad_words_match_vllms_rule(llm, ckpt):
    """bad_words_token_ids, greedy: the tokens equal HF's `generate` with vLLM's rule as a logits processor, for bans
    of one, two and three tokens each of which changes the output where the one before did not, with async
    scheduling (a ban's prefix ends in a token the device sampled the step before) and without it, batched with a
    request without bans. A sequence whose prefix is the prompt's last token bans nothing (only generated tokens
    match: vLLM's rule, not transformers'). Seeded sampling never draws a banned token."""
    import transformers

    hf = load_hf_model(ckpt)
    prompt = _prompts((9,), seed=31)[0]
    ids = torch.tensor([prompt])

    def hf_generate(sequences):
        extra = transformers.LogitsProcessorList([_VllmBadWords(len(prompt), sequences)])
        with torch.no_grad():
            return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                               pad_token_id=0, eos_token_id=None, logits_processor=extra)[0, len(prompt):].tolist()

    plain = hf_generate([])
    one = [[plain[0]]]
    out1 = hf_generate(one)
    two = one + [[out1[2], out1[3]]]
    out2 = hf_generate(two)
    three = two + [[out2[4], out2[5], out2[6]]]
    out3 = hf_generate(three)
    assert out1[0] != plain[0] and out2[:3] == out1[:3] != out2 and out3[:6] == out2[:6] != out3
    straddling = three + [[prompt[-1], out3[0]]]
    assert hf_generate(straddling) == out3
    # a word whose last token is the greedy second token, after another first one: nothing is banned there
    elsewhere = [[(plain[0] + 1) % 256, plain[1]]]
    out4 = hf_generate(elsewhere)
    assert out4[:2] == plain[:2]
    # with allowed_token_ids (every other token a one-token bad word for transformers), and with min_tokens (its
    # bans of EOS beside the bad words' until then: EOS is not among the first tokens anyway)
    allowed = sorted(set(out2) | set(plain[:3]))
    vocab = hf.config.vocab_size
    out5 = hf_generate(two + [[t] for t in range(vocab) if t not in allowed])
    assert out5 != plain and EOS_ID not in out2[:5]
    cases = [(one, out1, {}), (two, out2, {}), (three, out3, {}), (straddling, out3, {}), (elsewhere, out4, {}),
             (two, out5, dict(allowed_token_ids=allowed)), (two, out2, dict(min_tokens=5))]
    greedy = dict(max_tokens=10, temperature=0, ignore_eos=True)
    sync = LLM(model=ckpt, page_size=4, chunk_size=16, max_model_len=256, max_num_batched_tokens=64,
               async_scheduling=False, precompile=False)
    for engine in (llm, sync):
        outs = engine.generate([prompt] * (len(cases) + 1), [SamplingParams(**greedy, **kw, bad_words_token_ids=seqs)
                                                             for seqs, _, kw in cases] + [SamplingParams(**greedy)])
        assert [o.outputs[0].token_ids for o in outs] == [want for _, want, _ in cases] + [plain]
    hot = dict(max_tokens=12, temperature=1.5, ignore_eos=True)
    free = [o.outputs[0].token_ids for o in llm.generate([prompt] * 4, [SamplingParams(**hot, seed=s)
                                                                         for s in range(4)])]
    banned = sorted({t for toks in free for t in toks})[:5]
    got = [o.outputs[0].token_ids for o in llm.generate([prompt] * 4, [
        SamplingParams(**hot, seed=s, bad_words_token_ids=[[t] for t in banned]) for s in range(4)])]
    assert not set(banned) & {t for toks in got for t in toks}


def test_bad_words_become_vllms_token_sequences(llm):
    """A word and, when that gives as many tokens starting with another one, the word after a space (vLLM's
    `update_from_tokenizer`); the byte tokenizer's words are their bytes, one more with the space."""
    from mnemojax.engine.llm_engine import bad_word_sequences

    class Words:  # a tokenizer whose words carry their leading space, as SentencePiece's and Llama-3's do
        def encode(self, text, add_special_tokens=True):
            assert not add_special_tokens
            return {"foo": [5, 6], " foo": [7, 6], "bar": [8], " bar": [8], "a b": [9, 10], " a b": [11]}[text]

    assert bad_word_sequences(Words(), ["  foo", "bar", "a b"]) == [(5, 6), (7, 6), (8,), (9, 10)]
    words, sequences = llm.engine.bad_words(SamplingParams(bad_words=["ab", " c"], bad_words_token_ids=[[3, 4, 5]]))
    assert words == {ord("c")} and sequences == [((3, 4), 5), ((ord("a"),), ord("b"))]
    # a sequence ending in an always-banned token needs no slot; with allowed_token_ids, nor one ending elsewhere
    words, sequences = llm.engine.bad_words(SamplingParams(bad_words_token_ids=[[7], [1, 7], [1, 8], [2, 9]],
                                                           allowed_token_ids=[9, 10]))
    assert words == {7} and sequences == [((2,), 9)]


def test_logit_bias_and_min_tokens_beyond_the_slots_are_refused(ckpt):
    llm = LLM(model=ckpt, page_size=4, max_model_len=64, max_logit_bias=3, precompile=False)
    llm.engine.validate([1, 2], SamplingParams(logit_bias={1: 1.0, 2: 2.0}, min_tokens=1))  # + EOS: 3 slots
    with pytest.raises(ParamError, match=r"logit_bias \(3 tokens\) and the stop tokens min_tokens bans \(1\) bias 4 "
                                         r"tokens, more than max_logit_bias \(3, an engine setting\)") as e:
        llm.engine.validate([1, 2], SamplingParams(logit_bias={1: 1.0, 2: 2.0, 3: 0.5}, min_tokens=1))
    assert e.value.param == "logit_bias"
    with pytest.raises(ParamError, match=r"min_tokens bans \(4\)") as e:
        llm.engine.validate([1, 2], SamplingParams(stop_token_ids=[5, 6, 7], min_tokens=2))
    assert e.value.param == "min_tokens"
    with pytest.raises(ParamError, match=r"min_tokens bans \(4\)"):  # EOS even with ignore_eos (vLLM's)
        llm.engine.validate([1, 2], SamplingParams(stop_token_ids=[5, 6, 7], min_tokens=2, ignore_eos=True))
    llm.engine.validate([1, 2], SamplingParams(stop_token_ids=[5, 6], min_tokens=2, logit_bias={5: 1.0}))  # 3
    with pytest.raises(ParamError, match=r"logit_bias token ids must be in \[0, 320\)"):
        llm.engine.validate([1, 2], SamplingParams(logit_bias={320: 1.0}))
    # allowed_token_ids: one slot each (biases and bans on other tokens take none); all banned by min_tokens refused
    llm.engine.validate([1, 2], SamplingParams(allowed_token_ids=[4, 5, 6], logit_bias={7: 1.0, 5: 2.0}, min_tokens=1))
    with pytest.raises(ParamError, match=r"allowed_token_ids \(4 tokens\) are more than max_logit_bias \(3,") as e:
        llm.engine.validate([1, 2], SamplingParams(allowed_token_ids=[4, 5, 6, 7]))
    assert e.value.param == "allowed_token_ids"
    with pytest.raises(ParamError, match=r"every allowed token is a stop token that min_tokens \(2\) bans"):
        llm.engine.validate([1, 2], SamplingParams(allowed_token_ids=[5, EOS_ID], stop_token_ids=[5], min_tokens=2))
    with pytest.raises(ParamError, match=r"allowed_token_ids must be in \[0, 320\) \(the vocabulary\), got \[320\]"):
        llm.engine.validate([1, 2], SamplingParams(allowed_token_ids=[3, 320]))
    # bad words: one token takes a slot, as a bias does (shared with a bias of the same token), a longer sequence one
    # of its own (for its last token)
    llm.engine.validate([1, 2], SamplingParams(logit_bias={1: 1.0}, bad_words_token_ids=[[1], [2], [4, 5]]))
    with pytest.raises(ParamError, match=r"the bad words' single tokens \(2\) and sequences \(2\) .* bias 4 tokens, "
                                         r"more than max_logit_bias \(3,") as e:
        llm.engine.validate([1, 2], SamplingParams(bad_words_token_ids=[[1], [2], [4, 5], [6, 5]]))
    assert e.value.param == "bad_words"
    with pytest.raises(ParamError, match="every allowed token is a bad word") as e:
        llm.engine.validate([1, 2], SamplingParams(allowed_token_ids=[4, 6], bad_words_token_ids=[[4], [6]]))
    assert e.value.param == "allowed_token_ids"
    with pytest.raises(ParamError, match=r"every allowed token is a stop token that min_tokens \(2\) bans until then "
                                         r"or a bad word"):
        llm.engine.validate([1, 2], SamplingParams(allowed_token_ids=[5, EOS_ID], min_tokens=2,
                                                   bad_words_token_ids=[[5]]))
    with pytest.raises(ParamError, match=r"allowed_token_ids \(2 tokens\) and the bad words of more than one token "
                                         r"ending in one of them \(2\) need 4 slots") as e:
        llm.engine.validate([1, 2], SamplingParams(allowed_token_ids=[4, 5], bad_words_token_ids=[[1, 4], [2, 5]]))
    assert e.value.param == "bad_words"
    with pytest.raises(ParamError, match=r"bad_words_token_ids must be in \[0, 320\) \(the vocabulary\), got \[320\]"):
        llm.engine.validate([1, 2], SamplingParams(bad_words_token_ids=[[1, 320]]))
    none = LLM(model=ckpt, page_size=4, max_model_len=64, max_logit_bias=0, precompile=False)
    with pytest.raises(ParamError, match=r"bias 1 tokens, more than max_logit_bias \(0,"):
        none.engine.validate([1, 2], SamplingParams(logit_bias={1: 1.0}))
    with pytest.raises(ValueError, match="max_logit_bias must be an integer >= 0, got -1"):
        LLM(model=ckpt, max_logit_bias=-1)


def test_a_deleted_engine_gives_its_executor_back():
    """Nothing keeps an engine's executor (its weights and KV cache) once the `LLM` is gone: a notebook that builds
    another model gets the memory back. (Class-level caches of the executor's methods held every one.)"""
    import gc
    import weakref

    llm = LLM(model="tiny", page_size=4, max_model_len=64, max_num_batched_tokens=32)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0))
    executor = weakref.ref(llm.engine.executor)
    del llm
    gc.collect()
    assert executor() is None


def test_logprobs_shapes(llm):
    prompt = _prompts((11,))[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.8, seed=3, logprobs=3,
                                                prompt_logprobs=2, ignore_eos=True))[0]
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for d, t in zip(out.prompt_logprobs[1:], prompt[1:]):
        assert t in d and len(d) in (2, 3)  # top-2, plus the actual token when it is not among them
        assert all(v <= 0 for v in d.values())
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 4
    for d, t in zip(c.logprobs, c.token_ids):
        assert t in d and len(d) in (3, 4)
        top = sorted(d.values(), reverse=True)
        assert np.exp(top).sum() <= 1.0 + 1e-5


def test_top_logprobs_computed_only_for_rows_that_ask(llm, monkeypatch):
    """Each logits row says whether its request wants top log-probs (the step skips the vocabulary top-k when
    no row does); a request with logprobs=3 batched beside one without gets the same top entries as alone."""
    p0, p1, p2 = _prompts((9, 6, 7), seed=5)
    asks = SamplingParams(max_tokens=3, temperature=0, logprobs=3, ignore_eos=True)
    plain = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    scores = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1, ignore_eos=True)
    alone = llm.generate([p0], asks)[0].outputs[0]

    prepared, prepare = [], llm.engine.executor.prepare
    monkeypatch.setattr(llm.engine.executor, "prepare", lambda plan, T=None: prepared.append(prepare(plan, T)) or
                        prepared[-1])
    batched = llm.generate([p0, p1, p2], [asks, plain, scores])[0].outputs[0]
    mb = next(m for m in prepared if len(m.plan.chunks) == 3)
    want = [(ref.chunk, ref.is_sample, bool(mb.sampling.want_top[ref.rank, ref.row])) for ref in mb.refs]
    assert (0, True, True) in want and (1, True, False) in want and (2, True, False) in want
    assert [w for chunk, is_sample, w in want if not is_sample] == [True] * (len(p2) - 1)  # p2's prompt rows
    assert mb.sampling.want_top[0].sum() == 1 + len(p2) - 1  # padding rows want nothing

    assert batched.token_ids == alone.token_ids
    for a, b in zip(alone.logprobs, batched.logprobs):
        assert a.keys() == b.keys() and len(a) >= 3
        np.testing.assert_allclose([a[k] for k in a], [b[k] for k in a], rtol=0, atol=1e-5)


def test_stop_conditions(llm):
    prompt = _prompts((6,))[0]
    base = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0]
    toks = base.token_ids
    assert base.finish_reason == "length" and len(toks) == 12
    # A stop token id: generation ends at its first occurrence, the token included.
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                stop_token_ids=[toks[4]]))[0].outputs[0]
    assert out.token_ids == toks[:toks.index(toks[4]) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == toks[4]
    # ... and its text is left out, as vLLM does, unless include_stop_str_in_output.
    tok = llm.get_tokenizer()
    upto = toks.index(toks[4])
    assert out.text == tok.decode(toks[:upto], skip_special_tokens=True)
    kept = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                 stop_token_ids=[toks[4]], include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == tok.decode(toks[:upto + 1], skip_special_tokens=True) != out.text
    # The same stop token as the last token allowed: the length limit names the reason (vLLM's `check_stop` checks
    # it first), and the token's text is kept as any other token's.
    last = llm.generate([prompt], SamplingParams(max_tokens=upto + 1, temperature=0, ignore_eos=True,
                                                 stop_token_ids=[toks[4]]))[0].outputs[0]
    assert last.token_ids == toks[:upto + 1] and (last.finish_reason, last.stop_reason) == ("length", None)
    assert last.text == kept[0].outputs[0].text
    # A stop string: text is cut before it.
    full = tok.decode(toks, skip_special_tokens=True)  # as the engine does by default (vLLM's default)
    stop = full[3:5]
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[:full.index(stop)]


def test_eos_stops_unless_ignored(ckpt, tmp_path):
    """EOS ends generation (the token kept in token_ids) unless ignore_eos; EOS ids come from config.json."""
    import json
    import shutil
    prompt = _prompts((6,))[0]
    llm = LLM(model=ckpt, max_model_len=64)
    toks = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0] \
        .outputs[0].token_ids
    eos = toks[3]
    path = tmp_path / "eos"
    shutil.copytree(ckpt, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["eos_token_id"] = [EOS_ID, eos]
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "generation_config.json").unlink(missing_ok=True)
    llm = LLM(model=str(path), max_model_len=64)
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, skip_special_tokens=False))[0].outputs[0]
    assert out.token_ids == toks[:toks.index(eos) + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    # EOS adds no text even where special tokens are shown (vLLM's), unless include_stop_str_in_output
    tok = llm.get_tokenizer()
    assert out.text == tok.decode(toks[:toks.index(eos)], skip_special_tokens=False)
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == toks and out.finish_reason == "length"


def test_generation_config_gives_the_default_sampling_params(ckpt, tmp_path, monkeypatch):
    """vLLM's --generation-config auto: a request given no sampling parameters samples as the model's
    generation_config.json says (here greedily, 5 tokens); `vllm` ignores the file; its repetition_penalty is one
    of them (vLLM's)."""
    import json
    import shutil

    from mnemojax.engine.llm_engine import EngineConfig, LLMEngine
    path = tmp_path / "gen"
    shutil.copytree(ckpt, path)
    gen = {"bos_token_id": 256, "eos_token_id": EOS_ID, "do_sample": False, "temperature": 0.0,
           "top_k": 50, "max_new_tokens": 5}
    (path / "generation_config.json").write_text(json.dumps(gen))
    prompts = _prompts((6, 9), seed=3)
    llm = LLM(model=str(path), max_model_len=64)
    default = llm.get_default_sampling_params()
    assert (default.temperature, default.top_p, default.top_k, default.max_tokens) == (0.0, 1.0, 50, 5)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts)]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0))]
    assert got == want and all(len(t) == 5 or t[-1] == EOS_ID for t in got)
    # max_new_tokens is capped at the room a prompt leaves (the user asked for no number): 64 - 62 = 2 tokens
    long = _prompts((62,), seed=4)[0]
    assert llm.engine.default_sampling_params(len(long)).max_tokens == 2
    out = llm.generate([long])[0].outputs[0]
    assert len(out.token_ids) == 2 or out.token_ids[-1] == EOS_ID
    assert LLMEngine._generation_defaults(EngineConfig(model=str(path), generation_config="vllm")) == {}
    assert LLMEngine._generation_defaults(EngineConfig(model="tiny", generation_config=str(path)))["max_tokens"] == 5
    (path / "generation_config.json").write_text(json.dumps(dict(gen, repetition_penalty=1.2)))
    assert LLMEngine._generation_defaults(EngineConfig(model=str(path)))["repetition_penalty"] == 1.2
    (path / "generation_config.json").write_text(json.dumps(dict(gen, temperature=-1)))
    with pytest.raises(ValueError, match=r"generation_config.json: temperature must be"):
        LLMEngine._generation_defaults(EngineConfig(model=str(path)))
    (path / "generation_config.json").write_text(json.dumps(dict(gen, max_new_tokens=0)))
    with pytest.raises(ValueError, match=r"generation_config.json: max_new_tokens: "):  # the file's key
        LLMEngine._generation_defaults(EngineConfig(model=str(path)))
    # refused before the weights load (minutes for a large model)
    monkeypatch.setattr("mnemojax.engine.llm_engine.load", lambda config: pytest.fail("loaded first"))
    with pytest.raises(ValueError, match=r"generation_config must be 'auto', 'vllm' or a directory"):
        LLMEngine(EngineConfig(model=str(path), generation_config="nowhere"))


@pytest.mark.parametrize("prompt,params,match", [
    ([], SamplingParams(), "prompt must not be empty"),
    ([1, 320, 2], SamplingParams(), r"token id 320 .* vocabulary \[0, 320\)"),
    (list(range(200)), SamplingParams(max_tokens=100), r"max_model_len \(256\)"),
    # a float or a bool is no token id (it used to be int()-ed: 10.9 ran as token 10)
    ([10.9, 20.5, 30.2], SamplingParams(), r"prompt token ids must be integers; index 0 is 10.9 \(float\)"),
    ([5, True, 7], SamplingParams(), r"index 1 is True \(bool\)"),
    ([5, np.bool_(True)], SamplingParams(), r"index 1 is .*True.* \(bool"),
    ([5, None], SamplingParams(), r"index 1 is None"),
], ids=["empty", "vocab", "max_model_len", "float", "bool", "numpy_bool", "none"])
def test_bad_input_raises_and_engine_still_works(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([[5, 6], prompt], params)
    assert not llm.engine.has_unfinished() and llm.engine.kv.num_used == 0
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize("ids, match", [
    ([1.5, 2], r"index 0 is 1.5 \(float\)"),  # was served as token 1
    ([7.0] * 20, r"index 0 is 7.0 \(float\)"),  # was a TypeError from the prefix cache's hashing, request kept
    (np.array([[1, 2]]), r"index 0 is array"),  # was numpy's "truth value of an array is ambiguous"
])
def test_add_request_checks_prompt_token_ids_as_prompts(llm, ids, match):
    engine = llm.engine
    with pytest.raises(ParamError, match=match) as e:
        engine.add_request("ignored", SamplingParams(max_tokens=2), request_id="bad", prompt_token_ids=ids)
    assert e.value.param == "prompt_token_ids" and "bad" not in engine.requests
    assert not engine.has_unfinished() and engine.kv.num_used == 0


def test_a_bad_prompt_keeps_its_field_name_through_generate(llm):
    with pytest.raises(ParamError, match=r"prompts\[1\]: prompt must not be empty") as e:
        llm.generate([[5, 6], []], SamplingParams())
    assert e.value.param == "prompt"


def test_numpy_token_ids_are_one_prompt(llm):
    """Token ids as numpy integers (`list(array)`) or a 1-D array are one prompt, as a list of ints is (each id
    used to be taken for a prompt of its own, and the call died with a TypeError)."""
    p = _prompts((7,), seed=3)[0]
    greedy = SamplingParams(max_tokens=4, temperature=0)
    want = llm.generate(p, greedy)[0].outputs[0].token_ids
    for ids in (list(np.array(p, np.int64)), np.array(p, np.int32)):
        out = llm.generate(ids, greedy)
        assert len(out) == 1 and out[0].prompt_token_ids == p and out[0].outputs[0].token_ids == want
    with pytest.raises(ValueError, match=r"prompts\[1\]: .*a prompt is a string or a sequence of token ids, got int"):
        llm.generate([p, 5], greedy)


def test_seeds_use_all_64_bits(llm):
    """A seed is 64 bits wide: seed s and s + 2**32 draw different streams (the step used to key them by the low
    32 bits only), and a seed below 2**32 draws as before (its key is jax.random.key(seed), checked in
    tests/engine/test_sampler.py)."""
    p = _prompts((9,), seed=4)[0]
    draw = lambda s: llm.generate([p], SamplingParams(max_tokens=24, temperature=1.5, seed=s, ignore_eos=True))[0] \
        .outputs[0].token_ids
    a, c = draw(5), draw(6)
    assert a != c  # the draw does depend on the seed here
    assert draw(5 + 2**32) != a and draw(2**63 - 1) != draw(2**32 - 1)
    assert draw(5) == a


def test_sampling_values_past_the_step_columns_range_serve(llm):
    """A top_k past int32 (any top_k >= the vocabulary keeps every token) and a temperature past float32's range
    (valid: finite, >= 0) are served, not a failed step (they overflowed the step's int32 / float32 columns):
    the huge top_k draws what top_k=-1 draws with the same seed; the huge temperature, tokens of the vocabulary,
    without an overflow warning."""
    import warnings

    prompt = _prompts([9], seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        huge, off, hot = (llm.generate(prompt, SamplingParams(max_tokens=6, seed=3, ignore_eos=True, **kw))[0]
                          for kw in (dict(top_k=10 ** 12), dict(top_k=-1), dict(temperature=1e300)))
    assert huge.outputs[0].token_ids == off.outputs[0].token_ids and len(off.outputs[0].token_ids) == 6
    assert len(hot.outputs[0].token_ids) == 6 and all(0 <= t < 320 for t in hot.outputs[0].token_ids)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=-0.1), r"min_p must be in \[0, 1\]"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
    (dict(min_p=float("nan")), r"min_p must be in \[0, 1\]"),
    (dict(min_tokens=-1), r"min_tokens must be an int from 0 to max_tokens \(16\), got -1"),
    (dict(min_tokens=17), r"min_tokens must be an int from 0 to max_tokens \(16\), got 17"),
    (dict(logit_bias={-1: 1.0}), "logit_bias must map token ids"),
    (dict(logit_bias={1: float("inf")}), r"logit_bias values must be in \[-100, 100\], got \{1: inf\}"),
    (dict(logit_bias={1: 1e39}), r"logit_bias values must be in \[-100, 100\]"),  # +inf in float32
    (dict(logit_bias={1: float("nan")}), r"logit_bias values must be in \[-100, 100\]"),
    (dict(logit_bias=[(1, 2.0)]), "logit_bias must map token ids"),
])
def test_bad_sampling_params_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_prompt_that_never_fits_in_pages(ckpt):
    llm = LLM(model=ckpt, page_size=4, max_model_len=256, num_pages=11)  # 10 usable pages = 40 tokens
    with pytest.raises(ValueError, match=r"num_pages allows only 10"):
        llm.generate([list(range(30))], SamplingParams(max_tokens=20))
    assert len(llm.generate([list(range(30))], SamplingParams(max_tokens=4))[0].outputs[0].token_ids) == 4


def test_text_prompt_without_tokenizer(tmp_path):
    path = make_hf_checkpoint(tmp_path / "notok", tokenizer=False)
    llm = LLM(model=path, max_model_len=64)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["hello"])
    # stop strings cannot be matched without text (they were accepted and ignored)
    with pytest.raises(ParamError, match="no tokenizer, so stop strings cannot be matched") as e:
        llm.generate([[1, 2]], SamplingParams(max_tokens=3, stop=["x"]))
    assert e.value.param == "stop"
    assert len(llm.generate([[1, 2]], SamplingParams(max_tokens=3))[0].outputs[0].token_ids) == 3


def test_bfloat16_end_to_end(ckpt, alone):
    prompts, ref = alone
    llm = LLM(model=ckpt, dtype="bfloat16", page_size=4, chunk_size=16, max_model_len=256)
    assert llm.engine.executor.params["layers"][0]["wq"].dtype == jnp.bfloat16
    assert llm.engine.executor.k_cache.dtype == jnp.bfloat16
    outs = llm.generate(prompts, GREEDY)
    for out, r in zip(outs, ref):
        lps = _prompt_lps(out)
        assert np.isfinite(lps).all()
        # bf16 keeps ~3 significant digits: the same model, not the same bits.
        np.testing.assert_allclose(lps, _prompt_lps(r), atol=0.15, rtol=0.05)
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens


def test_tiny_preset_text_round_trip():
    llm = LLM(model="tiny", max_model_len=128)
    out = llm.generate("Hello", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert out.prompt_token_ids == [256] + list(b"Hello")
    assert len(out.outputs[0].token_ids) == 5 and isinstance(out.outputs[0].text, str)
    m = out.metrics
    assert m.ttft is not None and m.ttft > 0 and len(m.tbt) == 4


@pytest.mark.parametrize("name", ["llama3-8b", "llama3-70b", "llama3.2-1b", "llama3.2-3b"])
def test_full_size_presets_shapes(name):
    from models.config import preset
    from models.params import LlamaParams, param_shapes
    from flax import nnx
    cfg = preset(name)
    abstract = jax.eval_shape(lambda: LlamaParams(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)).pure())
    got = jax.tree.map(lambda a: a.shape, abstract)
    assert got == param_shapes(cfg)
    n = sum(int(np.prod(s)) for s in jax.tree.leaves(got, is_leaf=lambda x: isinstance(x, tuple)))
    published = {"llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496, "llama3.2-1b": 1_235_814_400,
                 "llama3.2-3b": 3_212_749_824}[name]
    assert n == published


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_log_probs_are_fetched_only_when_a_row_asked_for_them(async_scheduling, monkeypatch):
    """A step whose rows' requests asked for no log-probs fetches its tokens only (one transfer, not five); a step
    with a row that needs them (a request's `logprobs`, a prompt log-prob row) fetches them all; what each request
    gets does not change."""
    from mnemojax.engine.executor import Executor

    llm = LLM(model="tiny", max_model_len=128, async_scheduling=async_scheduling)
    fetched = []
    fetch = Executor.fetch
    monkeypatch.setattr(Executor, "fetch",
                        staticmethod(lambda out: fetched.append(sum(x is not None for x in out)) or fetch(out)))
    plain = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with_lp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)
    a = llm.generate([[1, 2, 3]], plain)[0].outputs[0]
    assert fetched and set(fetched) == {1}
    fetched.clear()
    b = llm.generate([[1, 2, 3]], with_lp)[0].outputs[0]
    assert fetched and set(fetched) == {5}
    assert a.token_ids == b.token_ids and a.logprobs is None
    assert [t in d for t, d in zip(b.token_ids, b.logprobs)] == [True] * 4
    fetched.clear()
    c, d = llm.generate([[1, 2, 3], [1, 2, 3]], [plain, with_lp])
    assert set(fetched) == {5} and c.outputs[0] == a and d.outputs[0] == b
    fetched.clear()
    e = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=0))[0]
    assert 5 in fetched and e.outputs[0].token_ids == a.token_ids and len(e.prompt_logprobs) == 3


def test_chat_is_generate_on_the_chat_templates_ids(llm, ckpt):
    """vLLM's `LLM.chat`: each conversation through the tokenizer's chat template (transformers' ids here), then
    generate; one conversation or several; content parts joined by newlines; continue_final_message,
    add_special_tokens, another template and template variables as transformers renders them; bad arguments raise
    naming them."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    talk = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer"}]

    def ids(messages, special=False, **kw):
        return tok.encode(tok.apply_chat_template(messages, tokenize=False, **kw), add_special_tokens=special)

    def tokens(outs):
        return [o.outputs[0].token_ids for o in outs]

    one = ids(talk[:1], add_generation_prompt=True)
    two = ids(talk, add_generation_prompt=False, continue_final_message=True)
    assert tokens(llm.chat(talk[:1], greedy)) == tokens(llm.generate([one], greedy))
    got = llm.chat([talk[:1], talk], greedy, add_generation_prompt=False, continue_final_message=True)
    assert [o.prompt_token_ids for o in got] == [ids(talk[:1], continue_final_message=True), two]
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert llm.chat(parts, greedy)[0].prompt_token_ids == ids([{"role": "user", "content": "a\nb"}],
                                                              add_generation_prompt=True)
    assert llm.chat(talk[:1], greedy, add_special_tokens=True)[0].prompt_token_ids == [tok.bos_token_id] + one
    template = "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}|{% endfor %}{{ extra }}"
    got = llm.chat(talk[:1], greedy, chat_template=template, chat_template_kwargs={"extra": "!"})
    assert got[0].prompt_token_ids == list(b"user:Hi|!")
    for kwargs, param in [(dict(continue_final_message=True), "continue_final_message"),
                          (dict(messages=[]), "messages"),
                          (dict(messages=[[]]), "messages"),
                          (dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages"),
                          (dict(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages"),
                          (dict(messages=[["not a message"]]), "messages"),
                          (dict(chat_template_kwargs={"tokenize": True}), "chat_template_kwargs"),
                          (dict(chat_template="{% if %}"), "chat_template")]:
        kwargs = {"messages": talk[:1], **kwargs}
        with pytest.raises(ParamError) as e:
            llm.chat(kwargs.pop("messages"), greedy, **kwargs)
        assert e.value.param == param, (kwargs, e.value)


# ---------------------------------------------------------------- vLLM's n, detokenize, spaces_between_special_tokens
def test_n_sequences_are_the_requests_with_seed_plus_j(llm):
    """vLLM's n: one RequestOutput per prompt, its n sequences indexed 0..n-1; with a seed, sequence j is the request
    with seed + j (sequence 0 the same request with n = 1), whatever the other prompts ask; greedy sequences are all
    the greedy one."""
    p = SamplingParams(max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
    prompts = _prompts((5, 9), seed=3)
    outs = llm.generate(prompts, [dataclasses.replace(p, n=3), p])
    assert [len(o.outputs) for o in outs] == [3, 1] and [c.index for c in outs[0].outputs] == [0, 1, 2]
    assert [o.prompt_token_ids for o in outs] == prompts
    for j, c in enumerate(outs[0].outputs):
        alone = llm.generate([prompts[0]], dataclasses.replace(p, seed=11 + j))[0].outputs[0]
        assert (c.token_ids, c.text, c.logprobs) == (alone.token_ids, alone.text, alone.logprobs)
    assert outs[1].outputs[0].token_ids == llm.generate([prompts[1]], p)[0].outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1  # three draws, not one
    greedy = llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0, n=2))[0].outputs
    assert greedy[0].token_ids == greedy[1].token_ids and len(greedy) == 2
    assert not llm.engine.requests  # every sequence's request popped


def test_n_detokenize_and_spaces_bad_values_name_the_field(llm):
    for kw, field in ((dict(n=0), "n"), (dict(n=2.0), "n"), (dict(n=3, seed=2**63 - 2), "seed"),
                      (dict(detokenize=False, stop=["x"]), "stop"), (dict(detokenize=1), "detokenize"),
                      (dict(spaces_between_special_tokens=None), "spaces_between_special_tokens")):
        with pytest.raises(ParamError) as e:
            SamplingParams(**kw)
        assert e.value.param == field, kw
    with pytest.raises(ParamError, match="n must be 1 here") as e:  # one engine request is one sequence
        llm.engine.add_request([1, 2, 3], SamplingParams(n=2))
    assert e.value.param == "n" and not llm.engine.requests


def test_detokenize_false_leaves_the_text_empty(llm):
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    words, ids = llm.generate([[40, 50, 60]] * 2, [p, dataclasses.replace(p, detokenize=False)])
    assert words.outputs[0].text and ids.outputs[0].text == ""
    assert ids.outputs[0].token_ids == words.outputs[0].token_ids and ids.outputs[0].logprobs == words.outputs[0].logprobs


def test_spaces_between_special_tokens_false_where_the_tokenizer_ignores_it(llm, monkeypatch):
    """False changes nothing with a fast tokenizer (as in vLLM); a tokenizer whose decode does put spaces between
    special tokens (a slow one under transformers 4) is found by trying it, and there False is refused."""
    assert llm.engine.spaces_matter is False
    special = sorted(llm.get_tokenizer().all_special_ids)
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, skip_special_tokens=False,
                       allowed_token_ids=special + [65, 66])
    a, b = llm.generate([[40, 50, 60]] * 2, [p, dataclasses.replace(p, spaces_between_special_tokens=False)])
    assert sum(t in special for t in a.outputs[0].token_ids) >= 2  # special tokens side by side in the text
    assert a.outputs[0].text == b.outputs[0].text and a.outputs[0].token_ids == b.outputs[0].token_ids

    class Spaced:  # transformers 4's slow decode, reduced to what matters
        all_special_ids = [1, 2]

        def decode(self, ids, skip_special_tokens=True, spaces_between_special_tokens=True):
            return (" " if spaces_between_special_tokens else "").join(f"<{i}>" for i in ids)

    assert spaces_between_special_tokens_matter(Spaced()) is True
    monkeypatch.setattr(llm.engine, "spaces_matter", True)
    with pytest.raises(ParamError) as e:
        llm.generate([[40, 50]], dataclasses.replace(p, spaces_between_special_tokens=False))
    assert e.value.param == "spaces_between_special_tokens"


def test_vllms_dict_prompts(llm):
    """vLLM's TextPrompt and TokensPrompt give what the string and the ids give; a TokensPrompt's text is its
    output's `prompt`; a key mnemojax does not read is refused, naming it, before anything is queued."""
    tok = llm.get_tokenizer()
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ids = tok.encode("Hello")
    plain = [o.outputs[0].token_ids for o in llm.generate(["Hello", ids], p)]
    dicts = llm.generate([{"prompt": "Hello"}, {"prompt_token_ids": ids, "prompt": "shown"}], p)
    assert [o.outputs[0].token_ids for o in dicts] == plain
    assert [o.prompt for o in dicts] == ["Hello", "shown"] and dicts[1].prompt_token_ids == ids
    assert llm.generate({"prompt_token_ids": ids}, p)[0].outputs[0].token_ids == plain[1]  # one dict: one prompt
    with pytest.raises(ParamError, match=r"prompts\[1\]: a dict prompt .*'multi_modal_data'") as e:
        llm.generate(["a", {"prompt": "a", "multi_modal_data": {}}], p)
    assert e.value.param == "prompt" and not llm.engine.requests


def test_reset_prefix_cache_makes_the_next_prompt_computed_again(llm):
    """vLLM's LLM.reset_prefix_cache: a prompt run again finds its pages cached, and after a reset does not, with
    the same tokens either way."""
    p = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    prompt = _prompts((41,), seed=9)[0]
    first = llm.generate([prompt], p)[0]
    again = llm.generate([prompt], p)[0]
    assert llm.reset_prefix_cache() is True
    fresh = llm.generate([prompt], p)[0]
    assert again.num_cached_tokens >= 40 - 40 % 4 - 4 and fresh.num_cached_tokens == 0
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == fresh.outputs[0].token_ids


def test_vllms_engine_argument_names():
    """LLM(tensor_parallel_size=..., pipeline_parallel_size=..., block_size=...) are tp, spp and page_size (checked
    as those: the errors name ours); one setting under both names is refused."""
    for kw, message in ((dict(tensor_parallel_size=0), "tp must be a positive integer, got 0"),
                        (dict(pipeline_parallel_size=-1), "spp must be a positive integer, got -1"),
                        (dict(block_size=0), "page_size must be a positive integer, got 0")):
        with pytest.raises(ValueError, match=message):
            LLM("tiny", **kw)
    with pytest.raises(ParamError, match="page_size and block_size") as e:
        LLM("tiny", page_size=8, block_size=8)
    assert e.value.param == "page_size"


def test_priority_needs_the_priority_policy_and_an_integer(llm):
    """vLLM's rule: a priority other than 0 needs scheduler_policy "priority" (vLLM's scheduling_policy); the
    ParamError names `priority`, and `generate` checks every prompt's before it queues any."""
    p = SamplingParams(max_tokens=2, temperature=0)
    with pytest.raises(ParamError, match="priority 1 needs scheduler_policy 'priority'.*'fcfs'") as e:
        llm.engine.add_request([1, 2, 3], p, priority=1)
    assert e.value.param == "priority"
    for bad in (1.5, True, "0"):
        with pytest.raises(ParamError, match="priority must be an integer") as e:
            llm.engine.add_request([1, 2, 3], p, priority=bad)
    with pytest.raises(ParamError, match=r"prompts\[1\]: priority -2 needs") as e:
        llm.generate([[1, 2], [3, 4]], p, priority=[0, -2])
    assert e.value.param == "priority"
    with pytest.raises(ParamError, match=r"one integer per prompt \(2\)") as e:
        llm.generate([[1, 2], [3, 4]], p, priority=[0])
    assert e.value.param == "priority" and not llm.engine.requests
    zero = llm.generate([[1, 2]], p, priority=[0])[0].outputs[0].token_ids  # 0 is every policy's
    assert zero == llm.generate([[1, 2]], p)[0].outputs[0].token_ids and len(zero) == 2


def test_priority_policy_starts_lower_values_first_with_the_same_tokens(ckpt, llm, alone):
    """Under vLLM's priority policy (its name for the setting) a step of 64 tokens holds four 16-token chunks, so
    of five prompts the one of the largest priority value starts a step later (FCFS: the last prompt); the tokens and
    prompt log-probs are those FCFS gives, and those of the prompts run alone."""
    prompts, refs = alone
    five = prompts[1:] + [p[::-1] for p in prompts[1:]] + [_prompts((20,), seed=3)[0]]
    starts, results = {}, {}
    by_priority = LLM(model=ckpt, page_size=4, chunk_size=16, max_model_len=256, max_num_batched_tokens=64,
                      scheduling_policy="priority")  # `llm`'s settings, under vLLM's name of scheduler_policy
    for policy, engine, priority in (("fcfs", llm, None), ("priority", by_priority, [0, 4, 1, 2, 3])):
        outs = engine.generate(five, GREEDY, priority=priority)
        first = [o.metrics.first_scheduled_time for o in outs]
        starts[policy] = [i for i, t in enumerate(first) if t > min(first)]
        results[policy] = [(o.outputs[0].token_ids,
                            [d[t] for d, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]) for o in outs]
    assert starts == {"fcfs": [4], "priority": [1]}
    alone_results = [(r.outputs[0].token_ids, [d[t] for d, t in zip(r.prompt_logprobs[1:], r.prompt_token_ids[1:])])
                     for r in refs[1:]]
    for got, want in zip(results["priority"], results["fcfs"]):
        assert got[0] == want[0]
        np.testing.assert_allclose(got[1], want[1], atol=1e-5, rtol=0)
    for got, want in zip(results["priority"], alone_results):  # the first two prompts are `alone`'s last two
        assert got[0] == want[0]
        np.testing.assert_allclose(got[1], want[1], atol=1e-5, rtol=0)


def _hf_greedy_allowed(hf, prompt: list[int], max_new: int, allowed) -> list[int]:
    """HF's greedy generate where `allowed(generated ids)` gives the tokens each step may take
    (`prefix_allowed_tokens_fn`), ending at EOS: the generated ids."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                           pad_token_id=0, eos_token_id=EOS_ID,
                           prefix_allowed_tokens_fn=lambda b, seq: allowed(seq[len(prompt):].tolist()))
    return want[0, len(prompt):].tolist()


def _choice_reference(tok, choices):
    """The tokens a choice-constrained row allows after `prefix` (the generated tokens), written from the rule and
    not from the engine: those continuing a choice's encoding, and EOS after a whole one."""
    encoded = [tok.encode(c, add_special_tokens=False) for c in choices]

    def allowed(prefix: list[int]) -> list[int]:
        out = {e[len(prefix)] for e in encoded if len(e) > len(prefix) and e[:len(prefix)] == prefix}
        return sorted(out | ({EOS_ID} if prefix in encoded else set()))
    return allowed


def test_structured_output_choices_match_hf_generate_with_the_same_allowed_tokens(llm, ckpt):
    """vLLM's structured outputs with `choice`: greedy equals HF's generate with `prefix_allowed_tokens_fn` giving
    the same allowed tokens (a choice's tokens, EOS after a whole one; choices sharing a prefix branch), the text is
    a choice and the request stops at its EOS; with async scheduling (the engine's default) too."""
    hf = load_hf_model(ckpt)
    choices = ["no", "not now", "never", "yes", "a"]
    allowed = _choice_reference(llm.get_tokenizer(), choices)
    so = StructuredOutputsParams(choice=choices)
    texts = []
    for prompt in _prompts((5, 23, 40, 9, 17), seed=12):
        got = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, structured_outputs=so,
                                                    logprobs=0))[0].outputs[0]
        assert got.token_ids == _hf_greedy_allowed(hf, prompt, 12, allowed)
        assert got.text in choices and got.finish_reason == "stop" and got.token_ids[-1] == EOS_ID
        texts.append(got.text)
    assert len(set(texts)) >= 2, texts  # the prompts steer it: not one forced answer


def test_structured_output_choices_sampled_short_and_refused(llm):
    """Sampled at temperature 1 every output is a choice; a max_tokens shorter than the choices ends with "length"
    and a start of one; what cannot be honoured is a ParamError naming structured_outputs."""
    choices = ["apple", "apricot", "banana"]
    so = StructuredOutputsParams(choice=choices)
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=3, n=12, structured_outputs=so)
    texts = [c.text for c in llm.generate(["Fruit:"], p)[0].outputs]
    assert set(texts) <= set(choices) and len(set(texts)) >= 2, texts
    short = llm.generate(["Fruit:"], SamplingParams(max_tokens=2, temperature=0, structured_outputs=so))[0].outputs[0]
    assert short.finish_reason == "length" and any(c.startswith(short.text) for c in choices) and len(short.text) == 2
    for kw, message in ((dict(ignore_eos=True), "not supported with ignore_eos"),
                        (dict(min_tokens=1), "not supported with min_tokens"),
                        (dict(logit_bias={5: 1.0}), "not supported with logit_bias")):
        with pytest.raises(ParamError, match=message) as e:
            SamplingParams(structured_outputs=so, **kw)
        assert e.value.param == "structured_outputs"
    for so_bad, message in ((StructuredOutputsParams(grammar="root ::= 'a'"), "grammar is not supported"),
                            (StructuredOutputsParams(json=0, choice=["a"]), "exactly one of choice, regex, json"),
                            (StructuredOutputsParams(choice=[]), "non-empty list"),
                            (StructuredOutputsParams(choice=["ok", ""]), "non-empty list")):
        with pytest.raises(ParamError, match=message):
            SamplingParams(structured_outputs=so_bad)
    many = StructuredOutputsParams(choice=[chr(ord("a") + i) for i in range(20)])  # 20 first tokens, 16 slots
    with pytest.raises(ParamError, match=r"allow 20 tokens at one step, more than max_logit_bias \(16") as e:
        llm.generate(["x"], SamplingParams(structured_outputs=many))
    assert e.value.param == "structured_outputs" and not llm.engine.requests


# A finite language, written out below without the engine's regex code: the reference for what may come next.
REGEX = r"(yes|no|maybe)-[0-9]{1,2}!?"
REGEX_WORDS = [f"{w}-{n}{bang}" for w in ("yes", "no", "maybe") for n in [*map(str, range(10)),
               *(f"{i:02d}" for i in range(100))] for bang in ("", "!")]


def _regex_reference(prefix: list[int]) -> list[int]:
    """The byte tokens a REGEX row allows after the generated `prefix`: those whose byte keeps the text a start of
    one of REGEX_WORDS, and EOS where the text is one."""
    text = bytes(prefix).decode()
    out = {b for b in range(128) if any(w.startswith(text + chr(b)) for w in REGEX_WORDS)}
    return sorted(out | ({EOS_ID} if text in REGEX_WORDS else set()))


def test_structured_output_regex_matches_hf_generate_with_the_same_allowed_tokens(llm, ckpt):
    """vLLM's structured outputs with `regex`: greedy equals HF's generate with `prefix_allowed_tokens_fn` giving
    the tokens that keep a whole match possible (EOS once the text matches), the text matches the pattern and the
    request stops at its EOS; with async scheduling (the engine's default) too."""
    hf = load_hf_model(ckpt)
    so = StructuredOutputsParams(regex=REGEX)
    texts = []
    for prompt in _prompts((5, 23, 40, 9), seed=13):
        got = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, structured_outputs=so))[0]
        got = got.outputs[0]
        assert got.token_ids == _hf_greedy_allowed(hf, prompt, 12, _regex_reference)
        assert re.fullmatch(REGEX, got.text) and got.finish_reason == "stop" and got.token_ids[-1] == EOS_ID
        texts.append(got.text)
    assert len(set(texts)) >= 2, texts  # the prompts steer it: not one forced answer


def test_structured_output_regex_sampled_batched_and_refused(llm, alone):
    """Sampled at temperature 1 every output matches; a regex request in the batch leaves a plain request's tokens
    and log-probs as they are alone (its step carries the masks); a short max_tokens ends with "length" on a start of
    a match; what cannot be honoured is a ParamError naming structured_outputs, and nothing is queued."""
    so = StructuredOutputsParams(regex=REGEX)
    outs = llm.generate(["Say:"], SamplingParams(max_tokens=12, temperature=1.0, seed=3, n=12,
                                                 structured_outputs=so))[0].outputs
    assert all(re.fullmatch(REGEX, c.text) and c.finish_reason == "stop" for c in outs)
    assert len({c.text for c in outs}) >= 4, [c.text for c in outs]
    prompts, ref = alone
    mixed = llm.generate([prompts[1], "Q:"], [GREEDY, SamplingParams(max_tokens=12, temperature=0,
                                                                       structured_outputs=so)])
    np.testing.assert_allclose(_prompt_lps(mixed[0]), _prompt_lps(ref[1]), atol=1e-5, rtol=0)
    assert mixed[0].outputs[0].token_ids == ref[1].outputs[0].token_ids
    assert re.fullmatch(REGEX, mixed[1].outputs[0].text)
    short = llm.generate(["Q:"], SamplingParams(max_tokens=2, temperature=0, structured_outputs=so))[0].outputs[0]
    assert short.finish_reason == "length" and any(w.startswith(short.text) for w in REGEX_WORDS)
    with pytest.raises(ParamError, match=r"missing '\)' at position 0") as e:
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="(ab"))
    assert e.value.param == "structured_outputs"
    with pytest.raises(ParamError, match="exactly one of choice, regex, json and json_object"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a", choice=["a"]))
    with pytest.raises(ParamError, match=r"regex must be a string, got \['a'\]"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex=["a"]))
    with pytest.raises(ParamError, match="not supported with ignore_eos"):
        SamplingParams(structured_outputs=so, ignore_eos=True)
    for pattern, message in ((r"[^\s\S]x", "matches no string"), ("\u00e9", "no token of the vocabulary")):
        with pytest.raises(ParamError, match=message) as e:  # the byte tokenizer's tokens hold no whole é
            llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(regex=pattern)))
        assert e.value.param == "structured_outputs" and not llm.engine.requests


# A JSON schema whose language is finite, its texts written out below without the engine's code (the reference).
JSON_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                                "n": {"type": "integer", "minimum": 0, "maximum": 20}},
               "required": ["ok"]}
JSON_TEXTS = [f'{{"ok": {b}{n}}}' for b in ("true", "false") for n in ["", *(f', "n": {i}' for i in range(21))]]


def _json_reference(prefix: list[int]) -> list[int]:
    text = bytes(prefix).decode()
    out = {b for b in range(128) if any(w.startswith(text + chr(b)) for w in JSON_TEXTS)}
    return sorted(out | ({EOS_ID} if text in JSON_TEXTS else set()))


def test_structured_output_json_matches_hf_generate_and_the_schema(llm, ckpt):
    """vLLM's structured outputs with `json` (a JSON schema, here with `disable_any_whitespace`, xgrammar's `, ` and
    `: `): greedy equals HF's generate with `prefix_allowed_tokens_fn` giving the tokens that keep the text a start
    of one of the schema's texts; sampled outputs (with a `whitespace_pattern`) all parse and validate (jsonschema)
    and stop at EOS."""
    import jsonschema

    hf = load_hf_model(ckpt)
    so = StructuredOutputsParams(json=JSON_SCHEMA, disable_any_whitespace=True)
    for prompt in _prompts((7, 30), seed=17):
        got = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, structured_outputs=so))[0]
        got = got.outputs[0]
        assert got.token_ids == _hf_greedy_allowed(hf, prompt, 24, _json_reference)
        assert got.text in JSON_TEXTS and got.finish_reason == "stop"
    spaced = StructuredOutputsParams(json=JSON_SCHEMA, whitespace_pattern="[ ]?")  # (outlines' default: the
    # default's any run of whitespace would let this random model spend all its tokens on it)
    outs = llm.generate(["JSON:"], SamplingParams(max_tokens=40, temperature=1.0, seed=5, n=8,
                                                  structured_outputs=spaced))[0].outputs
    for c in outs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), JSON_SCHEMA)
    assert len({c.text for c in outs}) >= 4 and any("  " not in c.text and " " in c.text for c in outs)


def test_cumulative_logprob_is_the_sequences_log_likelihood(llm, ckpt):
    """vLLM's `CompletionOutput.cumulative_logprob`: the generated tokens' summed log-probs, as transformers'
    float32 logits give them; None without logprobs."""
    prompt = _prompts((11,), seed=5)[0]
    p = SamplingParams(max_tokens=5, temperature=0.8, seed=4, logprobs=0, ignore_eos=True)
    c = llm.generate([prompt], p)[0].outputs[0]
    with torch.no_grad():
        lp = torch.log_softmax(load_hf_model(ckpt)(torch.tensor([prompt + c.token_ids])).logits[0].float(), -1)
    want = sum(lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(c.token_ids))
    assert c.cumulative_logprob == pytest.approx(want, abs=1e-4, rel=0)
    assert llm.generate([prompt], dataclasses.replace(p, logprobs=None))[0].outputs[0].cumulative_logprob is None
