"""The Pallas attention kernels against the reference paged attention and plain dense softmax attention.

On the CPU the kernels run in Pallas' interpreter (the same kernel code the GPU compiles); small head dims and
small blocks keep it fast while still cutting every sequence into several query tiles, key blocks and KV
partitions. Also: the compiled kernels lower to Triton IR (checked on the CPU by lowering for CUDA), the
`attention` switch refuses what it cannot run, the engine gives the same tokens with the interpreted kernels
as with the reference, and (GPU only) the compiled kernels against the float32 reference.
"""
import collections
import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from models import pallas_attention as pa
from models.attention import AttentionMetadata, attention, dense_attention_reference, paged_attention
from models.kernels import ATTENTION_IMPLS, NEG_INF

HIGHEST = jax.lax.Precision.HIGHEST


def make_step(rng, seqs, *, num_heads, num_kv_heads, head_dim, page, dtype=np.float32, num_layers=2,
              max_pages=None, pad_rows=0, shuffle=False):
    """A ragged step: `seqs` = [(keys held after the step, query tokens, kv_start)], sequences end to end
    (rows shuffled if asked; `pad_rows` padding rows at the end, as the executor adds them: they belong to
    an extra empty sequence). K/V of every sequence in random distinct pages of a random cache."""
    seqs = list(seqs) + ([(0, pad_rows, 0)] if pad_rows else [])
    pages_of = [-(-n // page) for n, _, _ in seqs]
    M = max_pages or max(max(pages_of), 1)
    P = 1 + sum(pages_of) + 3
    perm = rng.permutation(np.arange(1, P))
    table = np.zeros((len(seqs), M), np.int32)
    used = 0
    for b, k in enumerate(pages_of):
        table[b, :k] = perm[used:used + k]
        table[b, k:] = rng.integers(0, P, M - k)  # unused columns may hold any id
        used += k
    seq_ids, positions = [], []
    for b, (n, nq, start) in enumerate(seqs):
        seq_ids += [b] * nq
        positions += list(range(start + n - nq, start + n)) if n else [0] * nq
    seq_ids, positions = np.array(seq_ids, np.int32), np.array(positions, np.int32)
    if shuffle:
        order = rng.permutation(len(seq_ids))
        seq_ids, positions = seq_ids[order], positions[order]
    shape = (num_layers, P, page, num_kv_heads, head_dim)
    cast = (lambda x: jnp.asarray(x, dtype))
    return dict(
        q=cast(rng.standard_normal((len(seq_ids), num_heads, head_dim))),
        k_cache=cast(rng.standard_normal(shape)), v_cache=cast(rng.standard_normal(shape)),
        layer=jnp.int32(num_layers - 1), page_table=jnp.asarray(table),
        kv_lens=jnp.asarray([n for n, _, _ in seqs], jnp.int32),
        kv_start=jnp.asarray([s for _, _, s in seqs], jnp.int32),
        seq_ids=jnp.asarray(seq_ids), positions=jnp.asarray(positions))


def run(fn, step, **kw):
    """`fn(q, k_cache, v_cache, layer, meta, **kw)` on a `make_step` step."""
    s = dict(step)
    return fn(s.pop("q"), s.pop("k_cache"), s.pop("v_cache"), s.pop("layer"), AttentionMetadata(**s), **kw)


def f32(step):
    """The same step with every float array in float32 (bf16 values are exact in float32)."""
    return {k: v.astype(jnp.float32) if jnp.issubdtype(v.dtype, jnp.floating) else v for k, v in step.items()}


@jax.jit
def _dense_batched(q, k, v, q_pos, k_pos):
    return jax.vmap(dense_attention_reference)(q, k, v, q_pos, k_pos)


def dense(step):
    """`dense_attention_reference` per sequence over its own keys (gathered from the pages), all sequences in
    one vmapped call: queries and keys padded, padded keys at a position no query reaches."""
    s = {k: np.asarray(v.astype(jnp.float32) if jnp.issubdtype(v.dtype, jnp.floating) else v)
         for k, v in step.items()}
    T, N, H = s["q"].shape
    L, _, page, K, _ = s["k_cache"].shape
    seqs = np.unique(s["seq_ids"])
    rows = [np.flatnonzero(s["seq_ids"] == b) for b in seqs]
    nq, nk = max(map(len, rows)), max(1, int(s["kv_lens"].max()))
    q = np.zeros((len(seqs), nq, N, H), np.float32)
    q_pos = np.full((len(seqs), nq), -1, np.int32)
    k, v = (np.zeros((len(seqs), nk, K, H), np.float32) for _ in range(2))
    k_pos = np.full((len(seqs), nk), np.iinfo(np.int32).max, np.int32)
    for i, (b, r) in enumerate(zip(seqs, rows)):
        n = int(s["kv_lens"][b])
        pages = s["page_table"][b, :-(-n // page)]
        q[i, :len(r)], q_pos[i, :len(r)] = s["q"][r], s["positions"][r]
        k[i, :n] = s["k_cache"][s["layer"], pages].reshape(-1, K, H)[:n]
        v[i, :n] = s["v_cache"][s["layer"], pages].reshape(-1, K, H)[:n]
        k_pos[i, :n] = s["kv_start"][b] + np.arange(n)
    o, l = (np.asarray(x) for x in _dense_batched(q, k, v, q_pos, k_pos))
    out, lse = np.zeros((T, N, H), np.float32), np.full((T, N), NEG_INF, np.float32)
    for i, r in enumerate(rows):
        seen = np.isfinite(l[i, :len(r), 0])  # a token with no visible key: -inf (and NaN out) in dense softmax
        out[r[seen]], lse[r[seen]] = o[i, :len(r)][seen], l[i, :len(r)][seen]
    return out, lse


def assert_close(got, want, *, rtol=1e-5, atol=1e-6, out_atol=None, out_rtol=None):
    """float32-rounding agreement; NaN or inf never passes; rows with no visible key exactly (0, NEG_INF).
    `out_atol` / `out_rtol` replace atol / rtol for out (an out in bf16 or f16 is compared as float32)."""
    (out, lse), (ref_out, ref_lse) = [tuple(np.asarray(a, np.float32) for a in x) for x in (got, want)]
    assert np.isfinite(out).all() and np.isfinite(lse).all(), "NaN or inf in the kernel's output"
    assert np.isfinite(ref_out).all() and np.isfinite(ref_lse).all()
    empty = ref_lse <= NEG_INF / 2
    np.testing.assert_array_equal(lse[empty], np.float32(NEG_INF))
    np.testing.assert_array_equal(out[empty], 0.0)
    np.testing.assert_allclose(out, ref_out, rtol=rtol if out_rtol is None else out_rtol,
                               atol=atol if out_atol is None else out_atol)
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=rtol, atol=atol)


# (keys after the step, query tokens, kv_start): a prefill chunk mid-prompt ending mid-page, a decode, a first
# chunk, a chunk ending on a page boundary, a one-key sequence, an empty sequence (a KVP shard holding none of
# its keys), a KVP shard's view (keys from absolute position 37 on), a long decode.
MIXED = [(23, 7, 0), (17, 1, 0), (5, 5, 0), (16, 3, 0), (1, 1, 0), (0, 2, 0), (29, 6, 37), (61, 1, 0)]
SMALL = dict(head_dim=8, page=4)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1)])  # GQA ratios 1, 4, 8
def test_prefill_kernel_matches_reference(num_heads, num_kv_heads):
    """Chunked-prefill tiling (several tiles per sequence, several key blocks, 3 KV partitions), rows shuffled."""
    rng = np.random.default_rng(num_heads + 10 * num_kv_heads)
    step = make_step(rng, MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, shuffle=True, **SMALL)
    got = run(pa.prefill_attention, step, interpret=True, block_q=2, block_k=8, num_partitions=3)
    assert_close(got, run(paged_attention, step, block_pages=3, precision=HIGHEST))
    assert_close(got, dense(step))


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1)])
def test_decode_kernel_matches_reference(num_heads, num_kv_heads):
    """Decode tiling (one token per tile) with split-K over 4 partitions: contexts from 0 to 70 keys, not
    multiples of the page or the key block, one KVP shard; also a batch with prefill chunks (any batch is
    correct, just not efficient)."""
    rng = np.random.default_rng(num_heads + 10 * num_kv_heads + 1)
    decodes = [(n, 1, 0) for n in (1, 7, 8, 9, 33, 70)] + [(0, 1, 0), (13, 1, 100)]
    for seqs in (decodes, MIXED):
        step = make_step(rng, seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, **SMALL)
        got = run(pa.decode_attention, step, interpret=True, block_k=16, num_partitions=4)
        assert_close(got, run(paged_attention, step, block_pages=2, precision=HIGHEST))
        assert_close(got, dense(step))


def test_mixed_step_through_the_switch():
    """The engine's path: `attention("pallas_interpret")` splits a step into decode and prefill tiles with the
    default tile and block sizes; chunks of 1 to 512 tokens, contexts that are multiples of no block size,
    padding rows, a partial tile per sequence."""
    rng = np.random.default_rng(7)
    seqs = [(700, 512, 0), (300, 64, 0), (95, 31, 0), (41, 2, 0), (1000, 1, 0), (3, 1, 0), (250, 20, 11)]
    step = make_step(rng, seqs, num_heads=8, num_kv_heads=2, head_dim=8, page=16, pad_rows=5)
    got = run(functools.partial(attention, "pallas_interpret"), step, block_pages=4, precision=HIGHEST)
    assert_close(got, run(paged_attention, step, block_pages=4, precision=HIGHEST))


def test_bfloat16_inputs_against_float32_reference():
    """bf16 q and cache, float32 accumulation: the reference on the same values in float32. Scores and lse are
    float32-exact; P is rounded to bf16 for P @ V, so out is within 2^-9 max|v| (asserted: 2^-8) when asked for in
    float32 (`out_dtype`, a KVP rank's partial). By default out is bf16, the model's dtype: exactly the float32
    out rounded once (the kernel rounds as it writes; launches of one partition and merged ones, both tilings)."""
    rng = np.random.default_rng(3)
    step = make_step(rng, MIXED, num_heads=8, num_kv_heads=2, dtype=jnp.bfloat16, **SMALL)
    ref = run(paged_attention, f32(step), block_pages=3, precision=HIGHEST)
    bound = 2.0 ** -8 * float(jnp.abs(step["v_cache"].astype(jnp.float32)).max())
    for fn, kw in ((pa.prefill_attention, dict(block_q=2, block_k=8, num_partitions=2)),
                   (pa.decode_attention, dict(block_k=16, num_partitions=3)),
                   (pa.paged_attention_pallas, dict(block_q=2, block_k=8, decode_block_k=16, num_partitions=1,
                                                    decode_partitions=1))):
        got = run(fn, step, interpret=True, out_dtype=jnp.float32, **kw)
        assert got[0].dtype == jnp.float32 and got[1].dtype == jnp.float32
        assert_close(got, ref, out_atol=bound)
        err = np.linalg.norm(np.asarray(got[0]) - np.asarray(ref[0])) / np.linalg.norm(np.asarray(ref[0]))
        assert err < 4e-3
        out, lse = run(fn, step, interpret=True, **kw)
        assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(out), np.asarray(got[0].astype(jnp.bfloat16)))
        np.testing.assert_array_equal(np.asarray(lse), np.asarray(got[1]))
    with pytest.raises(ValueError, match="out_dtype must be q's dtype \\(bfloat16\\) or float32, got float16"):
        run(pa.decode_attention, step, interpret=True, out_dtype=jnp.float16)


def test_no_visible_key_gives_zero_weight():
    """Tokens of an empty sequence and tokens before a KVP shard's first key (prefill and decode tiles both):
    out 0, lse NEG_INF, never NaN."""
    k_cache = jnp.ones((1, 4, 4, 1, 8))
    meta = AttentionMetadata(page_table=jnp.array([[1, 3], [2, 3], [1, 3]]), kv_lens=jnp.array([0, 5, 3]),
                             kv_start=jnp.array([0, 10, 10]), seq_ids=jnp.array([0, 0, 1, 1, 2]),
                             positions=jnp.array([0, 1, 3, 9, 5]))
    out, lse = pa.paged_attention_pallas(jnp.ones((5, 2, 8)), k_cache, k_cache, 0, meta, interpret=True)
    np.testing.assert_array_equal(out, 0.0)
    np.testing.assert_array_equal(lse, np.float32(NEG_INF))


def poison_unwritten(step):
    """The step with NaN in every cache slot that holds none of a sequence's keys."""
    page = step["k_cache"].shape[2]
    written = np.zeros(step["k_cache"].shape[:3], bool)
    for b, n in enumerate(np.asarray(step["kv_lens"])):
        for i in range(n):
            written[:, step["page_table"][b, i // page], i % page] = True
    return {**step, **{name: jnp.where(written[..., None, None], step[name], jnp.nan)
                       for name in ("k_cache", "v_cache")}}


def test_unwritten_cache_slots_never_reach_the_output():
    """NaN in every cache slot that holds none of a sequence's keys (the rest of a last page, pages behind
    unused page-table columns, as uninitialised memory would be): results equal the reference on a clean
    cache. (The reference itself needs finite garbage: it multiplies weight 0 by whatever V holds.)"""
    rng = np.random.default_rng(11)
    step = make_step(rng, MIXED, num_heads=8, num_kv_heads=2, **SMALL)
    got = run(pa.paged_attention_pallas, poison_unwritten(step), interpret=True, block_q=2, block_k=8, decode_block_k=16,
              num_partitions=3, decode_partitions=3)
    assert_close(got, run(paged_attention, step, block_pages=3, precision=HIGHEST))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float32, marks=pytest.mark.slow)])
def test_compiled_kernels_lower_to_triton(dtype):
    """The non-interpreted kernels (static and persistent grids) at Llama-3-8B attention shapes lower to Triton IR
    for CUDA, alone and inside the step's shard_map on the 1x1x1 mesh (on the CPU: catches what the Triton
    lowering or shard_map's varying-axes check rejects; compiling to PTX and running need a GPU)."""
    persistent = [(functools.partial(fn, persistent=True), n) for fn, n in
                  ((pa.paged_attention_pallas, 2), (pa.prefill_attention, 1), (pa.decode_attention, 1))]
    one = dict(num_partitions=1, decode_partitions=1)  # the kernels write token order (and the model's dtype)
    direct = [(functools.partial(pa.paged_attention_pallas, **one), 2),
              (functools.partial(pa.paged_attention_pallas, persistent=True, **one), 2)]
    assert_lowers_for_cuda(dtype, ((pa.paged_attention_pallas, 2), (pa.prefill_attention, 1),
                                   (pa.decode_attention, 1), *persistent, *direct), "@__gpu$xla.gpu.triton")


# The GPU the lowering tests target. jax 0.11's Triton lowering reads the target's compute capability from the
# default device or, without a GPU, from the context's abstract mesh ("No supported GPU devices found, please
# specify an abstract GPU device"); jax 0.10 lowered without it. An abstract mesh names the device on both.
H100 = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")


def assert_lowers_for_cuda(dtype, cases, custom_call: str, *, num_heads: int = 32, page: int = 16,
                           head_dim: int = 128):
    """Each (fn, kernels) of `cases` exported for CUDA (Llama-3-8B attention shapes but `num_heads`, `page` and
    `head_dim`), alone and inside the step's shard_map on a 1x1x1 mesh of an abstract H100: its module holds
    `kernels` calls of `custom_call`."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from shardings.mesh import KVP, SPP, TP

    T, B, M = 64, 4, 256
    unchecked = [jax.export.DisabledSafetyCheck.custom_call(name)
                 for name in ("__gpu$xla.gpu.triton", "mosaic_gpu", "mosaic_gpu_v2")]
    mesh = AbstractMesh((1, 1, 1), (KVP, SPP, TP), axis_types=(AxisType.Explicit,) * 3, abstract_device=H100)
    specs = dict(q=P(KVP, None, TP, None), cache=P(SPP, KVP, None, TP, None), table=P(KVP, None, None),
                 seqs=P(KVP, None), toks=P(KVP, None))
    shapes = dict(q=((1, T, num_heads, head_dim), dtype),
                  cache=((2, 1 + B * M * 16 // page, page, 8, head_dim), dtype),
                  table=((1, B, M * 16 // page), jnp.int32), seqs=((1, B), jnp.int32), toks=((1, T), jnp.int32))
    names = ("q", "cache", "cache", "table", "seqs", "seqs", "toks", "toks")
    args = [jax.ShapeDtypeStruct(*shapes[n]) for n in names]
    sharded = [jax.ShapeDtypeStruct(*shapes[n], sharding=NamedSharding(mesh, specs[n])) for n in names]

    for fn, kernels in cases:
        def local(q, k, v, table, lens, start, seq_ids, positions, fn=fn):
            meta = AttentionMetadata(seq_ids=seq_ids[0], positions=positions[0], page_table=table[0],
                                     kv_lens=lens[0], kv_start=start[0])
            out, lse = fn(q[0], k, v, jnp.int32(1), meta)
            return out[None], lse[None]

        step = jax.shard_map(local, mesh=mesh, in_specs=tuple(specs[n] for n in names),
                             out_specs=(P(KVP, SPP, TP, None), P(KVP, SPP, TP)))
        for f, a in ((local, args), (step, sharded)):
            with jax.sharding.use_abstract_mesh(mesh):
                text = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=unchecked)(*a).mlir_module()
            assert text.count(custom_call + "(") == kernels, (fn, text.count(custom_call))


def test_switch_refuses_what_it_cannot_run():
    step = make_step(np.random.default_rng(0), [(5, 2, 0)], num_heads=2, num_kv_heads=1, **SMALL)
    with pytest.raises(ValueError, match="valid: auto, reference, pallas, pallas_interpret, mosaic, mosaic_interpret"):
        run(functools.partial(attention, "cudnn"), step, block_pages=1)
    assert ATTENTION_IMPLS == ("auto", "reference", "pallas", "pallas_interpret", "mosaic", "mosaic_interpret")
    if jax.default_backend() != "gpu":
        with pytest.raises(RuntimeError, match="attention='pallas' needs an NVIDIA GPU; use 'reference' or "
                                               "'pallas_interpret'"):
            run(functools.partial(attention, "pallas"), step, block_pages=1)
    from mnemojax.engine.llm_engine import EngineConfig
    from models.config import preset
    from models.llama import ModelSpec
    with pytest.raises(ValueError, match="unknown attention implementation 'flash'"):
        EngineConfig(attention="flash")
    with pytest.raises(ValueError, match="unknown attention implementation 'flash'"):
        ModelSpec(preset("tiny"), attention="flash")
    assert EngineConfig().attention == ModelSpec(preset("tiny")).attention == "auto"  # the one that chooses


@pytest.mark.slow  # ~29 s on 2 cores; tests/engine/test_step_kinds.py runs the engine on these kernels by default
def test_engine_with_interpreted_kernels_matches_reference():
    """LLM on the tiny preset (inside the step's shard_map on the 1x1x1 mesh): same greedy tokens, prompt
    log-probs within 1e-5, mixed decode + prefill steps."""
    from mnemojax import LLM, SamplingParams

    params = SamplingParams(max_tokens=5, temperature=0, prompt_logprobs=0, ignore_eos=True)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 37, 21)]
    outs = {}
    for impl in ("reference", "pallas_interpret"):
        llm = LLM(model="tiny", attention=impl, page_size=4, chunk_size=16, max_model_len=64,
                  max_num_batched_tokens=16, max_num_seqs=4)
        outs[impl] = llm.generate(prompts, params)
    for ref, got in zip(outs["reference"], outs["pallas_interpret"]):
        lps = [np.array([d[t] for d, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]) for o in (ref, got)]
        np.testing.assert_allclose(lps[1], lps[0], atol=1e-5, rtol=0)
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids and len(ref.outputs[0].token_ids) == 5


@contextlib.contextmanager
def _fill_in_layer_from(threshold: int):
    """`pa.FILL_IN_LAYER_BYTES` set to `threshold` inside the block, jax's caches cleared on the way in and out (the
    kernels' jitted wrappers keep what they traced with the other value)."""
    default = pa.FILL_IN_LAYER_BYTES
    try:
        pa.FILL_IN_LAYER_BYTES = threshold
        jax.clear_caches()
        yield
    finally:
        pa.FILL_IN_LAYER_BYTES = default
        jax.clear_caches()


@pytest.mark.slow  # ~31 s on 2 cores cold; test_large_blank_buffers_... checks the fill kernel by kernel
def test_engine_gives_the_same_results_with_every_buffer_filled_in_its_layer():
    """The engine's steps (inside the step's shard_map: prefill, decode and mixed kinds, several layers) with every
    token-order buffer's fill behind the barrier (FILL_IN_LAYER_BYTES 0; the tiny model's never reach the 4 MiB
    that turns it on), the kernels reading the K cache the barrier hands on: the same tokens and prompt log-probs,
    bit for bit. (Only padding rows keep a fill's values, which no result reads: the test above checks them.)"""
    from mnemojax import LLM, SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0, ignore_eos=True)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 23, 1)]
    outs = []
    for threshold in (pa.FILL_IN_LAYER_BYTES, 0):
        with _fill_in_layer_from(threshold):
            llm = LLM(model="tiny", attention="pallas_interpret", page_size=4, chunk_size=16, max_model_len=64,
                      max_num_batched_tokens=16, max_num_seqs=4)
            outs.append(llm.generate(prompts, params))
    for free, filled in zip(*outs):
        assert filled.outputs[0].token_ids == free.outputs[0].token_ids and len(free.outputs[0].token_ids) == 4
        assert filled.prompt_logprobs == free.prompt_logprobs


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


# The compiled kernels, each its own test: the switch, each kernel alone, and one partition (token order).
COMPILED = {"switch": pa.paged_attention_pallas, "prefill": pa.prefill_attention, "decode": pa.decode_attention,
            "one-partition": functools.partial(pa.paged_attention_pallas, num_partitions=1, decode_partitions=1)}


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("persistent", [False, True], ids=["static", "persistent"])
@pytest.mark.parametrize("kernel", sorted(COMPILED))
def test_compiled_kernels_on_gpu_match_float32_reference(kernel, persistent):
    """The compiled kernels (static and persistent grids; split-K and one partition writing token order) at
    Llama-3-8B attention shapes (32 q heads, 8 kv heads, head dim 128, page 16) on random bf16 inputs: a long
    prefill chunk, short chunks, decodes, an empty KVP shard, padding rows."""
    gpu = jax.devices("gpu")[0]
    rng = np.random.default_rng(0)
    seqs = [(5000, 512, 0), (2100, 32, 0), (777, 7, 0), (4096, 1, 0), (1, 1, 0), (0, 3, 0), (900, 17, 3000)]
    with jax.default_device(gpu):
        step = make_step(rng, seqs, num_heads=32, num_kv_heads=8, head_dim=128, page=16, dtype=jnp.bfloat16,
                         pad_rows=3)
        fn = COMPILED[kernel]
        check_compiled(step, (functools.partial(fn, persistent=True) if persistent else fn,))


def check_compiled(step, fns):
    """Compiled kernels `fns` on a bf16 step against the float32 reference: finite, relative error of out < 1e-2,
    lse within 1e-3."""
    ref_out, ref_lse = (np.asarray(x) for x in run(paged_attention, f32(step), block_pages=8, precision=HIGHEST))
    for fn in fns:
        out, lse = (np.asarray(x, np.float32) for x in run(fn, step))  # the kernels write out in bf16
        assert np.isfinite(out).all() and np.isfinite(lse).all()
        assert np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out) < 1e-2
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-3, atol=1e-3)


@pytest.fixture(scope="module")
def parallel_reference(tmp_path_factory):
    """tests/engine/test_parallel.py's checkpoint and its workload's results with the reference on one device."""
    from tests.hf_utils import make_hf_checkpoint
    from tests.engine.test_parallel import MODEL, run_workload

    ckpt = make_hf_checkpoint(tmp_path_factory.mktemp("par") / "m", weight_scale=8.0, seed=4, **MODEL)
    return ckpt, run_workload(ckpt)[0]


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(2, 1, 1), (2, 2, 2)], ids=str)
def test_engine_meshes_with_interpreted_kernels_match_one_device(parallel_reference, shape):
    """tests/engine/test_parallel.py's workload (a long request split over KVP ranks, short ones arriving later) with
    the interpreted kernels on a (kvp, spp, tp) mesh: the same tokens and log-probs (1e-5) as the reference on
    one device; the kernels' (out, lse) are merged over the KVP ranks."""
    from tests.engine.test_parallel import _check_same, run_workload

    ckpt, reference = parallel_reference
    outs, _ = run_workload(ckpt, *shape, attention="pallas_interpret")
    _check_same(outs, reference)


def equations(jaxpr, opaque=("pallas_call",)):
    """Every equation of `jaxpr` and of the jaxprs nested in its equations (jit, shard_map, ...), not inside an
    equation whose primitive is in `opaque` (a kernel's own body)."""
    for e in jaxpr.eqns:
        yield e
        if str(e.primitive) in opaque:
            continue
        for v in e.params.values():
            for sub in (v if isinstance(v, (list, tuple)) else [v]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from equations(inner, opaque)


def _primitives(jaxpr) -> list[str]:
    """The primitives of `jaxpr` and of the jaxprs nested in its equations, not inside a pallas_call (its kernel)."""
    return [str(e.primitive) for e in equations(jaxpr)]


@pytest.mark.parametrize("kind,want", [("mixed", 2), ("decode", 1), ("prefill", 1)])
def test_step_kind_launches_only_the_kernels_it_needs(kind, want):
    """A decode-only step launches the decode kernel alone, a prefill-only step the prefill kernel alone (issue
    12, item 2): counted as pallas_call equations of the traced attention; the results on a step that holds only
    that kind are the mixed path's, bit for bit."""
    rng = np.random.default_rng(11)
    seqs = {"decode": [(9, 1, 0), (30, 1, 0), (4, 1, 0)], "prefill": [(23, 7, 0), (12, 12, 0)],
            "mixed": MIXED}[kind]
    step = make_step(rng, seqs, num_heads=4, num_kv_heads=2, pad_rows=3, **SMALL)
    fn = functools.partial(attention, "pallas_interpret", block_pages=2, precision=HIGHEST, kind=kind)
    names = _primitives(jax.make_jaxpr(lambda s: run(fn, s))(step).jaxpr)
    assert names.count("pallas_call") == want, names
    got, ref = run(fn, step), run(functools.partial(attention, "pallas_interpret", block_pages=2,
                                                    precision=HIGHEST), step)
    real = np.asarray(step["seq_ids"]) < len(seqs)  # the padding rows' sequence gets attention only when mixed
    for g, r in zip(got, ref):
        np.testing.assert_array_equal(np.asarray(g)[real], np.asarray(r)[real])
    with pytest.raises(ValueError, match="kind"):
        attention("pallas_interpret", *[step[k] for k in ("q", "k_cache", "v_cache", "layer")],
                  AttentionMetadata(**{k: v for k, v in step.items() if k not in ("q", "k_cache", "v_cache",
                                                                                   "layer")}),
                  block_pages=2, kind="both")


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_large_blank_buffers_are_filled_in_their_layer_with_the_same_values(kind):
    """A one-kind step's token-order buffers start at (0, NEG_INF); from FILL_IN_LAYER_BYTES (here 0: every
    size) their fill passes an optimization barrier with the layer's K cache (written by the layer), so XLA can
    neither hoist every layer's fill to the step's start nor merge them (a GPU compile that did kept all 32
    layers' buffers alive: `scripts/aot_step.py`). Same results, bit for bit, the padding rows' (0, NEG_INF)
    included; the Mosaic path takes the same buffers."""
    rng = np.random.default_rng(5)
    seqs = {"decode": [(9, 1, 0), (30, 1, 0)], "prefill": [(23, 7, 0), (12, 12, 0)]}[kind]
    step = make_step(rng, seqs, num_heads=4, num_kv_heads=2, pad_rows=3, **SMALL)

    wide = make_step(rng, seqs, num_heads=4, num_kv_heads=2, head_dim=64, page=16, dtype=jnp.bfloat16, pad_rows=3)

    def traced(impl):  # Mosaic's kernels take 16-bit dtypes and head dims from 64
        fn = functools.partial(attention, impl, block_pages=2, kind=kind)
        s = wide if impl.startswith("mosaic") else step
        return _primitives(jax.make_jaxpr(lambda s: run(fn, s))(s).jaxpr).count("optimization_barrier")

    fn = functools.partial(attention, "pallas_interpret", block_pages=2, precision=HIGHEST, kind=kind)
    free = run(fn, step)
    assert traced("pallas_interpret") == 0
    with _fill_in_layer_from(0):
        assert traced("pallas_interpret") == 1 and traced("mosaic_interpret") == 1
        after = run(fn, step)
    pad = np.asarray(step["seq_ids"]) == len(seqs)
    for a, b in zip(after, free):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert pad.sum() == 3 and (np.asarray(after[0])[pad] == 0).all() and (np.asarray(after[1])[pad] == NEG_INF).all()


@pytest.mark.parametrize("partitions", [(1, 1), (1, 3), (3, 1)], ids=["direct", "prefill-direct", "decode-direct"])
def test_one_partition_writes_token_order_directly(partitions):
    """With one KV partition a kernel normalises and writes its rows straight into the token-order outputs
    (no merge or scatter after it); a mixed step's second kernel writes into the first's buffers. Shuffled rows
    (tokens of a sequence not adjacent), padding rows, two kv heads of G = 4, NaN in unwritten cache slots,
    either part direct and the other merged: every token's rows in their place, as the reference has them."""
    rng = np.random.default_rng(23)
    step = make_step(rng, MIXED, num_heads=8, num_kv_heads=2, pad_rows=3, shuffle=True, **SMALL)
    prefill, decode = partitions
    got = run(pa.paged_attention_pallas, poison_unwritten(step), interpret=True, block_q=2, block_k=8,
              decode_block_k=16, num_partitions=prefill, decode_partitions=decode)
    assert got[0].dtype == jnp.float32 and got[0].shape == step["q"].shape
    assert_close(got, run(paged_attention, step, block_pages=3, precision=HIGHEST))


def _pallas_grids(fn, step, **kw) -> list[tuple]:
    """The grids of the pallas_calls `fn(**kw)` traces on `step`."""
    jaxpr = jax.make_jaxpr(lambda s: run(fn, s, **kw))(step).jaxpr
    grids = []

    def walk(jx):
        for e in jx.eqns:
            if str(e.primitive) == "pallas_call":
                grids.append(tuple(e.params["grid_mapping"].grid))
                continue
            for v in e.params.values():
                for sub in (v if isinstance(v, (list, tuple)) else [v]):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)
    walk(jaxpr)
    return grids


@pytest.mark.parametrize("partitions,programs", [((1, 1), 3), ((3, 4), 3), ((3, 4), None)],
                         ids=["direct-3-programs", "split-K-3-programs", "split-K-default-grid"])
def test_persistent_grid_matches_reference(partitions, programs):
    """`persistent=True`: (programs, kv heads) programs loop over the step's work items (tiles with keys to read,
    cut into partitions by their keys). Shuffled rows, padding rows, an empty sequence, G = 4, NaN in unwritten
    cache slots; with 3 programs each loops over several items. A split-K launch's partial outputs start as NaN
    in Pallas' interpreter (what uninitialised GPU memory may hold), so a slot of a partition no item wrote
    reaches the output unless the merge drops it. With one partition the items do the static grid's arithmetic:
    the same bits."""
    rng = np.random.default_rng(29)
    step = make_step(rng, MIXED, num_heads=8, num_kv_heads=2, pad_rows=3, shuffle=True, **SMALL)
    ref = run(paged_attention, step, block_pages=3, precision=HIGHEST)
    prefill, decode = partitions
    poisoned = poison_unwritten(step)
    for fn, kw in ((pa.paged_attention_pallas, dict(block_q=2, block_k=8, decode_block_k=16, num_partitions=prefill,
                                                    decode_partitions=decode)),
                   (pa.prefill_attention, dict(block_q=2, block_k=8, num_partitions=prefill)),
                   (pa.decode_attention, dict(block_k=16, num_partitions=decode))):
        got = run(fn, poisoned, interpret=True, persistent=True, programs=programs, **kw)
        assert_close(got, ref)
        if partitions == (1, 1):
            static = run(fn, poisoned, interpret=True, **kw)
            for g, s in zip(got, static):
                np.testing.assert_array_equal(np.asarray(g), np.asarray(s))
    T, B = step["q"].shape[0], step["kv_lens"].shape[0]  # 29 rows (26 + 3 padding), 9 sequences
    nt_prefill, nt_decode = T // 2 + min(B, T // 2), min(T, B)  # the static bounds on each kind's tiles
    grids = _pallas_grids(pa.paged_attention_pallas, step, interpret=True, block_q=2, block_k=8, decode_block_k=16,
                          num_partitions=prefill, decode_partitions=decode, persistent=True, programs=programs)
    want = [(nt_decode * decode, 2), (nt_prefill * prefill, 2)]  # the work list's bound, when programs is None
    assert grids == [(min(n, programs or n), k) for n, k in want]


def test_work_items_cut_tiles_by_the_keys_they_read():
    """`_work_items`, by hand: tiles reading 0, 64, 640 and 8 keys in blocks of 64 with 2 kv heads and up to 4
    partitions: per item max(1, ceil(12 blocks x 2 / 1024)) = 1 block, so (0, 1, 4, 1) partitions (the third
    capped at 4), items (tile, partition) in order; with one partition, one item per tile that reads a key; with
    4,000 blocks over 8 kv heads, ceil(32,000 / 1024) = 32 blocks per item."""
    parts, count, tile, part = pa._work_items(jnp.array([0, 64, 640, 8], jnp.int32), 2, 4, 64)
    assert parts.tolist() == [0, 1, 4, 1] and count.tolist() == [6]
    assert tile.tolist()[:6] == [1, 2, 2, 2, 2, 3] and part.tolist()[:6] == [0, 0, 1, 2, 3, 0]
    assert tile.shape == part.shape == (16,)
    parts, count, tile, part = pa._work_items(jnp.array([0, 64, 640, 8], jnp.int32), 2, 1, 64)
    assert parts.tolist() == [0, 1, 1, 1] and count.tolist() == [3]
    assert tile.tolist()[:3] == [1, 2, 3] and part.tolist()[:3] == [0, 0, 0]
    parts, count, _, _ = pa._work_items(jnp.array([64 * 1000, 64 * 3000], jnp.int32), 8, 64, 64)
    assert parts.tolist() == [32, 64] and count.tolist() == [96]  # ceil(1000 / 32) = 32; ceil(3000 / 32) capped


def test_programs_needs_the_persistent_grid():
    step = make_step(np.random.default_rng(1), [(9, 3, 0)], num_heads=2, num_kv_heads=1, **SMALL)
    with pytest.raises(ValueError, match="programs .* needs persistent=True and >= 1, got 4"):
        run(pa.prefill_attention, step, interpret=True, programs=4)
    with pytest.raises(ValueError, match="programs .* needs persistent=True and >= 1, got 0"):
        run(pa.decode_attention, step, interpret=True, persistent=True, programs=0)


def _step_primitives(impl: str, num_layers: int, dtype: str) -> collections.Counter:
    """The primitives (outside kernels) of the model's step traced on the 1x1x1 mesh: a tiny model of
    `num_layers` layers (head dim 64, which the Mosaic kernels support), 12 rows of 3 sequences, a mixed step."""
    from jax.sharding import NamedSharding

    from models.config import preset
    from models.llama import ModelSpec, StepBatch, forward
    from models.params import init_params, split_layers
    from shardings.mesh import make_mesh
    from shardings.specs import ShardingTable

    c = dataclasses.replace(preset("tiny"), num_layers=num_layers, head_dim=64)
    mesh, table = make_mesh(1, 1, 1), ShardingTable()
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    params = split_layers(init_params(c, dtype=jnp.dtype(dtype), shardings=jax.tree.map(
        lambda s: NamedSharding(mesh, s), table.params(c.tie_word_embeddings))), 1)
    T, B, M, S = 12, 3, 4, 16
    cache = jax.ShapeDtypeStruct((num_layers, 1 + B * M, S, c.num_kv_heads, c.head_dim), jnp.dtype(dtype),
                                 sharding=NamedSharding(mesh, table.kv_lpskh))
    z = lambda *shape: jnp.zeros((1, 1, *shape), jnp.int32)  # noqa: E731
    batch = StepBatch(token_ids=z(T), write_pages=z(T), write_slots=z(T), shared=jnp.zeros((1, 1, T), bool),
                      attn=AttentionMetadata(seq_ids=z(T), positions=z(T), page_table=z(B, M), kv_lens=z(B),
                                             kv_start=z(B)))
    spec = ModelSpec(c, dtype, 8, impl)

    def step(params, k, v, register, batch, rows):
        logits, k, v, _ = forward(spec, params, k, v, register[0, 0], jax.tree.map(lambda a: a[0, 0], batch),
                                  rows[0], "mixed")
        return logits[None], k, v

    f = jax.jit(jax.shard_map(step, mesh=mesh, out_specs=(table.rows_kr, table.kv_lpskh, table.kv_lpskh),
                              in_specs=(jax.tree.map(lambda a: a.sharding.spec, params), table.kv_lpskh,
                                        table.kv_lpskh, table.register_kstd, StepBatch.partition_specs(table),
                                        table.rows_kr)))
    jaxpr = jax.make_jaxpr(f)(params, cache, cache, put(jnp.zeros((1, 1, T, c.hidden_size), dtype),
                                                        table.register_kstd),
                              jax.tree.map(put, batch, StepBatch.partition_specs(table)),
                              put(jnp.zeros((1, 1), jnp.int32), table.rows_kr))
    return collections.Counter(_primitives(jaxpr.jaxpr))


@pytest.mark.parametrize("impl,dtype", [("pallas_interpret", "float32"), ("mosaic_interpret", "bfloat16")])
def test_the_step_plans_the_kernels_tiles_once_for_all_layers(impl, dtype):
    """Issue 12 item 2 / issue 15 item 2, metadata once per step: the model's step traced with 1 and 3 layers
    holds the tiling's sort, cumsums and scatter-adds once (the model plans the tiles before its layer loop and
    every layer's attention reads them, as the kernels take them), whatever XLA would or would not merge; the launches
    are per layer."""
    one, three = _step_primitives(impl, 1, dtype), _step_primitives(impl, 3, dtype)
    for name in ("sort", "cumsum", "scatter-add"):
        assert one[name] == three[name] >= 1, (name, one[name], three[name])
    # No per-layer gathering of the plan's per-tile arrays (the Mosaic launches once stacked them with the layer).
    assert one["stack"] == three["stack"], (one["stack"], three["stack"])
    if impl == "pallas_interpret":
        assert (one["pallas_call"], three["pallas_call"]) == (2, 6)


@pytest.mark.slow  # ~19 s (the default suite's ten minutes, forty-seventh session)
def test_a_plan_gives_the_same_bits_and_owns_its_options():
    """attention(..., plan=plan_attention(...)) equals attention(...) bit for bit (mixed and decode-only steps,
    the persistent grid too); tiling options or another kind beside a plan, or a plan for the reference, raise;
    the reference plans nothing and a model spec gives it no kernel options."""
    from models.attention import plan_attention

    rng = np.random.default_rng(31)
    step = make_step(rng, MIXED, num_heads=8, num_kv_heads=2, pad_rows=3, shuffle=True, **SMALL)
    args = [step[k] for k in ("q", "k_cache", "v_cache", "layer")]
    meta = AttentionMetadata(**{k: v for k, v in step.items() if k not in ("q", "k_cache", "v_cache", "layer")})
    dims = dict(num_heads=8, num_kv_heads=2, head_dim=SMALL["head_dim"], page_size=SMALL["page"])
    for kind, opts in (("mixed", dict(block_q=2, block_k=8, num_partitions=3)), ("decode", {}),
                       ("mixed", dict(persistent=True, programs=3))):
        plan = plan_attention("pallas_interpret", meta, kind=kind, **dims, **opts)
        got = attention("pallas_interpret", *args, meta, block_pages=2, precision=HIGHEST, kind=kind, plan=plan)
        want = attention("pallas_interpret", *args, meta, block_pages=2, precision=HIGHEST, kind=kind, **opts)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    plan = plan_attention("pallas_interpret", meta, **dims)
    with pytest.raises(ValueError, match="tiles were planned with their own options .* got block_k"):
        attention("pallas_interpret", *args, meta, block_pages=2, plan=plan, block_k=16)
    with pytest.raises(ValueError, match="kind 'decode' differs from the plan's \\('mixed'\\)"):
        attention("pallas_interpret", *args, meta, block_pages=2, plan=plan, kind="decode")
    with pytest.raises(ValueError, match="the reference attention takes no plan"):
        attention("reference", *args, meta, block_pages=2, plan=plan)
    assert plan_attention("reference", meta, **dims) is None
    with pytest.raises(TypeError, match="the reference attention takes no kernel options"):
        plan_attention("reference", meta, block_k=16, **dims)
    from models.config import preset
    from models.llama import ModelSpec
    with pytest.raises(ValueError, match="attention_options: the reference attention takes none"):
        ModelSpec(preset("tiny"), attention="reference", attention_options=(("persistent", True),))
