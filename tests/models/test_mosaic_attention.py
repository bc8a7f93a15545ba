"""The Mosaic GPU attention kernels (`models.mosaic_attention`) against the float32 reference.

On the CPU the kernels run in jax's Mosaic GPU interpreter (the same kernel code a Hopper GPU compiles, with SMEM,
barriers, TMA copies, wgmma and the producer / consumer warpgroups simulated). The interpreter costs seconds per
grid program (it traces each program's threads anew), so the cases here are tiny: one or two kv heads, head dim
64, a handful of tiles; they still cover several tiles per sequence, key blocks before and at the causal edge,
partial pages and blocks, empty partitions, KVP shards, GQA groups of 1 to 8 and pages smaller and larger than a
key block. Inputs are fresh random bf16 values; the reference runs on the same values in float32, so scores and
lse agree to float32 rounding and out to the bf16 rounding of P (2^-9 max|v|; asserted 2^-8).
The GPU test (compiled kernels at Llama-3 shapes) skips without a Hopper GPU.
"""
import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import mosaic_attention as ma
from models.attention import AttentionMetadata, attention, on_hopper_gpu, paged_attention
from models.kernels import NEG_INF
from tests.models.test_pallas_attention import (assert_close, assert_lowers_for_cuda, check_compiled, dense,
                                                equations, f32, make_step, poison_unwritten, run)

HIGHEST = jax.lax.Precision.HIGHEST


def tolerance(step):
    """out: within 2^-8 max|v| (P rounded to the input dtype for P V, as before) plus one rounding of out itself to
    q's dtype, where the kernels now store it (relative: 2^-8 for bf16, 2^-11 for f16, the unit roundoff)."""
    out_rtol = 2.0 ** -8 if step["q"].dtype == jnp.bfloat16 else 2.0 ** -11
    return dict(out_atol=2.0 ** -8 * float(jnp.abs(step["v_cache"].astype(jnp.float32)).max()), out_rtol=out_rtol)


def check(fn, step, *, other_kind=None, **kw):
    """`fn` interpreted on a 16-bit step against the float32 reference and dense softmax on the same values: out
    in q's dtype, lse float32. `other_kind`: bool[T], tokens the step's kind leaves out (exactly 0, NEG_INF)."""
    got = run(fn, step, interpret=True, **kw)
    assert got[0].dtype == step["q"].dtype and got[1].dtype == jnp.float32
    assert got[0].shape == step["q"].shape and got[1].shape == step["q"].shape[:2]
    refs = [run(paged_attention, f32(step), block_pages=2, precision=HIGHEST), dense(step)]
    if other_kind is not None:
        refs = [(np.where(other_kind[:, None, None], 0.0, np.asarray(o)),
                 np.where(other_kind[:, None], np.float32(NEG_INF), np.asarray(l))) for o, l in refs]
    for ref in refs:
        assert_close(got, ref, **tolerance(step))
    ref_out = np.asarray(refs[0][0])
    err = np.linalg.norm(np.asarray(got[0], np.float32) - ref_out) / max(np.linalg.norm(ref_out), 1e-30)
    assert err < 4e-3


def planned_tiles(step, *, interpret: bool = True, **options):
    """The step's launches as `plan_step` plans them with `options` (heads, head dim and page size from the step),
    for the interpreter, which `check` runs, unless `interpret=False` (what a GPU runs: three consumers at head dim
    64 where compute-bound)."""
    q, k = step["q"], step["k_cache"]
    meta = AttentionMetadata(**{f: step[f] for f in ("seq_ids", "positions", "page_table", "kv_lens", "kv_start")})
    return ma.plan_step(meta, num_heads=q.shape[1], num_kv_heads=k.shape[3], head_dim=q.shape[2],
                        page_size=k.shape[2], interpret=interpret, **options)


def planned_parts(step, launch: str, **options) -> np.ndarray:
    """The partitions of each program's tile in the plan of the step's `launch` ("decode" or "prefill"; `plan_step` with
    `options`, `planned_tiles`; 0 for a program past the step's work items): what a test says it covers (a split tile
    or not)."""
    tiles = planned_tiles(step, **options)
    return np.asarray((tiles.decode if launch == "decode" else tiles.prefill).work[2])


# (heads, kv heads, page, partitions, sequences (keys after the step, query tokens, kv_start)). Head dim 64, so
# prefill blocks of 128 keys by default (`prefill_block_k`), but where a case says 64.
PREFILL = {
    # G=4 (16-token tiles): a 21-token chunk mid-prompt (two tiles, the first sees 16 keys unmasked), a first
    # chunk, a KVP shard's view; page 16, one partition (the in-kernel normalisation). Rows shuffled.
    "g4-page16-np1": (4, 1, 16, 1, [(37, 21, 0), (5, 5, 0), (29, 6, 37)]),
    # G=2 (64-token tiles): a 33-token chunk at 270 keys (three 128-key blocks, the causal edge inside the last),
    # pages of 8 (16 TMA copies a block), its one tile split over two partitions merged after the kernel.
    "g2-page8-np2": (2, 1, 8, 2, [(270, 33, 0)]),
    # Two kv heads of G=4, pages of 128 and 64-key blocks (a block is a slice of a page), a 3-token chunk at 150
    # keys, split over 2 partitions.
    "g4-k2-page128-np2": (8, 2, 128, 2, [(150, 3, 0)]),
}


# The interpreter takes seconds per grid program: one case in the default suite, the others with the slow tests.
@pytest.mark.parametrize("case", [c if i == 0 else pytest.param(c, marks=pytest.mark.slow)
                                  for i, c in enumerate(PREFILL)], ids=str)
def test_prefill_kernel_matches_reference(case):
    num_heads, num_kv_heads, page, parts, seqs = PREFILL[case]
    rng = np.random.default_rng(len(case))
    step = make_step(rng, seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64, page=page,
                     dtype=jnp.bfloat16, shuffle=True)
    block_k = 64 if page > 64 else None
    assert planned_parts(step, "prefill", kind="prefill", num_partitions=parts, block_k=block_k).max() == parts
    check(ma.prefill_attention, step, num_partitions=parts, block_k=block_k)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["g4-page16-np1", "g2-page8-np2"])
def test_prefill_kernel_with_one_consumer_matches_reference(case):
    """Prefill programs of one consumer warpgroup (64 rows: tiles of 64 // G tokens), the kernels' layout before
    two consumers shared each K/V load, kept as an option (`consumers=1`)."""
    num_heads, num_kv_heads, page, parts, seqs = PREFILL[case]
    rng = np.random.default_rng(len(case) + 1)
    step = make_step(rng, seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64, page=page,
                     dtype=jnp.bfloat16, shuffle=True)
    check(ma.prefill_attention, step, num_partitions=parts, consumers=1)


@pytest.mark.slow
def test_key_blocks_of_128_match_reference():
    """`block_k=128` / `decode_block_k=128` (an option to tune on a GPU): a 33-token chunk at 300 keys over pages of
    16 (8 TMA copies a block; the last block partial), each of its two tiles split in two, beside a decode at 200
    keys split in two."""
    rng = np.random.default_rng(12)
    step = make_step(rng, [(300, 33, 0), (200, 1, 0)], num_heads=4, num_kv_heads=1, head_dim=64, page=16,
                     dtype=jnp.bfloat16, shuffle=True, max_pages=32)
    plan = dict(num_partitions=4, block_k=128, decode_block_k=128)
    assert list(planned_parts(step, "prefill", **plan)) == [2, 2, 2, 2]
    assert list(planned_parts(step, "decode", **plan)) == [2, 2, 0, 0]  # its 2 blocks: no more, of 4 allowed
    check(ma.paged_attention_mosaic, step, **plan)


@pytest.mark.slow  # ~35 s at pages of 16 in the interpreter; an option that stays off (slower on the H100)
@pytest.mark.parametrize("page", [16, 64])
def test_key_blocks_of_192_match_reference(page):
    """`block_k=192` (FlashAttention-3's key block at head dim 64 without a causal mask; an option to time on a GPU):
    a 30-token chunk at 500 keys (one tile: a 192-key block all its rows see, another, then the causal edge inside
    the third, whose last 76 slots lie past the sequence's end) split in two partitions (two blocks and one), beside
    a decode at 400 keys in 192-key blocks split the same way, over pages of 16 (12 TMA copies a block) or 64 (3)."""
    rng = np.random.default_rng(19)
    step = make_step(rng, [(500, 30, 0), (400, 1, 0)], num_heads=4, num_kv_heads=1, head_dim=64, page=page,
                     dtype=jnp.bfloat16, shuffle=True, max_pages=-(-576 // page))
    plan = dict(num_partitions=2, decode_partitions=2, block_k=192, decode_block_k=192)
    assert list(planned_parts(step, "prefill", **plan)) == [2, 2]
    assert list(planned_parts(step, "decode", **plan)) == [2, 2]
    check(ma.paged_attention_mosaic, step, **plan)


@pytest.mark.slow
def test_pages_of_a_key_block_match_reference():
    """Pages of 128 keys with the default 128-key blocks (one TMA copy a block, the whole page: what a long request may
    ask for, `--page_size 128`, measured 8.5-10.5% faster in prefill on an H100): a 21-token chunk at 300 keys (one
    tile; its third block partial and holding the causal edge) split in two partitions (two blocks and one), beside
    a decode at 200 keys in 64-key blocks (the decode default: half a page each, a slice of it) split the same way."""
    rng = np.random.default_rng(128)
    step = make_step(rng, [(300, 21, 0), (200, 1, 0)], num_heads=4, num_kv_heads=1, head_dim=64, page=128,
                     dtype=jnp.bfloat16, shuffle=True)
    tiles = planned_tiles(step)
    assert (tiles.prefill.block_k, tiles.decode.block_k) == (128, 64)  # a prefill block is one page
    plan = dict(num_partitions=2, decode_partitions=2)
    assert list(planned_parts(step, "prefill", **plan)) == [2, 2]
    assert list(planned_parts(step, "decode", **plan)) == [2, 2]
    check(ma.paged_attention_mosaic, step, **plan)


@pytest.mark.slow  # ~13 s in the interpreter (the prefill case and the CUDA lowering stay in the default suite)
def test_decode_kernel_split_k_matches_reference():
    """Decode tiles (one token, its 8 heads as rows), up to 7 partitions a tile: 300 keys (five blocks) in four
    partitions (2, 2, 1 and 0 blocks: the last is empty), an empty KVP shard (no visible key: out 0, lse NEG_INF)
    and a shard's view from position 100 (one block) in one each, written by the kernel."""
    rng = np.random.default_rng(5)
    step = make_step(rng, [(300, 1, 0), (0, 1, 0), (13, 1, 100)], num_heads=8, num_kv_heads=1, head_dim=64,
                     page=16, dtype=jnp.bfloat16, max_pages=30)
    # 7 - 3 spare partitions shared by the blocks (5, 0, 1): floor(4 x 5 / 6) = 3 more for the first
    assert list(planned_parts(step, "decode", kind="decode", decode_partitions=7)) == [4, 4, 4, 4, 1, 1, 0]
    check(ma.decode_attention, step, num_partitions=7)


@pytest.mark.slow  # ~20 s in the interpreter (the prefill race-detector case stays in the default suite)
def test_overlap_over_split_tiles_matches_reference():
    """`overlap` (each block's softmax under the previous block's P V, FlashAttention-3's order) in a mixed step
    through the switch, the prefill consumers taking turns on the ring: a decode at 300 keys in four partitions of
    five (2, 2, 1 and 0 blocks: a partition of one block takes its softmax before the loop and its P V after, no
    turn; an empty one takes none), an empty KVP shard, and a 33-token chunk at 270 keys in three tiles
    split over six partitions (the causal edge inside a partition's last block, masked blocks before it), against the
    reference."""
    rng = np.random.default_rng(21)
    step = make_step(rng, [(300, 1, 0), (0, 1, 0), (270, 33, 0)], num_heads=8, num_kv_heads=1, head_dim=64,
                     page=16, dtype=jnp.bfloat16, max_pages=30, shuffle=True)
    assert 4 in planned_parts(step, "decode", decode_partitions=5, num_partitions=6, block_k=64)
    assert 2 in planned_parts(step, "prefill", decode_partitions=5, num_partitions=6, block_k=64)
    check(ma.paged_attention_mosaic, step, overlap=True, pingpong=True, decode_partitions=5, num_partitions=6,
          block_k=64)


def test_overlap_refuses_what_orders_the_loop_otherwise():
    """`overlap` orders a consumer's loop its own way (FlashAttention-3's): asking for it with `wait_k_in_pv` or
    `fenced_softmax` raises, naming them; with ping-pong (the consumers' turns on the ring) and `release_k` (K's
    slot freed after Q K^T) it combines, and left to the kernel takes both (turns only where the launch would
    take them: compiled, compute-bound or with 3 slots or more; never in a one-consumer decode)."""
    for clash in ("wait_k_in_pv", "fenced_softmax"):
        with pytest.raises(ValueError, match=f"does not combine with {clash}"):
            ma.Codegen(overlap=True, **{clash: True}).check(interpret=False)
    ma.Codegen(overlap=True, pingpong=True, release_k=True).check(interpret=False)

    def launch(codegen=ma.Codegen(overlap=True), **kw):
        c = codegen.for_launch(**dict(dict(interpret=False, consumers=2, num_parts=1, head_dim=128, block_k=128), **kw))
        return c.registers, c.pingpong, c.release_k, c.overlap

    assert launch() == (True, True, True, True)
    assert launch(consumers=1, num_parts=16, block_k=64) == (True, False, True, True)  # a decode: no turns
    assert launch(interpret=True) == (False, False, True, True)
    assert launch(ma.Codegen(overlap=True, release_k=False, pingpong=False)) == (True, False, False, True)
    assert not launch(ma.Codegen())[2]  # without overlap K's slot is freed with V's, as measured faster


@pytest.mark.slow  # ~25 s each in the interpreter (the ring with one partition stays in the default suite)
@pytest.mark.parametrize("options", [pytest.param({}, id="ring"), pytest.param(dict(overlap=True), id="overlap")])
def test_three_consumers_take_turns_over_split_tiles(options, race_detection):
    """Three consumers on the ring of barriers in partitions of two blocks, one and none: a 20-token chunk at 300
    keys (five 64-key blocks) in four partitions (2, 2, 1 and 0 blocks: the empty one's consumers pass the token
    0 -> 1 -> 2 and wait for nothing else; under `overlap` a partition of one block takes no turn, and the
    token starts only where there are two blocks or more), against the reference, with the race detector on."""
    rng = np.random.default_rng(33)
    step = make_step(rng, [(300, 20, 0)], num_heads=4, num_kv_heads=1, head_dim=64, page=16, dtype=jnp.bfloat16)
    assert list(planned_parts(step, "prefill", num_partitions=4, consumers=3, block_k=64)) == [4, 4, 4, 4]
    check(functools.partial(ma.prefill_attention, block_k=64), step, num_partitions=4, consumers=3, pingpong=True,
          **options)
    assert not race_detection()


def test_work_items_share_the_programs_by_the_keys_the_step_holds():
    """`_work_items`, by hand: a tile that holds tokens gets one partition or more, spare partitions (the most a
    tile may take, less the tiles that hold tokens) go by key blocks, never more partitions than blocks; past the
    items, programs get tile nt (nothing to do). (tile, partition, partitions of the tile) per program, and the first
    item of each split tile in order (W past the last): the merge kernel's programs."""
    def items(has_tokens, kv_hi, num_parts, block_k=64):
        return np.asarray(ma._work_items(jnp.asarray(has_tokens), jnp.asarray(kv_hi, jnp.int32), block_k, num_parts))

    # one chunk's tile among 3 static tile slots (the engine's many sequence slots), 16 partitions allowed:
    # 100 blocks, so all 16
    got = items([True, False, False], [6400, 0, 0], 16)
    np.testing.assert_array_equal(got, [[0] * 16, list(range(16)), [16] * 16, [0] + [16] * 15])
    # two tiles of 30 and 10 blocks and a tile with tokens but no key (one partition: it writes out 0, lse
    # NEG_INF): 16 - 3 = 13 spare, floor(13 x 30 / 40) = 9 and floor(13 x 10 / 40) = 3 more; an empty slot; 15 of
    # the 16 programs have an item
    got = items([True, True, True, False], [1920, 640, 0, 0], 16)
    np.testing.assert_array_equal(got, [[0] * 10 + [1] * 4 + [2, 4],
                                        list(range(10)) + list(range(4)) + [0, 0],
                                        [10] * 10 + [4] * 4 + [1, 0],
                                        [0, 10] + [16] * 14])  # the split tiles' first items
    # as many tiles with tokens as partitions allowed: one each, and the static slots past them do nothing
    got = items([True] * 4 + [False] * 2, [64 * 9] * 4 + [0, 0], 4)
    np.testing.assert_array_equal(got, [[0, 1, 2, 3, 6, 6], [0] * 6, [1, 1, 1, 1, 0, 0], [6] * 6])  # none split
    # a 3-block tile alone never gets more than its 3 partitions; tiles holding tokens need not be the first
    got = items([False, True], [0, 150], 8)
    np.testing.assert_array_equal(got, [[1, 1, 1, 2, 2, 2, 2, 2], [0, 1, 2, 0, 0, 0, 0, 0], [3, 3, 3] + [0] * 5,
                                        [0] + [8] * 7])


def test_query_order_by_hand():
    """`_query_order`: the launch's tokens in tile and slot order, each tile from a multiple of 8 rows (2 entries
    at G = 4, one at G = 8); T = 8 marks the gaps and the end; a tile without a token starts at 0."""
    T = 8
    tiles = jnp.asarray([[5, 6, 7, T], [0, 1, T, T], [T, T, T, T], [3, T, T, T]], jnp.int32)
    q_tok, q_start = ma._query_order(tiles, T, 4)
    # 3 tokens take 4 entries, 2 take 2, none 0, 1 takes 2; at most min(4 x 4, 8 + 1 x 4) = 12 entries
    np.testing.assert_array_equal(q_tok, [5, 6, 7, T, 0, 1, 3, T, T, T, T, T])
    np.testing.assert_array_equal(q_start, [0, 4, 0, 6])
    q_tok, q_start = ma._query_order(tiles, T, 8)  # a token is 8 rows: no gaps; min(16, 8) entries
    np.testing.assert_array_equal(q_tok, [5, 6, 7, 0, 1, 3, T, T])
    np.testing.assert_array_equal(q_start, [0, 3, 0, 5])
    decode = jnp.asarray([[2], [T], [0], [1]], jnp.int32)  # decode tiles at G = 2: 4 entries (8 rows) a token
    q_tok, q_start = ma._query_order(decode, T, 2)
    np.testing.assert_array_equal(q_tok, [2, T, T, T, 0, T, T, T, 1, T, T, T, T, T, T, T])
    np.testing.assert_array_equal(q_start, [0, 0, 4, 8])


@pytest.mark.parametrize("num_heads", [8, pytest.param(16, marks=pytest.mark.slow), 32,
                                       pytest.param(64, marks=pytest.mark.slow)], ids=lambda n: f"g{n // 4}")
def test_query_rows_hold_each_tiles_rows(num_heads):
    """The rows a program copies from `_query_rows` (64 a consumer, from its tile's `q_start` x G) are its tile's
    rows as the Triton kernels' layout (`pallas_attention._tile_rows`: token x head of the group) holds them, for
    every tile that holds a token, in both launches of a shuffled mixed step (decodes, chunks, partial tiles, a
    padding sequence, more tile slots than tokens); each copy starts at a multiple of 8 rows and stays inside the
    array; the array is at most q's tokens plus a gap a tile, where the tiles' own rows were every slot's."""
    from models import pallas_attention as pa

    K, H = 4, 64
    G = num_heads // K
    rng = np.random.default_rng(num_heads)
    seqs = [(90, 2 * ma.block_q_for(num_heads, K) + 3, 0), (20, 1, 0), (9, 5, 0), (70, 1, 0), (12, 3, 30)]
    step = make_step(rng, seqs, num_heads=num_heads, num_kv_heads=K, head_dim=H, page=16, dtype=jnp.bfloat16,
                     shuffle=True, pad_rows=3, max_pages=8)
    meta = AttentionMetadata(**{f: step[f] for f in ("seq_ids", "positions", "page_table", "kv_lens", "kv_start")})
    q = step["q"]
    T = q.shape[0]
    tiles = ma.plan_step(meta, num_heads=num_heads, num_kv_heads=K, head_dim=H, page_size=16)
    for launch, tokens in ((tiles.decode, 2), (tiles.prefill, T - 2)):  # the two decodes, the other tokens
        rows = launch.lim_rows.shape[1]
        got = np.asarray(ma._query_rows(q, launch, K, rows), np.float32)  # [K, Tq x G + rows, H]
        want = np.asarray(pa._tile_rows(q, launch.tok, K, rows), np.float32)  # [nt, K, rows, H]
        tok, start = np.asarray(launch.tok), np.asarray(launch.q_start)
        nt = tok.shape[0]
        held = (tok < T).sum(axis=1)
        assert held.sum() == tokens
        for t in np.flatnonzero(held):
            first = int(start[t]) * G
            assert first % 8 == 0 and first + rows <= got.shape[1]
            np.testing.assert_array_equal(got[:, first:first + held[t] * G], want[t][:, :held[t] * G])
        align = max(1, 8 // G)
        assert got.shape[1] <= (T + (align - 1) * min(nt, T) + align) * G + rows
        assert got.shape[1] % 8 == 0  # Mosaic tiles the GMEM array in 8-row tiles too


# ~30 s (decode) and ~70 s (mixed) on 2 cores: with the slow tests; on a GPU the compiled merge kernel is checked
# against XLA's merge by default (test_compiled_merge_kernel_matches_xla_merge_on_hopper)
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_merge_kernel_merges_split_tiles_in_token_order_without_races(kind, race_detection):
    """The merge kernel (`merge_kernel=True`, the default) after each launch: a decode at 390 keys in six partitions of
    its seven blocks (2, 2, 2, 1, 0, 0: more partials than the kernel's 4 slots, so it refills them; two empty,
    l = 0) and an empty KVP shard's decode (one partition, written by the attention kernel); mixed, beside them a
    20-token chunk at 300 keys in three partitions whose tile's 20 tokens fill the first consumer's 16 and 4 of the
    second's (the merge's programs are per consumer: the second merges its 64 rows and writes the 16 its 4 tokens
    take), and a 5-token chunk at 200 keys in two, whose second consumer holds no token (its merge program does
    nothing); two kv heads (the decode alone: one). Rows shuffled. In float32 against the reference with the race
    detector on, and against XLA's merge of the same partials (`merge_kernel=False`) to float32 rounding."""
    rng = np.random.default_rng(23)
    mixed = kind == "mixed"
    seqs = [(390, 1, 0), (0, 1, 0)] + ([(300, 20, 0), (200, 5, 0)] if mixed else [])
    step = make_step(rng, seqs, num_heads=8 if mixed else 4, num_kv_heads=2 if mixed else 1, head_dim=64,
                     page=16, dtype=jnp.bfloat16, shuffle=True, max_pages=25)
    plan = dict(decode_partitions=7, num_partitions=6, block_k=64)
    assert list(planned_parts(step, "decode", **plan))[:7] == [6] * 6 + [1]
    if mixed:
        assert list(planned_parts(step, "prefill", **plan)) == [3, 3, 3, 2, 2, 0]
        check(ma.paged_attention_mosaic, step, **plan)  # out in bf16 too
    fn = ma.paged_attention_mosaic if mixed else functools.partial(ma.paged_attention_mosaic, kind="decode")
    got = run(fn, step, interpret=True, out_dtype=jnp.float32, **plan)
    assert not race_detection()
    ref = run(paged_attention, f32(step), block_pages=2, precision=HIGHEST)
    assert_close(got, ref, **tolerance(step))
    xla = run(fn, step, interpret=True, out_dtype=jnp.float32, merge_kernel=False, **plan)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(xla[0]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(xla[1]), rtol=1e-6, atol=1e-5)


def test_merge_slots_fit_a_blocks_shared_memory():
    """A merge program's float32 [64, head dim] slots: 4 where they fit beside the output staging within a block's
    227 KB (8 KB kept for Mosaic's own), 2 at head dim 256 (3 x 64.5 KB + 32 KB would not), never more than the
    partitions."""
    assert ma.merge_slots(head_dim=64, out_itemsize=2, num_parts=16) == 4
    assert ma.merge_slots(head_dim=128, out_itemsize=4, num_parts=33) == 4  # 4 x 32.5 KB + 32 KB + 8 KB
    assert ma.merge_slots(head_dim=128, out_itemsize=2, num_parts=2) == 2
    assert ma.merge_slots(head_dim=256, out_itemsize=2, num_parts=16) == 2
    assert ma.merge_slots(head_dim=256, out_itemsize=4, num_parts=16) == 2
    assert ma._partial_rows(1, 4) == (8, 32)  # a decode tile: its 4 rows in one 8-row tile; m / l 128 bytes
    assert ma._partial_rows(1, 8) == (8, 32)
    assert ma._partial_rows(1, 64) == (64, 64)
    assert ma._partial_rows(16, 4) == (64, 64)  # a prefill consumer's 16 tokens: all its rows
    assert ma._partial_rows(6, 8) == (48, 64)


@pytest.mark.slow  # ~38 s in the interpreter
def test_a_short_chunk_among_many_sequence_slots_is_split():
    """The engine's page table has a row per sequence slot, so a step's static tile count is set by them, not by
    what it holds: here 16 slots, a 20-token chunk at 600 keys (one tile of 10 static ones) and a decode at 400 keys
    (one of 16). The plan splits each over the partitions the table allows (the chunk's 5 blocks of 128 keys, the
    decode's 7 of 64), where a static split by the tile slots gave the chunk 2 partitions at the Llama-3-8B shape
    (132 programs over 10 slots x 8 kv heads) and the decode 3: the GPU mostly idle. Right against the reference."""
    rng = np.random.default_rng(17)
    step = make_step(rng, [(600, 20, 0), (400, 1, 0)] + [(0, 0, 0)] * 14, num_heads=4, num_kv_heads=1,
                     head_dim=64, page=16, dtype=jnp.bfloat16)
    assert list(planned_parts(step, "prefill")) == [5] * 5 + [0] * 5
    assert list(planned_parts(step, "decode")) == [7] * 7 + [0] * 9
    check(ma.paged_attention_mosaic, step)


@pytest.fixture
def race_detection(monkeypatch):
    """The interpreter's happens-before race detector on for the kernels run in the test; yields the function
    that says whether the last launch had a race: of generic SMEM loads and stores (not wgmma's or TMA's own
    accesses), and on jax >= 0.11 an access to one group of a `plgpu.RefUnion` unordered with a write to another.
    Besides, the interpreter raises on a barrier misuse: a phase completed again before a waiter saw it, a barrier
    freed with phases a waiter skipped."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    plain = ma._interpret_params

    def detecting():
        plain()  # installs what the plain parameters install (jax 0.10's transposed-wgmma bridge)
        return InterpretGPUParams(detect_races=True)

    monkeypatch.setattr(ma, "_interpret_params", detecting)
    yield lambda: interpret_pallas_call.get_races().races_found


@pytest.mark.parametrize("kind,options", [
    pytest.param("decode", {}, id="decode"), pytest.param("prefill", {}, id="prefill"),
    pytest.param("decode", dict(lookahead=False), marks=pytest.mark.slow, id="decode-no-lookahead"),
    pytest.param("prefill", dict(lookahead=False), marks=pytest.mark.slow, id="prefill-no-lookahead"),
    pytest.param("prefill", dict(pingpong=True), marks=pytest.mark.slow, id="prefill-pingpong"),
    pytest.param("prefill", dict(release_k=True), marks=pytest.mark.slow, id="prefill-release-k"),
    pytest.param("decode", dict(release_k=True), marks=pytest.mark.slow, id="decode-release-k"),
    pytest.param("prefill", dict(release_k=True, max_registers=True, pingpong=True), marks=pytest.mark.slow,
                 id="prefill-release-k-max-registers-pingpong"),
    pytest.param("prefill", dict(fma_softmax=True, wait_k_in_pv=True, fenced_softmax=True), marks=pytest.mark.slow,
                 id="prefill-mgpu-loop"),
    pytest.param("decode", dict(fma_softmax=True, wait_k_in_pv=True, fenced_softmax=True), marks=pytest.mark.slow,
                 id="decode-mgpu-loop"),
    pytest.param("prefill", dict(wait_k_in_pv=True, release_k=True, pingpong=True, stages=3), marks=pytest.mark.slow,
                 id="prefill-wait-k-in-pv-release-k-pingpong-stages3"),
    pytest.param("decode", dict(stages=3), marks=pytest.mark.slow, id="decode-stages3"),
    pytest.param("decode", dict(stages=2), marks=pytest.mark.slow, id="decode-stages2"),
    pytest.param("prefill", dict(stages=4), marks=pytest.mark.slow, id="prefill-stages4"),
    pytest.param("prefill", dict(overlap=True, pingpong=True), marks=pytest.mark.slow, id="prefill-overlap-pingpong"),
    pytest.param("prefill", dict(overlap=True, release_k=False), marks=pytest.mark.slow,
                 id="prefill-overlap-shared-release"),
    pytest.param("decode", dict(overlap=True), marks=pytest.mark.slow, id="decode-overlap"),
    pytest.param("prefill", dict(overlap=True, fma_softmax=True, stages=3), marks=pytest.mark.slow,
                 id="prefill-overlap-fma-stages3"),
    pytest.param("prefill", dict(consumers=3, pingpong=True), marks=pytest.mark.slow,  # (~17 s: the cold default
                 id="prefill-c3-ring"),  # suite took 528-598 s in this session's fresh-clone CIs)
    pytest.param("prefill", dict(consumers=3, overlap=True, pingpong=True), marks=pytest.mark.slow,
                 id="prefill-c3-overlap-ring")],
    ids=str)
def test_a_program_refills_its_slots_without_races(kind, options, race_detection):
    """One partition over more key blocks than the ring has slots (by default 2 for the one-partition prefill, 4
    for the decode), so the producer refills slots the consumer released (it waits on "consumed" for each) and waits
    for the last ones at the end, and the output staging, which shares SMEM with the slots, is written after: 300
    keys (5 blocks) for the decode, a 20-token chunk at 300 keys (5 blocks, the last at the causal edge) beside a
    9-token first chunk for the prefill (64-key blocks: at this head dim, 64, the default would be 128).
    Checked against the reference, with the race detector on and finding nothing. (No earlier interpreted case
    had more than two blocks in a program: the interpreter then refused the kernel, whose producer left the
    last "consumed" phases unobserved.) Also without the page-table lookahead, and with the two prefill consumers
    taking turns on the schedule barrier (`pingpong`; a decode program has one consumer and no turns), with
    rings of 2 to 4 slots (`stages`), with the K slot released after Q K^T on its own barrier (`release_k`: the
    producer waits on two barriers per block; `max_registers` beside it is a no-op in the interpreter), and with
    the rest of `attention_mgpu`'s consumer loop (`fma_softmax`, `wait_k_in_pv`: each K waited for once, the next
    during P V, and `fenced_softmax`), with each block's softmax under the previous block's P V (`overlap`, FlashAttention-3's order: P carried from one block to the
    next, K's slot freed after Q K^T, the consumers' turns on a ring of barriers), and with three prefill consumers
    (48-token tiles, 16 tokens a consumer: a 60-token chunk takes two, its second tile's 12 tokens all in the first
    consumer, the other two holding none) passing their turn around a ring of barriers, or overlapping."""
    rng = np.random.default_rng(11)
    seqs = [(300, 1, 0), (70, 1, 0)] if kind == "decode" else [(300, 20, 0), (9, 9, 0)]
    if options.get("consumers") == 3:
        seqs = [(300, 60, 0), (9, 9, 0)]
    step = make_step(rng, seqs, num_heads=4, num_kv_heads=1, head_dim=64, page=16, dtype=jnp.bfloat16)
    fn = ma.decode_attention if kind == "decode" else functools.partial(ma.prefill_attention, block_k=64)
    check(fn, step, num_partitions=1, **options)
    assert not race_detection()


# Token-order writes: (heads, kv heads, dtype, prefill partitions, decode partitions, the most partitions a tile
# of each launch takes). Two kv heads, so a token's G heads land at kvh*G of N; one launch per kind, each writing
# its rows in place (the second into the first's buffers), and the rows of split tiles merged after the kernel
# and scattered into them.
TOKEN_ORDER = {
    "g2-k2-np1-f16": (4, 2, jnp.float16, 1, 1, (1, 1)),
    "g8-k2-np1": (16, 2, jnp.bfloat16, 1, 1, (1, 1)),
    "g4-k2-decode-split": (8, 2, jnp.bfloat16, 1, 4, (1, 2)),
    "g4-k2-prefill-split": (8, 2, jnp.bfloat16, 8, 1, (2, 1)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", TOKEN_ORDER)
def test_mixed_step_writes_every_token_in_its_place(case):
    """A mixed step, rows shuffled: a prefill chunk of a tile and 3 tokens at 300 keys (the second tile mostly
    empty slots), a 5-token chunk, two decodes, a sequence with no visible key (0, NEG_INF), a KVP shard's view; the
    decode launch has empty tiles too, and where the case allows, the tiles with the most keys are split (the
    chunk's two 3-block tiles, the 2-block decode). Every token's rows must land in its own row and heads: out in
    q's dtype, lse float32; a token no tile wrote would be NaN (the interpreter's uninitialised memory)."""
    num_heads, num_kv_heads, dtype, parts, decode_parts, most = TOKEN_ORDER[case]
    bq = ma.block_q_for(num_heads, num_kv_heads)
    rng = np.random.default_rng(num_heads + 3 * parts + 5 * decode_parts)
    seqs = [(300, bq + 3, 0), (20, 1, 0), (9, 5, 0), (70, 1, 0), (0, 2, 0), (12, 3, 30)]
    step = make_step(rng, seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64, page=16, dtype=dtype,
                     shuffle=True, max_pages=64)
    plan = dict(num_partitions=parts, decode_partitions=decode_parts)
    assert (planned_parts(step, "prefill", **plan).max(), planned_parts(step, "decode", **plan).max()) == most
    check(ma.paged_attention_mosaic, step, **plan)


@pytest.mark.slow  # ~11 s in the interpreter
def test_one_kind_step_leaves_the_other_kind_at_zero_weight():
    """kind="decode" / "prefill" launches one kernel, writing in place into buffers that start at (0, NEG_INF):
    the tokens of the other kind keep exactly that (what the switch promises), the others are right."""
    rng = np.random.default_rng(13)
    step = make_step(rng, [(40, 1, 0), (23, 7, 0), (5, 1, 0)], num_heads=4, num_kv_heads=1, head_dim=64, page=16,
                     dtype=jnp.bfloat16, shuffle=True)
    seq_ids = np.asarray(step["seq_ids"])
    decodes = np.isin(seq_ids, [0, 2])
    check(ma.paged_attention_mosaic, step, kind="decode", decode_partitions=1, other_kind=~decodes)
    check(ma.paged_attention_mosaic, step, kind="prefill", num_partitions=1, other_kind=decodes)


def test_unwritten_cache_slots_never_reach_the_output():
    """NaN in every cache slot that holds none of the sequence's keys (the rest of the last page and block, the
    pages behind unused page-table columns): the kernel zeroes V past the last visible key, so equal to the
    reference on the clean cache."""
    rng = np.random.default_rng(9)
    step = make_step(rng, [(45, 9, 0)], num_heads=4, num_kv_heads=1, head_dim=64, page=16, dtype=jnp.bfloat16,
                     max_pages=4)
    got = run(ma.prefill_attention, poison_unwritten(step), interpret=True, num_partitions=1)
    assert_close(got, run(paged_attention, f32(step), block_pages=2, precision=HIGHEST), **tolerance(step))


@pytest.mark.slow
def test_mixed_step_through_the_switch():
    """The engine's path, `attention("mosaic_interpret")`, default partitions: decodes and prefill chunks of one
    step in two launches, padding rows, contexts that are multiples of no block."""
    rng = np.random.default_rng(7)
    seqs = [(95, 31, 0), (41, 2, 0), (100, 1, 0), (3, 1, 0)]
    step = make_step(rng, seqs, num_heads=4, num_kv_heads=1, head_dim=64, page=16, dtype=jnp.bfloat16, pad_rows=2)
    got = run(functools.partial(attention, "mosaic_interpret"), step, block_pages=4)
    assert got[0].dtype == jnp.bfloat16
    assert_close(got, run(paged_attention, f32(step), block_pages=4, precision=HIGHEST), **tolerance(step))


@pytest.mark.slow  # ~35 s in the interpreter
def test_float32_out_for_a_kvp_partial_is_the_unrounded_result():
    """out_dtype=float32 (what a KVP rank asks for: its partial goes into the merge unrounded): out comes back in
    float32, right against the reference, not rounded to bf16, and the default bf16 out is exactly it rounded; both
    paths: the decode launch normalising in the kernel (one partition), the prefill launch's 300-key chunk merged
    after it (two partitions) and its other chunk normalised in the kernel."""
    rng = np.random.default_rng(21)
    step = make_step(rng, [(30, 1, 0), (300, 5, 0), (12, 3, 30)], num_heads=4, num_kv_heads=1, head_dim=64,
                     page=16, dtype=jnp.bfloat16, shuffle=True, max_pages=32)
    kw = dict(interpret=True, num_partitions=4, decode_partitions=1)
    assert list(planned_parts(step, "prefill", num_partitions=4)) == [2, 2, 1, 0]
    out32, lse32 = run(ma.paged_attention_mosaic, step, out_dtype=jnp.float32, **kw)
    assert out32.dtype == jnp.float32 and lse32.dtype == jnp.float32
    ref = run(paged_attention, f32(step), block_pages=2, precision=HIGHEST)
    assert_close((out32, lse32), ref, out_atol=tolerance(step)["out_atol"], out_rtol=0.0)
    seq_ids = np.asarray(step["seq_ids"])
    for rows in (seq_ids == 0, seq_ids != 0):  # the decode's rows, the prefill chunks' rows
        o = np.asarray(out32)[rows]
        assert (o != np.asarray(jnp.asarray(o).astype(jnp.bfloat16), np.float32)).any(), "rounded to bf16"
    out16, lse16 = run(ma.paged_attention_mosaic, step, **kw)
    assert out16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out16, np.float32), np.asarray(out32.astype(jnp.bfloat16), np.float32))
    np.testing.assert_array_equal(lse16, lse32)
    with pytest.raises(ValueError, match="out_dtype must be q's dtype .* or float32"):
        run(ma.paged_attention_mosaic, step, out_dtype=jnp.float16, **kw)


# The launches of each output path, (fn, kernels a mixed step launches; a one-kind step half as many): split-K
# partials merged by the merge kernel after each launch, token order in the model's dtype, a KVP rank's float32 out.
_ONE_PARTITION = functools.partial(ma.paged_attention_mosaic, num_partitions=1, decode_partitions=1)
OUTPUT_PATHS = ((ma.paged_attention_mosaic, 4), (_ONE_PARTITION, 2),
                (functools.partial(_ONE_PARTITION, out_dtype=jnp.float32), 2))


# attention_mgpu's consumer loop as a whole (which matched cuDNN on the H200 where ours was 1.27x slower): 128-key
# blocks, P in registers, ping-pong, K released after Q K^T, the register split, one FMA a score, the next K waited
# for during P V, the softmax finished before the turn is handed over
MGPU_LOOP = dict(block_k=128, registers=True, pingpong=True, release_k=True, max_registers=True, fma_softmax=True,
                 wait_k_in_pv=True, fenced_softmax=True)


# (all three lower in the slow suite: ~33 s of the default suite's ten minutes on 2 cores)
@pytest.mark.parametrize("num_heads,page,options", [
    pytest.param(32, 16, False, id="8b-page16", marks=pytest.mark.slow),  # (~21 s; lowering stays in the default
    # suite through test_every_supported_configuration_lowers)
    pytest.param(32, 16, True, id="8b-page16-options", marks=pytest.mark.slow),
    pytest.param(64, 128, True, id="70b-page128", marks=pytest.mark.slow)])
def test_compiled_kernels_lower_to_mosaic_gpu(num_heads, page, options):
    """The non-interpreted kernels at Llama-3-8B / -70B attention shapes lower through Pallas' Mosaic GPU lowering
    (layouts, swizzled SMEM, TMA copies of pages, transposed wgmma, warpgroups) to the Mosaic GPU custom call for
    CUDA, alone and inside the step's shard_map (on the CPU; compiling to PTX and running need a Hopper GPU); with
    `options`, the tuning options too."""
    base = ((ma.paged_attention_mosaic, 4),  # both launches split, each followed by its merge kernel
            (ma.decode_attention, 2),
            (_ONE_PARTITION, 2),  # token-order writes, the second launch into the first's buffers
            (functools.partial(_ONE_PARTITION, kind="decode"), 1),  # into (0, NEG_INF) buffers
            (functools.partial(ma.paged_attention_mosaic, num_partitions=1), 3),  # token order + the decode's merge
            (functools.partial(ma.paged_attention_mosaic, merge_kernel=False), 2),  # merged by XLA's ops instead
            (functools.partial(_ONE_PARTITION, out_dtype=jnp.float32), 2))  # a KVP rank's float32 partial
    tuning = ((functools.partial(ma.paged_attention_mosaic, pingpong=True, block_k=128), 4),
              (functools.partial(ma.paged_attention_mosaic, stages=3, block_k=64), 4),
              (functools.partial(ma.paged_attention_mosaic, registers=True, pingpong=True), 4),
              (functools.partial(ma.paged_attention_mosaic, release_k=True, max_registers=True), 4),
              (functools.partial(ma.paged_attention_mosaic, fma_softmax=True, wait_k_in_pv=True, fenced_softmax=True,
                                 registers=False), 4),
              (functools.partial(ma.paged_attention_mosaic, **MGPU_LOOP), 4),
              (functools.partial(ma.paged_attention_mosaic, overlap=True, max_registers=True), 4),  # turns on
              (functools.partial(ma.paged_attention_mosaic, overlap=True, pingpong=False, release_k=False), 4),
              (functools.partial(ma.paged_attention_mosaic, consumers=3), 4),  # the ring, registers split
              (functools.partial(ma.paged_attention_mosaic, consumers=3, overlap=True), 4),
              (functools.partial(_ONE_PARTITION, registers=True), 2))
    assert_lowers_for_cuda(jnp.bfloat16, base + (tuning if options else ()), "@mosaic_gpu_v2", num_heads=num_heads,
                           page=page)


# H100 (compute capability 9.0): 228 KB of shared memory per SM, of which one block may take at most 227 KB, and
# the system reserves 1 KB per resident block (CUDA C++ Programming Guide, "Technical Specifications per Compute
# Capability" and the Hopper tuning guide).
H100_SMEM_PER_SM, H100_SMEM_PER_BLOCK, SMEM_RESERVED_PER_BLOCK = 228 * 1024, 227 * 1024, 1024


@pytest.mark.parametrize("head_dim", [pytest.param(64, id="hd64-llama3.2-1b", marks=pytest.mark.slow),  # ~12 s each
                                      pytest.param(128, id="hd128-8b-70b"),
                                      pytest.param(256, id="hd256", marks=pytest.mark.slow)])
def test_compiled_kernels_fit_hopper_shared_memory(head_dim):
    """Mosaic GPU's lowering sums the kernel's SMEM and refuses a kernel over the limit. Every output path (split-K
    partials in float32, token order in the model's dtype, a KVP rank's float32 partial) with the default code
    generation (`Codegen.for_launch`: the deepest ring that fits for memory-bound launches) lowers within the
    module's own count (`program_smem_bytes` + SMEM_MARGIN, what `deepest_ring` trusts) and within an SM's share:
    decode programs (one consumer warpgroup) two per SM at head dim 64 (4 slots), one at 128 (4 slots: 160,824
    bytes) and 256 (2 slots); prefill programs (an SM's registers alone) one: split ones of two consumers, the
    others (compute-bound: 2 slots) of three at head dim 64 (`prefill_consumers`), else two. Head dim 256 with a
    float32 output once needed 242,744 bytes (the output staging beside the K/V slots), over the 227 KB a block
    may take."""
    from jax.experimental.mosaic.gpu import core as mgpu_core

    def lowers(paths, *, consumers, block_k, ring, per_sm):
        # compiled, P stays in registers (`registers`): no SMEM buffer for it
        counted = ma.program_smem_bytes(consumers=consumers, head_dim=head_dim, block_k=block_k, stages=ring,
                                        p_in_smem=False)
        limit = min(H100_SMEM_PER_BLOCK, H100_SMEM_PER_SM // per_sm - SMEM_RESERVED_PER_BLOCK,
                    counted + ma.SMEM_MARGIN)
        with mgpu_core.artificial_shared_memory_limit(limit):
            assert_lowers_for_cuda(jnp.bfloat16, paths, "@mosaic_gpu_v2", head_dim=head_dim)

    assert ma.SMS == 132  # an H100 SXM's and an H200's
    assert ma.PREFILL_CONSUMERS == 2
    # the layout `assert_lowers_for_cuda` lowers: 64 tokens, 4 sequences of 4,096 keys in pages of 16
    layout = AttentionMetadata(seq_ids=jnp.zeros(64, jnp.int32), positions=jnp.zeros(64, jnp.int32),
                               page_table=jnp.zeros((4, 256), jnp.int32), kv_lens=jnp.zeros(4, jnp.int32),
                               kv_start=jnp.zeros(4, jnp.int32))
    dims = dict(num_heads=32, num_kv_heads=8, head_dim=head_dim, page_size=16)
    for kind, consumers, per_sm in (("decode", 1, 2 if head_dim == 64 else 1), ("prefill", 2, 1)):
        block_k = ma.BLOCK_K if kind == "decode" else ma.prefill_block_k(head_dim, 16)  # 128 at head dims <= 128
        assert ma.programs_per_sm(consumers=consumers, head_dim=head_dim, block_k=block_k) == per_sm
        # the default partitions: one wave of programs at 8 kv heads
        assert ma.default_partitions(consumers=consumers, num_kv_heads=8, head_dim=head_dim,
                                     block_k=block_k) == 132 * per_sm // 8
        ring = ma.deepest_ring(consumers=consumers, head_dim=head_dim, block_k=block_k)
        # a prefill program's 128-key slots at head dim 128: two fit, a third not
        assert ring == (2 if head_dim == 256 or (kind, head_dim) == ("prefill", 128) else 4)
        split, *whole = ((functools.partial(fn, kind=kind), n // 2) for fn, n in OUTPUT_PATHS)
        if kind == "decode":  # memory-bound whether split or not: the deepest ring
            lowers((split, *whole), consumers=1, block_k=block_k, ring=ring, per_sm=per_sm)
            continue
        # the split prefill launch is memory-bound (the deepest ring, two consumers); one partition a tile makes it
        # compute-bound: `STAGES` slots, and three consumers at head dim 64 (`prefill_consumers`)
        assert ma.prefill_consumers(layout, **dims) == consumers
        lowers((split,), consumers=consumers, block_k=block_k, ring=ring, per_sm=per_sm)
        whole_consumers = ma.prefill_consumers(layout, num_partitions=1, **dims)
        assert whole_consumers == (ma.MAX_CONSUMERS if head_dim == 64 else consumers)
        lowers(whole, consumers=whole_consumers, block_k=ma.prefill_block_k(head_dim, 16, whole_consumers),
               ring=ma.STAGES, per_sm=per_sm)


@pytest.mark.slow  # 32-41 s a head dim on the 2-core VM this week; the defaults' fit (above) stays in the default suite
@pytest.mark.parametrize("head_dim", [pytest.param(64, id="hd64-llama3.2-1b"), pytest.param(128, id="hd128-8b-70b")])
def test_kernel_options_fit_hopper_shared_memory(head_dim):
    """Options that enlarge a program, within the 227 KB a block may take: a ring of 4 slots of 64 keys with one
    partition, attention_mgpu's loop with 128-key blocks, three consumers (their default blocks: 128 keys at head
    dim 64, 64 at 128) or P through SMEM (its buffer beside the ring): a prefill program still fits (one per SM, at
    head dim 256 not); a decode program with a ring of 3 fits one per SM; at head dim 64, 192-key blocks with 2
    slots, and without P's buffer 4."""
    from jax.experimental.mosaic.gpu import core as mgpu_core

    more = (("prefill", dict(block_k=192)), ("prefill", dict(block_k=192, stages=4))) if head_dim == 64 else ()
    for kind, options in (("prefill", dict(stages=4, block_k=64)), ("decode", dict(stages=3)),
                          ("prefill", MGPU_LOOP), ("prefill", dict(consumers=3)),
                          ("prefill", dict(registers=False))) + more:
        paths = tuple((functools.partial(fn, kind=kind, **options), n // 2) for fn, n in OUTPUT_PATHS)
        with mgpu_core.artificial_shared_memory_limit(H100_SMEM_PER_BLOCK):
            assert_lowers_for_cuda(jnp.bfloat16, paths, "@mosaic_gpu_v2", head_dim=head_dim)


def test_code_generation_is_chosen_per_launch():
    """What each launch gets for the options left to the kernel (None), as measured fastest on an H200, and that a
    given option wins: memory-bound launches (decode tiles, split-K) the deepest ring, compute-bound ones (two
    consumers, one partition) 2 slots; two consumers with P in registers take turns (ping-pong), memory-bound ones
    only with 3 slots or more; the interpreter neither P in registers nor, then, ping-pong."""
    def pick(codegen=ma.Codegen(), *, interpret=False, consumers=2, num_parts=1, head_dim=128, block_k=64):
        c = codegen.for_launch(interpret=interpret, consumers=consumers, num_parts=num_parts, head_dim=head_dim,
                               block_k=block_k)
        return c.registers, c.stages, c.pingpong

    assert pick() == (True, 2, True)  # a long chunk's prefill tiles
    assert pick(num_parts=16) == (True, 4, True)  # one 32-token chunk at a long context, split-K
    assert pick(consumers=1, num_parts=33) == (True, 4, False)  # decode tiles
    assert pick(consumers=1, num_parts=1, head_dim=64) == (True, 4, False)
    assert pick(consumers=1, num_parts=33, head_dim=256) == (True, 2, False)  # a third slot would not fit
    assert pick(num_parts=16, head_dim=128, block_k=128) == (True, 2, False)  # 128-key slots: 2 fit, no turns
    assert pick(num_parts=16, head_dim=256) == (True, 2, False)  # memory-bound with 2 slots: no turns (slower)
    assert pick(head_dim=256) == (True, 2, True)  # compute-bound: turns
    assert pick(num_parts=16, head_dim=64, block_k=128) == (True, 4, True)  # 4 slots still fit at head dim 64
    assert pick(interpret=True) == (False, 2, False)
    assert pick(interpret=True, num_parts=4) == (False, 4, False)
    assert pick(ma.Codegen(registers=False, stages=3, pingpong=True), num_parts=16) == (False, 3, True)
    assert pick(ma.Codegen(registers=False), num_parts=16) == (False, 4, False)
    assert pick(ma.Codegen(pingpong=False)) == (True, 2, False)
    # a decode launch (one consumer) of a step given the two-consumer options takes neither
    decode = ma.Codegen(pingpong=True, max_registers=True).for_launch(interpret=False, consumers=1, num_parts=33,
                                                                      head_dim=128, block_k=64)
    assert (decode.pingpong, decode.max_registers) == (False, False)
    # fma_softmax: compute-bound launches (every head dim since the eighteenth session); a given value wins
    def fma(codegen=ma.Codegen(), **launch):
        return codegen.for_launch(**dict(dict(interpret=False, consumers=2, num_parts=1, head_dim=64, block_k=128),
                                         **launch)).fma_softmax
    assert fma() and fma(interpret=True) and fma(head_dim=128) and fma(head_dim=256, block_k=64)
    assert not fma(num_parts=16) and not fma(consumers=1, block_k=64)
    assert not fma(ma.Codegen(fma_softmax=False)) and fma(ma.Codegen(fma_softmax=True), num_parts=16)
    # a ring deeper than the SMEM holds is refused when compiled, naming what fits
    with pytest.raises(ValueError, match=r"stages=3: 3 K/V slots of 128 keys at head dim 128.*the most that fit: 2"):
        ma.Codegen(stages=3).for_launch(interpret=False, consumers=2, num_parts=1, head_dim=128, block_k=128)
    assert ma.Codegen(stages=3).for_launch(interpret=False, consumers=2, num_parts=1, head_dim=128,
                                           block_k=64).stages == 3
    with pytest.raises(ValueError, match="no ring of 128-key slots fits: ask for block_k=64"):
        ma.Codegen(stages=2).for_launch(interpret=False, consumers=2, num_parts=1, head_dim=256, block_k=128)
    # three consumers: the registers redistributed (without, each thread may take 128), turns on the ring; a given
    # max_registers wins; two consumers redistribute theirs only under `overlap` (compute-bound or not: on an H100
    # the spilling two-consumer kernel was the faster at chunk 2048, and `overlap` without the split the slower at
    # chunk 32, twenty-third session); the split stays within an SM's 65,536 registers, in setmaxnreg's range (24
    # to 256, multiples of 8)
    def three(codegen=ma.Codegen(), **launch):
        return codegen.for_launch(**dict(dict(interpret=False, consumers=3, num_parts=1, head_dim=64, block_k=128),
                                         **launch))
    assert (three().max_registers, three().pingpong, three().stages, three().fma_softmax) == (True, True, 2, True)
    assert not three(ma.Codegen(max_registers=False)).max_registers
    def two(codegen=ma.Codegen(), **launch):
        return codegen.for_launch(**dict(dict(interpret=False, consumers=2, num_parts=1, head_dim=128, block_k=128),
                                         **launch)).max_registers
    assert not two() and not two(head_dim=64) and not two(num_parts=16)  # compute-bound, either head dim; split-K
    assert two(ma.Codegen(overlap=True)) and two(ma.Codegen(overlap=True), num_parts=16)
    assert not two(ma.Codegen(overlap=True, max_registers=False)) and two(ma.Codegen(max_registers=True))
    assert (ma.register_split(2), ma.register_split(3)) == ((40, 232), (32, 160))
    for consumers in (2, 3):
        producer, consumer = ma.register_split(consumers)
        assert all(r % 8 == 0 and 24 <= r <= 256 for r in (producer, consumer))
        assert 128 * (producer + consumers * consumer) <= 65_536
    # three consumers' 128-key slots at head dim 128 fit only without P's SMEM buffer, i.e. with P in registers
    # (`prefill_block_k`, which does not know, takes 64-key blocks there)
    with pytest.raises(ValueError, match="no ring of 128-key slots fits: ask for block_k=64"):
        three(ma.Codegen(registers=False), head_dim=128)
    assert three(head_dim=128).stages == 2 and three(head_dim=128, block_k=64).stages == 2
    assert ma.prefill_block_k(128, 16, consumers=3) == 64
    # 192-key blocks: two consumers at head dim 64 (3 slots with P's buffer, 4 without), not at 128, where the
    # error names the largest block that fits
    two = functools.partial(ma.Codegen().for_launch, interpret=False, consumers=2, num_parts=1, block_k=192)
    assert two(head_dim=64).stages == 2
    assert ma.rings_that_fit(consumers=2, head_dim=64, block_k=192) == [2, 3]
    assert ma.rings_that_fit(consumers=2, head_dim=64, block_k=192, p_in_smem=False) == [2, 3, 4]
    with pytest.raises(ValueError, match="no ring of 192-key slots fits: ask for block_k=128"):
        two(head_dim=128)
    # P's buffer: 64 rows x block_k of each consumer, in the input dtype, counted only where P goes through SMEM
    for c, h, b in ((1, 128, 64), (2, 64, 192), (3, 64, 128)):
        with_p, without = (ma.program_smem_bytes(consumers=c, head_dim=h, block_k=b, stages=2, p_in_smem=p)
                           for p in (True, False))
        assert with_p - without == c * 64 * b * 2
    # the count behind the ring: 2 slots of 64 keys at head dim 128, one consumer, is Mosaic's 95,288 bytes less
    # what it adds (row limits, m / l staging, barriers): 5,176 bytes, within SMEM_MARGIN
    assert ma.program_smem_bytes(consumers=1, head_dim=128, block_k=64, stages=2) == 95_288 - 5_176
    assert 5_176 <= ma.SMEM_MARGIN


# What the module says it supports beyond the 8B / 70B shapes: GQA groups 1 to 64, every page size class (below a
# block, a block, above), head dims 64 / 256, float16. (group, page, head dim, dtype)
SUPPORTED = [(1, 16, 128, jnp.bfloat16), (2, 8, 64, jnp.float16), (16, 32, 128, jnp.bfloat16),
             (64, 64, 128, jnp.bfloat16), (4, 256, 128, jnp.bfloat16), (8, 16, 256, jnp.bfloat16),
             (4, 16, 64, jnp.float16)]
# ~5-9 s each on 2 cores: this one in the default suite (head dim 64, float16: the 8B shapes' lowering above has head
# dim 128 in bfloat16), the others with the slow tests (g1-page16-hd128 moved there in the forty-fifth session, to
# keep the cold default suite's margin under ten minutes)
SUPPORTED_BY_DEFAULT = [(4, 16, 64, jnp.float16)]


@pytest.mark.parametrize("group,page,head_dim,dtype", [
    pytest.param(*c, id=f"g{c[0]}-page{c[1]}-hd{c[2]}-{jnp.dtype(c[3]).name}",
                 marks=[] if c in SUPPORTED_BY_DEFAULT else [pytest.mark.slow]) for c in SUPPORTED])
def test_every_supported_configuration_lowers(group, page, head_dim, dtype):
    """Split-K, token-order and float32-out launches lower for CUDA (SMEM within a block's 227 KB included)."""
    assert_lowers_for_cuda(dtype, OUTPUT_PATHS, "@mosaic_gpu_v2", num_heads=8 * group, page=page, head_dim=head_dim)


def _kernel_launches(jaxpr) -> list:
    """The Mosaic GPU kernel launches (`mpmd_map` equations) of `jaxpr` and of the jaxprs nested in it."""
    return [e for e in equations(jaxpr, opaque=("pallas_call", "mpmd_map")) if str(e.primitive) == "mpmd_map"]


def test_compiled_kernels_name_lane_lowering_semantics():
    """The compiled launches ask for Lane lowering semantics, which the kernel is written for (explicit WGMMA
    register layouts), whatever jax's default: jax 0.11, the GPU image's, made Warpgroup semantics the default."""
    step = make_step(np.random.default_rng(5), [(40, 1, 0), (23, 7, 0)], num_heads=4, num_kv_heads=1, head_dim=64,
                     page=16, dtype=jnp.bfloat16)
    launches = _kernel_launches(jax.make_jaxpr(lambda s: run(ma.paged_attention_mosaic, s))(step).jaxpr)
    assert len(launches) == 2  # the mixed step's prefill and decode launches
    for e in launches:
        assert e.params["compiler_params"].lowering_semantics is ma.plgpu.LoweringSemantics.Lane


def jax_primitives():
    """jax's Mosaic GPU Pallas primitives module, so the tests name a primitive by its object, not by its name,
    which changes between versions (jax 0.12 dropped the "_p" of "wgmma_accumulator_store_p" and "..._deref_p")."""
    from jax._src.pallas.mosaic_gpu import primitives

    return primitives


def _kernel_primitives(step, fn=functools.partial(ma.paged_attention_mosaic, kind="prefill"),
                       **options) -> collections.Counter:
    """The primitives of the compiled prefill launch's kernel body (nested jaxprs included) of `fn` (a step's prefill
    launch by default) for `options` (the others off, fma_softmax too, which a compute-bound launch would otherwise
    take; two consumers, which a compute-bound launch at head dim 64 would otherwise make three, with `overlap`)."""
    options = {"fma_softmax": False, "consumers": ma.PREFILL_CONSUMERS, **options}
    jaxpr = jax.make_jaxpr(lambda s: run(fn, s, **options))(step).jaxpr
    (launch,) = _kernel_launches(jaxpr)
    return collections.Counter(str(e.primitive) for body in launch.params["jaxprs"]
                               for e in equations(getattr(body, "jaxpr", body), opaque=()))


def test_each_loop_option_changes_the_kernel_as_it_says():
    """`fma_softmax`, `wait_k_in_pv`, `fenced_softmax` and `overlap` each reach the kernel and change what they say:
    one more multiply (the row max scaled, in the unmasked blocks' loop; the masked blocks keep theirs), one more
    wait (the first block's K before the loops; each block's wait moves into its P V, under a condition), an
    optimization barrier in each of the two loops' blocks."""
    step = make_step(np.random.default_rng(5), [(40, 1, 0), (23, 7, 0)], num_heads=4, num_kv_heads=1, head_dim=64,
                     page=16, dtype=jnp.bfloat16)
    base = _kernel_primitives(step)
    fma = _kernel_primitives(step, fma_softmax=True)
    assert fma - base == collections.Counter(mul=1) and not base - fma
    wait = _kernel_primitives(step, wait_k_in_pv=True)
    assert wait["barrier_wait"] == base["barrier_wait"] + 1 and wait["cond"] > base["cond"]
    fenced = _kernel_primitives(step, fenced_softmax=True)
    assert fenced - base == collections.Counter(optimization_barrier=2) and not base - fenced
    # `overlap` (FlashAttention-3's order; here without turns and with K freed with V, against a base without
    # turns): two more loops (the first block's softmax before the two loops of blocks, the last block's P V
    # after), each loop's block issuing its Q K^T and the previous block's P V into two accumulators, the carried
    # one handed in (a store into an accumulator), Q K^T's read waiting for it alone (wait_n=1); nothing of the
    # base's loop dropped but its two in-place P Vs' run_state (one left, the last P V's)
    base = _kernel_primitives(step, pingpong=False)
    overlap = _kernel_primitives(step, overlap=True, pingpong=False, release_k=False)
    assert overlap["while"] == base["while"] + 2 and overlap["wgmma_ref"] == base["wgmma_ref"] + 2
    store = str(jax_primitives().wgmma_accumulator_store_p)  # "wgmma_accumulator_store_p" to jax 0.11, then without _p
    assert overlap[store] == base[store] + 2
    assert overlap["run_scoped"] == base["run_scoped"] + 1 and base - overlap == collections.Counter(get=2,
                                                                                                      run_state=1)
    assert _accumulator_reads(step, wait_n=1, overlap=True) == 2 and _accumulator_reads(step, wait_n=1) == 0
    # its defaults add the turns on the ring (each loop's block waits for its turn and passes it on, consumer 0
    # starts it) and K's slot freed after Q K^T (an arrival in the first block and in each loop's block, the
    # producer's wait for it when refilling and draining)
    full = _kernel_primitives(step, overlap=True)
    assert (full - overlap)["barrier_arrive"] == 3 + 3 and (full - overlap)["barrier_wait"] == 2 + 2


def _accumulator_reads(step, *, wait_n: int, **options) -> int:
    """Reads of a wgmma accumulator that wait for all but `wait_n` wgmmas, in the compiled prefill launch's kernel."""
    options = {"fma_softmax": False, "consumers": ma.PREFILL_CONSUMERS, **options}
    jaxpr = jax.make_jaxpr(lambda s: run(ma.paged_attention_mosaic, s, kind="prefill", **options))(step).jaxpr
    (launch,) = _kernel_launches(jaxpr)
    return sum(1 for body in launch.params["jaxprs"] for e in equations(getattr(body, "jaxpr", body), opaque=())
               if e.primitive is jax_primitives().wgmma_accumulator_deref_p and e.params.get("wait_n") == wait_n)


def test_what_the_kernels_refuse():
    """Shapes outside what the kernels support raise, naming it; attention='mosaic' raises off a Hopper GPU."""
    rng = np.random.default_rng(0)
    ok = dict(num_heads=4, num_kv_heads=1, head_dim=64, page=16, dtype=jnp.bfloat16)
    for change, message in ((dict(dtype=np.float32), "one 16-bit dtype"), (dict(head_dim=32), "head dims"),
                            (dict(page=4), "page size"), (dict(page=24), "page size"),
                            (dict(num_heads=3, num_kv_heads=1), "power of two")):
        step = make_step(rng, [(5, 2, 0)], **{**ok, **change})
        with pytest.raises(ValueError, match=message):
            run(ma.paged_attention_mosaic, step, interpret=True)
    step = make_step(rng, [(5, 2, 0)], **{**ok, "page": 192})  # a multiple of 64, not of 128
    for options, message in ((dict(block_k=96), r"block_k \(keys per block .*\(64, 128, 192\), got 96"),
                             (dict(decode_block_k=32), r"decode_block_k \(keys per block"),
                             (dict(block_k=128), r"block_k 128: the page size \(192\) must divide it")):
        with pytest.raises(ValueError, match=message):
            run(ma.paged_attention_mosaic, step, interpret=True, **options)
    with pytest.raises(ValueError, match=r"stages \(K/V slots in the ring\) must be one of \(2, 3, 4\), got 5"):
        run(ma.paged_attention_mosaic, make_step(rng, [(5, 2, 0)], **ok), interpret=True, stages=5)
    with pytest.raises(ValueError, match=r"pingpong .* needs prefill programs of two consumers or more, got consumers=1"):
        run(ma.paged_attention_mosaic, make_step(rng, [(5, 2, 0)], **ok), interpret=True, pingpong=True,
            consumers=1)
    with pytest.raises(ValueError, match=r"max_registers .* needs prefill programs of two consumers or more, got consumers=1"):
        run(ma.paged_attention_mosaic, make_step(rng, [(5, 2, 0)], **ok), interpret=True, max_registers=True,
            consumers=1)
    with pytest.raises(ValueError, match=r"consumers \(warpgroups of 64 rows in a prefill program\) must be 1 \.\. 3, "
                                         r"got 4"):
        run(ma.paged_attention_mosaic, make_step(rng, [(5, 2, 0)], **ok), interpret=True, consumers=4)
    with pytest.raises(ValueError, match=r"consumers=3: their program at head dim 256 exceeds .* at most 2 consumer"):
        run(ma.paged_attention_mosaic, make_step(rng, [(5, 2, 0)], **dict(ok, head_dim=256)), interpret=True,
            consumers=3)
    with pytest.raises(ValueError, match=r"registers=True .* is compiled only"):
        run(ma.paged_attention_mosaic, make_step(rng, [(5, 2, 0)], **ok), interpret=True, registers=True)
    if not on_hopper_gpu():
        step = make_step(rng, [(5, 2, 0)], **ok)
        with pytest.raises(RuntimeError, match="attention='mosaic' needs an NVIDIA Hopper GPU .*use 'pallas', "
                                               "'reference' or 'mosaic_interpret'"):
            run(functools.partial(attention, "mosaic"), step, block_pages=1)


def test_three_consumers_in_the_interpreter_ask_for_enough_threads(monkeypatch):
    """The interpreter runs a program's warpgroups as threads blocked inside XLA CPU computations, which XLA's CPU
    client runs on NPROC threads (or as many as the cores): three consumers with fewer than 8 raise, naming NPROC,
    rather than hang as they did one run in four on 2 cores; two consumers run with any number."""
    step = make_step(np.random.default_rng(0), [(5, 2, 0)], num_heads=4, num_kv_heads=1, head_dim=64, page=16,
                     dtype=jnp.bfloat16)
    monkeypatch.setenv("NPROC", "2")
    with pytest.raises(RuntimeError, match=r"consumers=3 .* 4 warpgroup threads .* set NPROC=8"):
        run(ma.prefill_attention, step, interpret=True, consumers=3)
    ma.check_interpreter_threads(2)
    monkeypatch.setenv("NPROC", "8")
    ma.check_interpreter_threads(3)


def _engine_tokens(tmp_path, impls, max_tokens: int = 3, runs: dict | None = None):
    """Greedy tokens of LLM on a tiny bf16 checkpoint of head dim 64 (the kernels' smallest) for each attention
    implementation in `impls`: two prompts, prefill chunks and decodes in one step. `runs`, when given, gets the
    implementation each engine resolved its `attention` to."""
    from mnemojax import LLM, SamplingParams
    from tests.hf_utils import make_hf_checkpoint

    ckpt = make_hf_checkpoint(tmp_path / "m", hidden_size=128, intermediate_size=128, num_layers=1, num_heads=2,
                              num_kv_heads=1, head_dim=64, weight_scale=8.0, seed=3)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    prompts = [np.random.default_rng(0).integers(0, 256, n).tolist() for n in (5, 20)]
    outs = {}
    for impl in impls:
        llm = LLM(model=str(ckpt), attention=impl, dtype="bfloat16", page_size=16, chunk_size=16,
                  max_model_len=64, max_num_batched_tokens=16, max_num_seqs=2)
        outs[impl] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if runs is not None:
            runs[impl] = llm.engine.executor.spec.attention
    assert all(len(t) == max_tokens for t in outs[impls[0]])
    return outs


@pytest.mark.slow
def test_engine_with_interpreted_mosaic_kernels_matches_reference(tmp_path):
    """The same greedy tokens with attention="mosaic_interpret" as with the reference."""
    outs = _engine_tokens(tmp_path, ("reference", "mosaic_interpret"))
    assert outs["mosaic_interpret"] == outs["reference"]


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper_gpu(), reason="needs an NVIDIA Hopper GPU")
def test_engine_with_compiled_kernels_on_hopper_matches_reference(tmp_path):
    """The engine end to end on the GPU: the same greedy tokens with attention="mosaic" and "pallas" as with the
    reference (8 tokens: several decode steps), and "auto" resolved to "mosaic" for this bf16 model (head dim 64,
    G = 2, pages of 16) on Hopper."""
    runs = {}
    outs = _engine_tokens(tmp_path, ("reference", "mosaic", "pallas", "auto"), max_tokens=8, runs=runs)
    assert runs == {"reference": "reference", "mosaic": "mosaic", "pallas": "pallas", "auto": "mosaic"}
    assert outs["mosaic"] == outs["reference"]
    assert outs["pallas"] == outs["reference"]
    assert outs["auto"] == outs["mosaic"]


# The compiled kernels, each its own test (one that fails to compile or disagrees leaves the others' results), in
# this order: one-consumer programs first, then the two-consumer prefill programs, then the options (all of them
# passed on an H200 by the sixteenth session but `overlap` and three consumers, written after).
COMPILED = {"decode": ma.decode_attention,
            "prefill-c1": functools.partial(ma.prefill_attention, consumers=1),
            "prefill": ma.prefill_attention,
            "switch": ma.paged_attention_mosaic,
            "switch-exact-math": functools.partial(ma.paged_attention_mosaic, approx_math=False),
            "switch-block128": functools.partial(ma.paged_attention_mosaic, block_k=128, decode_block_k=128),
            "switch-no-lookahead": functools.partial(ma.paged_attention_mosaic, lookahead=False),
            "switch-pingpong": functools.partial(ma.paged_attention_mosaic, pingpong=True),
            "switch-stages4": functools.partial(ma.paged_attention_mosaic, stages=4, block_k=64),  # 128-key: 2 fit
            # last: compiled only (the interpreter runs neither)
            "switch-registers": functools.partial(ma.paged_attention_mosaic, registers=True),
            "switch-registers-pingpong": functools.partial(ma.paged_attention_mosaic, registers=True, pingpong=True),
            "switch-release-k": functools.partial(ma.paged_attention_mosaic, release_k=True),
            "switch-max-registers": functools.partial(ma.paged_attention_mosaic, max_registers=True),
            "switch-release-k-max-registers": functools.partial(ma.paged_attention_mosaic, release_k=True,
                                                                max_registers=True),
            "switch-fma-softmax": functools.partial(ma.paged_attention_mosaic, fma_softmax=True),
            "switch-wait-k-in-pv": functools.partial(ma.paged_attention_mosaic, wait_k_in_pv=True),
            "switch-fenced-softmax": functools.partial(ma.paged_attention_mosaic, fenced_softmax=True),
            "switch-mgpu-loop": functools.partial(ma.paged_attention_mosaic, **MGPU_LOOP),
            # `overlap`: FlashAttention-3's loop since the seventeenth session (passed on an H100, twenty-third)
            "switch-overlap": functools.partial(ma.paged_attention_mosaic, overlap=True),
            "switch-overlap-max-registers": functools.partial(ma.paged_attention_mosaic, overlap=True,
                                                              max_registers=True),
            "switch-overlap-no-turns": functools.partial(ma.paged_attention_mosaic, overlap=True, pingpong=False,
                                                         release_k=False),
            # seventeenth session, passed on an H100 (twenty-third): three consumers, taking turns on the ring, or
            # overlapping
            "switch-c3": functools.partial(ma.paged_attention_mosaic, consumers=3),
            "switch-c3-overlap": functools.partial(ma.paged_attention_mosaic, consumers=3, overlap=True)}


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper_gpu(), reason="needs an NVIDIA Hopper GPU")
@pytest.mark.parametrize("num_heads", [32, 64])
@pytest.mark.parametrize("kernel", list(COMPILED))
def test_compiled_kernels_on_hopper_match_float32_reference(kernel, num_heads):
    """The compiled kernels at Llama-3-8B and -70B attention shapes (32 or 64 q heads, 8 kv heads, head dim 128,
    page 16) on random bf16 inputs: a long prefill chunk, short chunks, decodes, an empty KVP shard, padding rows."""
    rng = np.random.default_rng(num_heads)
    seqs = [(5000, 512, 0), (2100, 32, 0), (777, 7, 0), (4096, 1, 0), (1, 1, 0), (0, 3, 0), (900, 17, 3000)]
    step = make_step(rng, seqs, num_heads=num_heads, num_kv_heads=8, head_dim=128, page=16, dtype=jnp.bfloat16,
                     pad_rows=3)
    check_compiled(step, (COMPILED[kernel],))


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper_gpu(), reason="needs an NVIDIA Hopper GPU")
def test_compiled_kernels_split_a_short_chunk_among_many_sequence_slots_on_hopper():
    """The engine's layout at the Llama-3-8B shape: 64 sequence slots (so 17 static prefill tiles), a 32-token
    chunk at 40,000 keys and a decode at 30,000 split over the free programs (16 partitions each: the default, one
    wave), against the float32 reference."""
    rng = np.random.default_rng(3)
    step = make_step(rng, [(40000, 32, 0), (30000, 1, 0)] + [(0, 0, 0)] * 62, num_heads=32, num_kv_heads=8,
                     head_dim=128, page=16, dtype=jnp.bfloat16)
    parts = {launch: planned_parts(step, launch, interpret=False).max() for launch in ("prefill", "decode")}
    assert parts == dict(prefill=16, decode=16)
    check_compiled(step, (ma.paged_attention_mosaic,))


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper_gpu(), reason="needs an NVIDIA Hopper GPU")
@pytest.mark.parametrize("num_heads", [32, 64])
def test_compiled_merge_kernel_matches_xla_merge_on_hopper(num_heads):
    """Passed on an H100 at 32 q heads (twenty-third session; at 64 the premise below was wrong, so the kernels never
    ran): the merge kernel of the split tiles (the default) against XLA's merge of the same partials
    (`merge_kernel=False`), float32 out, at the Llama-3-8B / -70B shapes in the engine's layout: 64 sequence slots, a
    32-token chunk at 40,000 keys, decodes at 30,000 and 100 keys and an empty KVP shard's decode, 16 partitions a
    launch; both against the float32 reference too."""
    rng = np.random.default_rng(18)
    step = make_step(rng, [(40000, 32, 0), (30000, 1, 0), (100, 1, 0), (0, 1, 0)] + [(0, 0, 0)] * 60,
                     num_heads=num_heads, num_kv_heads=8, head_dim=128, page=16, dtype=jnp.bfloat16)
    # the 32-token chunk's 32 x G rows make one 128-row tile at G = 4 and two at G = 8, which share the launch's 16
    # partitions (`_work_items`: 1 + 14 x 313 // 626 = 8 each; the twenty-third session's H100 run asserted 16 here)
    parts = {launch: planned_parts(step, launch, interpret=False).max() for launch in ("prefill", "decode")}
    assert parts["prefill"] == 16 // (num_heads // 32) and parts["decode"] > 1
    check_compiled(step, (ma.paged_attention_mosaic, functools.partial(ma.paged_attention_mosaic, merge_kernel=False)))
    kernel, xla = (run(ma.paged_attention_mosaic, step, out_dtype=jnp.float32, merge_kernel=m) for m in (True, False))
    np.testing.assert_allclose(np.asarray(kernel[0]), np.asarray(xla[0]), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(kernel[1]), np.asarray(xla[1]), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper_gpu(), reason="needs an NVIDIA Hopper GPU")
@pytest.mark.parametrize("options", [pytest.param({}, id="default-128"), pytest.param(dict(block_k=64), id="block64"),
                                     pytest.param(dict(overlap=True, max_registers=True), id="overlap"),
                                     pytest.param(dict(consumers=3), id="c3"),
                                     # the TTFT's candidates (twenty-third session, H100: chunk 8192 at 1M 155.4 /
                                     # 164.4 ms against the defaults' 186.5)
                                     pytest.param(dict(consumers=3, overlap=True), id="c3-overlap"),
                                     pytest.param(dict(consumers=3, pingpong=False), id="c3-no-turns"),
                                     pytest.param(dict(block_k=192, decode_block_k=192), id="block192"),
                                     pytest.param(dict(block_k=192, stages=4), id="block192-stages4")])
def test_compiled_kernels_at_head_dim_64_on_hopper_match_float32_reference(options):
    """The compiled kernels at the llama3.2-1b attention shape (32 q heads, 8 kv heads, head dim 64, page 16), whose
    prefill tiles take 128-key blocks by default (`prefill_block_k`), with 64-key blocks asked for, and with each
    block's softmax under the previous block's P V (`overlap`, registers redistributed), with three consumers (192-row
    programs of 48 tokens, FlashAttention-3's tile at this head dim), with three consumers and `overlap` or without
    turns (the llama3.2-1b TTFT's candidates, never run on a GPU: twenty-third session), and with 192-key blocks
    (nineteenth session, passed on an H100 in the twenty-third: FlashAttention-3's key block at this head dim without a
    causal mask), with a ring of 4 (which fits only without P's SMEM buffer)."""
    rng = np.random.default_rng(64)
    seqs = [(5000, 512, 0), (2100, 32, 0), (777, 7, 0), (4096, 1, 0), (1, 1, 0), (0, 3, 0), (900, 17, 3000)]
    step = make_step(rng, seqs, num_heads=32, num_kv_heads=8, head_dim=64, page=16, dtype=jnp.bfloat16, pad_rows=3)
    check_compiled(step, (functools.partial(ma.paged_attention_mosaic, **options),))


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper_gpu(), reason="needs an NVIDIA Hopper GPU")
@pytest.mark.parametrize("page", [16, 128])
@pytest.mark.parametrize("options", [pytest.param({}, id="default"),
                                     pytest.param(dict(overlap=False, pingpong=False), id="c3-no-turns")])
def test_compiled_default_compute_bound_prefill_at_head_dim_64_on_hopper_matches_float32_reference(options, page):
    """The thirty-eighth session's default at the llama3.2-1b attention shape (32 q heads, 8 kv heads, head dim 64):
    a step whose prefill tiles fill their 16 partitions takes three consumers with FlashAttention-3's loop and no
    split (`prefill_consumers`, `Codegen.for_launch`), against the float32 reference, with pages of 16 and of 128.
    The `gpu` tests of three consumers with `overlap` that passed on an H200 (thirty-eighth session) were split
    launches; this is the code the 1M-token TTFT ran. Also without that loop and without turns
    (`mosaic+consumers=3+overlap=false+pingpong=false`, the `long-c3` stage's candidate for the TTFT, whose `gpu`
    test, "hd64-c3-no-turns" of the pages-of-128 cases, is a split launch)."""
    rng = np.random.default_rng(page + 64)
    seqs = [(6000, 1024, 0), (2100, 32, 0), (777, 7, 0), (4096, 1, 0), (0, 3, 0), (900, 17, 3000)]
    step = make_step(rng, seqs, num_heads=32, num_kv_heads=8, head_dim=64, page=page, dtype=jnp.bfloat16)
    assert planned_tiles(step, interpret=False).prefill.lim_rows.shape[1] == 192
    assert planned_parts(step, "prefill", interpret=False).max() == 1
    check_compiled(step, (functools.partial(ma.paged_attention_mosaic, **options),))


# Pages of 128 keys (a 128-key prefill block one TMA copy of a whole page; a decode block half a page): timed on an
# H100 (twenty-third session: prefill 8.5-10.5% faster than with pages of 16) but never checked there. The defaults
# and the candidates the next runs time at this page size, as their labels run them: at head dim 128 FlashAttention-3's
# loop without turns (K released after Q K^T, `overlap`'s default) and with them, the chunk-2048 candidates against
# cuDNN; at head dim 64 the 1M-token TTFT's: three consumers with that loop, with and without turns, and without
# it and turns (`test_labels_timed_with_pages_of_128_have_their_gpu_test` holds the checklist's labels to these).
PAGES_OF_128 = {"hd128-default": (128, {}),
                "hd128-overlap-no-turns": (128, dict(overlap=True, pingpong=False)),
                "hd128-overlap": (128, dict(overlap=True)),
                "hd64-default": (64, {}),
                "hd64-c3-overlap": (64, dict(consumers=3, overlap=True)),
                "hd64-c3-overlap-no-turns": (64, dict(consumers=3, overlap=True, pingpong=False)),
                "hd64-c3-no-turns": (64, dict(consumers=3, overlap=False, pingpong=False)),
                "hd64-two-consumers": (64, dict(consumers=2))}


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper_gpu(), reason="needs an NVIDIA Hopper GPU")
@pytest.mark.parametrize("case", list(PAGES_OF_128))
def test_compiled_kernels_with_pages_of_128_on_hopper_match_float32_reference(case):
    """The compiled kernels at the Llama-3-8B / llama3.2-1b attention shapes (32 q heads, 8 kv heads, head dim 128 or
    64) with pages of 128 keys, on the steps of the tests above (a long prefill chunk, short chunks, decodes, an empty
    KVP shard, padding rows), against the float32 reference."""
    head_dim, options = PAGES_OF_128[case]
    rng = np.random.default_rng(head_dim + 128)
    seqs = [(5000, 512, 0), (2100, 32, 0), (777, 7, 0), (4096, 1, 0), (1, 1, 0), (0, 3, 0), (900, 17, 3000)]
    step = make_step(rng, seqs, num_heads=32, num_kv_heads=8, head_dim=head_dim, page=128, dtype=jnp.bfloat16,
                     pad_rows=3)
    consumers = options.get("consumers", ma.PREFILL_CONSUMERS)
    assert planned_tiles(step, interpret=False, consumers=consumers).prefill.block_k == 128  # one page a block
    check_compiled(step, (functools.partial(ma.paged_attention_mosaic, **options),))


def test_supports_says_what_check_shapes_accepts():
    """`supports` (what attention="auto" asks of a model) agrees with the kernels' own check: the Llama-3 shapes
    in bf16 / f16 with their page sizes yes; float32, another head dim, a page size that neither divides the 64-key
    block nor is a multiple of it, a GQA group that is not a power of two, no."""
    ok = dict(dtype=jnp.bfloat16, num_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
    assert ma.supports(**ok)
    assert ma.supports(**dict(ok, num_heads=64, page_size=128)) and ma.supports(**dict(ok, head_dim=64))
    assert ma.supports(**dict(ok, dtype=jnp.float16, page_size=8))
    for bad in (dict(dtype=jnp.float32), dict(head_dim=96), dict(page_size=24), dict(page_size=4),
                dict(num_heads=24), dict(num_heads=128, num_kv_heads=1)):
        assert not ma.supports(**dict(ok, **bad)), bad


def _layout(seqs, page: int = 16) -> AttentionMetadata:
    """A step's metadata alone (no cache): `seqs` as (keys after the step, query tokens), one page table row each."""
    pages = max(-(-keys // page) for keys, _ in seqs)
    seq_ids = np.concatenate([np.full(n, i, np.int32) for i, (_, n) in enumerate(seqs)])
    positions = np.concatenate([np.arange(keys - n, keys, dtype=np.int32) for keys, n in seqs])
    return AttentionMetadata(seq_ids=jnp.asarray(seq_ids), positions=jnp.asarray(positions),
                             page_table=jnp.zeros((len(seqs), pages), jnp.int32),
                             kv_lens=jnp.asarray([k for k, _ in seqs], jnp.int32),
                             kv_start=jnp.zeros(len(seqs), jnp.int32))


@pytest.mark.slow  # ~31 s (the default suite's ten minutes, forty-seventh session)
def test_compute_bound_prefill_at_head_dim_64_takes_three_consumers_with_overlap():
    """The thirty-eighth session's default (measured on an H100 and an H200, docs/benchmarks.md): at head dim 64 a
    compiled prefill launch that fills its partitions' worth of tiles takes programs of three consumers (192 rows:
    48 tokens at G = 4) with FlashAttention-3's loop and the register split; a memory-bound one (a short chunk at a
    long context, split over 16 partitions), another head dim, the interpreter, or consumers asked for keep what
    they had."""
    dims = dict(num_heads=32, num_kv_heads=8, head_dim=64, page_size=16)

    def rows(meta, **options):
        return ma.plan_step(meta, **dict(dims, **options)).prefill.lim_rows.shape[1]

    long_chunk = _layout([(5000, 1024), (300, 1)])  # 1,025 tokens: 21 tiles of 48 for 16 partitions
    short_chunk = _layout([(40000, 32), (300, 1)])  # 33 tokens: no tile of 48 for each of 16 partitions
    assert rows(long_chunk) == 192 and rows(short_chunk) == 128
    assert rows(_layout([(5000, 767)])) == 128 and rows(_layout([(5000, 768)])) == 192  # 15 and 16 tiles of 48
    assert rows(long_chunk, head_dim=128) == 128 and rows(long_chunk, interpret=True) == 128
    assert rows(long_chunk, consumers=2) == 128 and rows(short_chunk, consumers=3) == 192
    assert rows(long_chunk, num_partitions=32) == 128  # 21 tiles no longer fill the partitions asked for
    assert ma.prefill_consumers(long_chunk, **dims) == 3
    # code generation that a three-consumer program's SMEM cannot hold (`stages`, `registers`: the plan reads them
    # too) keeps two consumers, which fit: 3 slots of 192 keys with P through SMEM
    assert rows(long_chunk, block_k=192, stages=3, registers=False) == 128
    assert rows(long_chunk, block_k=192, stages=3) == 192 and rows(long_chunk, block_k=192, stages=4) == 192
    # the switch's planner plans for the interpreter when it runs (`plan_attention`)
    from models.attention import plan_attention
    assert plan_attention("mosaic", long_chunk, **dims).prefill.lim_rows.shape[1] == 192
    assert plan_attention("mosaic_interpret", long_chunk, **dims).prefill.lim_rows.shape[1] == 128
    # the code of such a launch (`for_launch`): FlashAttention-3's loop with K released early and registers split,
    # not for split, two-consumer or one-consumer launches, nor where overlap is refused or another loop asked for
    launch = dict(interpret=False, consumers=3, num_parts=1, head_dim=64, block_k=128)
    c = ma.Codegen().for_launch(**launch)
    assert (c.overlap, c.release_k, c.max_registers, c.pingpong, c.stages) == (True, True, True, True, 2)
    assert not ma.Codegen().for_launch(**dict(launch, num_parts=16)).overlap
    assert not ma.Codegen().for_launch(**dict(launch, consumers=2)).overlap
    assert not ma.Codegen().for_launch(**dict(launch, consumers=1, block_k=64)).overlap
    assert not ma.Codegen(overlap=False).for_launch(**launch).overlap
    assert not ma.Codegen().for_launch(**dict(launch, interpret=True)).overlap  # interpreted: each loop as asked
    for other in ("wait_k_in_pv", "fenced_softmax"):
        assert not ma.Codegen(**{other: True}).for_launch(**launch).overlap


@pytest.mark.slow  # (seven GPU kernels traced: ~24 s of the default suite's ten minutes on 2 cores)
def test_the_traced_three_consumer_kernel_is_the_default_at_head_dim_64():
    """The kernel traced for the GPU (no compile) at head dim 64 is the one asked for with consumers=3 and
    overlap=True (`test_compute_bound_prefill_at_head_dim_64_takes_three_consumers_with_overlap` plans it)."""
    step = make_step(np.random.default_rng(38), [(120, 100, 0)], num_heads=4, num_kv_heads=1, head_dim=64, page=16,
                     dtype=jnp.bfloat16)  # one partition (120 keys: one block), so no merge kernel
    assert planned_tiles(step, interpret=False).prefill.lim_rows.shape[1] == 192
    default = _kernel_primitives(step, consumers=None, fma_softmax=None)
    assert default == _kernel_primitives(step, consumers=3, overlap=True, fma_softmax=None)
    assert default != _kernel_primitives(step, consumers=3, overlap=False, fma_softmax=None)
    # and `prefill_attention`'s, which plans its own launch
    own = functools.partial(_kernel_primitives, step, ma.prefill_attention, fma_softmax=None)
    assert own(consumers=None) == own(consumers=3, overlap=True) == default
    # asked for code that does not fit three consumers, the default traces two (it raised before)
    small = dict(block_k=192, stages=3, registers=False, fma_softmax=None)
    assert _kernel_primitives(step, consumers=None, **small) == _kernel_primitives(step, consumers=2, **small)


def test_prefill_blocks_default_to_128_keys_at_head_dims_64_and_128():
    """The default prefill key block: 128 at head dims 64 and 128 where the page size allows it, else 64 (at 256
    two 128-key slots do not fit a two-consumer program, nor at 128 a three-consumer one); decode blocks stay 64;
    an asked-for block wins."""
    assert ma.prefill_block_k(64, 16) == 128 and ma.prefill_block_k(64, 256) == 128
    assert ma.prefill_block_k(64, 192) == 64  # 192 neither divides 128 nor is a multiple of it
    assert ma.prefill_block_k(128, 16) == 128 and ma.prefill_block_k(128, 8) == 128
    assert ma.prefill_block_k(128, 192) == 64 and ma.prefill_block_k(256, 16) == 64
    # three consumers: 128-key slots fit at head dim 64, not at 128; one consumer's fit at 128, not at 256
    assert ma.prefill_block_k(64, 16, 3) == 128 and ma.prefill_block_k(128, 16, 3) == 64
    assert ma.prefill_block_k(128, 16, 1) == 128 and ma.prefill_block_k(256, 16, 1) == 64
    step = make_step(np.random.default_rng(0), [(300, 20, 0), (90, 1, 0)], num_heads=32, num_kv_heads=8, head_dim=64,
                     page=16)
    meta = AttentionMetadata(**{k: v for k, v in step.items() if k not in ("q", "k_cache", "v_cache", "layer")})
    dims = dict(num_heads=32, num_kv_heads=8, page_size=16)
    tiles = ma.plan_step(meta, head_dim=64, **dims)
    assert (tiles.prefill.block_k, tiles.decode.block_k) == (128, 64)
    assert ma.plan_step(meta, head_dim=128, **dims).prefill.block_k == 128
    assert ma.plan_step(meta, head_dim=256, **dims).prefill.block_k == 64
    assert ma.plan_step(meta, head_dim=64, block_k=64, **dims).prefill.block_k == 64


@pytest.mark.parametrize("kind,want", [("mixed", 2), ("decode", 1), ("prefill", 1)])
def test_step_kind_launches_only_the_kernels_it_needs(kind, want):
    """As for the Triton kernels: a decode-only or prefill-only step traces one kernel launch, a mixed step two
    (traced only: the interpreter is slow; in it each Mosaic GPU kernel is an `mpmd_map` of its warpgroups)."""
    from tests.models.test_pallas_attention import _primitives

    rng = np.random.default_rng(5)
    step = make_step(rng, [(40, 1, 0), (23, 7, 0)], num_heads=4, num_kv_heads=1, head_dim=64, page=16,
                     dtype=jnp.bfloat16)
    fn = functools.partial(attention, "mosaic_interpret", block_pages=4, kind=kind)
    names = _primitives(jax.make_jaxpr(lambda s: run(fn, s))(step).jaxpr)
    assert names.count("mpmd_map") == want, sorted(set(names))
