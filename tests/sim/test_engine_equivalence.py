"""The simulator is the engine's loop with the predictor as its clock: given the same trace, configuration and
predictor, the engine on a virtual clock whose steps take that predictor's time (`tests.virtual_clock`) and the
simulator serve every request at the same times: when it was first scheduled, its first token, every token, its
end. Synchronous and async scheduling (the simulator models the engine's default, async: step N + 1 is planned
before step N's results, and an arrival during step N first runs in step N + 2), FCFS and ILRS, with adaptive
chunks of a target (so every decision depends on the clock)."""
import numpy as np
import pytest

from mnemojax.engine.llm_engine import EngineConfig, LLMEngine
from mnemojax.scheduling.request import Request
from mnemojax.scheduling.sampling_params import SamplingParams
from mnemojax.sim.simulator import SimConfig, Simulator, TraceRequest
from tests.virtual_clock import VirtualMachine

NUM_PAGES = 400
# (arrival s, prompt tokens, output tokens): a long prompt, short ones arriving during its prefill and decodes,
# a gap in which the engine idles, then a burst.
TRACE = [(0.0, 900, 6), (0.004, 40, 12), (0.011, 130, 9), (0.02, 17, 20), (0.05, 300, 5), (0.052, 64, 8),
         (0.3, 500, 4), (0.3001, 33, 15), (0.301, 33, 3), (0.302, 250, 10)]


def settings(policy: str) -> dict:
    return dict(model="tiny", chunk_size=128, max_num_batched_tokens=256, max_num_seqs=8, scheduler_policy=policy,
                target_batch_time_ms=6.0, min_chunk_size=16, tp=1, spp=1, kvp=1, page_size=16, num_pages=NUM_PAGES)


def engine_run(policy: str, async_scheduling: bool):
    """The trace on the engine, on a virtual clock priced by the engine's own (uncalibrated) predictor."""
    config = EngineConfig(**settings(policy), hardware="cpu", calibrate=False, enable_prefix_caching=False,
                          async_scheduling=async_scheduling)
    vm = VirtualMachine()
    engine = LLMEngine(config, clock=vm.clock)
    vm.machine = engine.predictor
    vm.attach(engine)
    pending = sorted(TRACE)
    ids = []
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= vm.now:
            arrival, prompt, out = pending.pop(0)
            ids.append(engine.add_request([1 + (len(ids) * 7 + i) % 250 for i in range(prompt)],
                                          SamplingParams(max_tokens=out, ignore_eos=True), arrival_time=arrival))
        if engine.has_unfinished():
            engine.step()
        else:
            vm.now = max(vm.now, pending[0][0])  # idle until the next arrival, as the simulator does
    return engine.predictor, [engine.pop_finished(rid).metrics for rid in ids]


@pytest.mark.parametrize("policy, async_scheduling", [
    pytest.param("fcfs", False, marks=pytest.mark.slow), ("ilrs", True),  # ~13 s and ~7 s on 2 cores
    pytest.param("fcfs", True, marks=pytest.mark.slow), pytest.param("ilrs", False, marks=pytest.mark.slow)],
    ids=["fcfs-sync", "ilrs-async", "fcfs-async", "ilrs-sync"])
def test_simulator_serves_the_trace_as_the_engine_does(policy, async_scheduling):
    predictor, measured = engine_run(policy, async_scheduling)
    config = SimConfig(**settings(policy), hardware="cpu", dtype_bytes=4, async_scheduling=async_scheduling)
    sim = Simulator(config, [TraceRequest(a, p, o) for a, p, o in TRACE], predictor=predictor)
    result = sim.run()
    assert result.metrics["completed"] == len(TRACE)
    simulated = {int(r["id"]): r for r in result.requests}
    for i, m in enumerate(measured):
        r = simulated[i]
        assert m.arrival_time == r["arrival"]
        for mine, theirs in ((m.first_scheduled_time, "first_scheduled"), (m.first_token_time, "first_token"),
                             (m.finished_time, "finished")):
            assert mine == pytest.approx(r[theirs], abs=1e-12), (i, theirs)
        gaps = np.diff(m.token_times)
        assert gaps.mean() == pytest.approx(r["tbt_mean"], abs=1e-12)
        assert gaps.max() == pytest.approx(r["tbt_max"], abs=1e-12)


def test_async_scheduling_starts_an_arrival_one_step_later():
    """A request that arrives while another decodes: synchronously its prefill runs in the step after the one
    running at its arrival; async, in the one after that (that step was planned before it arrived). Both plan it
    at the same time, when the step running at its arrival ends."""
    trace = [TraceRequest(0.0, 20, 30), TraceRequest(0.0105, 20, 2)]
    runs = {}
    for mode in (False, True):
        config = SimConfig(**settings("fcfs"), hardware="cpu", dtype_bytes=4, async_scheduling=mode)
        runs[mode] = Simulator(config, trace).run().requests[1]
    sync, async_ = runs[False], runs[True]
    assert async_["first_token_step"] == sync["first_token_step"] + 1
    assert async_["first_scheduled"] == sync["first_scheduled"]
    assert async_["first_token"] > sync["first_token"]


def test_prefill_factor_deadlines_are_the_simulators_without_a_target():
    """`ttft_slo_prefill_factor` prices deadlines with the predictor; without a target batch time the engine
    built no predictor and kept the per-token deadline, while the simulator applied the factor."""
    kw = dict(settings("ilrs"), target_batch_time_ms=None, ttft_slo_prefill_factor=1000.0, ttft_slo_min_s=1.0,
              ttft_slo_per_token_s=1e-3)
    engine = LLMEngine(EngineConfig(**kw, hardware="cpu", calibrate=False, precompile=False))
    assert engine.predictor is not None
    rid = engine.add_request([1 + i % 250 for i in range(900)], SamplingParams(max_tokens=1, ignore_eos=True))
    mine = engine.requests[rid].deadline_duration
    sim = Simulator(SimConfig(**kw, hardware="cpu", dtype_bytes=4), [], predictor=engine.predictor)
    theirs = Request("sim", list(range(900)), SamplingParams(max_tokens=1, ignore_eos=True), 0.0, seed=0)
    sim.scheduler.add(theirs)
    assert mine > 1.0 + 1e-3 * 900  # the factor, not the per-token deadline
    assert mine == theirs.deadline_duration


def test_simulator_prices_a_pipeline_as_the_engine_does_by_default():
    from models.config import preset

    kw = dict(settings("ilrs"), spp=2)
    engine_predictor = LLMEngine._make_predictor(EngineConfig(**kw, hardware="cpu"), preset("tiny"))
    sim = Simulator(SimConfig(**kw, hardware="cpu", dtype_bytes=4), [TraceRequest(0.0, 10, 1)])
    assert engine_predictor.pipeline_tokens is not None
    assert sim.predictor.pipeline_tokens == engine_predictor.pipeline_tokens


@pytest.mark.parametrize("page_size", [16, 32])
def test_simulator_prices_steps_with_the_engines_profile_and_blocks(page_size):
    """The simulator's default predictor is the engine's: the hardware's shipped profile (cpu.json; it used no
    profile, the GPU defaults) and the reference attention's blocks of 8 pages (it used 8 x 16 tokens whatever the
    page size)."""
    from mnemojax.scheduling.predictor import ChunkShape
    from models.config import preset

    kw = dict(settings("ilrs"), page_size=page_size)
    engine_predictor = LLMEngine._make_predictor(EngineConfig(**kw, hardware="cpu"), preset("tiny"))
    sim = Simulator(SimConfig(**kw, hardware="cpu", dtype_bytes=4), [TraceRequest(0.0, 10, 1)])
    steps = [[ChunkShape(256, 2048)], [ChunkShape(1, 4096)] * 8, [ChunkShape(64, 700), ChunkShape(1, 300)]]
    assert [sim.predictor.step_time(s) for s in steps] == [engine_predictor.step_time(s) for s in steps]
    assert sim.predictor.profile == engine_predictor.profile
