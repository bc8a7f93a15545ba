"""A step that fails (a device error, a KeyboardInterrupt during a compile) must not wedge the engine: it
preempts every running request by recompute, gives every page back and serves on, with the same results."""
import pytest

from mnemojax import LLM, SamplingParams
from mnemojax.engine.executor import Executor
from mnemojax.scheduling.sampling_params import RequestOutputKind

PROMPTS = [list(range(1, 21)), [5, 6, 7, 8, 9], list(range(30, 60)), [3, 1, 4, 1, 5, 9, 2, 6]]


def _flaky_run(monkeypatch, fail_at: int, error: BaseException):
    """Executor.run raising `error` at its `fail_at`-th call, having consumed the KV cache first (as a step that
    failed after taking its donated buffers)."""
    real, calls = Executor.run, [0]

    def run(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == fail_at:
            self.k_cache.delete()
            self.v_cache.delete()
            raise error
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Executor, "run", run)


@pytest.mark.parametrize("async_scheduling, spp", [(False, 1), (True, 1), pytest.param(True, 2, marks=pytest.mark.slow)],
                         ids=["sync", "async", "spp2"])  # spp 2: 21 s on 2 cores cold
def test_a_failed_step_preempts_everyone_and_the_results_stay_exact(monkeypatch, async_scheduling, spp):
    llm = LLM(model="tiny", page_size=4, max_model_len=96, chunk_size=16, max_num_batched_tokens=32,
              enable_prefix_caching=True, async_scheduling=async_scheduling, spp=spp)
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True,
                                                output_kind=RequestOutputKind.FINAL_ONLY)) for p in PROMPTS]
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
