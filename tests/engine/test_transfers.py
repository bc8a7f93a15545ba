"""A step's host arrays reach the device in one transfer (`executor.Packing`), its page-table updates in one more,
and the packed buffer gives back exactly the arrays that were packed."""
import jax
import numpy as np
import pytest

from mnemojax import LLM, SamplingParams
from mnemojax.engine.executor import Packing


def _arrays(rng):
    """Leaves of every dtype a step sends, with the bit patterns a cast would change: NaN payloads, -0.0,
    infinities, subnormals, uint32 past int32's range, negative int32."""
    f = rng.standard_normal((2, 3, 5)).astype(np.float32)
    f.reshape(-1)[:6] = [np.nan, -0.0, np.inf, -np.inf, 1e-45, -3e-39]
    f.view(np.uint32).reshape(-1)[6] = 0x7FC0_1234  # a NaN with a payload
    u = rng.integers(0, 2**32, (2, 4), dtype=np.uint64).astype(np.uint32)
    u[0, 0] = 2**32 - 1
    i = rng.integers(-2**31, 2**31, (2, 3, 1, 2), dtype=np.int64).astype(np.int32)
    b = rng.random((2, 7)) < 0.5
    return {"f": f, "nested": (u, [i, b])}


def test_packing_gives_back_every_leaf_bit_for_bit():
    tree = _arrays(np.random.default_rng(0))
    packed, packing = Packing.pack(tree)
    assert packed.dtype == np.int32 and packed.shape == (2, 15 + 4 + 6 + 7)
    got = jax.jit(packing.unpack)(packed)
    assert jax.tree.structure(got) == jax.tree.structure(tree)
    for g, want in zip(jax.tree.leaves(got), jax.tree.leaves(tree)):
        g = np.asarray(g)
        assert g.dtype == want.dtype and g.shape == want.shape
        if want.dtype == np.bool_:
            assert (g == want).all()
        else:  # the same bits (NaN payloads and -0.0 included)
            assert (g.view(np.uint32) == want.view(np.uint32)).all()
    assert hash(packing) == hash(Packing.pack(tree)[1])  # the jitted step's static argument


@pytest.mark.parametrize("dtype", [np.int64, np.float64, np.int16])
def test_packing_refuses_dtypes_it_cannot_carry_exactly(dtype):
    with pytest.raises(TypeError, match=f"dtype {np.dtype(dtype)}"):
        Packing.pack((np.zeros((1, 2), np.int32), np.zeros((1, 2), dtype)))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_step_sends_its_host_arrays_in_one_transfer(async_scheduling, monkeypatch):
    """Each `jax.device_put` while serving carries one array: the step's packed buffer, or the page-table updates
    before it (at most two a step; the step had one transfer per array, 18 of them, each costing the same fixed
    ~40 us on a CPU whatever its size); the tokens are those of the same engine before the counting."""
    llm = LLM(model="tiny", max_model_len=128, page_size=4, async_scheduling=async_scheduling)
    params = SamplingParams(max_tokens=9, temperature=0.8, seed=3, ignore_eos=True, logprobs=1)
    prompts = [[1, 2, 3], list(range(5, 30)), [7] * 11]
    want = [o.outputs[0] for o in llm.generate(prompts, params)]

    puts, steps = [], []
    put, run = jax.device_put, llm.engine.executor.run
    monkeypatch.setattr(jax, "device_put", lambda x, *a, **k: puts.append(len(jax.tree.leaves(x))) or put(x, *a, **k))
    monkeypatch.setattr(llm.engine.executor, "run", lambda *a, **k: steps.append(1) or run(*a, **k))
    got = [o.outputs[0] for o in llm.generate(prompts, params)]
    for g, w in zip(got, want):  # the second run's steps mix differently (prefix-cache hits): float32 rounding
        assert g.token_ids == w.token_ids and [d.keys() for d in g.logprobs] == [d.keys() for d in w.logprobs]
        np.testing.assert_allclose([list(d.values()) for d in g.logprobs], [list(d.values()) for d in w.logprobs],
                                   rtol=0, atol=1e-5)
    assert len(steps) >= 9 and set(puts) == {1}
    assert len(steps) < len(puts) <= 2 * len(steps)  # a packed buffer a step, page-table updates in some
