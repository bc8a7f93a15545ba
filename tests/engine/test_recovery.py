"""A step that fails (a device error, a KeyboardInterrupt during a compile) must not wedge the engine: it
preempts every running request by recompute, gives every page back and serves on, with the same results."""
import asyncio
import threading

import jax
import numpy as np
import pytest

from mnemojax import LLM, SamplingParams
from mnemojax.engine.async_llm import AsyncLLM, EngineDeadError, EngineStepError
from mnemojax.engine.executor import Executor
from mnemojax.scheduling.sampling_params import RequestOutputKind

PROMPTS = [list(range(1, 21)), [5, 6, 7, 8, 9], list(range(30, 60)), [3, 1, 4, 1, 5, 9, 2, 6]]


def _flaky_run(monkeypatch, fail_at: int, error: BaseException):
    """Executor.run raising `error` at its `fail_at`-th call, having consumed the KV cache and the penalties' state
    first (as a step that failed after taking its donated buffers, or an update of that state before it)."""
    real, calls = Executor.run, [0]

    def run(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == fail_at:
            for buffer in (self.k_cache, self.v_cache, self.token_counts, self.prompt_tokens):
                buffer.delete()
            raise error
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Executor, "run", run)


@pytest.mark.parametrize("async_scheduling, spp", [(False, 1), (True, 1), pytest.param(True, 2, marks=pytest.mark.slow)],
                         ids=["sync", "async", "spp2"])  # spp 2: 21 s on 2 cores cold
def test_a_failed_step_preempts_everyone_and_the_results_stay_exact(monkeypatch, async_scheduling, spp):
    llm = LLM(model="tiny", page_size=4, max_model_len=96, chunk_size=16, max_num_batched_tokens=32,
              enable_prefix_caching=True, async_scheduling=async_scheduling, spp=spp)
    # with penalties too: the failed step consumed their state, which the recovery allocates again
    sampling = dict(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True, frequency_penalty=1.5,
                    repetition_penalty=1.2)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(**sampling))]
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(**sampling, output_kind=RequestOutputKind.FINAL_ONLY))
           for p in PROMPTS]
    _flaky_run(monkeypatch, fail_at=4, error=RuntimeError("device lost"))  # some prefilling, some decoding
    failures = 0
    while engine.has_unfinished():
        try:
            engine.step()
        except RuntimeError as e:
            assert str(e) == "device lost"
            failures += 1
            assert not engine.executor.has_in_flight() and engine.kv.num_used == 0
    engine.drain()
    outs = [engine.pop_finished(i) for i in ids]
    assert failures == 1 and engine.kv.num_used == 0
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.num_preemptions for o in outs) > 0


def test_an_interrupted_generate_ends_its_requests_and_the_next_one_is_served(monkeypatch):
    llm = LLM(model="tiny", page_size=4, max_model_len=64, max_num_batched_tokens=32)
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    want = llm.generate([[7, 8, 9]], greedy)[0].outputs[0].token_ids
    _flaky_run(monkeypatch, fail_at=2, error=KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[1, 2, 3, 4, 5], [6, 7]], greedy)
    engine = llm.engine
    assert not engine.requests and not engine.has_unfinished() and engine.kv.num_used == 0
    assert engine.scheduler.num_seats_held == 0
    assert llm.generate([[7, 8, 9]], greedy)[0].outputs[0].token_ids == want


def _streams(llm: AsyncLLM, prompts, params, ids):
    """Each prompt's stream to its end (its DELTA outputs joined), or the exception it raised."""
    async def one(prompt, rid):
        tokens = []
        async for out in llm.generate(prompt, params, rid):
            tokens += out.outputs[0].token_ids
        return tokens

    async def main():
        return await asyncio.gather(*(one(p, rid) for p, rid in zip(prompts, ids)), return_exceptions=True)

    return asyncio.run(asyncio.wait_for(main(), 60))


STREAMED = SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
ASYNC_KW = dict(page_size=4, max_model_len=96, chunk_size=16, max_num_batched_tokens=32, enable_prefix_caching=True)


def test_the_async_engine_serves_on_after_a_failed_step_with_exact_streams(monkeypatch):
    """A step that fails under `AsyncLLM` does not stop it: the requests it was running are computed again and
    every stream ends with the tokens of a run without the failure, none repeated or lost; all pages come back."""
    want = [o.outputs[0].token_ids for o in LLM(model="tiny", **ASYNC_KW).generate(PROMPTS, STREAMED)]
    llm = AsyncLLM("tiny", **ASYNC_KW)
    try:
        _flaky_run(monkeypatch, fail_at=4, error=RuntimeError("device lost"))  # some prefilling, some decoding
        got = _streams(llm, PROMPTS, STREAMED, [f"r{i}" for i in range(len(PROMPTS))])
        assert got == want
        assert llm.is_alive and llm.stats().step_failures == 1 and llm.stats().preemptions > 0
        assert llm.engine.kv.num_used == 0 and not llm.engine.requests
    finally:
        llm.shutdown()


def _poisoned_launch(monkeypatch, poison: str, engine=None, wait_for: int = 0):
    """Executor.launch failing (having consumed the KV cache) whenever its step holds a chunk of request `poison`;
    the first launch waits until `engine` holds `wait_for` requests (so they all run from the first step on)."""
    real, added = Executor.launch, threading.Event()

    def launch(self, plan, *args, **kwargs):
        while engine is not None and not added.is_set():
            added.wait(0.01)
            if len(engine.requests) >= wait_for:
                added.set()
        if any(ch.request.request_id == poison for ch in plan.chunks):
            self.k_cache.delete()
            self.v_cache.delete()
            raise RuntimeError(f"{poison} breaks the step")
        return real(self, plan, *args, **kwargs)

    monkeypatch.setattr(Executor, "launch", launch)


def test_requests_running_in_two_failed_steps_are_ended_and_later_ones_served(monkeypatch):
    """A step that fails whenever it holds one request's chunk: the requests running in two failed steps (that one
    and those that run beside it: all four here) are ended with `EngineStepError`, the failure as its cause, and the
    finished listeners hear of them as ended by an error (vLLM's "error"); the engine serves on, exact, with every
    page back."""
    want = LLM(model="tiny", **ASYNC_KW).generate(PROMPTS[:1], STREAMED)[0].outputs[0].token_ids
    llm = AsyncLLM("tiny", **ASYNC_KW, max_failed_steps_in_a_row=3)
    heard = []
    llm.add_finished_listener(lambda out: heard.append((out.request_id, out.outputs[0].finish_reason)))
    try:
        _poisoned_launch(monkeypatch, "poison", llm.engine, wait_for=4)
        got = _streams(llm, PROMPTS[:3] + [[9, 9, 9]], STREAMED, ["a", "b", "c", "poison"])
        assert all(isinstance(g, EngineStepError) and g.failures == 2 for g in got), got
        assert [g.request_id for g in got] == ["a", "b", "c", "poison"]
        assert all(str(g.__cause__) == "poison breaks the step" for g in got)
        assert sorted(heard) == [("a", "error"), ("b", "error"), ("c", "error"), ("poison", "error")]
        assert llm.is_alive and llm.stats().step_failures == 2
        assert llm.engine.kv.num_used == 0 and not llm.engine.requests
        assert _streams(llm, PROMPTS[:1], STREAMED, ["later"]) == [want]
        assert llm.engine.kv.num_used == 0 and not llm.engine.requests
        # "later"'s steps succeeded: failures in a row count afresh, so two more (the limit is 3) stop nothing
        (again,) = _streams(llm, [[9, 9, 9]], STREAMED, ["poison"])
        assert isinstance(again, EngineStepError) and llm.is_alive and llm.stats().step_failures == 4
    finally:
        llm.shutdown()


def test_a_device_that_fails_its_check_after_a_failed_step_stops_the_async_engine(monkeypatch):
    """After a failed step the engine checks every device with a round trip; one that answers wrong (as a lost
    GPU would fail) means no recovery: every caller gets `EngineDeadError` naming the device, and `is_alive` (what
    /health reads) is False."""
    llm = AsyncLLM("tiny", **ASYNC_KW, precompile=False)
    real_put = jax.device_put

    def lost(error):  # from the failing step on, every array reaches the devices as zeros
        monkeypatch.setattr(jax, "device_put", lambda x, *a, **k: real_put(np.zeros_like(x), *a, **k))
        return error

    real_run, calls = Executor.run, [0]

    def run(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise lost(RuntimeError("device lost"))
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(Executor, "run", run)
    try:
        got = _streams(llm, PROMPTS[:2], STREAMED, ["a", "b"])
        assert all(isinstance(g, EngineDeadError) for g in got), got
        assert all("returned a wrong value after a failed step" in str(g.__cause__) for g in got)
        assert not llm.is_alive and llm.stats().step_failures == 0
    finally:
        llm.shutdown()


def test_failed_steps_in_a_row_stop_the_async_engine(monkeypatch):
    """`max_failed_steps_in_a_row` failures with no step succeeding between (an engine that fails whatever it runs)
    stop it: every caller gets `EngineDeadError` with the last failure as its cause, and /health can say so."""
    llm = AsyncLLM("tiny", **ASYNC_KW, step_failures_per_request=5, max_failed_steps_in_a_row=2, precompile=False)
    try:
        _poisoned_launch(monkeypatch, "poison")
        got = _streams(llm, [[1, 2, 3]], STREAMED, ["poison"])
        assert isinstance(got[0], EngineDeadError) and str(got[0].__cause__) == "poison breaks the step"
        assert not llm.is_alive and llm.stats().step_failures == 1  # the second stopped it
    finally:
        llm.shutdown()


@pytest.mark.parametrize("field", ["step_failures_per_request", "max_failed_steps_in_a_row"])
def test_the_async_engines_failure_limits_are_checked(field):
    with pytest.raises(ValueError, match=f"{field} must be an integer >= 1, got 0"):
        AsyncLLM("tiny", **ASYNC_KW, **{field: 0})
