"""Paged attention as Pallas Mosaic GPU kernels for Hopper (wgmma, TMA, warp specialisation): issue 15.

Same arguments and results as the reference `models.attention.paged_attention` and the Triton kernels of
`models.pallas_attention` (whose tilings, per-tile metadata, partition merge and scatter this module reuses):
every query token attends to the keys of its own sequence held in the paged cache [L, P, S, K, H] at local
index i < kv_lens[seq] and i <= positions[t] - kv_start[seq] (bottom-right causal, KVP shards included);
out f32[T, N, H], lse f32[T, N] in natural log; a token with no visible key gets out = 0 and lse = NEG_INF.

One kernel, two tilings (as in `models.pallas_attention`):
  - prefill tiles: the tokens of each sequence cut into tiles of 64 // G tokens, the G query heads of a kv head
    packed into the 64 rows of one wgmma tile (row = token x head of the group), so the group shares every K/V
    load; split-K over KV partitions (all of a tile's key blocks in one partition by default for prefill, more
    partitions for few tiles, e.g. one 32-token chunk at a long context);
  - decode tiles: one token per tile, its G heads as rows, split-K over partitions (FlashDecoding).
The grid is (tiles, kv heads, partitions). Each program (a CUDA block) holds two warpgroups:
  - a producer warpgroup copies the K and V blocks of its partition by TMA, page by page through the page table
    (one copy of `page_size` rows per page, or one slice of a page when pages are larger than a block), into a
    ring of STAGES SMEM slots, and waits on a "consumed" barrier before refilling a slot;
  - a consumer warpgroup runs the online softmax: S = Q K^T by wgmma (K transposed by the wgmma descriptor),
    masking only in the key blocks at the causal edge and the sequence end, P rounded to the input dtype and
    stored to SMEM, P V by wgmma, then releases the slot.
With one partition the consumer normalises and writes (out, lse) itself; with several it writes the partial
(acc, m, l) and `models.pallas_attention._merge` combines them exactly right after the kernel.

Supported (anything else raises, no fallback): bfloat16 or float16 q and cache (wgmma's 16-bit inputs; float32
accumulation, float32 softmax); head dim 64, 128 or 256 (a multiple of the 128-byte swizzle, at most wgmma's
N = 256); page size a multiple of 8 that divides the 64-key block (8, 16, 32, 64) or a multiple of it (128, 256,
...); G = num_heads / num_kv_heads a power of two <= 64; any chunk size, any context length, any ragged batch.

Numerics: as the Triton kernels with bf16 inputs: scores and softmax in float32, P rounded to bf16 for P V.

`interpret=True` runs the same kernel code in jax's Mosaic GPU interpreter (`InterpretGPUParams`, jax >= 0.10),
which simulates SMEM, barriers, TMA copies and wgmma on the CPU. What it lacks, and how this module bridges it
(checked against jax 0.10.2):
  - wgmma with a transposed SMEM operand (`plgpu.transpose_ref`): `_interpreter_transposed_wgmma` installs a
    wgmma callback that reads a trailing transpose (hardware wgmma supports it for 16-bit types);
  - `plgpu.layout_cast`, `plgpu.broadcasted_iota(layout=...)`, `plgpu.load(layout=...)` have no CPU rule: under
    the interpreter they are the plain jnp operations (layouts are a register-allocation hint, no value change);
  - `pl.run_state` / accumulating into a register-initialised ACC, and wgmma with its A operand in registers, do
    not run: so every wgmma here starts from a fresh zero ACC (the running output is rescaled and added in
    registers) and P goes through SMEM (FlashAttention-3 keeps P in registers: a cost measured on no GPU).
Nothing here has run on a GPU: the compiled path is only known to lower to the Mosaic GPU custom call for CUDA
(exported on the CPU, tests/models/test_mosaic_attention.py); its compilation to PTX, correctness and timings on a
Hopper GPU are unmeasured (issue 15).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from models import pallas_attention as pa
from models.kernels import DECODE, MIXED, NEG_INF, PREFILL

try:  # Mosaic GPU Pallas (jax >= 0.5); the interpreter from jax 0.10
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - depends on the jax version
    plgpu = None

LOG2E = math.log2(math.e)
ROWS = 64  # rows of a tile: one wgmma M tile, one consumer warpgroup
BLOCK_K = 64  # keys per block of the online softmax
STAGES = 2  # K/V SMEM slots in flight between the producer and the consumer
HEAD_DIMS = (64, 128, 256)
TARGET_PROGRAMS = 264  # grid size the KV partitions aim for (2 programs per SM of an H100 SXM, 132 SMs)
_TILE_INFO = 4  # i32 per tile: layer, sequence, keys every row sees, keys its furthest row sees


def _cdiv(a, b):
    return pa._cdiv(a, b)


def supported_page_size(page_size: int) -> bool:
    return page_size % 8 == 0 and (BLOCK_K % page_size == 0 or page_size % BLOCK_K == 0)


def check_shapes(q, k_cache, v_cache):
    """Raises ValueError naming what the Mosaic kernels support when (q, cache) falls outside it."""
    T, N, H = q.shape
    if k_cache.shape != v_cache.shape or k_cache.ndim != 5:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} must both be [L, P, S, K, H]")
    _, _, S, K, Hc = k_cache.shape
    if N % K or Hc != H:
        raise ValueError(f"q {q.shape} does not fit the cache {k_cache.shape} (N % K == 0, same head dim)")
    G = N // K
    dtypes = {jnp.dtype(q.dtype), jnp.dtype(k_cache.dtype), jnp.dtype(v_cache.dtype)}
    if len(dtypes) != 1 or dtypes.pop() not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError("the Mosaic GPU attention kernels need q and the KV cache in one 16-bit dtype "
                         f"(bfloat16 or float16: wgmma's inputs), got q {q.dtype}, cache {k_cache.dtype}; "
                         "use attention='pallas' or 'reference' for float32")
    if H not in HEAD_DIMS:
        raise ValueError(f"the Mosaic GPU attention kernels support head dims {HEAD_DIMS}, got {H}")
    if not supported_page_size(S):
        raise ValueError(f"the Mosaic GPU attention kernels need a page size that is a multiple of 8 and divides "
                         f"{BLOCK_K} or is a multiple of it (8, 16, 32, 64, 128, ...), got {S}")
    if G > ROWS or G & (G - 1):
        raise ValueError(f"the Mosaic GPU attention kernels need num_heads / num_kv_heads a power of two <= {ROWS}, "
                         f"got {N} / {K}")


# ------------------------------------------------------------------------------------------ interpreter
def _interpret_params():
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    _interpreter_transposed_wgmma()
    return InterpretGPUParams()


@functools.cache
def _interpreter_transposed_wgmma():
    """Teaches jax's Mosaic GPU interpreter (jax 0.10.2) wgmma operands with a trailing transpose.

    Its wgmma callback slices operands with `to_range`, which reads only indexers and fails on
    `plgpu.transpose_ref` ("'TransposeTransform' object has no attribute 'indices'"). This replacement is the
    same callback (read a, b and the accumulator from simulated SMEM, acc += a @ b in the accumulator's dtype)
    with a trailing transpose of a or b applied to the value read. Only the interpreter is touched; compiled
    kernels never call it.
    """
    import numpy as np
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as gc
    from jax._src.state.types import TransposeTransform

    missing = [n for n in ("wgmma", "_remove_noop_transforms", "_get_shared_memory", "HostAllocationKey",
                           "interpret_utils") if not hasattr(gc, n)]
    if missing:  # pragma: no cover - depends on the jax version
        raise RuntimeError(f"attention='mosaic_interpret' needs jax's Mosaic GPU interpreter as in jax 0.10.2; "
                           f"this jax ({jax.__version__}) lacks {missing}")

    def wgmma(*, token, device_id, grid_point_coords, thread_id, acc_allocation_key_as_array, acc_transforms,
              acc_dtype, a_allocation_key_as_array, a_transforms, b_allocation_key_as_array, b_transforms,
              source_info=None):
        device_id, thread_id = int(device_id), int(thread_id)
        coords = tuple(int(x) for x in grid_point_coords)
        shm = gc._get_shared_memory()
        gtid = shm.get_global_thread_id(device_id, thread_id)
        info = gc.interpret_utils.GPULoggingInfo(device_id=device_id, grid_point_coords=coords,
                                                 thread_id=thread_id, source_info=source_info)

        def where(transforms):
            transforms = tuple(gc._remove_noop_transforms(transforms))
            perm = None
            if transforms and isinstance(transforms[-1], TransposeTransform):
                perm, transforms = transforms[-1].permutation, transforms[:-1]
            if any(isinstance(t, TransposeTransform) for t in transforms):
                raise NotImplementedError("only a trailing transpose of a wgmma operand is interpreted")
            return gc.interpret_utils.to_range(jax.tree.map(int, transforms)), perm

        def read(key, transforms):
            rng, perm = where(transforms)
            x, _, _ = shm.get_buffer_content(gc.HostAllocationKey.from_array(key), rng, gtid, logging_info=info)
            return x if perm is None else np.transpose(x, perm)

        a = read(a_allocation_key_as_array, a_transforms)
        b = read(b_allocation_key_as_array, b_transforms)
        acc_key = gc.HostAllocationKey.from_array(acc_allocation_key_as_array)
        acc_range, perm = where(acc_transforms)
        assert perm is None
        acc, _, _ = shm.get_buffer_content(acc_key, acc_range, gtid, logging_info=info)
        shm.store_buffer_content(acc_key, acc_range, acc + np.matmul(a, b, dtype=acc_dtype), gtid,
                                 logging_info=info)
        return token

    gc.wgmma = wgmma


class _Ops:
    """The layout-carrying Mosaic GPU operations, or their plain-jnp values under the interpreter."""

    def __init__(self, interpret: bool):
        self.interpret = interpret

    def cast(self, x, layout):
        return x if self.interpret else plgpu.layout_cast(x, layout)

    def iota(self, shape, dim):
        if self.interpret:
            return lax.broadcasted_iota(jnp.int32, shape, dim)
        return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)

    def load_rows(self, ref):
        if self.interpret:
            return ref[...]
        return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(1))


# ------------------------------------------------------------------------------------------ the kernel
def _kernel(info_ref, lim_ref, table_ref, q_ref, k_ref, v_ref, *out_refs, num_parts: int, scale: float,
            ops: _Ops):
    """One (tile, kv head, partition) program: warpgroup 0 consumes, warpgroup 1 produces (TMA).

    info_ref i32[nt, 4] (layer, sequence, keys all rows see, keys the furthest row sees); lim_ref i32[nt, 64]
    keys each row sees; table_ref i32[B, M]; q_ref [nt, K, 64, H]; k_ref / v_ref the cache [L, P, S, K, H].
    Outputs: (out [nt, K, 64, H], lse [nt, K, 64]) normalised when num_parts == 1, else the partial
    (acc [nt, K, NP, 64, H], m [nt, K, NP, 64] base-2, l [nt, K, NP, 64]).
    """
    _, _, S, _, H = k_ref.shape
    max_pages = table_ref.shape[1]
    cdt = q_ref.dtype
    tr = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    scratch = [
        plgpu.SMEM((ROWS, H), cdt, transforms=tr),  # q
        plgpu.SMEM((STAGES, BLOCK_K, H), cdt, transforms=tr),  # k slots
        plgpu.SMEM((STAGES, BLOCK_K, H), cdt, transforms=tr),  # v slots
        plgpu.SMEM((ROWS, BLOCK_K), cdt, transforms=tr),  # p
        plgpu.SMEM((ROWS,), jnp.int32),  # keys each row sees
        plgpu.SMEM((ROWS, H), jnp.float32),  # output staging
        plgpu.SMEM((ROWS,), jnp.float32),  # lse / m staging
        plgpu.SMEM((ROWS,), jnp.float32),  # l staging
    ]
    copies = max(1, BLOCK_K // S)  # TMA copies per key block: one per page, or one slice of a large page
    barriers = [
        plgpu.Barrier(num_arrivals=2),  # q and the row limits landed
        plgpu.Barrier(num_arrivals=copies, num_barriers=STAGES),  # k slot full
        plgpu.Barrier(num_arrivals=copies, num_barriers=STAGES),  # v slot full
        plgpu.Barrier(num_arrivals=1, num_barriers=STAGES),  # slot consumed
    ]
    pl.run_scoped(functools.partial(_program, info_ref, lim_ref, table_ref, q_ref, k_ref, v_ref, out_refs,
                                    num_parts=num_parts, scale=scale, ops=ops, page_size=S, max_pages=max_pages),
                  *scratch, *barriers, collective_axes="wg")


def _program(info_ref, lim_ref, table_ref, q_ref, k_ref, v_ref, out_refs, q_smem, k_smem, v_smem, p_smem, lim_smem,
             o_smem, m_smem, l_smem, q_bar, k_bar, v_bar, consumed, *, num_parts, scale, ops, page_size,
             max_pages):
    t, kvh, part = lax.axis_index("tile"), lax.axis_index("kvh"), lax.axis_index("part")
    wg = lax.axis_index("wg")
    layer, seq, kv_full, kv_hi = (info_ref[t, i] for i in range(_TILE_INFO))
    head_dim = q_smem.shape[-1]
    cdt = q_smem.dtype

    # This partition's share of the tile's key blocks, and where the unmasked ones end.
    n_blocks = _cdiv(kv_hi, BLOCK_K)
    per_part = _cdiv(n_blocks, num_parts)
    lo = jnp.minimum(part * per_part, n_blocks)
    hi = jnp.minimum(lo + per_part, n_blocks)
    split = jnp.clip(lax.div(kv_full, BLOCK_K), lo, hi)

    @pl.when(wg == 1)
    def _producer():
        def fill(step, _):
            slot = lax.rem(step, STAGES)

            @pl.when(step >= STAGES)
            def _():
                plgpu.barrier_wait(consumed.at[slot])

            first = (lo + step) * BLOCK_K  # local index of the block's first key
            if page_size <= BLOCK_K:
                for i in range(BLOCK_K // page_size):
                    page = table_ref[seq, jnp.minimum(lax.div(first, page_size) + i, max_pages - 1)]
                    rows = pl.ds(i * page_size, page_size)
                    plgpu.copy_gmem_to_smem(k_ref.at[layer, page, :, kvh, :], k_smem.at[slot, rows], k_bar.at[slot])
                    plgpu.copy_gmem_to_smem(v_ref.at[layer, page, :, kvh, :], v_smem.at[slot, rows], v_bar.at[slot])
            else:
                page = table_ref[seq, jnp.minimum(lax.div(first, page_size), max_pages - 1)]
                rows = pl.ds(lax.rem(first, page_size), BLOCK_K)
                plgpu.copy_gmem_to_smem(k_ref.at[layer, page, rows, kvh, :], k_smem.at[slot], k_bar.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[layer, page, rows, kvh, :], v_smem.at[slot], v_bar.at[slot])
            return ()

        lax.fori_loop(0, hi - lo, fill, ())

    @pl.when(wg == 0)
    def _consumer():
        plgpu.copy_gmem_to_smem(q_ref.at[t, kvh], q_smem, q_bar)
        plgpu.copy_gmem_to_smem(lim_ref.at[t], lim_smem, q_bar)
        plgpu.barrier_wait(q_bar)
        lim = ops.load_rows(lim_smem)

        def block(step, carry, masked: bool):
            m, l, acc = carry
            slot = lax.rem(step - lo, STAGES)
            plgpu.barrier_wait(k_bar.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((ROWS, BLOCK_K), jnp.float32)) * scale  # base-2 logits
            if masked:
                idx = step * BLOCK_K + ops.iota((ROWS, BLOCK_K), 1)
                visible = idx < lax.broadcast_in_dim(lim, (ROWS, BLOCK_K), [0])
                s = jnp.where(visible, s, NEG_INF)
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            if masked:
                p = jnp.where(visible, p, 0.0)
            l = l * alpha + p.sum(axis=1)
            plgpu.barrier_wait(v_bar.at[slot])
            if masked:
                # Slots past the tile's last visible key may never have been written (another sequence's pages
                # behind unused page-table columns, uninitialised memory): zero them so 0 x NaN cannot reach out.
                key = step * BLOCK_K + ops.iota((BLOCK_K, head_dim), 0)
                v_slot = v_smem.at[slot]
                v_slot[...] = jnp.where(key < kv_hi, v_slot[...], jnp.zeros((), cdt))
            p_smem[...] = p.astype(cdt)
            plgpu.commit_smem()

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
                return acc_ref[...]

            out = pl.run_scoped(pv, plgpu.ACC((ROWS, head_dim), jnp.float32))
            plgpu.barrier_arrive(consumed.at[slot])
            return m_new, l, acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + out

        row = plgpu.Layout.WGMMA.reduce(1) if not ops.interpret else None
        carry = (ops.cast(jnp.full((ROWS,), NEG_INF, jnp.float32), row),
                 ops.cast(jnp.zeros((ROWS,), jnp.float32), row),
                 ops.cast(jnp.zeros((ROWS, head_dim), jnp.float32), None if ops.interpret else plgpu.Layout.WGMMA))
        carry = lax.fori_loop(lo, split, functools.partial(block, masked=False), carry)
        m, l, acc = lax.fori_loop(split, hi, functools.partial(block, masked=True), carry)

        if num_parts == 1:  # the merge is the normalisation: (out, lse) straight from the kernel
            out_ref, lse_ref = out_refs
            empty = l == 0.0
            safe = jnp.where(empty, 1.0, l)
            o_smem[...] = jnp.where(lax.broadcast_in_dim(empty, acc.shape, [0]), 0.0,
                                    acc / lax.broadcast_in_dim(safe, acc.shape, [0]))
            m_smem[...] = jnp.where(empty, NEG_INF, (m + jnp.log2(safe)) * (1.0 / LOG2E))
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, out_ref.at[t, kvh])
            plgpu.copy_smem_to_gmem(m_smem, lse_ref.at[t, kvh])
        else:
            acc_ref, m_ref, l_ref = out_refs
            o_smem[...] = acc
            m_smem[...] = m
            l_smem[...] = l
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, acc_ref.at[t, kvh, part])
            plgpu.copy_smem_to_gmem(m_smem, m_ref.at[t, kvh, part])
            plgpu.copy_smem_to_gmem(l_smem, l_ref.at[t, kvh, part])
        plgpu.wait_smem_to_gmem(0)


# ------------------------------------------------------------------------------------------ the wrappers
def _attend_tiles(q, k_cache, v_cache, layer, meta, tile_tok, *, num_partitions: int | None, interpret: bool):
    """Attention of the tokens laid out in tiles (tile_tok i32[nt, BQ], T = empty slot, one sequence per tile):
    out f32[nt, BQ, N, H], lse f32[nt, BQ, N]."""
    T, N, H = q.shape
    _, _, S, K, _ = k_cache.shape
    B, M = meta.page_table.shape
    nt, bq = tile_tok.shape
    G = N // K
    if bq * G > ROWS:
        raise ValueError(f"a tile of {bq} tokens x {G} heads exceeds the kernel's {ROWS} rows")

    tile_seq, kv_full, kv_hi, lim_rows, qt = pa._tile_metadata(q, meta, tile_tok, K, ROWS)  # the Triton kernels'
    info = jnp.stack([jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (nt,)), tile_seq, kv_full, kv_hi], axis=1)

    if num_partitions is None:
        num_partitions = max(1, min(_cdiv(M * S, BLOCK_K), _cdiv(TARGET_PROGRAMS, nt * K)))
    NP = num_partitions
    f32 = jnp.float32
    if NP == 1:
        out_shape = [jax.ShapeDtypeStruct((nt, K, ROWS, H), f32), jax.ShapeDtypeStruct((nt, K, ROWS), f32)]
    else:
        out_shape = [jax.ShapeDtypeStruct((nt, K, NP, ROWS, H), f32),
                     jax.ShapeDtypeStruct((nt, K, NP, ROWS), f32), jax.ShapeDtypeStruct((nt, K, NP, ROWS), f32)]
    ops = _Ops(interpret)
    kernel = plgpu.kernel(
        functools.partial(_kernel, num_parts=NP, scale=H ** -0.5 * LOG2E, ops=ops),
        out_type=out_shape,
        grid=(nt, K, NP), grid_names=("tile", "kvh", "part"),
        num_threads=2, thread_name="wg",
        **({"interpret": _interpret_params()} if interpret else {}),
    )
    outs = kernel(info, lim_rows, meta.page_table.astype(jnp.int32), qt, k_cache, v_cache)
    if NP == 1:
        out, lse = outs[0][:, :, :bq * G], outs[1][:, :, :bq * G]
    else:
        acc, m, l = (x[..., :bq * G, :] if x.ndim == 5 else x[..., :bq * G] for x in outs)
        out, lse = pa._merge(acc, m, l)
    out = out.reshape(nt, K, bq, G, H).transpose(0, 2, 1, 3, 4).reshape(nt, bq, N, H)
    lse = lse.reshape(nt, K, bq, G).transpose(0, 2, 1, 3).reshape(nt, bq, N)
    return out, lse


def _check(q, k_cache, v_cache, meta, interpret: bool):
    if plgpu is None:  # pragma: no cover - depends on the jax version
        raise RuntimeError("the Mosaic GPU attention kernels need jax.experimental.pallas.mosaic_gpu")
    check_shapes(q, k_cache, v_cache)
    if meta.page_table.shape[0] < 1 or meta.page_table.shape[1] < 1:
        raise ValueError(f"page_table must be [B >= 1, M >= 1], got {meta.page_table.shape}")


def block_q_for(num_heads: int, num_kv_heads: int) -> int:
    """Tokens per prefill tile: the query heads of a group x tokens fill the 64 rows."""
    return ROWS // (num_heads // num_kv_heads)


@pa._jit
def prefill_attention(q, k_cache, v_cache, layer, meta, *, interpret: bool = False,
                      num_partitions: int | None = None):
    """Chunked-prefill attention: every sequence's tokens in tiles of 64 // G tokens, split-K over
    `num_partitions` (default: enough programs to fill the GPU). Arguments and results as
    `models.attention.paged_attention` (but `block_pages`)."""
    _check(q, k_cache, v_cache, meta, interpret)
    T, N, H = q.shape
    B = meta.page_table.shape[0]
    bq = block_q_for(N, k_cache.shape[3])
    tiles = pa._sequence_tiles(meta.seq_ids, jnp.ones(T, bool), B, bq, T // bq + min(B, T))
    out, lse = _attend_tiles(q, k_cache, v_cache, layer, meta, tiles, num_partitions=num_partitions,
                             interpret=interpret)
    return pa._scatter(T, N, H, [(tiles, out, lse)])


@pa._jit
def decode_attention(q, k_cache, v_cache, layer, meta, *, interpret: bool = False,
                     num_partitions: int | None = None):
    """Decode attention (split-K, FlashDecoding): one tile per query token, its G heads as rows, the keys split
    over `num_partitions` partitions merged by log-sum-exp (in the kernel when there is one)."""
    _check(q, k_cache, v_cache, meta, interpret)
    T, N, H = q.shape
    tiles = pa._token_tiles(jnp.ones(T, bool), T)
    out, lse = _attend_tiles(q, k_cache, v_cache, layer, meta, tiles, num_partitions=num_partitions,
                             interpret=interpret)
    return pa._scatter(T, N, H, [(tiles, out, lse)])


@pa._jit
def paged_attention_mosaic(q, k_cache, v_cache, layer, meta, *, interpret: bool = False,
                           num_partitions: int | None = None, decode_partitions: int | None = None,
                           kind: str = MIXED):
    """A mixed step (what attention="mosaic" runs): tokens of one-token sequences (decodes) through decode tiles,
    the others through prefill tiles, two kernel launches with grids fixed by (T, B); `kind` DECODE or PREFILL
    (static: the step holds only those) launches only that kernel."""
    _check(q, k_cache, v_cache, meta, interpret)
    T, N, H = q.shape
    B = meta.page_table.shape[0]
    bq = block_q_for(N, k_cache.shape[3])
    counts = jnp.zeros(B, jnp.int32).at[meta.seq_ids].add(1)
    is_decode = counts[meta.seq_ids] == 1
    args = (q, k_cache, v_cache, layer, meta)
    parts = []
    if kind != PREFILL:
        dec = pa._token_tiles(is_decode, min(T, B))
        parts.append((dec, *_attend_tiles(*args, dec, num_partitions=decode_partitions, interpret=interpret)))
    num_prefill_tiles = T // bq + min(B, T // 2)
    if num_prefill_tiles and kind != DECODE:
        pre = pa._sequence_tiles(meta.seq_ids, ~is_decode, B, bq, num_prefill_tiles)
        parts.append((pre, *_attend_tiles(*args, pre, num_partitions=num_partitions, interpret=interpret)))
    return pa._scatter(T, N, H, parts)
