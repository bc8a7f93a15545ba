"""AsyncLLM: concurrent streams equal the offline results, aborts free pages, bad input is answered alone."""
import asyncio
import dataclasses
import threading

import numpy as np
import pytest

from mnemojax import LLM, SamplingParams
from mnemojax.engine.async_llm import AsyncLLM, EngineDeadError
from mnemojax.scheduling.sampling_params import RequestOutputKind

KW = dict(max_model_len=128, page_size=4, chunk_size=16, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def async_llm():
    llm = AsyncLLM("tiny", **KW)
    yield llm
    llm.shutdown()


async def _collect(llm, prompt, params, **kw):
    outs = [o async for o in llm.generate(prompt, params, **kw)]
    return outs


def test_concurrent_streams_equal_offline_results(async_llm):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in (40, 7, 19, 3)]
    params = [SamplingParams(max_tokens=6 + i, temperature=0.9, seed=i, ignore_eos=True) for i in range(4)]

    async def main():
        return await asyncio.gather(*(_collect(async_llm, p, sp) for p, sp in zip(prompts, params)))

    streams = asyncio.run(main())
    offline = LLM("tiny", **KW).generate(prompts, params)
    for outs, ref in zip(streams, offline):
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        assert outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids
        # progress arrives token by token: the streamed token lists only grow
        lens = [len(o.outputs[0].token_ids) for o in outs]
        assert lens == sorted(lens) and lens[-1] == len(ref.outputs[0].token_ids)
    assert async_llm.engine.kv.num_used == 0


def test_dropping_a_stream_aborts_it_and_frees_pages(async_llm):
    async def main():
        long = async_llm.generate(list(range(60)), SamplingParams(max_tokens=50, ignore_eos=True))
        async for out in long:
            if len(out.outputs[0].token_ids) >= 2:
                break  # the client goes away mid-stream
        await long.aclose()
        # the next request still works
        return await _collect(async_llm, [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))

    outs = asyncio.run(main())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
    assert async_llm.engine.kv.num_used == 0 and not async_llm.engine.requests


def test_bad_input_is_answered_and_others_continue(async_llm):
    # SamplingParams validates on construction; an invalid one cannot reach the engine, so only the engine's
    # own checks (prompt length) are exercised here.
    async def main_engine_checks():
        good = asyncio.ensure_future(_collect(async_llm, [5, 6], SamplingParams(max_tokens=4, ignore_eos=True)))
        with pytest.raises(ValueError, match="max_model_len"):
            await _collect(async_llm, list(range(100)), SamplingParams(max_tokens=100))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await _collect(async_llm, [1, 10_000], SamplingParams(max_tokens=2))
        return await good

    outs = asyncio.run(main_engine_checks())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
    assert async_llm.engine.kv.num_used == 0


async def _wait_until_done(llm):
    while llm.engine.requests or llm.engine.has_unfinished():
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # let the engine thread's last hand-offs reach this loop


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
def test_a_caller_that_does_not_read_holds_one_merged_output(async_llm, kind):
    """While its caller reads nothing, a request's outputs are merged (deltas added up, a cumulative one replaced
    by the newer), not queued one per step: memory per request stays bounded by its own output."""
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True, logprobs=2, output_kind=kind)

    async def main():
        gen = async_llm.generate([5, 6, 7], params)
        first = await anext(gen)
        await _wait_until_done(async_llm)  # the request runs to its end meanwhile
        return first, [o async for o in gen]

    first, rest = asyncio.run(main())
    assert len(rest) == 1 and rest[0].finished
    ref = LLM("tiny", **KW).generate([[5, 6, 7]], dataclasses.replace(params, output_kind=RequestOutputKind.CUMULATIVE))
    ref = ref[0].outputs[0]
    last = rest[0].outputs[0]
    if kind is RequestOutputKind.DELTA:
        first.add(rest[0])
        last = first.outputs[0]
    assert last.token_ids == ref.token_ids and last.text == ref.text and len(last.logprobs) == 24
    assert last.logprobs == ref.logprobs


def test_a_final_only_request_yields_one_output_when_it_ends(async_llm):
    """FINAL_ONLY (vLLM's): the caller gets one output, finished, holding everything, as the cumulative one; the
    engine built none before (its steps return outputs of finished FINAL_ONLY requests only)."""
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True, logprobs=1,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    got = asyncio.run(_collect(async_llm, [9, 8, 7], params))
    ref = LLM("tiny", **KW).generate([[9, 8, 7]], dataclasses.replace(params, output_kind=RequestOutputKind.CUMULATIVE))
    assert len(got) == 1 and got[0].finished
    assert got[0].outputs[0] == ref[0].outputs[0] and got[0].prompt_token_ids == [9, 8, 7]
    assert len(got[0].outputs[0].token_ids) == 12 and got[0].outputs[0].text


def test_a_steps_outputs_reach_a_callers_loop_in_one_call(async_llm):
    """The engine thread hands a step's outputs for the callers on one event loop over in one thread-safe call (one
    per output cost its thread ~6 us each): eight streams decoding together get their outputs in far fewer calls
    than they yield, each call carrying several streams' outputs; every stream still gets all its tokens."""
    prompts = [[i + 1, i + 2] for i in range(8)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    calls = []

    async def main():
        loop = asyncio.get_running_loop()
        threadsafe = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda fn, *a, **k: calls.append(a) or threadsafe(fn, *a, **k)
        try:
            return await asyncio.gather(*(_collect(async_llm, p, params) for p in prompts))
        finally:
            del loop.call_soon_threadsafe

    streams = asyncio.run(main())
    offline = LLM("tiny", **KW).generate(prompts, params)
    for outs, ref in zip(streams, offline):
        assert outs[-1].finished and outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids
    yields = sum(len(outs) for outs in streams)
    assert yields >= 16 and 2 * len(calls) <= yields
    assert max(len(a[0]) for a in calls) == 8  # a step's eight outputs in one call


def test_prefix_cache_stats_and_reset():
    """A repeated prompt is served from the prefix cache: the published counters count it, the final output
    says how many prompt tokens were cached, and a reset (run on the engine thread) forgets the pages."""
    llm = AsyncLLM("tiny", **KW)
    try:
        prompt = list(range(1, 42))  # 41 tokens: 10 full pages of 4
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

        async def main():
            first = (await _collect(llm, prompt, params))[-1]
            second = (await _collect(llm, prompt, params))[-1]
            stats = llm.stats()
            reset = await llm.reset_prefix_cache()
            third = (await _collect(llm, prompt, params))[-1]
            return first, second, stats, reset, third

        first, second, stats, reset, third = asyncio.run(main())
        assert (first.num_cached_tokens, second.num_cached_tokens, third.num_cached_tokens) == (0, 40, 0)
        assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (82, 40)
        assert reset == 10  # 41 prompt + 1 generated token computed: 10 full pages
        assert second.outputs[0].token_ids == first.outputs[0].token_ids == third.outputs[0].token_ids
    finally:
        llm.shutdown()


def test_generate_and_reset_after_shutdown_raise_instead_of_hanging():
    """After `shutdown()` no engine thread reads the command queue: a new request or cache reset raises
    `EngineDeadError` at once instead of waiting for ever. (No step runs: nothing is compiled.)"""
    llm = AsyncLLM("tiny", **KW, precompile=False)
    llm.shutdown()
    assert not llm.is_alive

    async def main():
        with pytest.raises(EngineDeadError, match="engine thread has stopped"):
            await _collect(llm, [1, 2, 3], SamplingParams(max_tokens=2))
        with pytest.raises(EngineDeadError):
            await llm.reset_prefix_cache()
        assert llm.num_active == 0 and llm.num_waiting == 0

    asyncio.run(asyncio.wait_for(main(), 10))


def test_commands_queued_when_the_engine_fails_are_answered():
    """Commands queued while the engine thread is inside the step that fails (a cache reset, a new request) and
    the request in flight all get `EngineDeadError` (the failure as its cause), not a wait for ever; later ones
    raise at once."""
    llm = AsyncLLM("tiny", **KW, precompile=False)
    stepping, fail = threading.Event(), threading.Event()

    def failing_step():
        stepping.set()
        fail.wait(10)
        raise RuntimeError("device lost")

    llm.engine.step = failing_step

    async def main():
        in_flight = asyncio.ensure_future(_collect(llm, [1, 2, 3], SamplingParams(max_tokens=4)))
        while not stepping.is_set():
            await asyncio.sleep(0.01)
        reset = asyncio.ensure_future(llm.reset_prefix_cache())
        queued = asyncio.ensure_future(_collect(llm, [4, 5], SamplingParams(max_tokens=2)))
        await asyncio.sleep(0.05)  # both are queued behind the step
        assert llm.engine.requests.keys() == {"req-0"} and llm._commands.qsize() == 2
        fail.set()
        results = await asyncio.gather(in_flight, reset, queued, return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert all(isinstance(r.__cause__, RuntimeError) for r in results)
        with pytest.raises(EngineDeadError):
            await llm.reset_prefix_cache()
        with pytest.raises(EngineDeadError):
            await _collect(llm, [6], SamplingParams(max_tokens=2))

    try:
        asyncio.run(asyncio.wait_for(main(), 20))
    finally:
        fail.set()
        llm.shutdown()


def test_max_request_tokens_is_what_the_kv_pages_hold(async_llm):
    """`max_request_tokens`: the most tokens one request can hold, which the engine's checks accept and one more
    they refuse: max_model_len, or fewer when the KV pages hold fewer (15 usable pages of 4 tokens: 60)."""
    assert async_llm.max_request_tokens == async_llm.max_model_len == 128
    small = AsyncLLM("tiny", **{**KW, "num_pages": 16}, precompile=False)
    try:
        assert small.max_request_tokens == 60
        small.validate(list(range(1, 11)), SamplingParams(max_tokens=50))
        with pytest.raises(ValueError, match="KV pages"):
            small.validate(list(range(1, 11)), SamplingParams(max_tokens=51))
    finally:
        small.shutdown()


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA,
                                  pytest.param(RequestOutputKind.FINAL_ONLY, marks=pytest.mark.slow)])
def test_n_sequences_come_as_one_request(async_llm, kind):
    """vLLM's n on AsyncLLM.generate: sequence j is the seeded request with seed + j and n = 1; the
    outputs come as one request's: CUMULATIVE ones hold every sequence's latest, DELTA ones one sequence's new
    tokens (joined, each sequence's whole), FINAL_ONLY one output; the last is finished, with every sequence."""
    prompt = [7, 8, 9, 10]
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=3, ignore_eos=True, n=3, output_kind=kind)
    alone = [dataclasses.replace(params, n=1, seed=3 + j, output_kind=RequestOutputKind.CUMULATIVE)
             for j in range(3)]
    want = [asyncio.run(_collect(async_llm, prompt, p))[-1].outputs[0].token_ids for p in alone]
    assert len({tuple(w) for w in want}) > 1

    outs = asyncio.run(_collect(async_llm, prompt, params, request_id="three"))
    assert {o.request_id for o in outs} == {"three"} and outs[-1].finished and not any(o.finished for o in outs[:-1])
    if kind is RequestOutputKind.DELTA:
        got = [sum((c.token_ids for o in outs for c in o.outputs if c.index == j), []) for j in range(3)]
        assert all(len(o.outputs) == 1 for o in outs)
        assert [o.prompt_token_ids for o in outs] == [prompt] + [[]] * (len(outs) - 1)  # (the prompt once, as n=1)
    else:
        got = [c.token_ids for c in sorted(outs[-1].outputs, key=lambda c: c.index)]
        assert [c.index for c in outs[-1].outputs] == [0, 1, 2]
        assert len(outs) == 1 if kind is RequestOutputKind.FINAL_ONLY else len(outs) > 3
    assert got == want
    assert async_llm.engine.kv.num_used == 0 and not async_llm.engine.requests


def test_leaving_n_sequences_early_aborts_them_all(async_llm):
    async def main():
        gen = async_llm.generate([1, 2, 3], SamplingParams(max_tokens=60, ignore_eos=True, n=3), request_id="n")
        async for _ in gen:
            break
        await gen.aclose()
        return await _collect(async_llm, [4, 5], SamplingParams(max_tokens=2, ignore_eos=True))

    assert asyncio.run(main())[-1].finished
    assert async_llm.engine.kv.num_used == 0 and not async_llm.engine.requests and not async_llm._parents
