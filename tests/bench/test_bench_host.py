"""`scripts/bench_host.py` (`mnemojax.bench.host`): each part of the engine's step is timed by wrapping the
engine's own methods, on a page table wider than the model's positions."""
from mnemojax.bench import host


def test_measure_times_every_part_of_a_decode_step():
    m = host.measure(requests=8, steps=3, max_model_len=65536)
    assert set(m) == set(host.PARTS) | {"host", "step"}
    assert all(m[p] > 0 for p in host.PARTS)
    # the parts are inside the step (medians of different steps, so compare with room)
    assert m["run"] < m["step"] and sum(m[p] for p in host.PARTS) < 2 * m["step"]
    assert 0.0 <= host.hidden_fraction(m) <= 1.0
    # by hand: parts 1+2+3+10+1 = 17 ms in a 12 ms step: 5 ms of the 7 ms of host parts overlapped the device
    assert host.hidden_fraction({"schedule": 1, "arrays": 2, "put": 3, "run": 10, "update": 1, "step": 12}) == 5 / 7
    text = host.table({65536: m}, 8)
    assert "65,536 tokens" in text and "8 requests decoding" in text
