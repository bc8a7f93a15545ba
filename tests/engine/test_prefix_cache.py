"""Prefix caching is exact: every request gives what the same engine gives with `enable_prefix_caching=False`
(greedy tokens equal, log-probs within float32 rounding), whether its cached prefix ends mid-page, it arrives
while the prefix it shares is still being prefilled, requests are preempted, cached pages are evicted, or the
prefix spans several KVP ranks."""
import numpy as np
import pytest

from mnemojax import LLM, SamplingParams
from tests.hf_utils import make_hf_checkpoint

PAGE = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0, logprobs=3, ignore_eos=True)
KW = dict(page_size=PAGE, chunk_size=16, max_model_len=160, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("prefix") / "gqa", weight_scale=8.0, seed=3,
                              num_heads=4, num_kv_heads=2, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def off(ckpt):
    return LLM(model=ckpt, enable_prefix_caching=False, **KW)


def _tokens(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


CONTEXT = _tokens(43, 0)  # 10 full pages and 3 tokens: the questions below differ in the middle of page 10
PROMPTS = [CONTEXT + _tokens(9, 1), CONTEXT + _tokens(5, 2), CONTEXT[:40], CONTEXT + _tokens(9, 1)]


def _same(out, ref):
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    for a, b in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs):
        assert a.keys() == b.keys()
        np.testing.assert_allclose([a[k] for k in a], [b[k] for k in a], atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def ref(off):
    return [off.generate([p], GREEDY)[0] for p in PROMPTS]


def test_follow_ups_reuse_the_shared_prefix_exactly(ckpt, ref):
    on = LLM(model=ckpt, **KW)
    outs = [on.generate([p], GREEDY)[0] for p in PROMPTS]
    for out, r in zip(outs, ref):
        _same(out, r)
    # The first computes everything; the next finds the context's 10 full pages; a prompt of exactly 10 pages
    # finds 9 (its last token is always computed); the repeat, 13 pages exactly, finds 12 of them.
    assert [o.num_cached_tokens for o in outs] == [0, 40, 36, 48]
    kv = on.engine.kv
    assert kv.num_used == 0 and kv.ranks[0].num_cached > 0
    assert (kv.prefix_queries, kv.prefix_hits) == (sum(len(p) for p in PROMPTS), 124)


def test_request_arriving_while_prefix_is_prefilled(ckpt, ref):
    """The second request arrives after the first has computed part of the shared context: it waits for the
    first to compute the rest of it (its next page is pending), then takes all of the context's full pages."""
    on = LLM(model=ckpt, **{**KW, "chunk_size": 8})
    e = on.engine
    a = e.add_request(PROMPTS[0], GREEDY)
    e.step(), e.step()  # 16 tokens of the first: 4 full pages
    b = e.add_request(PROMPTS[1], GREEDY)
    e.step()
    assert e.requests[b].status.value == "waiting" and e.requests[a].num_computed == 24  # it waits
    while e.has_unfinished():
        e.step()
    out_a, out_b = e.pop_finished(a), e.pop_finished(b)
    _same(out_a, ref[0])
    _same(out_b, ref[1])
    assert out_a.num_cached_tokens == 0 and out_b.num_cached_tokens == 40
    assert e.kv.num_used == 0


def test_prompt_logprobs_skip_the_cache(ckpt, off):
    on = LLM(model=ckpt, **KW)
    on.generate([PROMPTS[0]], GREEDY)
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2, ignore_eos=True)
    out, r = on.generate([PROMPTS[1]], params)[0], off.generate([PROMPTS[1]], params)[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == r.outputs[0].token_ids
    for a, b in zip(out.prompt_logprobs[1:], r.prompt_logprobs[1:]):
        np.testing.assert_allclose([a[k] for k in b], list(b.values()), atol=1e-5, rtol=0)


def test_preemption_and_eviction_keep_results(ckpt, off, ref, caplog):
    """Pages for about two requests: requests preempt each other, cached pages are evicted for new ones."""
    small = LLM(model=ckpt, num_pages=34, **KW)
    extra = [_tokens(50, 8), _tokens(50, 9)]  # unrelated to the context: they compete for pages
    ref_extra = [off.generate([p], GREEDY)[0] for p in extra]
    with caplog.at_level("INFO"):
        small_outs = outs = small.generate(extra + PROMPTS + PROMPTS[:2], GREEDY)
        for out, r in zip(outs[:2], ref_extra):
            _same(out, r)
        outs = outs[2:]
        outs += small.generate([_tokens(124, 5)], GREEDY)  # 132 tokens: all 33 pages, the whole cache evicted
        outs += small.generate(PROMPTS[:1], GREEDY)
    for out, r in zip(outs[:6] + outs[7:], ref + ref[:2] + ref[:1]):
        _same(out, r)
    kv = small.engine.kv
    assert sum(o.num_preemptions for o in small_outs) > 0 and kv.num_evictions > 0
    assert outs[-1].num_cached_tokens == 0  # its pages were evicted
    assert "eviction pressure" in caplog.text
    assert kv.num_used == 0


def test_reset_prefix_cache(ckpt, ref):
    on = LLM(model=ckpt, **KW)
    on.generate([PROMPTS[0]], GREEDY)
    assert on.engine.reset_prefix_cache() == 14  # 52 prompt + 7 generated tokens computed: 14 full pages
    out = on.generate([PROMPTS[1]], GREEDY)[0]
    assert out.num_cached_tokens == 0
    _same(out, ref[1])


def test_prefix_over_kvp_ranks_is_reused_on_the_same_ranks(ckpt, ref):
    """KV of 20 tokens per rank: the 43-token context spans three ranks; a follow-up reuses all three."""
    on = LLM(model=ckpt, kvp=4, max_tokens_per_kvp_rank=20, **KW)
    e = on.engine
    first = e.add_request(PROMPTS[0], GREEDY)
    ranks = []
    while e.has_unfinished():
        e.step()
        ranks = list(e.requests[first].kv_ranks) or ranks  # freed when it finishes
    assert len(ranks) == 3
    _same(e.pop_finished(first), ref[0])
    second = e.add_request(PROMPTS[1], GREEDY)
    e.step()
    assert e.requests[second].kv_ranks == ranks[:3]
    while e.has_unfinished():
        e.step()
    out = e.pop_finished(second)
    _same(out, ref[1])
    assert out.num_cached_tokens == 40 and e.kv.num_used == 0


def test_n_choices_share_the_prompt(ckpt, off):
    """Three choices of one prompt arrive together: the first computes the prompt, the others wait for its full
    pages and compute only the partial last page (recomputed, not copied) and their own tokens."""
    on = LLM(model=ckpt, **KW)
    params = [SamplingParams(max_tokens=6, temperature=0.8, seed=s, logprobs=2, ignore_eos=True) for s in (1, 2, 3)]
    outs = on.generate([PROMPTS[0]] * 3, params)
    refs = off.generate([PROMPTS[0]] * 3, params)
    for out, r in zip(outs, refs):
        _same(out, r)
    assert sorted(o.num_cached_tokens for o in outs) == [0, 48, 48]  # 52 tokens: 12 full pages, last token computed
    assert on.engine.kv.num_used == 0 and not on.engine.kv._pending


def test_pipeline_and_tensor_parallel_reuse(ckpt, ref):
    """spp = 2 (a chunk's K/V is written over two steps: pages are cached only once it has left the pipeline) and
    tp = 2: follow-ups equal the one-device results without the cache."""
    on = LLM(model=ckpt, spp=2, tp=2, **KW)
    outs = [on.generate([p], GREEDY)[0] for p in PROMPTS[:2]]
    for out, r in zip(outs, ref):
        _same(out, r)
    assert [o.num_cached_tokens for o in outs] == [0, 40] and on.engine.kv.num_used == 0
