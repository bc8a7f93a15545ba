"""`scripts/bench_structured.py` (`mnemojax.bench.structured`), small: every pattern walks a match, its masks agree
with the plain walk (the benchmark raises otherwise), and the table has every column."""
from mnemojax.bench import structured as bench


def test_measure_small():
    rows = bench.measure(vocab=3000, tokens=6, seed=1)
    assert [r[0] for r in rows] == list(bench.PATTERNS)
    assert all(states >= 2 and new > 0 and plain > 0 and cached > 0 for _, states, new, plain, cached in rows)
    text = bench.table(rows, 3000)
    assert "speed-up" in text and "mask per regex row: 376 bytes" in text
