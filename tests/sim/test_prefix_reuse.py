"""The simulator models prefix reuse: requests sharing a long context (a trace's prefix_id) compute only their
own tokens when prefix caching is on, and everything when it is off."""
import numpy as np
import pytest

from mnemojax.sim import simulator
from mnemojax.sim.simulator import SimConfig, SimPrompt, TraceRequest


def _trace():
    # One 200K-token context, then 8 follow-ups over it with 300 new tokens each, and 4 unrelated short requests.
    reqs = [TraceRequest(0.0, 200_000, 8, prefix_id=7, prefix_tokens=200_000)]
    reqs += [TraceRequest(60.0 + i, 200_300, 8, prefix_id=7, prefix_tokens=200_000) for i in range(8)]
    reqs += [TraceRequest(61.5 + i, 500, 8) for i in range(4)]
    return reqs


def test_shared_prefix_is_reused_and_cuts_ttft(tmp_path):
    on = simulator.simulate(SimConfig(), _trace())
    off = simulator.simulate(SimConfig(enable_prefix_caching=False), _trace())
    by_len = {}  # records are in arrival order: the short ones interleave with the follow-ups
    for r in on.requests:
        by_len.setdefault(r["prompt_tokens"], []).append(r["cached_tokens"])
    assert by_len == {200_000: [0], 200_300: [200_000] * 8, 500: [0] * 4}
    assert all(r["cached_tokens"] == 0 for r in off.requests)
    ttft_on = np.array([r["ttft"] for r in on.requests if r["prompt_tokens"] == 200_300])
    ttft_off = np.array([r["ttft"] for r in off.requests if r["prompt_tokens"] == 200_300])
    assert len(ttft_on) == len(ttft_off) == 8
    assert (ttft_on * 5 < ttft_off).all()  # 300 new tokens against 200K
    path = tmp_path / "t.jsonl"
    simulator.save_trace(_trace(), str(path))
    assert simulator.load_trace(str(path)) == sorted(_trace(), key=lambda r: r.arrival_time)


@pytest.mark.parametrize("prefix_id", [123_456_789, 2**62, -5])
def test_any_integer_prefix_id_is_reused_as_a_small_one(prefix_id):
    """A trace's prefix ids are any integers: 123456789 overflowed the 64-bit token ids the prefix hashing reads
    (OverflowError). Each prefix id now stands for its index among the trace's prefixes."""
    small = simulator.simulate(SimConfig(), _trace())
    trace = [r if r.prefix_id is None else TraceRequest(r.arrival_time, r.prompt_tokens, r.output_tokens, prefix_id,
                                                        r.prefix_tokens) for r in _trace()]
    big = simulator.simulate(SimConfig(), trace)
    assert [r["cached_tokens"] for r in big.requests] == [r["cached_tokens"] for r in small.requests]
    assert sum(r["cached_tokens"] for r in big.requests) == 8 * 200_000


def test_sim_prompt_tokens_and_trace_validation():
    a, b, c = SimPrompt(0, 10, 3, 6), SimPrompt(1, 8, 3, 6), SimPrompt(2, 8)
    assert a[:6] == b[:6] and a[6] != b[6] and len(set(a[:] + b[6:] + c[:])) == 10 + 2 + 8
    assert a[-1] == a[9] and len(a) == 10
    with pytest.raises(IndexError):
        a[10]
    with pytest.raises(ValueError, match="prefix_tokens"):
        TraceRequest(0.0, 10, 1, prefix_id=1, prefix_tokens=11)
    with pytest.raises(ValueError, match="prefix_id and prefix_tokens go together"):
        TraceRequest(0.0, 10, 1, prefix_tokens=5)
