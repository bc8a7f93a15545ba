"""`scripts/bench_sampler.py` (`mnemojax.bench.sampler`), small: its sort baseline keeps the sampler's sets, and it
times every case."""
from mnemojax.bench import sampler as bench


def test_measure_small():
    results = bench.measure(rows=4, vocab=300, repeats=1)  # asserts the sort and the bisection agree per case
    assert [r[0] for r in results[:len(bench.CASES)]] == list(bench.CASES)
    assert all(r[2] > 0 for r in results)
    assert "speed-up" in bench.table(results, 4, 300)


def test_measure_penalties_small():
    results = bench.measure_penalties(rows=4, vocab=300, repeats=1)
    assert [r[0] for r in results][:3] == ["no biases, no penalty state", "penalty state, no row penalized",
                                           "every row penalized"]
    assert len(results) == 5 and all(ms > 0 for _, ms in results)
    assert "x baseline" in bench.penalties_table(results, 4, 300)
