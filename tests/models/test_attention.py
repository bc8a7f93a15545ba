"""The reference paged attention against plain dense softmax attention; the kernel names and `auto`."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.attention import (AttentionMetadata, attention, dense_attention_reference, on_nvidia_gpu,
                              paged_attention, resolve_attention)
from models.kernels import ATTENTION_IMPLS, NEG_INF, resolve_attention_impl

PAGE = 4


def _layout(rng, lens, num_pages, max_pages):
    """Random distinct pages per sequence, a page table and a cache with random K/V in those pages."""
    perm = rng.permutation(np.arange(1, num_pages))
    table = np.zeros((len(lens), max_pages), np.int32)
    used = 0
    for b, n in enumerate(lens):
        k = -(-n // PAGE)
        table[b, :k] = perm[used:used + k]
        used += k
    return table


# row_block 256: one row block; 5: row blocks across sequences, the last padded. One row block of one page at a time
# is the slowest case on a CPU (~5 s): with 4 or 2 kv heads it runs in the slow suite (CI runs it).
@pytest.mark.parametrize("num_heads,num_kv_heads,block_pages,row_block", [
    pytest.param(h, kv, bp, rb, id=f"{rb}-{bp}-{h}-{kv}",
                 marks=[pytest.mark.slow] if (rb, bp) == (256, 1) and kv > 1 else [])
    for rb in (256, 5) for bp in (1, 3) for h, kv in ((4, 4), (4, 2), (4, 1))])
def test_paged_matches_dense(num_heads, num_kv_heads, block_pages, row_block):
    rng = np.random.default_rng(num_heads * 10 + num_kv_heads + block_pages)
    H, L, P, M = 8, 2, 40, 12
    # (context length after this step, query tokens this step): a prefill chunk mid-prompt, a decode, a
    # first chunk, a chunk that ends on a page boundary, a one-key sequence.
    seqs = [(23, 7), (17, 1), (5, 5), (16, 3), (1, 1)]
    # KV-parallel shard view: the second sequence's keys here start at absolute position 6.
    kv_start = np.array([0, 6, 0, 0, 0], np.int32)
    lens = [n for n, _ in seqs]
    table = _layout(rng, lens, P, M)
    k_cache = rng.standard_normal((L, P, PAGE, num_kv_heads, H)).astype(np.float32)
    v_cache = rng.standard_normal((L, P, PAGE, num_kv_heads, H)).astype(np.float32)
    layer = 1
    seq_ids, positions = [], []
    for b, (n, q) in enumerate(seqs):
        seq_ids += [b] * q
        positions += list(range(kv_start[b] + n - q, kv_start[b] + n))
    T = len(seq_ids)
    q = rng.standard_normal((T, num_heads, H)).astype(np.float32)
    meta = AttentionMetadata(seq_ids=jnp.asarray(seq_ids, jnp.int32), positions=jnp.asarray(positions, jnp.int32),
                             page_table=jnp.asarray(table), kv_lens=jnp.asarray(lens, jnp.int32),
                             kv_start=jnp.asarray(kv_start))
    out, lse = paged_attention(jnp.asarray(q), jnp.asarray(k_cache), jnp.asarray(v_cache), layer, meta,
                               block_pages=block_pages, precision=jax.lax.Precision.HIGHEST, row_block=row_block)
    t = 0
    for b, (n, nq) in enumerate(seqs):
        pages = table[b, :-(-n // PAGE)]
        k = k_cache[layer, pages].reshape(-1, num_kv_heads, H)[:n]
        v = v_cache[layer, pages].reshape(-1, num_kv_heads, H)[:n]
        ref_out, ref_lse = dense_attention_reference(q[t:t + nq], k, v, np.asarray(positions[t:t + nq]),
                                                     kv_start[b] + np.arange(n))
        np.testing.assert_allclose(out[t:t + nq], ref_out, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lse[t:t + nq], ref_lse, rtol=1e-5, atol=1e-5)
        t += nq


def test_numpy_softmax_cross_check():
    """The dense reference itself against a direct numpy softmax (so the reference is not self-checked)."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((3, 2, 4))
    k = rng.standard_normal((5, 1, 4))
    v = rng.standard_normal((5, 1, 4))
    qpos, kpos = np.array([2, 3, 4]), np.arange(5)
    out, lse = dense_attention_reference(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32),
                                         jnp.asarray(v, jnp.float32), qpos, kpos)
    for t in range(3):
        for n in range(2):
            s = np.array([q[t, n] @ k[c, 0] / 2.0 for c in range(qpos[t] + 1)])
            w = np.exp(s - s.max())
            np.testing.assert_allclose(out[t, n], (w / w.sum()) @ v[:qpos[t] + 1, 0], rtol=1e-5)
            np.testing.assert_allclose(lse[t, n], s.max() + np.log(w.sum()), rtol=1e-5)


def test_no_visible_key_gives_zero_weight():
    """A token with no visible key (empty shard) returns out 0 and lse NEG_INF, never NaN."""
    k_cache = jnp.ones((1, 3, PAGE, 1, 8))
    meta = AttentionMetadata(seq_ids=jnp.array([0, 0]), positions=jnp.array([0, 1]), page_table=jnp.array([[1, 2]]),
                             kv_lens=jnp.array([0]), kv_start=jnp.array([0]))
    out, lse = paged_attention(jnp.ones((2, 2, 8)), k_cache, k_cache, 0, meta, block_pages=1)
    assert not np.isnan(np.asarray(out)).any()
    np.testing.assert_array_equal(out, 0.0)
    np.testing.assert_array_equal(lse, np.float32(NEG_INF))


def test_kernel_names_and_what_auto_means():
    assert ATTENTION_IMPLS == ("auto", "reference", "pallas", "pallas_interpret", "mosaic", "mosaic_interpret")
    assert resolve_attention_impl("auto", nvidia_gpu=False) == "reference"
    assert resolve_attention_impl("auto", nvidia_gpu=True) == "pallas"
    assert resolve_attention_impl("auto", nvidia_gpu=True, mosaic=True) == "mosaic"  # Hopper, a model they support
    for name in ATTENTION_IMPLS[1:]:  # only auto chooses: a named implementation is itself everywhere
        assert (resolve_attention_impl(name, nvidia_gpu=False) == resolve_attention_impl(name, nvidia_gpu=True)
                == resolve_attention_impl(name, nvidia_gpu=True, mosaic=True) == name)
    with pytest.raises(ValueError, match="unknown attention implementation 'flash'; valid: auto, reference, pallas, "
                                         "pallas_interpret, mosaic, mosaic_interpret$"):
        resolve_attention_impl("flash", nvidia_gpu=True)


def test_auto_is_mosaic_on_hopper_for_the_models_they_support(monkeypatch):
    """`resolve_attention` with a model: on a Hopper GPU the Mosaic kernels where they run its dtype, heads, head
    dim and page size, else the Pallas kernels; without a model (the model-level calls) the Pallas kernels; on
    another NVIDIA GPU the Pallas kernels. (The GPU is pretended: the tests run on a CPU.)"""
    from models import attention as attn_mod

    monkeypatch.setattr(attn_mod, "on_nvidia_gpu", lambda: True)
    monkeypatch.setattr(attn_mod, "on_hopper_gpu", lambda: True)
    llama8b = dict(num_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
    assert resolve_attention("auto", dtype="bfloat16", **llama8b) == "mosaic"
    assert resolve_attention("auto", dtype="float16", **dict(llama8b, num_heads=64, page_size=128)) == "mosaic"
    assert resolve_attention("auto", dtype="bfloat16", **dict(llama8b, head_dim=64)) == "mosaic"  # llama3.2-1b
    for unsupported in (dict(dtype="float32"), dict(head_dim=96), dict(page_size=24), dict(num_heads=24)):
        assert resolve_attention("auto", **dict(dict(llama8b, dtype="bfloat16"), **unsupported)) == "pallas"
    assert resolve_attention("auto") == "pallas"  # no model given
    assert resolve_attention("auto", dtype="bfloat16", num_heads=32, num_kv_heads=8, head_dim=128) == "pallas"
    assert resolve_attention("pallas", dtype="bfloat16", **llama8b) == "pallas"  # a named one is itself
    monkeypatch.setattr(attn_mod, "on_hopper_gpu", lambda: False)  # an A100, say
    assert resolve_attention("auto", dtype="bfloat16", **llama8b) == "pallas"


@pytest.mark.skipif(on_nvidia_gpu(), reason="auto is the Pallas kernels on an NVIDIA GPU")
def test_auto_is_the_reference_off_nvidia_gpus():
    assert resolve_attention("auto") == "reference"
    rng = np.random.default_rng(1)
    cache = jnp.asarray(rng.standard_normal((1, 4, PAGE, 1, 8)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((3, 2, 8)), jnp.float32)
    meta = AttentionMetadata(seq_ids=jnp.array([0, 0, 0]), positions=jnp.array([3, 4, 5]),
                             page_table=jnp.array([[1, 3]]), kv_lens=jnp.array([6]), kv_start=jnp.array([0]))
    got = attention("auto", q, cache, cache, 0, meta, block_pages=1)
    want = paged_attention(q, cache, cache, 0, meta, block_pages=1)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    with pytest.raises(TypeError, match="the reference attention takes no kernel options"):
        attention("auto", q, cache, cache, 0, meta, block_pages=1, block_q=2)


def test_kernel_options_split_into_tiling_and_code_generation():
    """`split_kernel_options`: what each planner takes goes to the step's plan, the rest to every layer's call; a
    ModelSpec's `attention_options` are split the same way (its plan and call options)."""
    from models.attention import split_kernel_options
    from models.config import preset
    from models.llama import ModelSpec

    opts = dict(consumers=1, block_k=128, stages=3, pingpong=True, approx_math=False)
    # `stages` and `registers` go to both (the planner's choice of consumers must fit them: `PLAN_AND_CALL`)
    assert split_kernel_options("mosaic_interpret", dict(opts, registers=False)) == (
        dict(consumers=1, block_k=128, stages=3, registers=False),
        dict(stages=3, pingpong=True, approx_math=False, registers=False))
    assert split_kernel_options("pallas_interpret", dict(persistent=True, block_q=16)) == (
        dict(persistent=True, block_q=16), {})
    assert split_kernel_options("reference", dict(stages=3)) == ({}, dict(stages=3))  # the call refuses them
    spec = ModelSpec(preset("tiny"), attention="mosaic_interpret", attention_options=(("consumers", 1), ("stages", 3)))
    assert (spec.plan_options, spec.call_options) == (dict(consumers=1, stages=3), dict(stages=3))
