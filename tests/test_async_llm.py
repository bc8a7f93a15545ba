"""AsyncLLM: concurrent streams equal the offline results, aborts free pages, bad input is answered alone."""
import asyncio

import numpy as np
import pytest

from mnemojax import LLM, SamplingParams
from mnemojax.async_llm import AsyncLLM

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
