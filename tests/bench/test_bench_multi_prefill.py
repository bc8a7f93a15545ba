"""`scripts/bench_multi_prefill.py` (`mnemojax.bench.multi_prefill`), small: the steps of a warm second `generate` are
timed with their plans, and the report states the ratio against the 2x bound."""
import pytest

from mnemojax.bench import multi_prefill


@pytest.mark.slow  # ~11 s on 2 cores: a benchmark script's smoke run (its helpers' tests stay in the default suite)
def test_measure_finds_each_workloads_prefill_step():
    m = multi_prefill.measure(long=40, short=24, num_short=2, max_tokens=2, chunk_size=128,
                              max_num_batched_tokens=128, max_model_len=256)
    assert m["multi"][:2] == (3, 88) and m["single"][:2] == (1, 88)  # all prompts prefilled in one step
    assert m["long_alone"][:2] == (1, 40) and m["short_alone"][:2] == (1, 24)
    text = multi_prefill.report(m)
    assert "bound 2x" in text and "seqs" in text


def test_report_by_hand():
    m = {"multi": (7, 3672, 900.0), "single": (1, 3672, 3000.0), "long_alone": (1, 600, 150.0),
         "short_alone": (1, 512, 100.0), "median_ms": 5.0, "num_short": 6}
    text = multi_prefill.report(m)
    assert "0.30 (bound 2x: within)" in text and "one at a time: 750.0 ms (together: 1.20x that)" in text
    m["multi"] = (7, 3672, 6100.0)
    assert "2.03 (bound 2x: EXCEEDED)" in multi_prefill.report(m)
