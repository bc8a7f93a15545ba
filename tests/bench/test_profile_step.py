"""`scripts/profile_step.py` (`mnemojax.bench.profile_step`, its trace reading in `mnemojax.bench.trace`): the
trace's kernels, nesting removed, busy time as the union of intervals, on the CPU with the tiny model."""
import argparse

import pytest

from mnemojax.bench import profile_step, trace


def test_leaves_drop_events_that_contain_others():
    events = [("loop", 0, 100), ("a", 10, 20), ("b", 40, 10), ("c", 150, 5), ("outer", 200, 50), ("inner", 210, 5)]
    assert sorted(e[0] for e in trace._leaves(events)) == ["a", "b", "c", "inner"]


def test_busy_is_the_union_of_intervals():
    assert trace._busy_ns([("a", 0, 10), ("b", 5, 10), ("c", 30, 5), ("d", 31, 1)]) == 15 + 5
    assert trace._busy_ns([]) == 0


@pytest.mark.slow  # ~18 s on 2 cores: a benchmark script's smoke run (its helpers' tests stay in the default suite)
def test_profiles_decode_steps_of_the_tiny_model():
    args = argparse.Namespace(model="tiny", dtype="float32", attention="reference", batch=3, context=40,
                              prefill_chunk=0, page_size=8, steps=3)
    engine = profile_step.build_engine(args)
    assert len(engine.scheduler.running) == 3 and all(r.output_token_ids for r in engine.scheduler.running)
    prof = profile_step.profile_steps(engine, 3)
    assert prof.steps == 3 and prof.kernels and prof.launches > 10  # the four layers' ops at least
    assert 0 < prof.busy_ms <= prof.wall_ms * 1.05
    assert all(k.calls > 0 and k.total_ns > 0 for k in prof.kernels)
    assert not any(k.name.startswith("ThunkExecutor") for k in prof.kernels)
    text = prof.table(top=5)
    assert "kernel launches" in text and "more kernels" in text
