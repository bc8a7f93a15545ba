"""Paged attention as Pallas GPU (Triton) kernels: the attention contract of DESIGN.md, fast.

Same arguments and results as the reference `models.attention.paged_attention` (the step's layout as one
`models.attention.AttentionMetadata`, `meta`): every query token attends to the keys of its own sequence held in
the paged cache [L, P, S, K, H] at local index i < kv_lens[seq] and i <= positions[t] - kv_start[seq]
(bottom-right causal, KVP shards included); out f32[T, N, H], lse f32[T, N]
in natural log; a token with no visible key gets out = 0 and lse = NEG_INF. Keys and values are read straight
from the cache through the page table, one key row per page-table lookup, so a key block need not align with
pages and any page size works.

The work is cut into *tiles*: a tile is up to `block_q` query tokens of one sequence. All G query heads of a kv
head ride in the same tile, so one program's rows are (token, head of the group) pairs, R = block_q x G of
them (padded to a power of two >= 16, Triton's smallest matmul): the group shares every K/V load, and a
32-token chunk of a G=4 model fills a 128-row tile. The grid is (tiles, kv heads, KV partitions): each
program runs an online softmax (base 2) over its partition's share of the tile's key blocks. With several
partitions it writes a partial (acc, m, l), and `_merge` combines the partitions exactly (log-sum-exp) before
the results are scattered into token order; splitting the keys (split-K, FlashDecoding) keeps the GPU busy when
there are few tiles, e.g. one 32-token chunk at 1M context. With one partition the program normalises and
writes its rows straight into the token-order outputs (a row of token t and query head h to out[t, h]; padding
rows to a sink row T, sliced off), and a mixed step's second kernel writes into the first's buffers (aliased),
so no merge, transpose or scatter follows the kernels.

Two tilings, one kernel:
  - prefill tiles (`prefill_attention`): the tokens of each sequence cut into tiles of `block_q` tokens;
  - decode tiles (`decode_attention`): one token per tile, rows = its G heads, many partitions.
`paged_attention_pallas` (what `attention="pallas"` runs) sends the tokens of one-token sequences (decodes) to
decode tiles and the rest to prefill tiles, in the same step. Grid sizes are static given (T, B, M): prefill
tiles number T // block_q + min(B, T // 2) (every sequence adds at most one partial tile), decode tiles
min(T, B); tiles a step does not use exit at once. `persistent=True` launches instead a work-list grid:
(programs, kv heads), each program looping over the step's (tile, partition) items, only tiles with keys to
read, each tile cut into partitions by the keys it reads (not by the page table's capacity), so no partition is
empty and no program only exits unless the whole step has fewer items than the grid has programs (the grid is
static: sizing it from the device would need a host sync). It is the same arithmetic per item and is checked
in Pallas' interpreter and lowered to Triton on the CPU, but has not run on a GPU: off by default until
`scripts/bench_attention.py --persistent` measures it against the static grid. The per-tile metadata (which
tokens, which sequence, how far each row sees) is computed on device with jnp, so the kernels need no host work
and run inside jit and shard_map.

Masking: a key block all of whose keys every row of the tile sees runs without a mask; only the blocks at the
causal edge (and the sequence end) compute one. Rows of padding and rows whose sequence has no visible key are
masked everywhere and come out with l = 0.

Numerics: scores and the softmax in float32 whatever the input dtype; with bf16 inputs the probabilities are
rounded to bf16 for the P @ V matmul (as FlashAttention does), bounding the output error by 2^-9 max|v|; with
float32 inputs (and precision None or HIGHEST, as `ModelSpec` passes) every matmul is IEEE float32, no TF32, and
results equal the reference to float32 rounding. The tilings and per-tile metadata do not depend on the layer:
`plan_step` computes them once per step (the model calls it before its layer loop) and every layer's
`paged_attention_pallas(..., tiles=...)` reads them; called without `tiles`, a call plans its own.

`interpret=True` runs the same kernels in Pallas' interpreter (any backend, e.g. the CPU tests).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import config as jax_config  # `_check_vma`, see _interpret_call
from jax.experimental import pallas as pl

from models.kernels import DECODE, MIXED, NEG_INF, PREFILL

try:  # jax >= 0.4.31 names the Triton flavour `triton`; older ones `gpu`.
    from jax.experimental.pallas import triton as _pltriton
except ImportError:  # pragma: no cover - depends on the jax version
    from jax.experimental.pallas import gpu as _pltriton

# Triton's compiler options class: `CompilerParams` (jax >= 0.5), `TritonCompilerParams` before.
_CompilerParams = getattr(_pltriton, "CompilerParams", None) or getattr(_pltriton, "TritonCompilerParams", None)
_SQ = getattr(pl, "squeezed", None)  # a squeezed block dimension: `pl.squeezed` where it exists, else None

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

ROWS_PER_TILE = 128  # prefill tile rows (tokens x group heads) on a GPU: one 128-row MMA tile
BLOCK_K = 64  # keys per block of a prefill tile's online softmax
DECODE_BLOCK_K = 128  # keys per block of a decode tile (16-row tiles: larger key blocks, fewer iterations)
TARGET_PROGRAMS = 1024  # grid size the KV partitions aim for (~8 programs per SM of an H100/H200)
MAX_PARTIAL_BYTES = 1 << 28  # cap on the float32 partial results of one call (256 MiB)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _cdiv(a, b):
    """Ceiling division of non-negative ints: Python ints stay static, traced ones avoid floor-division's sign
    fix-ups (plain truncating division is exact for non-negative operands)."""
    if isinstance(a, int) and isinstance(b, int):
        return -(-a // b)
    return lax.div(a + b - 1, b)


def _out_struct(shape, dtype, like):
    """ShapeDtypeStruct varying over the same manual mesh axes as `like`, so a pallas_call type-checks inside
    `jax.shard_map(check_vma=True)`. The field is `manual_axis_type` in jax 0.10, `vma` in some older ones."""
    aval = jax.typeof(like)
    params = inspect.signature(jax.ShapeDtypeStruct).parameters
    for name in ("manual_axis_type", "vma"):
        if name in params and getattr(aval, name, None) is not None:
            return jax.ShapeDtypeStruct(shape, dtype, **{name: getattr(aval, name)})
    return jax.ShapeDtypeStruct(shape, dtype)


def _varying_axes(x) -> frozenset:
    """The manual mesh axes `x` varies over inside shard_map (empty outside)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()) or ())


def _typed_like(operands):
    """A scalar varying over every mesh axis some operand varies over (only its type is used: dead code)."""
    return functools.reduce(jnp.add, [x[(0,) * x.ndim].astype(jnp.float32) for x in operands])


def _interpret_call(call, operands):
    """Runs an interpreted pallas_call (`call(like)` builds it, outputs typed like `like`), in shard_map too.

    Pallas' interpreter (run when the step is lowered) slices each block out of its operand with grid indices
    that vary over no mesh axis, which the varying-axes check rejects when the operand varies (jax 0.10:
    "dynamic_slice requires varying manual axes to match"). So the operands enter the call typed as varying
    over no axis (an identity `+ 0` traced with the check off), and its outputs are typed back as varying over
    every axis an operand varies over, which is what they are. Only the interpreter needs this: the compiled
    kernel is not traced per block.
    """
    axes = frozenset().union(*map(_varying_axes, operands))
    check_vma = getattr(jax_config, "_check_vma", None)
    if not axes or check_vma is None:
        return call(operands[0])(*operands)
    with check_vma(False):
        operands = [x + jnp.zeros((), x.dtype) for x in operands]
    outs = call(operands[0])(*operands)
    return [lax.pcast(o, tuple(sorted(axes)), to="varying") for o in outs]


def _compiler_params(rows: int):
    warps = 8 if rows >= 128 else 4
    if _CompilerParams is None:  # pragma: no cover - very old jax
        return dict(triton=dict(num_warps=warps, num_stages=2))
    return _CompilerParams(num_warps=warps, num_stages=2)


# ---------------------------------------------------------------------------------------------- the kernel
def _partition(layer, b, kv_full, kv_hi, q, lim, table_ref, k_ref, v_ref, kvh, part, num_parts, *,
               block_k: int, scale: float, precision):
    """Online softmax (base 2) of one tile's query rows over partition `part` of `num_parts` of its key blocks.

    layer, b (the tile's sequence), kv_full / kv_hi (the keys every row / the furthest row of the tile sees),
    kvh, part, num_parts: i32 scalars; q [R, H] the rows of (tile, kv head); lim i32[R] the keys each row sees
    (local index < lim); table_ref i32[B, M]; k_ref / v_ref the whole cache [L, P, S, K, H]. Returns (m [R], the
    running max of the base-2 scores; l [R], the sum of weights; acc [R, H], unnormalised), all float32.
    """
    page_size = k_ref.shape[2]
    max_pages = table_ref.shape[1]
    rows, head_dim = q.shape
    cdt = q.dtype  # compute dtype of the matmuls (accumulation is float32)

    # This partition's share of the tile's key blocks, and where the unmasked ones end.
    n_blocks = _cdiv(kv_hi, block_k)
    per_part = _cdiv(n_blocks, num_parts)
    lo = jnp.minimum(part * per_part, n_blocks)
    hi = jnp.minimum(lo + per_part, n_blocks)
    split = jnp.clip(lax.div(kv_full, block_k), lo, hi)

    def block(j, carry, masked: bool):
        m, l, acc = carry
        idx = j * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)  # local key index
        pages = table_ref[b, jnp.minimum(lax.div(idx, page_size), max_pages - 1)]
        slots = lax.rem(idx, page_size)
        k = k_ref[layer, pages, slots, kvh, :].astype(cdt)  # [block_k, H]
        v = v_ref[layer, pages, slots, kvh, :].astype(cdt)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * scale  # [R, block_k], base-2 logits
        if masked:
            visible = idx[None, :] < lim[:, None]
            s = jnp.where(visible, s, NEG_INF)
            # Slots past the tile's last visible key may never have been written (uninitialised memory, other
            # sequences' pages via unused page-table columns): zero them so 0 x NaN cannot reach the output.
            v = jnp.where((idx < kv_hi)[:, None], v, jnp.zeros_like(v))
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        if masked:
            p = jnp.where(visible, p, 0.0)
        l = l * alpha + p.sum(axis=1)
        pv = lax.dot_general(p.astype(cdt), v, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)
        return m_new, l, acc * alpha[:, None] + pv

    carry = (jnp.full((rows,), NEG_INF, jnp.float32), jnp.zeros((rows,), jnp.float32),
             jnp.zeros((rows, head_dim), jnp.float32))
    carry = lax.fori_loop(lo, split, functools.partial(block, masked=False), carry)
    return lax.fori_loop(split, hi, functools.partial(block, masked=True), carry)


def _write_rows(tok, kvh, group: int, m, l, acc, out_ref, lse_ref):
    """Normalises one (tile, kv head)'s rows and writes them in token order: row r to (tok[r], kvh x G + r % G)
    of out [T + 1, N, H] (in its dtype: one rounding of the float32 result) and lse f32[T + 1, N] (natural log); a
    row with no visible key (l = 0) gets (0, NEG_INF); padding rows and empty slots have tok = T, the sink row."""
    rows = tok.shape[0]
    head = kvh * group + lax.rem(lax.broadcasted_iota(jnp.int32, (rows,), 0), group)
    empty = l == 0.0
    safe = jnp.where(empty, 1.0, l)
    out_ref[tok, head, :] = jnp.where(empty[:, None], 0.0, acc / safe[:, None]).astype(out_ref.dtype)
    lse_ref[tok, head] = jnp.where(empty, NEG_INF, (m + jnp.log2(safe)) * LN2)


def _kernel(layer_ref, seq_ref, full_ref, hi_ref, lim_ref, q_ref, table_ref, k_ref, v_ref,  # inputs
            *rest, block_k: int, num_parts: int, scale: float, precision, group: int | None):
    """One (tile, kv head, partition) program of the static grid.

    layer_ref i32[1]; seq_ref / full_ref / hi_ref i32[nt]: the tile's sequence, the keys every row of it sees,
    the keys its furthest row sees; lim_ref i32[R]: keys each row sees (local index < lim); q_ref [R, H];
    table_ref i32[B, M]; k_ref / v_ref the whole cache [L, P, S, K, H].

    With several partitions (`group` None), `rest` is this (tile, kv head, partition)'s outputs: acc [R, H]
    (unnormalised), m [R] (running max of base-2 scores) and l [R] (sum of weights). With one (`group` = G, the
    query heads per kv head), `rest` is (row_tok_ref i32[R], the token of each row: T for padding and empty
    slots; the input buffers out [T + 1, N, H] and lse [T + 1, N], aliased to the outputs; the outputs): the
    program normalises and writes its rows straight into token order, row r to (row_tok[r], kv head x G + r % G),
    so no merge, transpose or scatter follows the kernel (row T is a sink for padding rows, sliced off).
    """
    t, kvh, part = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    m, l, acc = _partition(layer_ref[0], seq_ref[t], full_ref[t], hi_ref[t], q_ref[...], lim_ref[...], table_ref,
                           k_ref, v_ref, kvh, part, num_parts, block_k=block_k, scale=scale, precision=precision)
    if group is None:
        acc_ref, m_ref, l_ref = rest
        acc_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l
        return
    row_tok_ref, _, _, out_ref, lse_ref = rest  # (the two inputs are the outputs' buffers: aliased)
    _write_rows(row_tok_ref[...], kvh, group, m, l, acc, out_ref, lse_ref)


def _persistent_kernel(layer_ref, seq_ref, full_ref, hi_ref, parts_ref, count_ref, item_tile_ref, item_part_ref,
                       lim_ref, q_ref, table_ref, k_ref, v_ref,  # inputs
                       *rest, block_k: int, programs: int, scale: float, precision, group: int | None):
    """One program of the persistent grid (programs, kv heads): it runs the work items pid, pid + programs, ...
    below count_ref[0], each one partition of one tile (`item_tile_ref`, `item_part_ref`), so only items that
    hold keys are run and no program of a step with at least `programs` items only exits.

    parts_ref i32[nt]: the partitions tile t is cut into (0 for a tile with no key to read); lim_ref i32[nt, R],
    q_ref [nt, K, R, H] (the rows of every tile: indexed by the item's tile); the rest as `_kernel`'s. With
    several partitions (`group` None) `rest` is the whole partial outputs acc [nt, K, NP, R, H], m and l
    [nt, K, NP, R] (the slots of partitions a tile does not have are left unwritten: the merge ignores them);
    with one, as `_kernel`'s but with row_tok_ref i32[nt, R].
    """
    pid, kvh = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]

    def item(j, carry):
        i = pid + j * programs
        t, part = item_tile_ref[i], item_part_ref[i]
        m, l, acc = _partition(layer, seq_ref[t], full_ref[t], hi_ref[t], q_ref[t, kvh], lim_ref[t], table_ref,
                               k_ref, v_ref, kvh, part, parts_ref[t], block_k=block_k, scale=scale,
                               precision=precision)
        if group is None:
            acc_ref, m_ref, l_ref = rest
            acc_ref[t, kvh, part] = acc
            m_ref[t, kvh, part] = m
            l_ref[t, kvh, part] = l
        else:
            row_tok_ref, _, _, out_ref, lse_ref = rest
            _write_rows(row_tok_ref[t], kvh, group, m, l, acc, out_ref, lse_ref)
        return carry

    lax.fori_loop(0, _cdiv(jnp.maximum(count_ref[0] - pid, 0), programs), item, 0)


def _work_items(kv_hi, num_kv_heads: int, num_parts: int, block_k: int):
    """The persistent grid's work list: which tiles hold keys to read, cut into how many partitions.

    kv_hi i32[nt]: the keys each tile's furthest row sees. With one partition (`num_parts` 1) every tile that
    reads a key is one item; with several, a tile of n key blocks gets min(num_parts, ceil(n / per_item))
    partitions, per_item = the step's key blocks x kv heads / TARGET_PROGRAMS (at least 1): partitions sized by
    the contexts the step holds rather than by the page table's capacity, so they share the work evenly and
    none is empty. Returns parts i32[nt], count i32[1] (the items) and item_tile / item_part i32[nt x
    num_parts] (item i's tile and its partition there; entries from count on are unused).
    """
    nt = kv_hi.shape[0]
    n_blocks = _cdiv(kv_hi, block_k)
    if num_parts == 1:
        parts = (n_blocks > 0).astype(jnp.int32)
    else:
        per_item = jnp.maximum(_cdiv(n_blocks.sum() * num_kv_heads, TARGET_PROGRAMS), 1)
        parts = jnp.minimum(_cdiv(n_blocks, per_item), num_parts).astype(jnp.int32)
    size = nt * num_parts
    first = jnp.cumsum(parts) - parts  # each tile's first item
    item_tile = jnp.repeat(jnp.arange(nt, dtype=jnp.int32), parts, total_repeat_length=size)
    item_part = jnp.arange(size, dtype=jnp.int32) - first[item_tile]
    return parts, parts.sum(keepdims=True), item_tile, item_part


# ---------------------------------------------------------------------------------------------- the step's plan
@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("tok", "seq", "full", "hi", "lim_rows", "row_tok", "work", "q_tok", "q_start"),
                   meta_fields=("block_k", "num_parts", "programs"))
@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch's tiles and per-tile metadata: what depends on the step's layout (`AttentionMetadata`)
    and static shapes only, never on the layer, so a step computes it once (`plan_step`) and every layer's
    launch reads it.

    tok i32[nt, BQ]: the token of each tile slot (T = empty), all of one sequence per tile; seq i32[nt]: the
    tile's sequence; full / hi i32[nt]: the keys every row / its furthest row sees; lim_rows i32[nt, R]: the keys
    each row (token x head of the group, padded) sees; row_tok i32[nt, R]: with one partition, the token of each
    row (T for padding rows and empty slots: the sink row), where the kernel writes it, else None; work: the
    persistent grid's work list (`_work_items`) or None for the static grid. Static: block_k keys per block,
    num_parts KV partitions, programs the persistent grid's programs per kv head (0: the static grid). The Mosaic
    kernels' launches also carry q_tok i32[Tq] (the launch's tokens in the order of its tiles and slots, without
    the empty slots; T in the gaps that start each tile at a multiple of 8 rows, and past them) and q_start
    i32[nt] (where each tile's first token is in q_tok): a tile's tokens
    are consecutive there, so its query rows are one slice of q gathered in that order (`mosaic_attention`);
    the Triton kernels' launches leave them None.
    """

    tok: jax.Array
    seq: jax.Array
    full: jax.Array
    hi: jax.Array
    lim_rows: jax.Array
    row_tok: jax.Array | None
    work: tuple | None
    block_k: int
    num_parts: int
    programs: int
    q_tok: jax.Array | None = None
    q_start: jax.Array | None = None


@functools.partial(jax.tree_util.register_dataclass, data_fields=("decode", "prefill"), meta_fields=("kind",))
@dataclasses.dataclass(frozen=True)
class StepTiles:
    """A step's launches (`Launch`, None for a kind the step does not launch), planned once per step by
    `plan_step` and passed to every layer's `paged_attention_pallas(..., tiles=...)`."""

    decode: Launch | None
    prefill: Launch | None
    kind: str


def _rows_per_tile(block_q: int, group: int) -> int:
    """Rows of a program: tokens x heads of the group, padded to a power of two >= 16 (Triton's smallest dot)."""
    return _next_pow2(max(16, block_q * group))


def _launch(meta, tile_tok, *, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, rows: int,
            block_k: int, num_partitions: int | None, persistent: bool = False,
            programs: int | None = None) -> Launch:
    """The `Launch` of the tiles `tile_tok` (i32[nt, BQ]) in programs of `rows` rows: per-tile metadata, KV
    partitions (`num_partitions`, default enough for ~TARGET_PROGRAMS programs, capped by the partial results'
    bytes) and, `persistent`, the work list and the grid's programs per kv head (`programs`, default
    TARGET_PROGRAMS / kv heads)."""
    if programs is not None and (not persistent or programs < 1):
        raise ValueError(f"programs (the persistent grid's size) needs persistent=True and >= 1, got {programs}")
    nt = tile_tok.shape[0]
    K, H = num_kv_heads, head_dim
    seq, full, hi, lim_rows = _tile_layout(meta, tile_tok, num_heads // num_kv_heads, rows)
    NP = num_partitions
    if NP is None:
        max_blocks = _cdiv(meta.page_table.shape[1] * page_size, block_k)
        NP = max(1, min(max_blocks, _cdiv(TARGET_PROGRAMS, nt * K),
                        MAX_PARTIAL_BYTES // (nt * K * rows * (H + 2) * 4)))
    work, grid = None, 0
    if persistent:
        work = _work_items(hi, K, NP, block_k)
        grid = min(nt * NP, programs or _cdiv(TARGET_PROGRAMS, K))
    row_tok = None
    if NP == 1:
        T, G, bq = meta.seq_ids.shape[0], num_heads // num_kv_heads, tile_tok.shape[1]
        row_tok = jnp.pad(jnp.repeat(tile_tok, G, axis=1), ((0, 0), (0, rows - bq * G)), constant_values=T)
    return Launch(tok=tile_tok, seq=seq, full=full, hi=hi, lim_rows=lim_rows, row_tok=row_tok, work=work,
                  block_k=block_k, num_parts=NP, programs=grid)


def _attend_tiles(q, k_cache, v_cache, layer, meta, launch: Launch, *, precision, interpret: bool, into: tuple):
    """Attention of the tokens laid out in `launch`'s tiles. `into` are the token-order buffers (out f32[T + 1, N,
    H], lse f32[T + 1, N], row T a sink); returns them with these tiles' tokens written: by the kernel itself with
    one KV partition, else merged and scattered after it.

    The grid: (tiles, kv heads, partitions), every program one (tile, kv head, partition), those of empty tiles
    and partitions exiting at once; or, a persistent launch, (programs, kv heads), each program looping over the
    step's work items (`_work_items`: only tiles with keys to read, partitions sized by the step's contexts)."""
    T, N, H = q.shape
    K = k_cache.shape[3]
    B, M = meta.page_table.shape
    tile_tok = launch.tok
    nt, bq = tile_tok.shape
    G = N // K
    R = launch.lim_rows.shape[1]
    block_k = launch.block_k
    if not interpret and (block_k < 16 or block_k & (block_k - 1)):
        raise ValueError(f"the compiled kernels need key blocks of a power of two >= 16 keys, got {block_k}")
    cdt = jnp.promote_types(q.dtype, k_cache.dtype)
    if precision is None:
        precision = lax.Precision.HIGHEST if cdt == jnp.float32 else lax.Precision.DEFAULT

    qt = _tile_rows(q.astype(cdt), tile_tok, K, R)
    NP = launch.num_parts
    direct = NP == 1
    scale = H ** -0.5 * LOG2E
    layer = jnp.reshape(layer, (1,)).astype(jnp.int32)
    table = meta.page_table.astype(jnp.int32)

    if launch.work is not None:
        programs = launch.programs
        grid = (programs, K)
        kernel = functools.partial(_persistent_kernel, block_k=block_k, programs=programs, scale=scale,
                                   precision=precision, group=G if direct else None)
        whole = lambda shape: pl.BlockSpec(shape, lambda p, k: (0,) * len(shape))  # noqa: E731
        parts, count, item_tile, item_part = launch.work
        in_specs = [whole((1,)), whole((nt,)), whole((nt,)), whole((nt,)), whole((nt,)), whole((1,)),
                    whole(item_tile.shape), whole(item_part.shape), whole((nt, R)), whole((nt, K, R, H)),
                    whole((B, M)), whole(k_cache.shape), whole(v_cache.shape)]
        operands = [layer, launch.seq, launch.full, launch.hi, parts, count, item_tile, item_part, launch.lim_rows,
                    qt, table, k_cache, v_cache]
        row_tok_spec = whole((nt, R))
        partial_specs = [whole((nt, K, NP, R, H)), whole((nt, K, NP, R)), whole((nt, K, NP, R))]
    else:
        grid = (nt, K, NP)
        kernel = functools.partial(_kernel, block_k=block_k, num_parts=NP, scale=scale, precision=precision,
                                   group=G if direct else None)
        whole = lambda shape: pl.BlockSpec(shape, lambda t, k, p: (0,) * len(shape))  # noqa: E731
        in_specs = [
            whole((1,)),  # layer
            whole((nt,)), whole((nt,)), whole((nt,)),  # tile sequence, keys all rows see, keys any row sees
            pl.BlockSpec((_SQ, R), lambda t, k, p: (t, 0)),  # keys each row sees
            pl.BlockSpec((_SQ, _SQ, R, H), lambda t, k, p: (t, k, 0, 0)),  # q rows of (tile, kv head)
            whole((B, M)),  # page table
            whole(k_cache.shape), whole(v_cache.shape),
        ]
        operands = [layer, launch.seq, launch.full, launch.hi, launch.lim_rows, qt, table, k_cache, v_cache]
        row_tok_spec = pl.BlockSpec((_SQ, R), lambda t, k, p: (t, 0))
        partial_specs = [pl.BlockSpec((_SQ, _SQ, _SQ, R, H), lambda t, k, p: (t, k, p, 0, 0)),
                         pl.BlockSpec((_SQ, _SQ, _SQ, R), lambda t, k, p: (t, k, p, 0)),
                         pl.BlockSpec((_SQ, _SQ, _SQ, R), lambda t, k, p: (t, k, p, 0))]
    if direct:
        axes = frozenset().union(*map(_varying_axes, operands))
        in_specs += [row_tok_spec, whole((T + 1, N, H)), whole((T + 1, N))]
        operands += [launch.row_tok, *(_varying(x, axes) for x in into)]
        out_specs = [whole((T + 1, N, H)), whole((T + 1, N))]
        shapes = [((T + 1, N, H), into[0].dtype), ((T + 1, N), jnp.float32)]
        aliases = {len(operands) - 2: 0, len(operands) - 1: 1}
    else:
        out_specs = partial_specs
        shapes = [((nt, K, NP, R, H), jnp.float32), ((nt, K, NP, R), jnp.float32), ((nt, K, NP, R), jnp.float32)]
        aliases = {}
    name = (f"paged_attention_r{R}_k{block_k}" + ("_tokens" if direct else "")
            + ("_persistent" if launch.work is not None else ""))
    call = lambda like: pl.pallas_call(  # noqa: E731  (out_shape varies over the mesh axes `like` varies over)
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=[_out_struct(shape, dtype, like) for shape, dtype in shapes],
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=_compiler_params(R),
        name=name,
    )
    outs = _interpret_call(call, operands) if interpret else call(_typed_like(operands))(*operands)
    if direct:
        return tuple(outs)

    acc, m, l = outs
    if launch.work is not None:  # a tile's slots past its partitions were never written (uninitialised): dropped
        written = (jnp.arange(NP) < launch.work[0][:, None])[:, None, :, None]  # [nt, 1, NP, 1]
        acc = jnp.where(written[..., None], acc, 0.0)
        m, l = jnp.where(written, m, NEG_INF), jnp.where(written, l, 0.0)
    out, lse = _merge(acc[..., :bq * G, :], m[..., :bq * G], l[..., :bq * G])  # [nt, K, BQ*G, (H)]
    out = out.reshape(nt, K, bq, G, H).transpose(0, 2, 1, 3, 4).reshape(nt, bq, N, H)
    lse = lse.reshape(nt, K, bq, G).transpose(0, 2, 1, 3).reshape(nt, bq, N)
    return _scatter_into(into, [(tile_tok, out, lse)])  # empty slots (T) land in the sink row


def _token_order_buffers(T: int, N: int, H: int, dtype, k_cache):
    """((out, lse), k_cache): the token-order outputs before any tile writes them, out 0 (in `dtype`) and lse
    NEG_INF (a token no tile holds, e.g. a padding row of a one-kind step, has no visible key), with a sink row T
    for padding rows and empty slots; and the cache, to read after them (`blank_buffers`)."""
    return blank_buffers((T + 1, N, H), dtype, k_cache)


FILL_IN_LAYER_BYTES = 4 << 20  # out buffers from this size are filled in their layer (`blank_buffers`)


def blank_buffers(shape: tuple[int, int, int], dtype, k_cache):
    """((out zeros of `shape` [T, N, H] in `dtype`, lse f32[T, N] NEG_INF), k_cache): buffers of
    `FILL_IN_LAYER_BYTES` or more are filled only after the layer has written its keys to `k_cache` (their fill
    values pass an optimization barrier with it, and the cache returned is the barrier's, for the caller's kernels
    to read), so the compiler can neither fill them before the layer nor merge every layer's fills into one kernel.
    Left free, XLA's GPU compiler fuses all layers' fills into one kernel at the step's start, every layer's
    buffers alive at once: 512 MiB of the 648 MiB of scratch of a Llama-3-8B prefill step of 2,048 tokens, 1.9 of
    2.6 GiB at 8,192 (`scripts/aot_step.py`, its temp MiB column). Smaller buffers (a decode step's: up to 256
    rows of Llama-3-8B in bf16) stay free: one fill kernel for all layers costs less than two a layer. The cache,
    not q, carries the dependency: it exists already, where q would have to be written out for the barrier
    instead of fused into the kernels' tiling."""
    if math.prod(shape) * jnp.dtype(dtype).itemsize < FILL_IN_LAYER_BYTES:
        return (jnp.zeros(shape, dtype), jnp.full(shape[:2], NEG_INF, jnp.float32)), k_cache
    zero, neg_inf, k_cache = lax.optimization_barrier((jnp.zeros((), dtype), jnp.float32(NEG_INF), k_cache))
    return (jnp.broadcast_to(zero, shape), jnp.broadcast_to(neg_inf, shape[:2])), k_cache


def _out_dtype(q, out_dtype):
    """The dtype of out: q's (the model's: the kernels write it once, rounded from float32) unless float32 is asked
    for (a KVP rank's partial, which the merge across ranks needs unrounded)."""
    dtype = jnp.dtype(q.dtype if out_dtype is None else out_dtype)
    if dtype not in (jnp.dtype(q.dtype), jnp.dtype(jnp.float32)):
        raise ValueError(f"out_dtype must be q's dtype ({q.dtype}) or float32, got {dtype}")
    return dtype


def _varying(x, axes: frozenset):
    """`x` typed as varying over the mesh axes `axes` (inside shard_map), as a kernel output aliased to it is."""
    missing = tuple(sorted(axes - _varying_axes(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def _tile_layout(meta, tile_tok, group: int, rows: int):
    """Per-tile metadata of the tiles `tile_tok` (i32[nt, BQ], T = empty slot, one sequence per tile) for
    programs of `rows` rows (row = token x head of a group of `group` query heads, padded): tile_seq i32[nt] (the
    tile's sequence), kv_full i32[nt] (keys every token of it sees), kv_hi i32[nt] (keys its furthest token sees)
    and lim_rows i32[nt, rows] (keys each row sees; 0 for padding). Depends on the step's layout only."""
    T = meta.seq_ids.shape[0]
    valid = tile_tok < T  # [nt, BQ]
    tok = jnp.minimum(tile_tok, T - 1)
    tile_seq = jnp.where(valid[:, 0], meta.seq_ids[tok[:, 0]], 0).astype(jnp.int32)  # [nt]
    lim = jnp.minimum(meta.kv_lens[tile_seq][:, None], meta.positions[tok] - meta.kv_start[tile_seq][:, None] + 1)
    lim = jnp.where(valid, jnp.maximum(lim, 0), 0).astype(jnp.int32)  # [nt, BQ] keys each token sees
    kv_hi = lim.max(axis=1)
    kv_full = jnp.where(valid.any(axis=1), jnp.where(valid, lim, jnp.iinfo(jnp.int32).max).min(axis=1), 0)
    lim_rows = jnp.pad(jnp.repeat(lim, group, axis=1), ((0, 0), (0, rows - lim.shape[1] * group)))
    return tile_seq, kv_full.astype(jnp.int32), kv_hi, lim_rows


def _tile_rows(q, tile_tok, num_kv_heads: int, rows: int):
    """The query rows of the tiles `tile_tok`: qt [nt, K, rows, H] in q's dtype (row = token x head of the group,
    padding rows 0)."""
    T, N, H = q.shape
    nt, bq = tile_tok.shape
    K = num_kv_heads
    G = N // K
    qt = jnp.concatenate([q, jnp.zeros((1, N, H), q.dtype)])[tile_tok]  # [nt, BQ, N, H]
    qt = qt.reshape(nt, bq, K, G, H).transpose(0, 2, 1, 3, 4).reshape(nt, K, bq * G, H)
    return jnp.pad(qt, ((0, 0), (0, 0), (0, rows - bq * G), (0, 0)))  # [nt, K, R, H]


def _merge(acc, m, l):
    """Exact merge of the partitions (axis 2) of partial softmaxes in base 2: out and natural-log lse."""
    m_max = m.max(axis=2)
    w = jnp.exp2(m - m_max[:, :, None])  # an empty partition has l = 0, so its weight does not matter
    l_sum = (l * w).sum(axis=2)
    acc_sum = (acc * w[..., None]).sum(axis=2)
    empty = l_sum == 0.0
    safe = jnp.where(empty, 1.0, l_sum)
    out = jnp.where(empty[..., None], 0.0, acc_sum / safe[..., None])
    lse = jnp.where(empty, NEG_INF, (m_max + jnp.log2(safe)) * LN2)
    return out, lse


def _scatter_into(into, parts):
    """The token-order buffers `into` = (out [T', N, H], lse [T', N]) with the rows of the tiles
    [(tile_tok, out_tiles, lse_tiles), ...] set (each token in exactly one slot; out cast to the buffer's dtype).
    An empty slot (T) lands in the sink row when T' = T + 1, else is dropped."""
    out, lse = into
    N, H = out.shape[1:]
    idx = jnp.concatenate([tt.reshape(-1) for tt, _, _ in parts])
    return (out.at[idx].set(jnp.concatenate([o.reshape(-1, N, H) for _, o, _ in parts]).astype(out.dtype),
                            mode="drop"),
            lse.at[idx].set(jnp.concatenate([s.reshape(-1, N) for _, _, s in parts]), mode="drop"))


# ---------------------------------------------------------------------------------------------- tilings
def _sequence_tiles(seq_ids, include, num_seqs: int, block_q: int, num_tiles: int):
    """i32[num_tiles, block_q]: the included tokens of each sequence, cut into tiles of block_q (T = empty)."""
    T = seq_ids.shape[0]
    key = jnp.where(include, seq_ids, num_seqs)  # excluded tokens sort after every sequence
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    skey = key[order]
    counts = jnp.zeros(num_seqs + 1, jnp.int32).at[key].add(1)[:num_seqs]
    first = jnp.cumsum(counts) - counts  # sorted index of each sequence's first token
    tiles = _cdiv(counts, block_q)
    tile0 = jnp.cumsum(tiles) - tiles
    sb = jnp.minimum(skey, num_seqs - 1)
    rank = jnp.arange(T, dtype=jnp.int32) - first[sb]
    tile = jnp.where(skey < num_seqs, tile0[sb] + rank // block_q, num_tiles)  # excluded: out of range, dropped
    return jnp.full((num_tiles, block_q), T, jnp.int32).at[tile, rank % block_q].set(order, mode="drop")


def _token_tiles(include, num_tiles: int):
    """i32[num_tiles, 1]: the included tokens, one per tile, in order (T = empty)."""
    T = include.shape[0]
    dest = jnp.where(include, jnp.cumsum(include) - 1, num_tiles)
    return jnp.full((num_tiles,), T, jnp.int32).at[dest].set(jnp.arange(T, dtype=jnp.int32), mode="drop")[:, None]


def step_tilings(meta, *, kind: str, block_q: int):
    """The token tilings of a step's launches, (decode i32[min(T, B), 1], prefill i32[nt, block_q]), None for a
    kind `kind` does not launch: the tokens of one-token sequences (decodes) one per decode tile, the others by
    sequence in prefill tiles of `block_q` tokens, at most T // block_q + min(B, T // 2) of them (a prefill
    sequence has >= 2 tokens: at most one partial tile each). Static sizes given (T, B)."""
    T = meta.seq_ids.shape[0]
    B = meta.page_table.shape[0]
    counts = jnp.zeros(B, jnp.int32).at[meta.seq_ids].add(1)
    is_decode = counts[meta.seq_ids] == 1
    dec = _token_tiles(is_decode, min(T, B)) if kind != PREFILL else None
    num_prefill_tiles = T // block_q + min(B, T // 2)
    pre = None
    if num_prefill_tiles and kind != DECODE:
        pre = _sequence_tiles(meta.seq_ids, ~is_decode, B, block_q, num_prefill_tiles)
    return dec, pre


def _default_block_q(num_heads: int, num_kv_heads: int) -> int:
    return max(1, ROWS_PER_TILE // (num_heads // num_kv_heads))


def _check(q, k_cache, v_cache, meta, interpret: bool):
    T, N, H = q.shape
    if k_cache.shape != v_cache.shape or k_cache.ndim != 5:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} must both be [L, P, S, K, H]")
    if N % k_cache.shape[3] or k_cache.shape[4] != H:
        raise ValueError(f"q {q.shape} does not fit the cache {k_cache.shape} (N % K == 0, same head dim)")
    if not interpret and (H < 16 or H & (H - 1)):
        raise ValueError(f"the compiled kernels need a head dim that is a power of two >= 16, got {H}")
    if meta.page_table.shape[0] < 1 or meta.page_table.shape[1] < 1:
        raise ValueError(f"page_table must be [B >= 1, M >= 1], got {meta.page_table.shape}")


def _jit(fn, dynamic: tuple = ()):
    """jax.jit with every keyword-only argument (the kernel's options) static, but those named in `dynamic`."""
    static = [n for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY and n not in dynamic]
    return jax.jit(fn, static_argnames=static)


def plan_step(meta, *, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, kind: str = MIXED,
              block_q: int | None = None, block_k: int = BLOCK_K, decode_block_k: int = DECODE_BLOCK_K,
              num_partitions: int | None = None, decode_partitions: int | None = None, persistent: bool = False,
              programs: int | None = None) -> StepTiles:
    """A step's launches for `paged_attention_pallas` (options as its own; num_heads / num_kv_heads / head_dim /
    page_size: q's heads and the cache's shape as the kernels see them, i.e. per device): the tilings and per-tile
    metadata, from the step's layout `meta` alone. The model computes it once per step and every layer's
    attention reads it (`tiles=`), so no layer recomputes it, whatever the compiler would merge."""
    if kind not in (MIXED, DECODE, PREFILL):
        raise ValueError(f"kind must be one of {(MIXED, DECODE, PREFILL)}, got {kind!r}")
    G = num_heads // num_kv_heads
    bq = block_q or _default_block_q(num_heads, num_kv_heads)
    dims = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                persistent=persistent, programs=programs)
    dec, pre = step_tilings(meta, kind=kind, block_q=bq)
    return StepTiles(
        decode=None if dec is None else _launch(meta, dec, rows=_rows_per_tile(1, G), block_k=decode_block_k,
                                                num_partitions=decode_partitions, **dims),
        prefill=None if pre is None else _launch(meta, pre, rows=_rows_per_tile(bq, G), block_k=block_k,
                                                 num_partitions=num_partitions, **dims),
        kind=kind)


def _one_launch(q, k_cache, v_cache, layer, meta, tile_tok, *, precision, interpret, block_q: int, block_k: int,
                num_partitions, persistent, programs, out_dtype):
    T, N, H = q.shape
    K = k_cache.shape[3]
    launch = _launch(meta, tile_tok, num_heads=N, num_kv_heads=K, head_dim=H, page_size=k_cache.shape[2],
                     rows=_rows_per_tile(block_q, N // K), block_k=block_k, num_partitions=num_partitions,
                     persistent=persistent, programs=programs)
    into, k_cache = _token_order_buffers(T, N, H, _out_dtype(q, out_dtype), k_cache)
    out, lse = _attend_tiles(q, k_cache, v_cache, layer, meta, launch, precision=precision, interpret=interpret,
                             into=into)
    return out[:T], lse[:T]


@_jit
def prefill_attention(q, k_cache, v_cache, layer, meta, *, precision=None, interpret: bool = False,
                      block_q: int | None = None, block_k: int = BLOCK_K, num_partitions: int | None = None,
                      persistent: bool = False, programs: int | None = None, out_dtype=None):
    """Chunked-prefill attention: every sequence's tokens in tiles of `block_q` (default 128 // G), split-K
    over `num_partitions` KV partitions (default: enough for ~TARGET_PROGRAMS programs). Any ragged batch.
    `persistent`: the work-list grid of `_attend_tiles`, `programs` programs per kv head (default
    TARGET_PROGRAMS / kv heads); no faster than the static grid on an H200 (docs/benchmarks.md), so off by default.

    Arguments and results as `models.attention.paged_attention`, whose `block_pages` has no use here (the
    kernel's key block is `block_k` keys), but that out is in `out_dtype`: q's dtype by default (the kernel
    rounds its float32 result once, as it writes it), or float32.
    """
    _check(q, k_cache, v_cache, meta, interpret)
    T, N, _ = q.shape
    B = meta.page_table.shape[0]
    bq = block_q or _default_block_q(N, k_cache.shape[3])
    tiles = _sequence_tiles(meta.seq_ids, jnp.ones(T, bool), B, bq, T // bq + min(B, T))
    return _one_launch(q, k_cache, v_cache, layer, meta, tiles, precision=precision, interpret=interpret,
                       block_q=bq, block_k=block_k, num_partitions=num_partitions, persistent=persistent,
                       programs=programs, out_dtype=out_dtype)


@_jit
def decode_attention(q, k_cache, v_cache, layer, meta, *, precision=None, interpret: bool = False,
                     block_k: int = DECODE_BLOCK_K, num_partitions: int | None = None, persistent: bool = False,
                     programs: int | None = None, out_dtype=None):
    """Decode attention (FlashDecoding): one tile per query token, its G heads as rows, the keys split over
    `num_partitions` partitions. Correct for any batch; efficient when each sequence has one query token.
    `persistent`, `programs` as `prefill_attention`'s.

    Arguments and results as `prefill_attention`'s.
    """
    _check(q, k_cache, v_cache, meta, interpret)
    tiles = _token_tiles(jnp.ones(q.shape[0], bool), q.shape[0])
    return _one_launch(q, k_cache, v_cache, layer, meta, tiles, precision=precision, interpret=interpret,
                       block_q=1, block_k=block_k, num_partitions=num_partitions, persistent=persistent,
                       programs=programs, out_dtype=out_dtype)


def _paged_attention_pallas(q, k_cache, v_cache, layer, meta, *, precision=None, interpret: bool = False,
                            block_q: int | None = None, block_k: int = BLOCK_K,
                            decode_block_k: int = DECODE_BLOCK_K, num_partitions: int | None = None,
                            decode_partitions: int | None = None, kind: str = MIXED, persistent: bool = False,
                            programs: int | None = None, tiles: StepTiles | None = None, out_dtype=None):
    """A mixed step: tokens of one-token sequences (decodes) through decode tiles, the others through prefill
    tiles, both kernels launched with grids fixed by (T, B, M); `kind` DECODE or PREFILL (static: the step holds
    only those) launches only that kernel; `persistent` launches them as work-list grids of `programs`
    programs per kv head (`prefill_attention`). `tiles`: the step's launches planned once (`plan_step`, which
    takes the tiling options and `kind` instead: giving them here too raises). Arguments and results as
    `prefill_attention`'s: out in q's dtype or `out_dtype` float32, both kernels writing into the same buffers."""
    _check(q, k_cache, v_cache, meta, interpret)
    T, N, H = q.shape
    options = dict(block_q=block_q, block_k=block_k, decode_block_k=decode_block_k, num_partitions=num_partitions,
                   decode_partitions=decode_partitions, persistent=persistent, programs=programs)
    if tiles is None:
        tiles = plan_step(meta, num_heads=N, num_kv_heads=k_cache.shape[3], head_dim=H,
                          page_size=k_cache.shape[2], kind=kind, **options)
    elif options != _TILING_DEFAULTS or kind != MIXED:
        given = sorted(k for k, v in options.items() if v != _TILING_DEFAULTS[k]) + (["kind"] if kind != MIXED else [])
        raise ValueError(f"tiles were planned with their own options (plan_step); got {', '.join(given)} too")
    out, k_cache = _token_order_buffers(T, N, H, _out_dtype(q, out_dtype), k_cache)  # each kernel writes here
    for launch in (tiles.decode, tiles.prefill):
        if launch is not None:
            out = _attend_tiles(q, k_cache, v_cache, layer, meta, launch, into=out, precision=precision,
                                interpret=interpret)
    return out[0][:T], out[1][:T]


_TILING = ("block_q", "block_k", "decode_block_k", "num_partitions", "decode_partitions", "persistent", "programs")
_TILING_DEFAULTS = {name: p.default for name, p in inspect.signature(_paged_attention_pallas).parameters.items()
                    if name in _TILING}  # what `plan_step` takes instead when the call is given `tiles`
paged_attention_pallas = _jit(_paged_attention_pallas, dynamic=("tiles",))
