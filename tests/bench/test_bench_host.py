"""`scripts/bench_host.py` (`mnemojax.bench.host`): each part of the engine's step is timed by wrapping the
engine's own methods, on a page table wider than the model's positions, synchronous and async."""
import pytest

from mnemojax.bench import host


@pytest.mark.slow  # a 65,536-position engine, sync and async: 19 s on 2 cores cold
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_measure_times_every_part_of_a_decode_step(async_scheduling):
    m = host.measure(requests=8, steps=3, max_model_len=65536, async_scheduling=async_scheduling)
    assert set(m) == set(host.PARTS) | {"host", "step", "full_gc"}
    assert all(m[p] > 0 for p in host.PARTS)
    assert m["host"] == pytest.approx(sum(m[p] for p in host.HOST_PARTS) + (m["run"] if async_scheduling else 0))
    # the parts are inside the step (medians of different steps, so compare with room)
    assert m["run"] < m["step"] and sum(m[p] for p in host.PARTS) < 2 * m["step"]
    assert 0.0 <= host.hidden_fraction(m, m["run"]) <= 1.0
    text = host.table({(65536, False): m, (65536, True): m}, 8)
    assert "65,536 tokens" in text and "8 requests decoding" in text and " async " in text


@pytest.mark.slow  # 19 s on 2 cores cold
@pytest.mark.parametrize("kind", ["cumulative", "final_only"])
def test_the_output_kind_reaches_the_requests_and_outputs_are_timed(kind, monkeypatch):
    from mnemojax.engine.llm_engine import LLMEngine

    built = []
    output = LLMEngine.output
    monkeypatch.setattr(LLMEngine, "output", lambda self, req, k=None: built.append(req.params.output_kind.value)
                        or output(self, req, k))
    m = host.measure(requests=4, steps=3, max_model_len=8192, output_kind=kind)
    assert m["outputs"] > 0
    # cumulative: an output per request per step; final_only: none before a request's end (its last step is later)
    assert set(built) == {kind} if kind == "cumulative" else built.count(kind) <= 2 * 4


def test_long_prompt_output_is_timed_for_the_kinds_that_build_one_per_step():
    ms = host.long_prompt_output_ms(4096, generated=8, repeats=3)
    assert set(ms) == {"cumulative", "delta"} and all(v > 0 for v in ms.values())


def test_hidden_fraction_by_hand():
    # 7 ms of host work and a 10 ms device step in a 12 ms step: 5 of the 7 ms overlapped the device
    assert host.hidden_fraction({"host": 7, "step": 12}, 10) == 5 / 7
    assert host.hidden_fraction({"host": 7, "step": 17}, 10) == 0.0  # one after the other
    assert host.hidden_fraction({"host": 7, "step": 10}, 10) == 1.0  # all behind the device


def test_full_collections_are_timed():
    """The full-GC clock counts generation-2 collections only. (`--freeze_gc` calls the server's
    `freeze_startup_objects`, whose effect the serve-process test checks in the server's own process: frozen here,
    the objects of every later test in this process would stay out of the collector's reach.)"""
    import gc

    clock = host._FullCollections()
    gc.callbacks.append(clock)
    try:
        gc.collect(0)
        assert clock.seconds == 0.0
        gc.collect()
        assert clock.seconds > 0.0
    finally:
        gc.callbacks.remove(clock)


def test_delivery_to_callers_is_timed_per_step(monkeypatch):
    """The AsyncLLM line: the engine thread's time handing outputs over, per step, counted in `_send` and
    `_deliver` (both called: every stream gets its outputs)."""
    from mnemojax.engine.async_llm import AsyncLLM

    calls = {"_send": 0, "_deliver": 0}
    for name in calls:
        original = getattr(AsyncLLM, name)
        monkeypatch.setattr(AsyncLLM, name, lambda self, *a, _f=original, _n=name: calls.__setitem__(
            _n, calls[_n] + 1) or _f(self, *a))
    assert host.delivery_ms(4, tokens=3) > 0
    assert calls["_send"] >= 2 * 4 * 3  # two runs (warm-up and measured) of 4 streams of 3 tokens
    assert 0 < calls["_deliver"] < calls["_send"]


@pytest.mark.slow  # an engine of 8,192 positions with async scheduling: ~10 s on 2 cores cold
def test_bad_words_reach_the_requests(monkeypatch):
    from mnemojax.engine import executor

    banned = []
    bans = executor._bad_word_bans
    monkeypatch.setattr(executor, "_bad_word_bans", lambda req, step: banned.append(len(req.bad_words))
                        or bans(req, step))
    m = host.measure(requests=4, steps=3, max_model_len=8192, async_scheduling=True, bad_words=True)
    assert m["arrays"] > 0 and banned and set(banned) == {8}
