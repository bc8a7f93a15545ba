"""Async scheduling (issue 12, item 4): the engine launches step N+1 before it collects step N, and a token step N
sampled enters step N+1 on the device. Results must be those of the synchronous loop (itself checked against HF
in test_engine.py and test_parallel.py), on every layout; a stopped request's extra token is thrown away and its
pages still freed; nothing runs on after `generate` returns."""
import numpy as np
import pytest

from mnemojax import LLM, SamplingParams
from mnemojax.engine.llm_engine import EngineConfig, LLMEngine
from tests.hf_utils import make_hf_checkpoint

MODEL = dict(num_layers=2, num_heads=4, num_kv_heads=2, hidden_size=32, intermediate_size=64)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("async") / "m", weight_scale=8.0, seed=5,
                              max_position_embeddings=512, **MODEL)


def _workload(seed=0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 70, 17, 33, 9)]
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.8, top_k=20, seed=3, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=15, temperature=1.0, top_p=0.9, seed=7, prompt_logprobs=1),
              SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2),
              SamplingParams(max_tokens=10, temperature=1.2, seed=11)]
    return prompts, params


def _results(outs):
    return [(o.prompt_logprobs, o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].finish_reason,
             o.outputs[0].stop_reason) for o in outs]


def _generate(ckpt, async_scheduling, prompts, params, **kw):
    llm = LLM(model=ckpt, page_size=4, chunk_size=16, max_model_len=128, max_num_batched_tokens=32,
              async_scheduling=async_scheduling, **kw)
    outs = llm.generate(prompts, params)
    e = llm.engine
    assert not e.has_unfinished() and e._launched is None and e.kv.num_used == 0  # nothing left running or held
    return _results(outs), llm


@pytest.mark.parametrize("layout", [{}, pytest.param({"spp": 2}, marks=pytest.mark.slow),
                                    {"kvp": 2, "max_tokens_per_kvp_rank": 40},
                                    pytest.param({"kvp": 2, "tp": 2, "max_tokens_per_kvp_rank": 40},
                                                 marks=pytest.mark.slow)], ids=str)
def test_async_equals_sync(ckpt, layout):
    """Greedy and seeded sampling, top-k / top-p, log-probs, prompt log-probs, max_tokens=1, EOS allowed; with
    kvp=2 the 70-token prompt's KV spans both ranks (its decodes read the token on both)."""
    prompts, params = _workload()
    sync, _ = _generate(ckpt, False, prompts, params, **layout)
    async_, llm = _generate(ckpt, True, prompts, params, **layout)
    assert llm.engine.async_scheduling
    assert async_ == sync


def test_decodes_are_launched_before_their_token_reaches_the_host(ckpt):
    """Each decode after the first token reads its input token on the device: launched while the step that
    sampled it was not collected. The request ends at max_tokens without a wasted launch."""
    llm = LLM(model=ckpt, page_size=4, chunk_size=16, max_model_len=128, async_scheduling=True)
    ex = llm.engine.executor
    launches = []
    launch = ex.launch

    def spy(plan, fetch=False):
        unseen = [ch.start + ch.num_tokens > ch.request.num_tokens for ch in plan.chunks]
        launched = launch(plan, fetch)
        launches.append((unseen, launched.leaving.src))
        return launched

    ex.launch = spy
    prompt = list(range(3, 40))
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    unseen = [u for us, _ in launches for u in us]
    # three prefill chunks (37 tokens, chunks of 16), then 7 decodes of unseen tokens
    assert len(launches) == 10 and unseen == [False] * 3 + [True] * 7
    srcs = [src for _, src in launches]
    assert all((s < 0).all() for s in srcs[:3]) and all((s >= 0).sum() == 1 for s in srcs[3:])
    sync = LLM(model=ckpt, page_size=4, chunk_size=16, max_model_len=128, async_scheduling=False)
    assert out.outputs[0].token_ids == sync.generate([prompt], SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0].token_ids


def test_stop_token_wastes_one_decode_and_frees_pages(ckpt):
    prompt = list(range(10, 30))
    free = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    ref, _ = _generate(ckpt, False, [prompt], [free])
    stop_at = ref[0][1][3]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=[stop_at])
    sync, _ = _generate(ckpt, False, [prompt], [params])
    async_, llm = _generate(ckpt, True, [prompt], [params])
    assert async_ == sync and sync[0][1] == ref[0][1][:ref[0][1].index(stop_at) + 1]
    assert sync[0][3:] == ("stop", stop_at)


def test_generate_leaves_nothing_in_the_pipeline(ckpt):
    # spp 2, async: the decode launched before the stop token was seen was still in the pipeline's second stage
    # when generate returned, holding its pages until some later step
    llm = LLM(model=ckpt, page_size=4, chunk_size=16, max_model_len=128, max_num_batched_tokens=32, spp=2,
              async_scheduling=True)
    prompt = list(range(10, 30))
    ref = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].outputs[0]
    stop_at = ref.token_ids[3]
    out = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                stop_token_ids=[stop_at]))[0].outputs[0]
    assert out.token_ids == ref.token_ids[:4] and out.finish_reason == "stop"
    engine = llm.engine
    assert not engine.has_unfinished() and not engine.executor.has_in_flight() and engine.kv.num_used == 0
    assert engine.scheduler.num_seats_held == 0


def test_abort_with_a_decode_in_flight(ckpt):
    llm = LLM(model=ckpt, page_size=4, chunk_size=16, max_model_len=128, async_scheduling=True)
    e = llm.engine
    gone = e.add_request(list(range(20)), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    stays = e.add_request(list(range(5, 25)), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    for _ in range(4):
        e.step()
    assert e.requests[gone].num_unfetched == 1 and e._launched is not None
    e.abort(gone)
    seen = []
    while e.has_unfinished():
        seen += [o.request_id for o in e.step()]
    assert gone not in seen and e.requests[stays].is_finished and e.kv.num_used == 0
    assert e.requests[gone].finish_reason == "abort"


def test_async_with_a_multi_host_channel_raises(ckpt):
    config = EngineConfig(model=ckpt, page_size=4, max_model_len=64, async_scheduling=True)
    with pytest.raises(ValueError, match="async_scheduling"):
        LLMEngine(config, channel=object())


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_calibration_measures_steps(ckpt, async_scheduling):
    """Online calibration times steps in both loops (async: between consecutive collects)."""
    llm = LLM(model=ckpt, page_size=4, chunk_size=16, max_model_len=128, target_batch_time_ms=50,
              async_scheduling=async_scheduling)
    llm.generate([list(range(12))] * 3, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    llm.generate([list(range(12))] * 3, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert llm.engine.calibrator.num_observed >= 8


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_every_collect_waits_for_its_step(ckpt, monkeypatch, async_scheduling):
    """A step of prefill chunks samples nothing, so there is nothing to fetch; collecting it still waits for the
    step, or the host would queue a long prompt's every chunk on the device at once (and a short request
    arriving then would run behind them all, whatever the scheduler decided)."""
    import jax

    from mnemojax.engine import executor as executor_module

    engine = LLMEngine(EngineConfig(model=ckpt, page_size=4, chunk_size=16, max_model_len=128,
                                    max_num_batched_tokens=16, async_scheduling=async_scheduling))
    waited, block = [], jax.block_until_ready
    monkeypatch.setattr(executor_module.jax, "block_until_ready", lambda x: waited.append(x) or block(x))
    collected = []
    collect = engine.executor.collect
    engine.executor.collect = lambda launched: collected.append(launched) or collect(launched)
    engine.add_request(list(range(1, 65)), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    no_rows = [launched for launched in collected if launched.out is None]
    assert len(no_rows) == 3  # the 64-token prompt's first three 16-token chunks
    assert [id(x) for x in waited] == [id(launched.done) for launched in no_rows]
    assert all(isinstance(launched.done, jax.Array) for launched in no_rows)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_full_batch_on_a_pipeline_admits_a_waiting_request_only_into_a_free_slot(ckpt, async_scheduling):
    """spp = 2, max_num_seqs = 2, four requests: B is aborted while a chunk of it is in the pipeline, and A ends
    (a stop token) while a chunk of it is still there (async: the decode of a token not yet seen), each while a
    request waits. A finished request's chunk still reads its sequence slot on the device, so the waiting request
    must not take the place at once (that asked the executor for a third slot: `RuntimeError: rank 0: all 2
    sequence slots (max_num_seqs) are held`). Every answer is what the request gives alone."""
    prompts = [list(range(10, 30)), list(range(40, 57)), list(range(60, 71)), list(range(80, 95))]
    free = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True) for _ in prompts]
    alone = [_generate(ckpt, False, [p], [s])[0][0][1] for p, s in zip(prompts, free)]
    stop_at = alone[0][7]
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stop_at])] + free[1:]
    llm = LLM(model=ckpt, page_size=4, chunk_size=16, max_model_len=128, spp=2, max_num_seqs=2,
              async_scheduling=async_scheduling)
    e = llm.engine
    ids = [e.add_request(p, s) for p, s in zip(prompts, params)]
    a, b, c, d = (e.requests[i] for i in ids)
    aborted_in_flight = False
    while e.has_unfinished():
        e.step()
        full = len(e.scheduler.running) == 2 and e.scheduler.waiting  # a full batch, and a request waits
        if full and not b.is_finished and b.in_flight and len(b.output_token_ids) >= 2:
            e.abort(ids[1])
            aborted_in_flight = True
    assert aborted_in_flight and e.kv.num_used == 0 and e._launched is None
    assert a.output_token_ids == alone[0][:alone[0].index(stop_at) + 1] and a.finish_reason == "stop"
    assert b.finish_reason == "abort" and b.output_token_ids == alone[1][:len(b.output_token_ids)]
    assert (c.output_token_ids, d.output_token_ids) == (alone[2], alone[3])
