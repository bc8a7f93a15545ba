"""No compiles after start-up: an engine built with `precompile=True` compiles every step shape it can meet
before it serves, and a mixed workload afterwards (a long prompt in chunks, short prompts arriving mid-way,
greedy and sampled, log-probs and prompt log-probs, a batch at the token budget) lowers and compiles nothing."""
import jax
import numpy as np
import pytest
from jax._src import dispatch

from mnemojax.engine.llm_engine import EngineConfig, LLMEngine
from mnemojax.scheduling.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # (a precompiled engine: ~25 s; the default suite's ten minutes, forty-seventh session)

EVENTS = (dispatch.JAXPR_TO_MLIR_MODULE_EVENT, dispatch.BACKEND_COMPILE_EVENT)


class CompileCounter:
    """Counts jit lowerings and XLA compiles while active (jax.monitoring listeners cannot be removed, so one
    is registered per process and switched on and off)."""

    instance = None

    def __init__(self):
        self.active, self.events = False, []
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, duration, **kwargs):
        if self.active and event in EVENTS:
            self.events.append(event)

    @classmethod
    def get(cls):
        cls.instance = cls.instance or cls()
        cls.instance.events = []
        return cls.instance


@pytest.fixture(scope="module")
def engine_and_warm_up_events():
    counter = CompileCounter.get()
    counter.active = True
    try:
        engine = LLMEngine(EngineConfig(model="tiny", precompile=True, page_size=8, chunk_size=64,
                                        max_num_batched_tokens=128, max_num_seqs=8, max_model_len=1024))
    finally:
        counter.active = False
    return engine, list(counter.events)


def test_shape_buckets_cover_token_and_logits_rows(engine_and_warm_up_events):
    engine, _ = engine_and_warm_up_events
    # T: powers of two from 16 to the budget's bucket; R: 8 (one row per sequence, max_num_seqs 8) and T; the
    # reference attention has one kind of step.
    assert engine.executor.shape_buckets() == [(16, 8, "mixed"), (16, 16, "mixed"), (32, 8, "mixed"),
                                               (32, 32, "mixed"), (64, 8, "mixed"), (64, 64, "mixed"),
                                               (128, 8, "mixed"), (128, 128, "mixed")]


def test_precompile_lowers_every_shape(engine_and_warm_up_events):
    _, events = engine_and_warm_up_events
    assert events.count(dispatch.JAXPR_TO_MLIR_MODULE_EVENT) >= 8  # the listener sees the warm-up's lowerings


def test_mixed_workload_after_start_up_compiles_nothing(engine_and_warm_up_events):
    engine, _ = engine_and_warm_up_events
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in (700, 5, 40, 64, 130, 3, 90)]
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.8, top_k=20, top_p=0.9, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True),
              SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=1.0, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[7], ignore_eos=True),
              SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0, logprobs=0, ignore_eos=True)]
    counter = CompileCounter.get()
    counter.active = True
    try:
        ids = [engine.add_request(prompts[0], params[0])]
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
            if steps in (2, 4, 6) and len(ids) < len(prompts):  # short requests arrive during the long prefill
                for p, s in zip(prompts[len(ids):len(ids) + 2], params[len(ids):len(ids) + 2]):
                    ids.append(engine.add_request(p, s))
        ids += [engine.add_request(p, s) for p, s in zip(prompts[len(ids):], params[len(ids):])]
        while engine.has_unfinished():
            engine.step()
        outs = [engine.pop_finished(rid) for rid in ids]
    finally:
        counter.active = False
    assert len(outs) == len(prompts) and all(o.finished for o in outs)
    assert len(outs[3].prompt_logprobs) == 64
    assert counter.events == []
    assert engine.kv.num_used == 0


def test_precompile_structured_outputs_compiles_the_masked_variants_too():
    """Steps with structured outputs' rows (token masks) are their own compiled variant: after a plain precompile a
    regex request lowers a step; with `precompile_structured_outputs` it lowers and compiles nothing (a json_object
    request neither)."""
    from mnemojax.scheduling.sampling_params import StructuredOutputsParams

    counter = CompileCounter.get()
    kw = dict(model="tiny", precompile=True, page_size=8, chunk_size=16, max_num_batched_tokens=16, max_num_seqs=8,
              max_model_len=256)
    params = [SamplingParams(max_tokens=6, temperature=0, structured_outputs=StructuredOutputsParams(
        regex=r"[a-z]{2,5}")), SamplingParams(max_tokens=6, temperature=0, structured_outputs=StructuredOutputsParams(
            json_object=True, whitespace_pattern=""))]
    for structured in (False, True):
        engine = LLMEngine(EngineConfig(**kw, precompile_structured_outputs=structured))
        counter.events, counter.active = [], True
        try:
            for p in params:
                engine.add_request("Hello there", p)
                while engine.has_unfinished():
                    engine.step()
        finally:
            counter.active = False
        assert bool(counter.events) != structured, (structured, counter.events)
    with pytest.raises(ValueError, match="precompile_structured_outputs needs precompile"):
        EngineConfig(model="tiny", precompile=False, precompile_structured_outputs=True)
