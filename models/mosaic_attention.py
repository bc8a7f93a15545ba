"""Paged attention as Pallas Mosaic GPU kernels for Hopper (wgmma, TMA, warp specialisation): issue 15.

Same arguments and results as the reference `models.attention.paged_attention` and the Triton kernels of
`models.pallas_attention` (whose tilings, per-tile metadata, partition merge and scatter this module reuses):
every query token attends to the keys of its own sequence held in the paged cache [L, P, S, K, H] at local
index i < kv_lens[seq] and i <= positions[t] - kv_start[seq] (bottom-right causal, KVP shards included);
out [T, N, H] in q's dtype (bf16 or f16: the model's dtype; the reference and the Triton kernels give float32)
or, asked with `out_dtype=float32`, in float32 (a KVP rank's partial: the merge across ranks must see it
unrounded), lse f32[T, N] in natural log; a token with no visible key gets out = 0 and lse = NEG_INF.

One kernel, two tilings (as in `models.pallas_attention`):
  - prefill tiles: the tokens of each sequence cut into tiles of C x 64 // G tokens (C consumer warpgroups of 64
    rows: PREFILL_CONSUMERS = 2, or 3 for compute-bound launches at head dim 64, `prefill_consumers`), the G query
    heads of a kv head packed into the rows (row = token x head of
    the group), so the group shares every K/V load, and both consumers share each block the producer loads;
    split-K over KV partitions when the step holds few tiles (e.g. one 32-token chunk at a long context);
  - decode tiles: one token per tile, its G heads as the rows of one consumer, split-K over partitions
    (FlashDecoding).
A consumer's 64 rows of Q are one TMA copy from one gather of q a layer (`_query_rows`): the launch's tokens in
the order of its tiles (`_query_order`, in the plan), kv-head-major, each tile from a multiple of 8 rows.
The grid is (work items, kv heads): an item is a (tile, partition) of the step's plan (`_work_items`), the
partitions chosen per step from the tiles that hold tokens and their key blocks, not from the static tile count:
the tiles of a launch share one wave of programs (`default_partitions`), so one chunk's tile at a long
context takes 16 partitions at the Llama-3 shapes (8 kv heads, 128 programs) whatever the step's other sequence
slots, which the engine's page table has one of per request it can hold. Programs past the step's items do
nothing. Each program (a CUDA block) holds C + 1 warpgroups:
  - a producer warpgroup (the last) copies the K and V blocks of its partition by TMA, page by page through the
    page table (one copy of `page_size` rows per page, or one slice of a page when pages are larger than a block),
    into a ring of `stages` SMEM slots, and waits on a "consumed" barrier (an arrival from every consumer) before
    refilling a slot; with `lookahead` it loads the next block's page-table entries before that wait;
  - C consumer warpgroups, each with its own 64 rows of Q, P and accumulator, run the online softmax on every block:
    S = Q K^T by wgmma (K transposed by the wgmma descriptor), masking only in the key blocks at the causal edge and
    the sequence end, P rounded to the input dtype, P V by wgmma (compiled: P in registers and the accumulator
    updated in place, as in FlashAttention-3; interpreted: P through SMEM), then release the slot. The block holding
    the tile's last visible key may hold unwritten slots past it: consumer 0 zeroes them in the shared slot and the
    others wait on a barrier for that before their P V.
Two consumers per prefill program (measured on an H200: chunk 2048 from ~270 to ~435 TFLOP/s) double the rows each K/V
block's load serves: a 64-row program does 64 FLOPs per byte it loads from L2, which caps it near what both this kernel
with one consumer and the Triton kernels reached. Three (`consumers=3`: FlashAttention-3's 192-row tile at head dim
64, the default for compute-bound launches there since the thirty-eighth session, `prefill_consumers`; on an H100,
twenty-third session, the llama3.2-1b shape's chunk 8192 at 1M 186.5 ms with two, 187.0 with three, 164.4 without
turns and 155.4 with `overlap`; on an H200, thirty-eighth session, 183.1 -> 154.6 ms with `overlap` at pages of 16,
158.2 -> 147.0 at pages of 128; an option elsewhere: the Llama-3-8B shape's chunk 2048 70.1 -> 74.7 ms on the H100)
need their registers redistributed (`register_split`, on by default for them) and take turns on a ring of barriers, a
token passed from consumer to consumer (`_program`).
Code generation per launch (`Codegen.for_launch`, each a keyword that overrides it), as measured fastest on an H200 or
an H100: P in registers when compiled, and then the prefill consumers taking turns on the tensor cores (`pingpong`,
as FlashAttention-3 and jax's `attention_mgpu`); memory-bound launches (decode tiles, split-K launches: few tiles at a
long context) with the deepest ring that fits the SMEM (with 64-key blocks 4 slots at head dims 64 and 128; a
two-consumer split-K launch's 128-key blocks at head dim 128 fit 2, and then take no turns), compute-bound ones
(prefill tiles of two or three consumers, one partition) with 2 slots; prefill key blocks of 128 at head dims 64 and 128
(`prefill_block_k`), else 64 (192, an option at head dim 64: FlashAttention-3's key block there without a causal mask,
slower on an H100, 186.5 -> 196.0 ms at the llama3.2-1b shape's chunk 8192); `fma_softmax` (one multiply-add per score
for the exponent, as jax's `attention_mgpu`) for compute-bound prefill launches (at every head dim since the eighteenth
session; on an H100 at head dim 128 chunk 2048 69.1 against 68.3 ms without, within the spread of the runs);
`max_registers` (`plgpu.set_max_registers`: consumers 232 per thread, the producer 40) for three consumers and under
`overlap` only. The eighteenth session turned it on for compute-bound two-consumer launches, whose 168 registers a
thread spill ~540 bytes in the key-block loop at head dim 128 with 128-key blocks (ptxas,
`scripts/kernel_resources.py`); measured on an H100 (twenty-third session, 1M keys) the spilling kernel is the faster:
chunk 2048 of the Llama-3-8B shape 69.1 -> 63.2 ms without the split, 508 -> 556 TFLOP/s, and the llama3.2-1b shape's
chunk 8192 186.8 -> 183.4 ms, so it is off there again. `overlap`: on for compiled compute-bound launches of three
consumers (the head-dim-64 default). Off, as measured no faster on an H200 (sixteenth session,
Llama-3-8B shape at 1M, each alone against the defaults): `release_k` (the K slot freed after Q K^T on its own barrier;
chunk 2048 75.8 -> 80.4 ms), `wait_k_in_pv` (the next K waited for during P V; 79.3) and `fenced_softmax` (the softmax
finished before the turn is handed over; 75.7), each as `attention_mgpu` does; those three, with `max_registers` and
`fma_softmax` and 128-key blocks (the one run of the new defaults together, with the three off options besides): 70.4
against 66.1 with 128-key blocks alone. Off but for three consumers: `overlap` (on an H100, twenty-third session, chunk
2048 65.8 ms, 62.4 without turns, against 69.1 with the defaults then; chunk 32 1.98 ms without the register split,
1.48 with it, which it now takes by default; on an H200, thirty-eighth session, pages of 128, the 8B shape's chunk 2048
13.98 against 15.07 ms at 256K and 59.59 against 61.60 at 1M, the 70B shape's 129.2 against 126.9 at 1M, one sample
each), FlashAttention-3's loop (its overlap inside a warpgroup, which neither `attention_mgpu` nor the
default loop has): each block's Q K^T and the previous block's P V issued back to back, in the consumer's turn on a ring
of barriers, then the block's softmax under that P V, P carried from block to block and K's slot freed after Q K^T
(`release_k`).
The output staging (below) shares SMEM with the ring and P (`plgpu.RefUnion`: they are dead once every consumer's
loop ends, which the consumers wait for with a barrier when C > 1). P has a buffer (64 x block_k per consumer) only
where it goes through SMEM (`registers=False`, the interpreter's path; nineteenth session: compiled with P in
registers, none, `program_smem_bytes(p_in_smem=False)`). With 2 slots and P's buffer a decode program takes 54,328 /
95,288 / 177,208 bytes at head dim 64 / 128 / 256 (Mosaic's count; 8,192 less without P's buffer; with separate
staging head dim 256 and a float32 output exceeded a block's 227 KB), and a two-consumer prefill program with 64-key
blocks 70,744 / 119,896 / 218,200 (16,384 less without P's) and holds an SM alone (its registers too); each further
slot adds 4 x block_k x head dim bytes (`program_smem_bytes`): a decode program with the default 4 slots at head dim
128 (160,824 bytes with P's buffer) also holds an SM alone (at 1M keys 1.04 ms, against 1.12 with 2 slots and two
programs per SM, P in registers both), so its partitions are one wave of 128 programs, not two of 264
(`default_partitions`, which counts P's buffer, as the interpreter's path has it: without, two still do not fit); at
head dim 64 a 4-slot decode program still fits two per SM.
With one partition the consumer normalises and writes (out, lse) itself, in token order: the tile's token i
(index `tile_tok[t, i]`, read from GMEM) owns rows i*G .. i*G+G-1, a [G, H] box that one TMA copy takes from the
SMEM staging (in q's dtype) to out[tok, kvh*G : kvh*G+G, :], and its G lse floats by a second TMA copy when G % 4
== 0 (a TMA row is a multiple of 16 bytes), else by scalar stores; an empty slot (tok == T) writes nothing. A step's
two launches (decode tiles, prefill tiles) then write into the same buffers: the second takes the first's outputs
as mutable refs (`jax.new_ref`, aliased in and out of the kernel), every token written by exactly one tile; a
one-kind step (`kind` decode or prefill) starts them at (0, NEG_INF), what a token of the other kind gets. So no
slice, transpose, merge or scatter follows the kernel. A tile split over several partitions writes a float32 partial
(acc, m, l) per partition, at its item's index (below the most partitions a tile may take, `num_parts`: the partial
buffers are that small; only the rows its tokens take: a decode tile's G rounded up to 8, not 64), and one more kernel
right after the launch (`_merge_partials`, a program per split tile, kv head and consumer's rows, one warpgroup, the
partials TMA-copied through a ring of 4 SMEM slots, 2 at head dim 256) merges each split tile's partials exactly
(log-sum-exp, online: to float32 rounding) and writes their rows in token order into the same buffers, as a
one-partition program writes its own (eighteenth session: in the engine's decode step it replaces three XLA fusions and
a scatter a layer, `scripts/aot_step.py --show_layer`; on an H100, twenty-third session, its GPU time is 0.010-0.012 ms
a decode layer, and decode B=1 measured 0.403 / 1.522 ms at 256K / 1M against 0.421 / 1.490 with XLA's merge);
`merge_kernel=False` gives XLA's merge and scatter back (`_merge_items`, `pa._scatter_into`) for a side-by-side
measurement.

Supported (anything else raises, no fallback): bfloat16 or float16 q and cache (wgmma's 16-bit inputs; float32
accumulation, float32 softmax); head dim 64, 128 or 256 (a multiple of the 128-byte swizzle, at most wgmma's
N = 256); page size a multiple of 8 that divides the 64-key block (8, 16, 32, 64) or a multiple of it (128, 256,
...); G = num_heads / num_kv_heads a power of two <= 64; any chunk size, any context length, any ragged batch.

Numerics: as the Triton kernels with bf16 inputs: scores and softmax in float32, P rounded to bf16 for P V.

`interpret=True` runs the same kernel code in jax's Mosaic GPU interpreter (`InterpretGPUParams`, jax >= 0.10),
which simulates SMEM, barriers, TMA copies and wgmma on the CPU. What it lacks, and how this module bridges it
(checked against jax 0.10.2 and 0.11.2):
  - jax 0.10 only: wgmma with a transposed SMEM operand (`ref.transpose`, which `plgpu.transpose_ref`, deprecated
    in 0.11, calls): `_interpreter_transposed_wgmma` installs a wgmma callback that reads a trailing transpose
    (hardware wgmma supports it for 16-bit types); jax 0.11's interpreter reads it itself;
  - `plgpu.layout_cast`, `plgpu.broadcasted_iota(layout=...)`, `plgpu.load(layout=...)` have no CPU rule: under
    the interpreter they are the plain jnp operations (layouts are a register-allocation hint, no value change);
  - `pl.run_state` / accumulating into a register-initialised ACC, and wgmma with its A operand in registers, do
    not run: so interpreted, every wgmma here starts from a fresh zero ACC (the running output is rescaled and
    added in registers) and P goes through SMEM (`registers` defaults to False there, and True raises); compiled,
    P stays in registers and the P V wgmma accumulates in place, as FlashAttention-3 does (`registers`, default
    True there: the `gpu` tests check it against the float32 reference, which the CPU cannot);
  - jax 0.10 only: a `plgpu.RefUnion` hangs the interpreter: the staging and the ring are separate buffers there
    (the same values; jax 0.11's interpreter runs the union, and its race detector checks the disjoint lifetimes);
  - `copy_smem_to_gmem(..., predicate=...)` raises "predicate not supported": the token-order copies of an empty
    slot are skipped by `pl.when` instead;
  - `plgpu.kernel` wraps the kernel in a custom_vmap that rejects mutable-ref operands ("JaxprInputEffect ... does
    not have a corresponding jaxpr input"): the launches go through `pl.kernel` on a `plgpu.Mesh` (what it wraps),
    the refs in GMEM (`memory_space=plgpu.GMEM`; the interpreter cannot place a ref of no memory space).
Compiled and run on an H200 (2026-11-26, jax 0.11.2): every launch kind and option matched the float32 reference
(the `gpu` tests of tests/models/test_mosaic_attention.py); timings in docs/benchmarks.md (issue 15).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import config as jax_config  # `_check_vma`, as `plgpu.kernel` uses it
from jax.experimental import pallas as pl

from models import pallas_attention as pa
from models.kernels import DECODE, MIXED, NEG_INF, PREFILL

try:  # Mosaic GPU Pallas (jax >= 0.5); the interpreter from jax 0.10
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - depends on the jax version
    plgpu = None

# jax 0.10 requires load's separate index, 0.11 deprecates it, 0.12 has none
_LOAD_NEEDS_INDEX = plgpu is not None and getattr(
    inspect.signature(plgpu.load).parameters.get("idx"), "default", None) is inspect.Parameter.empty
LOG2E = math.log2(math.e)
ROWS = 64  # rows of a consumer warpgroup: one wgmma M tile
PREFILL_CONSUMERS = 2  # consumer warpgroups of a prefill program: 128 rows share each K/V block's load
MAX_CONSUMERS = 3  # `consumers=3`: 192 rows share each load (FlashAttention-3's tile at head dim 64), 4 warpgroups
# (512 threads) whose registers must be redistributed (`register_split`)
PLAN_AND_CALL = ("stages", "registers")  # code generation options `plan_step` reads too (its choice of consumers)
BLOCK_K = 64  # keys per block of the online softmax (the default; `block_k` / `decode_block_k`: BLOCK_KS)
BLOCK_KS = (64, 128, 192)  # key blocks the kernel takes: multiples of 64, as P V's contraction over them must be
# (Mosaic's wgmma: whole 128-byte swizzle groups of V's rows; P through SMEM: whole 64-column tiles); two 128-key
# K/V slots of head dim 128 still fit a two-consumer program's SMEM, two of 192 keys only at head dim 64
# (FlashAttention-3's key block there without a causal mask)
STAGES = 2  # K/V SMEM slots in flight between the producer and the consumers (compute-bound launches' default;
# memory-bound ones: `deepest_ring`; `stages`: 2 to 4)
STAGES_RANGE = (2, 3, 4)
HEAD_DIMS = (64, 128, 256)
SMS = 132  # streaming multiprocessors of an H100 SXM or H200: the KV partitions of a launch's tiles aim for one
# wave of programs (`default_partitions`): SMS x the programs an SM holds at once // kv heads, rounded down (16 at
# 8 kv heads where a program holds an SM alone: 128 programs; rounded up, 17 made 136, four in a second wave)


def compiler_params(approx_math: bool = True):
    """The kernels' Mosaic GPU compiler parameters: Lane lowering semantics, named rather than defaulted. The
    kernel is written for them (registers in explicit WGMMA layouts: `plgpu.layout_cast`, `load(layout=)`,
    `broadcasted_iota(layout=)`), they were jax 0.10's default, and jax 0.11 made Warpgroup semantics (layouts
    inferred) the default: left to the default, the same code would lower differently on the GPU image's jax.
    `approx_math`: exp2 / log2 by the hardware's approximate instructions (ex2.approx.ftz.f32: relative error
    ~2^-22, what Triton's exp2 uses), division approximate too; the interpreter computes them exactly."""
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane, approx_math=approx_math)


SMEM_PER_BLOCK = 227 * 1024  # the most SMEM a CUDA block may take on Hopper
SMEM_PER_SM = 228 * 1024  # an SM's, shared by the blocks it runs at once
SMEM_RESERVED_PER_BLOCK = 1024  # what the system reserves of an SM's SMEM for each block it runs
SMEM_MARGIN = 8 * 1024  # what Mosaic's count adds to `program_smem_bytes` (row limits, m and l staging, barriers,
# alignment): 5,176 bytes for a one-consumer program, 5,208 for a two-consumer one, 8 per slot more with `release_k`


def program_smem_bytes(*, consumers: int, head_dim: int, block_k: int, stages: int, itemsize: int = 2,
                       p_in_smem: bool = True) -> int:
    """SMEM of one program's big buffers: Q (64 rows per consumer), and over one region (`_Ops.union`) the K/V ring
    with P (`p_in_smem`: P through SMEM, `registers=False`; with P in registers it has no buffer), or the output
    staging (at most float32). Mosaic's count of a whole program is ~5.2 KB more (e.g. 95,288 for a decode program
    at head dim 128 with 2 slots of 64 keys and P's buffer, 5,176 more): `SMEM_MARGIN` covers it. The plan's
    choices that precede the code generation (`prefill_block_k`, `programs_per_sm`) count P's buffer."""
    q = consumers * ROWS * head_dim * itemsize
    ring = 2 * stages * block_k * head_dim * itemsize + p_in_smem * consumers * ROWS * block_k * itemsize
    staging = consumers * ROWS * head_dim * 4
    return q + max(ring, staging)


def rings_that_fit(*, consumers: int, head_dim: int, block_k: int, p_in_smem: bool = True) -> list[int]:
    """The K/V slot counts (of `STAGES_RANGE`) whose program fits a block's SMEM."""
    return [s for s in STAGES_RANGE if program_smem_bytes(consumers=consumers, head_dim=head_dim, block_k=block_k,
                                                          stages=s, p_in_smem=p_in_smem) + SMEM_MARGIN
            <= SMEM_PER_BLOCK]


def deepest_ring(*, consumers: int, head_dim: int, block_k: int, p_in_smem: bool = True) -> int:
    """The most K/V slots (of `STAGES_RANGE`) whose program still fits a block's SMEM."""
    return max(rings_that_fit(consumers=consumers, head_dim=head_dim, block_k=block_k, p_in_smem=p_in_smem),
               default=STAGES)


def register_split(consumers: int) -> tuple[int, int]:
    """Registers per thread of (the producer, each consumer) when a prefill program redistributes them
    (`max_registers`, `plgpu.set_max_registers`): an SM's 65,536 among 128 x (consumers + 1) threads, the TMA
    issuer taking few. Two consumers: 40 and 232 (64,512 in all); three: 32 and 160 (65,536: FlashAttention-3's
    split for three consumer warpgroups), where without a split each thread may take only 128, fewer than a
    consumer's scores, P and accumulator need."""
    return (40, 232) if consumers <= 2 else (32, 160)


def programs_per_sm(*, consumers: int, head_dim: int, block_k: int) -> int:
    """Programs of a memory-bound launch (the ones split over KV partitions) that an SM runs at once, with the
    default ring (`deepest_ring`): a two-consumer program holds an SM alone (3 x 128 threads x up to 168
    registers); a one-consumer (decode) program two where their SMEM fits, else one: two at head dim 64 (4 slots),
    one at 128 (4 slots, 160,824 bytes) and 256 (2 slots). Counted by SMEM alone, before anything compiles: two
    decode programs an SM also need at most 128 registers a thread, which ptxas is not held to;
    `scripts/kernel_resources.py` checks the compiled kernel against this (126 at head dim 64 for an H100, 181 at
    128: docs/benchmarks.md, twenty-second session)."""
    if consumers > 1:
        return 1
    smem = program_smem_bytes(consumers=1, head_dim=head_dim, block_k=block_k,
                              stages=deepest_ring(consumers=1, head_dim=head_dim, block_k=block_k))
    return 2 if 2 * (smem + SMEM_MARGIN + SMEM_RESERVED_PER_BLOCK) <= SMEM_PER_SM else 1


def default_partitions(*, consumers: int, num_kv_heads: int, head_dim: int, block_k: int) -> int:
    """The most KV partitions a tile may take when none are asked for: one wave of programs over the GPU's SMs
    (`SMS` x `programs_per_sm`) // kv heads, rounded down; the tiles of a step share them (`_work_items`). At the
    Llama-3 shapes (8 kv heads) 16 for prefill tiles and for decode tiles at head dim 128 (measured on an H200,
    docs/benchmarks.md, sixteenth session: decode at 256K 0.330 -> 0.300 ms against 33 partitions, two waves of
    programs that each hold an SM; at 1M 1.070 against 1.081 ms, within the run's spread), 33 for decode tiles at
    head dim 64 (two programs an SM)."""
    per_sm = programs_per_sm(consumers=consumers, head_dim=head_dim, block_k=block_k)
    return max(1, SMS * per_sm // num_kv_heads)


@dataclasses.dataclass(frozen=True)
class Codegen:
    """How the kernel is generated, not how the step is tiled (the kernels' code-generation options, one value
    from the public functions' keywords to the kernel): `approx_math` (`compiler_params`), `lookahead` (the next
    block's page-table entries loaded before the producer's wait), `pingpong` (the prefill consumers taking turns:
    two at a schedule barrier, three passing a token around a ring of barriers), `registers` (P in registers for P V, the accumulator updated in place: compiled only),
    `stages` (K/V slots in the ring), `fma_softmax` (the row max taken of the raw scores and scaled after, the same
    value since the scale is positive and rounding monotonic, so each score's exponent is one multiply-add,
    `s * scale - m`, rather than a multiply and then a subtraction; blocks at the causal edge keep the multiply,
    their mask works on scaled scores; as jax's `attention_mgpu`) and `max_registers` (prefill programs redistribute
    registers, `register_split`: with two consumers each consumer thread up to 232, the producer's down to 40,
    `plgpu.set_max_registers`, as FlashAttention-3 and `attention_mgpu`). None (the default of those five): chosen
    per launch (`for_launch`). Off, measured no faster on an H200 (sixteenth session; the module's docstring has the
    numbers): `release_k` (the K slot released after Q K^T, the V slot after P V: separate "consumed" barriers, so
    the producer refills K while P V runs, as `attention_mgpu`; None, its default: on under `overlap`, whose
    consumer holds a block's V past the next block's Q K^T), and the rest of what `attention_mgpu` does in its
    consumers' loop and ours did not: `wait_k_in_pv` (the next block's K waited
    for while this block's P V wgmma runs, the first block's before the loop, rather than at the top of each
    block) and `fenced_softmax` (the accumulator's rescale, P's conversion and l finished, behind an optimization
    barrier, before the consumer hands the tensor cores over at the schedule barrier and waits for V, rather than
    after: `attention_mgpu`'s order, which its authors measured to matter "quite significantly"). Off but for
    compute-bound three-consumer launches, measured on an H100 and an H200 (twenty-third and thirty-eighth sessions,
    the module's docstring): `overlap` (FlashAttention-3's loop, its overlap inside a
    warpgroup: block j's Q K^T and block j-1's P V issued back to back, then block j's softmax once Q K^T is done, under
    the P V, whose accumulator is read last; P (bf16) is carried from block to block, as FlashAttention-3's registers
    hold it. With `pingpong` (its default where the launch takes turns) the issuing is the consumer's turn on a ring of
    barriers, as FlashAttention-3's scheduler barriers, for two consumers as for three. It orders the loop its own way:
    with `wait_k_in_pv` or `fenced_softmax` it raises; None, its default: on for compute-bound launches of three
    consumers, the head-dim-64 default (`prefill_consumers`), unless one of those two is asked for). On:
    `merge_kernel` (a launch's split tiles merged and written in
    token order by one more kernel, `_merge_partials`, where XLA took three fusions and a scatter; False: XLA's,
    `_merge_items`, for a side-by-side measurement; even on an H100, twenty-third session: decode B=1 at 256K 0.403
    against 0.421 ms, at 1M 1.522 against 1.490, one sample each)."""

    approx_math: bool = True
    lookahead: bool = True
    pingpong: bool | None = None
    registers: bool | None = None
    stages: int | None = None
    release_k: bool | None = None
    max_registers: bool | None = None
    fma_softmax: bool | None = None
    wait_k_in_pv: bool = False
    fenced_softmax: bool = False
    overlap: bool | None = None
    merge_kernel: bool = True

    def check(self, interpret: bool):
        if self.stages is not None and self.stages not in STAGES_RANGE:
            raise ValueError(f"stages (K/V slots in the ring) must be one of {STAGES_RANGE}, got {self.stages}")
        if self.registers and interpret:
            raise ValueError("registers=True (P in registers for P V, the accumulator updated in place) is compiled "
                             "only: jax's Mosaic GPU interpreter runs neither")
        if self.overlap:
            clash = [n for n in ("wait_k_in_pv", "fenced_softmax") if getattr(self, n)]
            if clash:
                raise ValueError(f"overlap=True (each block's softmax under the previous block's P V) orders a "
                                 f"consumer's loop its own way; it does not combine with {', '.join(clash)}")

    def _ring(self, *, interpret: bool, memory_bound: bool, consumers: int, head_dim: int, block_k: int):
        """(registers, stages, the launch's `program_smem_bytes` arguments) as `for_launch` resolves them: P has an
        SMEM buffer only when it goes through SMEM."""
        registers = (not interpret) if self.registers is None else self.registers
        smem = dict(consumers=consumers, head_dim=head_dim, p_in_smem=not registers)
        stages = self.stages
        if stages is None:
            stages = deepest_ring(block_k=block_k, **smem) if memory_bound else STAGES
        return registers, stages, smem

    def fits(self, *, consumers: int, head_dim: int, block_k: int, memory_bound: bool) -> bool:
        """Whether a compiled launch's ring, as `for_launch` resolves it, fits a block's SMEM (else it raises)."""
        _, stages, smem = self._ring(interpret=False, memory_bound=memory_bound, consumers=consumers,
                                     head_dim=head_dim, block_k=block_k)
        return stages in rings_that_fit(block_k=block_k, **smem)

    def for_launch(self, *, interpret: bool, consumers: int, num_parts: int, head_dim: int, block_k: int
                   ) -> "Codegen":
        """The options of one launch: those given, and for those left to the kernel (None) what measured fastest on an
        H200 (docs/benchmarks.md, 2026-11-26, fourteenth and sixteenth sessions; Llama-3-8B shape at 1M keys) or an H100
        (2026-11-27, twenty-third session), or, marked unmeasured (eighteenth session, no GPU), what ptxas's report and
        the disassembly favour (`scripts/kernel_resources.py`, at head dims 64 and 128; head dim 256 follows the same
        rule unchecked):
          - `registers`: compiled, yes (chunk 2048 83.6 -> 78.9 ms, chunk 32 2.30 -> 2.02 ms); interpreted, no
            (the interpreter runs neither P in registers nor the in-place accumulator);
          - `stages`: for memory-bound launches (one-consumer programs: decode tiles, and consumers=1 prefill
            tiles, whose 64 rows do 64 FLOPs per byte they load; or split over several KV partitions: few tiles
            at a long context) the deepest ring that fits the SMEM (`deepest_ring`: with 64-key blocks 4 slots at
            head dims 64 and 128, decode 1.12 -> 1.04 ms, chunk 32 with ping-pong 2.37 -> 1.91 ms; the default
            128-key prefill blocks at head dim 128 fit 2, and chunk 32 with them, 2 slots and no turns, measured
            1.20 ms against 1.25 with 64-key blocks, 4 slots and turns, sixteenth session), else 2 (chunk 2048
            with 4: 83.0 against 75.5 ms);
          - `pingpong`: with P in registers, programs of two consumers or more take turns (chunk 2048 78.9 -> 75.5 ms; chunk 32
            with the ring of 4 2.01 -> 1.93 ms), but memory-bound ones only with a ring of 3 or more slots (with 2,
            chunk 32 was slower: 2.02 -> 2.37 ms);
          - `fma_softmax`: compute-bound launches (sixteenth session: the llama3.2-1b shape's chunk 8192 at 1M
            198.6 -> 192.4 ms; the Llama-3-8B shape's chunk 2048 75.8 -> 75.1 ms, within the run's spread, then left
            off at head dim 128; on there since the eighteenth session, on the disassembly: the unmasked key-block
            loop 529 -> 467 instructions a thread, 64 multiplies fewer, the count of `attention_mgpu`'s, 472,
            `scripts/kernel_resources.py`; on an H100, twenty-third session, 69.1 against 68.3 ms without, within
            the runs' spread); memory-bound ones no (chunk 32 1.25 -> 1.28 ms);
          - `max_registers`: programs of three consumers (each thread may take 128 registers without it), and
            two-consumer ones under `overlap` (on an H100, twenty-third session: chunk 32 at 1M 1.98 -> 1.48 ms,
            chunk 2048 65.8 either way). Not two-consumer ones otherwise: the eighteenth session turned it on for
            the compute-bound ones on ptxas's report (with 128-key blocks a thread's 168 registers spill ~540 bytes
            at head dim 128, 4 local stores and 5 loads in each key block of the unmasked loop, at head dim 64 8 /
            16 bytes; redistributed, none), but the spilling kernel measured faster on an H100 (twenty-third
            session, 1M keys: the Llama-3-8B shape's chunk 2048 63.2 ms against 69.1 redistributed, the
            llama3.2-1b shape's chunk 8192 183.4 against 186.8); memory-bound ones (split-K) keep theirs (chunk 32
            1.25 -> 1.28 ms redistributed, sixteenth session; 1.483 without, 1.473 with, twenty-third: even).
          - `overlap`: compute-bound launches of three consumers, the head-dim-64 default (`prefill_consumers`; the
            llama3.2-1b shape's chunk 8192 at 1M, on an H100 187.0 -> 155.4 ms; on an H200, thirty-eighth session,
            three consumers without it or turns 166.0 -> 154.6 with pages of 16, but 143.4 against 147.0 with pages
            of 128, queued again), unless `wait_k_in_pv` or `fenced_softmax` asks for
            another loop; not two-consumer ones (at head dim 128 it won at the 8B shape and lost at the 70B shape's
            on the H200) nor memory-bound ones (chunk 32 at 1M 1.48 ms either way on the H100).
        `num_parts`: the partitions the launch's tiles are expected to take (the split is chosen per step, so the
        caller gives more than one when the step's tokens could not fill the partitions' worth of tiles)."""
        memory_bound = consumers == 1 or num_parts > 1
        registers, stages, smem = self._ring(interpret=interpret, memory_bound=memory_bound, consumers=consumers,
                                             head_dim=head_dim, block_k=block_k)
        overlap = self.overlap
        if overlap is None:  # FlashAttention-3's loop for compiled compute-bound three-consumer launches, unless
            # another order of the loop was asked for (interpreted, as asked: its race tests keep each loop apart)
            overlap = (not interpret and consumers > PREFILL_CONSUMERS and not memory_bound
                       and not (self.wait_k_in_pv or self.fenced_softmax))
        fma_softmax = self.fma_softmax
        if fma_softmax is None:
            fma_softmax = not memory_bound
        if not interpret:  # given or not: a ring the SMEM cannot hold raises here, naming what fits
            fits = rings_that_fit(block_k=block_k, **smem)
            if stages not in fits:
                need = program_smem_bytes(block_k=block_k, stages=stages, **smem)
                smaller = [b for b in BLOCK_KS if b < block_k and rings_that_fit(block_k=b, **smem)]
                raise ValueError(f"stages={stages}: {stages} K/V slots of {block_k} keys at head dim {head_dim} "
                                 f"({consumers} consumer(s)) need about {need + SMEM_MARGIN} bytes of SMEM, over the "
                                 f"{SMEM_PER_BLOCK} a block may take; "
                                 + (f"the most that fit: {max(fits)}" if fits else f"no ring of {block_k}-key slots "
                                    + (f"fits: ask for block_k={max(smaller)}" if smaller else
                                       f"fits {consumers} consumer(s) at head dim {head_dim}")))
        pingpong = self.pingpong
        if pingpong is None:
            pingpong = registers and (not memory_bound or stages >= 3)
        max_registers = self.max_registers
        if max_registers is None:  # three consumers need it, two only under `overlap` (`for_launch`)
            max_registers = consumers > PREFILL_CONSUMERS or (consumers == PREFILL_CONSUMERS and overlap)
        many = consumers > 1  # turns and a register split need two consumers or more: a decode has one
        release_k = overlap if self.release_k is None else self.release_k
        return dataclasses.replace(self, registers=registers, stages=stages, pingpong=pingpong and many,
                                   release_k=release_k, overlap=overlap,
                                   max_registers=max_registers and many, fma_softmax=fma_softmax)


def _ring(consumers: int, codegen: Codegen) -> bool:
    """Whether the consumers' turns (`pingpong`) pass a token around a ring of barriers, one each (three consumers,
    or any under `overlap`: FlashAttention-3's scheduler barriers), rather than two meeting at one barrier."""
    return consumers > 2 or codegen.overlap


def _swizzled(dtype) -> tuple:
    """SMEM transforms of wgmma's operand layout: 8-row tiles of 128 bytes, swizzled over 128 bytes. A store into
    such a buffer from WGMMA-layout registers is free of bank conflicts."""
    return plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(128)


def _token_rows_tiled(group: int) -> bool:
    """Whether the token-order output staging is tiled: only when a token's `group` rows, which its own TMA copy
    takes, fill whole 8-row tiles (Mosaic refuses a slice of part of a tile)."""
    return group % 8 == 0


def _cdiv(a, b):
    return pa._cdiv(a, b)


def _partial_rows(tokens: int, group: int) -> tuple[int, int]:
    """(rows of acc, rows of m and l) of a consumer's float32 partial that its `tokens` tokens x `group` heads
    take, what a split tile's programs write and the merge reads: whole 8-row tiles of acc (a decode tile's G rows
    rounded up to 8, not 64), and of m / l a multiple of 32 floats (Pallas' lowering of a copy into SMEM splits its
    bytes among a warpgroup's 128 threads, so it takes a multiple of 128 bytes)."""
    rows = min(ROWS, -(-tokens * group // 8) * 8)
    return rows, min(ROWS, -(-rows // 32) * 32)


def supported_page_size(page_size: int, block_k: int = BLOCK_K) -> bool:
    return page_size % 8 == 0 and (block_k % page_size == 0 or page_size % block_k == 0)


def prefill_block_k(head_dim: int, page_size: int, consumers: int = PREFILL_CONSUMERS) -> int:
    """Keys per block of the prefill tiles when none is asked for: 128 where the page size allows it and a ring of
    128-key slots fits the program's SMEM (`rings_that_fit`: two consumers at head dims 64 and 128, three at 64),
    else 64 (two 128-key slots do not fit at head dim 256, nor with three consumers at 128). Measured on an H200
    (docs/benchmarks.md): at head dim 64 a 64-key block carries half the wgmma work per softmax, barrier and wait
    of one at 128 (the llama3.2-1b shape's chunk 8192 at 1M 253 -> 199 ms, fourteenth session); at head dim 128,
    with P in registers, the Llama-3-8B shape at 1M chunk 2048 75.8 -> 66.1 ms (464 -> 532 TFLOP/s) and chunk 32
    1.25 -> 1.20 ms (sixteenth session; with P through SMEM it had been slower, 84 -> 120 ms)."""
    fits = rings_that_fit(consumers=consumers, head_dim=head_dim, block_k=128)
    return 128 if fits and supported_page_size(page_size, 128) else BLOCK_K


def check_block_k(name: str, block_k: int):
    if block_k not in BLOCK_KS:
        raise ValueError(f"{name} (keys per block of the Mosaic kernels) must be one of {BLOCK_KS}, got {block_k}")


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


def supports(*, dtype, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int) -> bool:
    """Whether the kernels run attention of this shape (`check_shapes` would not raise): what `attention="auto"`
    asks before choosing them for a model."""
    if plgpu is None:  # pragma: no cover - depends on the jax version
        return False
    q = jax.ShapeDtypeStruct((1, num_heads, head_dim), dtype)
    cache = jax.ShapeDtypeStruct((1, 1, page_size, num_kv_heads, head_dim), dtype)
    try:
        check_shapes(q, cache, cache)
    except ValueError:
        return False
    return True


# ------------------------------------------------------------------------------------------ interpreter
INTERPRETER_NPROC = 8  # threads XLA's CPU client needs for a three-consumer program in the interpreter (below)


def check_interpreter_threads(consumers: int):
    """Raises where jax's Mosaic GPU interpreter could hang on a program of `consumers` consumer warpgroups. It runs
    each warpgroup as a thread that blocks (at barriers) inside its own XLA CPU computation, and XLA's CPU client
    runs computations on a pool of threads as many as the machine's cores, or `NPROC` (an environment variable read
    once, when jax's CPU backend starts: set it before). Measured on a 2-core machine (seventeenth session): two
    consumers (3 threads) always ran; three (4 threads) hung in most runs (one in four in a first batch, five of
    five in a later one; `PJRT_NPROC=8` five of five too), the fourth warpgroup's computation never started; with
    NPROC=4, 5 or 8 every run finished (16 runs). So three consumers need NPROC >= INTERPRETER_NPROC, or as many
    cores; the tests' conftest sets it. (What is read here is the environment now, which a process that changed it
    after jax started would not have.)"""
    if consumers <= PREFILL_CONSUMERS:
        return
    nproc = os.environ.get("NPROC", "")
    threads = int(nproc) if nproc.isdigit() else (os.cpu_count() or 1)
    if threads < INTERPRETER_NPROC:
        raise RuntimeError(f"consumers={consumers} in jax's Mosaic GPU interpreter runs {consumers + 1} warpgroup "
                           f"threads that XLA's CPU client must run at once; with {threads} threads (this machine's "
                           f"cores, or NPROC) it can hang: set NPROC={INTERPRETER_NPROC} in the environment before "
                           "jax starts, or use consumers=2")


def _interpret_params():
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    _interpreter_transposed_wgmma()
    return InterpretGPUParams()


@functools.cache
def _interpreter_transposed_wgmma():
    """Teaches jax's Mosaic GPU interpreter (jax 0.10.2) wgmma operands with a trailing transpose.

    Its wgmma callback slices operands with `to_range`, which reads only indexers and fails on
    a transposed ref ("'TransposeTransform' object has no attribute 'indices'"). This replacement is the
    same callback (read a, b and the accumulator from simulated SMEM, acc += a @ b in the accumulator's dtype)
    with a trailing transpose of a or b applied to the value read. Only the interpreter is touched; compiled
    kernels never call it. jax 0.11's interpreter reads transposed operands itself (`interpret_utils.to_access`,
    a range and a permutation) and its callback has another signature: there nothing is replaced.
    """
    import numpy as np
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as gc
    from jax._src.state.types import TransposeTransform

    if hasattr(getattr(gc, "interpret_utils", None), "to_access"):
        return  # jax >= 0.11: transposes are interpreted
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


@functools.cache
def _interpreter_runs_ref_union() -> bool:
    """Whether jax's Mosaic GPU interpreter runs a `plgpu.RefUnion` (jax >= 0.11: it tags the members for race
    detection; jax 0.10.2's hangs in a kernel that has one)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    return hasattr(gpu_callbacks, "call_tag_ref_union")


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

    def store(self, ref, value, optimized=True):
        """`ref[...] = value`, written as a store: `ref[...] =` is a swap, whose lowering also loads the old value
        (jax 0.12's lowering refuses that load from an untiled staging buffer: "Failed to synthesize a transfer
        pattern that avoids bank conflicts"); `plgpu.store` (jax >= 0.12) does not load it. `optimized=False`: a
        store that may be bank-conflicted (jax 0.12 refuses one otherwise; 0.10 / 0.11 lower it as it is)."""
        if self.interpret or not hasattr(plgpu, "store"):
            ref[...] = value
        else:
            plgpu.store(ref, value, optimized=optimized)

    def union(self, *groups):
        """SMEM buffers whose lifetimes are disjoint (`groups`: trees of `plgpu.SMEM`), laid over one region: a
        `plgpu.RefUnion`, but for jax 0.10's interpreter, which cannot run one (the kernel hangs): there the groups
        are separate buffers (the same values; jax >= 0.11's interpreter runs the union, and its race detector
        checks that no access of one group is unordered with a write of another)."""
        if self.interpret and not _interpreter_runs_ref_union():
            return tuple(groups)
        return plgpu.RefUnion(*groups)

    def load_rows(self, ref):  # [64] (a value per row of a wgmma tile)
        return self.load(ref, plgpu.Layout.WGMMA.reduce(1) if plgpu is not None else None)

    def empty_rows(self, head_dim: int):
        """(m, l, acc) of 64 rows that have seen no key: m NEG_INF (base 2), l 0 [64], acc 0 [64, head_dim], in the
        WGMMA layouts when compiled: an online softmax's (and an online merge's) starting state."""
        row = None if self.interpret else plgpu.Layout.WGMMA.reduce(1)
        return (self.cast(jnp.full((ROWS,), NEG_INF, jnp.float32), row),
                self.cast(jnp.zeros((ROWS,), jnp.float32), row),
                self.cast(jnp.zeros((ROWS, head_dim), jnp.float32), None if self.interpret else plgpu.Layout.WGMMA))

    def load(self, ref, layout):
        if self.interpret:
            return ref[...]
        if _LOAD_NEEDS_INDEX:
            return plgpu.load(ref, (), layout=layout)
        return plgpu.load(ref, layout=layout)


# ------------------------------------------------------------------------------------------ the kernel
def _kernel(layer_ref, seq_ref, full_ref, hi_ref, start_ref, items_ref, lim_ref, table_ref, q_ref, k_ref, v_ref,
            *io_refs, num_parts: int, group: int, scale: float, ops: _Ops, out_dtype, block_k: int,
            codegen: Codegen):
    """One (work item, kv head) program, the item a (tile, partition) of the step's plan: warpgroups 0 .. C-1
    consume (64 rows each), warpgroup C produces (TMA), C = the tile's rows / 64 (`consumers`, 1 to 3, for prefill
    tiles, 1 for decode tiles).

    layer_ref i32[1]; seq_ref / full_ref / hi_ref i32[nt]: the tile's sequence, the keys all its rows see, the keys
    its furthest row sees (the step's plan, shared by every layer); start_ref i32[nt]: where the tile's first token
    is in the launch's token order (`_query_order`); items_ref i32[4, W]: each program's tile (nt: none, the
    program does nothing), partition and its tile's partitions (`_work_items`); lim_ref i32[nt, 64 C] keys each
    row sees; table_ref i32[B, M]; q_ref [K, Tq G + 64 C, H] (`_query_rows`: the tile's rows are start x G ..
    start x G + 64 C - 1 of its kv head's); k_ref / v_ref the cache [L, P, S, K, H].
    io_refs = (tok_ref i32[nt, BQ]: the tile's tokens, T = empty slot; out [T, N, H] in `out_dtype`; lse f32[T, N]):
    a program whose tile has one partition writes its rows normalised, in token order, each token's G heads
    straight to their place (token i of the tile is rows i*G .. i*G+G-1); empty slots write nothing. When tiles
    may be split (num_parts > 1: the most partitions a tile may take), io_refs also hold the partials (acc
    [num_parts, K, 64 C, H], m [num_parts, K, 64 C] base-2, l [num_parts, K, 64 C], float32), where a program whose
    tile has several partitions writes its own at its item's index (< num_parts: see `_work_items`), only the rows
    its tokens take (`_partial_rows`: a decode tile's G rounded up to 8, of 64)."""
    _, _, S, _, H = k_ref.shape
    C = lim_ref.shape[1] // ROWS
    stages = codegen.stages
    max_pages = table_ref.shape[1]
    cdt = q_ref.dtype
    tr = _swizzled(cdt)
    # The K/V slots and P are dead once the consumer's loop ends (every TMA copy into a slot has landed: the consumer
    # waited for each; every wgmma reading them has completed: it read its accumulator), and the output staging is
    # live only after it: one SMEM region holds both (`_Ops.union`), so the staging costs no SMEM of its own.
    loop = (plgpu.SMEM((stages, block_k, H), cdt, transforms=tr),  # k slots
            plgpu.SMEM((stages, block_k, H), cdt, transforms=tr))  # v slots
    if not codegen.registers:  # P through SMEM for P V, one per consumer (with P in registers, no buffer)
        loop += (plgpu.SMEM((C, ROWS, block_k), cdt, transforms=tr),)
    # output staging: rows of G heads copied out per token (out_dtype; tiled only where G-row slices are whole
    # tiles: `_token_rows_tiled`), or the float32 partial, copied out whole: tiled and swizzled as the wgmma
    # operands are, so the store from registers is free of bank conflicts (jax 0.12 refuses the untiled store of
    # a float32 WGMMA-layout array)
    staging = (plgpu.SMEM((C, ROWS, H), out_dtype,
                          transforms=_swizzled(out_dtype) if _token_rows_tiled(group) else ()),)
    if num_parts > 1:  # a split tile's partition: the float32 partial
        staging += (plgpu.SMEM((C, ROWS, H), jnp.float32, transforms=_swizzled(jnp.float32)),)
    scratch = [
        plgpu.SMEM((C, ROWS, H), cdt, transforms=tr),  # q
        ops.union(loop, *staging),
        plgpu.SMEM((C, ROWS), jnp.int32),  # keys each row sees
        plgpu.SMEM((C, ROWS), jnp.float32),  # lse / m staging
        plgpu.SMEM((C, ROWS), jnp.float32),  # l staging
    ]
    copies = max(1, block_k // S)  # TMA copies per key block: one per page, or one slice of a large page
    barriers = [
        plgpu.Barrier(num_arrivals=2, num_barriers=C),  # a consumer's q and row limits landed
        plgpu.Barrier(num_arrivals=copies, num_barriers=stages),  # k slot full
        plgpu.Barrier(num_arrivals=copies, num_barriers=stages),  # v slot full
        plgpu.Barrier(num_arrivals=C, num_barriers=stages),  # slot consumed (by every consumer; `release_k`: V)
    ]
    if codegen.release_k:
        barriers.append(plgpu.Barrier(num_arrivals=C, num_barriers=stages))  # K slot consumed (`release_k`)
    if C > 1:
        barriers += [plgpu.Barrier(num_arrivals=1, num_barriers=stages),  # v slot's keys past the tile's zeroed
                     plgpu.Barrier(num_arrivals=C),  # every consumer's loop done (the staging overlays the ring)
                     # the consumers' turns on the tensor cores (`pingpong`): a token around a ring, or a meeting
                     plgpu.Barrier(num_arrivals=1, num_barriers=C) if _ring(C, codegen)
                     else plgpu.Barrier(num_arrivals=C)]
    tile = (layer_ref, seq_ref, full_ref, hi_ref, start_ref, items_ref)
    pl.run_scoped(functools.partial(_program, tile, lim_ref, table_ref, q_ref, k_ref, v_ref, io_refs,
                                    num_parts=num_parts, group=group, scale=scale, ops=ops, page_size=S,
                                    max_pages=max_pages, block_k=block_k, codegen=codegen),
                  *scratch, *barriers, collective_axes="wg")


def _program(tile_refs, lim_ref, table_ref, q_ref, k_ref, v_ref, io_refs, q_smems, union, lim_smems, m_smems,
             l_smems, q_bars, k_bar, v_bar, consumed, *more, num_parts, group, scale, ops, page_size, max_pages,
             block_k, codegen):
    (k_smem, v_smem, *p_smems), o_smems, *f_smems = union  # the ring and P; the token-order, float32 staging
    C = q_smems.shape[0]  # consumer warpgroups; warpgroup C produces
    stages, lookahead, registers = codegen.stages, codegen.lookahead, codegen.registers
    pingpong, max_registers, release_k = codegen.pingpong, codegen.max_registers, codegen.release_k  # `for_launch`
    k_consumed, sync = (more[0], more[1:]) if release_k else (consumed, more)  # the K slot's release
    v_zeroed, loop_done, schedule = sync if C > 1 else (None, None, None)

    ring = _ring(C, codegen)

    def take_turn():
        """`pingpong` (two consumers): arrive at the schedule barrier and wait for the other consumer to arrive
        too. Placed as in FlashAttention-3 and jax's `attention_mgpu`: after issuing Q K^T and before P V, so one
        consumer's softmax runs while the other's wgmmas do (the consumers alternate on the tensor cores)."""
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    def await_turn():
        """`pingpong` before P V: with two consumers until the other one's turn is done (its arrival after its
        softmax); on the ring (three consumers, or any under `overlap`) until the token reaches this consumer's
        barrier. A consumer's turn on the ring is FlashAttention-3's: its P V, then the next block's Q K^T (under
        `overlap`: block j's Q K^T and block j-1's P V), after which it passes the token on (`pass_turn`), so while
        one consumer issues, the others run their softmax."""
        plgpu.barrier_wait(schedule.at[wg] if ring else schedule)

    def pass_turn():  # `ring`: the tensor cores to the next consumer
        plgpu.barrier_arrive(schedule.at[lax.rem(wg + 1, C)])

    item, kvh = lax.axis_index("item"), lax.axis_index("kvh")
    wg = lax.axis_index("wg")
    layer_ref, seq_ref, full_ref, hi_ref, start_ref, items_ref = tile_refs
    nt = seq_ref.shape[0]
    tile, part, parts = items_ref[0, item], items_ref[1, item], items_ref[2, item]
    valid = tile < nt  # else a program past the step's work items: it does nothing
    t = jnp.minimum(tile, nt - 1)
    layer, seq, kv_full, kv_hi = layer_ref[0], seq_ref[t], full_ref[t], jnp.where(valid, hi_ref[t], 0)
    head_dim = q_smems.shape[-1]
    cdt = q_smems.dtype

    # This partition's share of the tile's key blocks, and where the unmasked ones end.
    n_blocks = _cdiv(kv_hi, block_k)
    per_part = _cdiv(n_blocks, jnp.maximum(parts, 1))
    lo = jnp.minimum(part * per_part, n_blocks)
    hi = jnp.minimum(lo + per_part, n_blocks)
    split = jnp.clip(lax.div(kv_full, block_k), lo, hi)

    @pl.when((wg == C) & valid)
    def _producer():
        if max_registers:  # a TMA issuer needs few: the consumers take them (`max_registers`)
            plgpu.set_max_registers(register_split(C)[0], action="decrease")

        def pages_of(step):
            """The page-table entries of the partition's block `step` (columns clamped: one past the last block
            reads a real column, unused)."""
            first_page = lax.div((lo + step) * block_k, page_size)
            return tuple(table_ref[seq, jnp.minimum(first_page + i, max_pages - 1)]
                         for i in range(max(1, block_k // page_size)))

        def fill(step, pages):
            slot = lax.rem(step, stages)
            # The page-table loads (GMEM, dependent TMA copies after them) go first: with `lookahead`, the next
            # block's, before this block's wait, so their latency hides behind it; else this block's, all of them
            # before its copies rather than each just before its own.
            if lookahead:
                upcoming = pages_of(step + 1)
            else:
                pages, upcoming = pages_of(step), ()

            def wait_free(barrier):
                @pl.when(step >= stages)
                def _():
                    plgpu.barrier_wait(barrier.at[slot])

            first = (lo + step) * block_k  # local index of the block's first key

            def copies(ref, smem, bar):  # (source, destination, barrier) of each TMA copy of the block
                if page_size <= block_k:
                    return [(ref.at[layer, page, :, kvh, :], smem.at[slot, pl.ds(i * page_size, page_size)],
                             bar.at[slot]) for i, page in enumerate(pages)]
                rows = pl.ds(lax.rem(first, page_size), block_k)
                return [(ref.at[layer, pages[0], rows, kvh, :], smem.at[slot], bar.at[slot])]

            k_copies, v_copies = copies(k_ref, k_smem, k_bar), copies(v_ref, v_smem, v_bar)
            wait_free(k_consumed)  # without `release_k` the one "consumed" barrier frees K and V
            if release_k:  # K as soon as its slot is free, V once its own is
                for c in k_copies:
                    plgpu.copy_gmem_to_smem(*c)
                wait_free(consumed)
                for c in v_copies:
                    plgpu.copy_gmem_to_smem(*c)
            else:
                for kc, vc in zip(k_copies, v_copies):
                    plgpu.copy_gmem_to_smem(*kc)
                    plgpu.copy_gmem_to_smem(*vc)
            return upcoming

        lax.fori_loop(0, hi - lo, fill, pages_of(0) if lookahead else ())

        # Wait for the consumption of the last stages blocks too, which no fill waited for: then this warpgroup has
        # observed every phase of the "consumed" barriers before they go (jax's interpreter refuses a barrier
        # deallocated with phases a waiting thread skipped; the hardware would not mind). The producer is idle by
        # then; the consumer never waits for it.
        def drain(step, _):
            plgpu.barrier_wait(consumed.at[lax.rem(step, stages)])
            if release_k:
                plgpu.barrier_wait(k_consumed.at[lax.rem(step, stages)])
            return ()

        lax.fori_loop(jnp.maximum(hi - lo - stages, 0), hi - lo, drain, ())

    @pl.when((wg < C) & valid)
    def _consumer():  # rows wg*64 .. wg*64+63 of the tile
        if max_registers:
            plgpu.set_max_registers(register_split(C)[1], action="increase")
        q_smem, o_smem, lim_smem, m_smem, l_smem, q_bar = (
            x.at[wg] for x in (q_smems, o_smems, lim_smems, m_smems, l_smems, q_bars))
        p_smem = p_smems[0].at[wg] if p_smems else None
        f_smem = f_smems[0].at[wg] if f_smems else None
        rows = pl.ds(pl.multiple_of(wg * ROWS, ROWS), ROWS)
        first_row = pl.multiple_of(start_ref[t] * group + wg * ROWS, 8)  # whole 8-row tiles (`_query_order`)
        plgpu.copy_gmem_to_smem(q_ref.at[kvh, pl.ds(first_row, ROWS)], q_smem, q_bar)
        plgpu.copy_gmem_to_smem(lim_ref.at[t, rows], lim_smem, q_bar)
        plgpu.barrier_wait(q_bar)
        lim = ops.load_rows(lim_smem)
        wait_k_in_pv, fenced = codegen.wait_k_in_pv, codegen.fenced_softmax

        def wait_k(step):  # block `step`'s K slot full
            plgpu.barrier_wait(k_bar.at[lax.rem(step - lo, stages)])

        def wait_next_k(step):  # `wait_k_in_pv`: the next block's K, while this block's P V runs
            pl.when(step + 1 < hi)(functools.partial(wait_k, step + 1))

        def issue_qk(acc_ref, slot):  # Q K^T of the block in `slot` into `acc_ref` (K transposed by the descriptor)
            plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))

        def scores(slot, after_issue=None):
            """The raw scores of the block in `slot` (its K waited for), `after_issue` run once Q K^T is issued;
            with `release_k` K's slot is freed once they are read."""
            def qk(acc_ref):
                issue_qk(acc_ref, slot)
                if after_issue is not None:
                    after_issue()
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((ROWS, block_k), jnp.float32))
            if release_k:  # Q K^T has completed (its accumulator read): the K slot is free
                plgpu.barrier_arrive(k_consumed.at[slot])
            return s

        def softmax(s, m, l, step, masked: bool):
            """The online softmax of block `step`'s raw scores `s`: (m_new, l_new, p, alpha)."""
            # m is kept in base-2 logits (scores x scale, the softmax scale with log2(e) folded in)
            if codegen.fma_softmax and not masked:  # max(s) x scale == max(s x scale); then one FMA a score
                m_new = jnp.maximum(m, s.max(axis=1) * scale)
                p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_new, s.shape, [0]))
            else:
                s = s * scale
                if masked:
                    idx = step * block_k + ops.iota((ROWS, block_k), 1)
                    visible = idx < lax.broadcast_in_dim(lim, (ROWS, block_k), [0])
                    s = jnp.where(visible, s, NEG_INF)
                m_new = jnp.maximum(m, s.max(axis=1))
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                if masked:
                    p = jnp.where(visible, p, 0.0)
            alpha = jnp.exp2(m - m_new)
            return m_new, l * alpha + p.sum(axis=1), p, alpha

        def zero_past_last_key(step, slot):
            """Slots past the tile's last visible key may never have been written (another sequence's pages behind
            unused page-table columns, uninitialised memory): zero them so 0 x NaN cannot reach out. Only the
            block that holds the tile's last visible key has such slots, and one consumer zeroes them in the shared
            slot; the others wait for it before reading the slot."""
            partial = (step + 1) * block_k > kv_hi

            @pl.when(partial & (wg == 0))
            def _():
                key = step * block_k + ops.iota((block_k, head_dim), 0)
                v_slot = v_smem.at[slot]
                ops.store(v_slot, jnp.where(key < kv_hi, v_slot[...], jnp.zeros((), cdt)))
                if C > 1:
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(v_zeroed.at[slot])

            if C > 1:
                @pl.when(partial & (wg > 0))
                def _():
                    plgpu.barrier_wait(v_zeroed.at[slot])

        def pv(acc, p16, step, slot, masked: bool, turn: bool = pingpong):
            """acc (already rescaled) + P V of block `step`, then its slot released (`turn`: in this consumer's
            turn on the tensor cores)."""
            if registers:  # P V with P in registers, accumulated in place (FlashAttention-3's; compiled only)
                if masked:
                    plgpu.commit_smem()  # the zeroed V slot
                if turn:
                    await_turn()

                def pv_in_place(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                    if wait_k_in_pv:
                        wait_next_k(step)

                acc = pl.run_state(pv_in_place)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(consumed.at[slot])
                return acc
            ops.store(p_smem, p16)
            plgpu.commit_smem()
            if turn:
                await_turn()

            def pv_scoped(acc_ref):
                plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
                if wait_k_in_pv:
                    wait_next_k(step)
                return acc_ref[...]

            out = pl.run_scoped(pv_scoped, plgpu.ACC((ROWS, head_dim), jnp.float32))
            plgpu.barrier_arrive(consumed.at[slot])
            return acc + out

        def block(step, carry, masked: bool):
            m, l, acc = carry
            slot = lax.rem(step - lo, stages)
            if not wait_k_in_pv:  # else waited for during the previous block's P V (the first: before the loop)
                wait_k(step)

            s = scores(slot, (pass_turn if ring else take_turn) if pingpong else None)
            m_new, l, p, alpha = softmax(s, m, l, step, masked)
            if fenced:  # everything of the softmax done before the turn is handed over (`fenced_softmax`)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                p16 = p.astype(cdt)
                acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
            if pingpong and not ring:
                plgpu.barrier_arrive(schedule)  # softmax done: the other consumer may take the tensor cores
            plgpu.barrier_wait(v_bar.at[slot])
            if masked:
                zero_past_last_key(step, slot)
            if not fenced:
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                p16 = p.astype(cdt)
            return m_new, l, pv(acc, p16, step, slot, masked)

        def first_scores(step, carry):
            """`overlap`'s first block: its Q K^T and softmax, no P V yet (P carried to the next block's turn);
            taken as masked (exact for a block all rows see); the accumulator is still zero, so not rescaled."""
            m, l, acc, _ = carry
            wait_k(step)
            m_new, l_new, p, _ = softmax(scores(lax.rem(step - lo, stages)), m, l, step, True)
            return m_new, l_new, acc, p.astype(cdt)

        def overlapped_step(step, carry, masked: bool):
            """`overlap`, FlashAttention-3's order inside a warpgroup: block `step`'s Q K^T and the previous block's
            P V issued back to back (with `pingpong`, in this consumer's turn on the ring), then block `step`'s
            softmax once Q K^T is done (`wgmma_accumulator_load(wait_n=1)`), under the P V still running, then the
            accumulator read (P V done) and rescaled. P is carried from block to block (in registers when compiled:
            the P V accumulates in place into the carried accumulator, `acc_ref[...] = acc`; interpreted, through
            SMEM into a fresh accumulator, added). K's slot is released after Q K^T with `release_k` (the default
            under `overlap`), the slot (V) after P V."""
            m, l, acc, p16 = carry
            slot, prev = lax.rem(step - lo, stages), lax.rem(step - 1 - lo, stages)

            def body(s_ref, o_ref):
                if registers:
                    o_ref[...] = acc
                else:
                    ops.store(p_smem, p16)
                    plgpu.commit_smem()
                if pingpong:
                    await_turn()
                wait_k(step)
                issue_qk(s_ref, slot)
                plgpu.barrier_wait(v_bar.at[prev])
                plgpu.wgmma(o_ref, p16 if registers else p_smem, v_smem.at[prev])
                if pingpong:  # the last consumer's last turn hands the token to no one
                    pl.when(jnp.logical_not((wg == C - 1) & (step == hi - 1)))(pass_turn)
                s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # Q K^T done, P V in flight
                if release_k:
                    plgpu.barrier_arrive(k_consumed.at[slot])
                m_new, l_new, p, alpha = softmax(s, m, l, step, masked)
                out = o_ref[...]  # P V done
                plgpu.barrier_arrive(consumed.at[prev])
                out = out if registers else acc + out
                return m_new, l_new, out * lax.broadcast_in_dim(alpha, out.shape, [0]), p.astype(cdt)

            return pl.run_scoped(body, plgpu.ACC((ROWS, block_k), jnp.float32),
                                 plgpu.ACC((ROWS, head_dim), jnp.float32))

        def last_pv(step, carry):
            """`overlap`'s last P V (block `step` = hi - 1, whose unwritten slots past the tile's last key are
            zeroed first), outside the turns, as FlashAttention-3's."""
            m, l, acc, p16 = carry
            slot = lax.rem(step - lo, stages)
            plgpu.barrier_wait(v_bar.at[slot])
            zero_past_last_key(step, slot)
            return m, l, pv(acc, p16, step, slot, True, turn=False), p16

        carry = ops.empty_rows(head_dim)
        if codegen.overlap:
            # the first block's softmax before the loop, each later block's Q K^T with the previous block's P V,
            # the last P V after (none of them when the partition has no block); with `pingpong` the token starts
            # at consumer 0 when there is a turn to take (two blocks or more)
            wgmma_layout = None if ops.interpret else plgpu.Layout.WGMMA
            carry = carry + (ops.cast(jnp.zeros((ROWS, block_k), cdt), wgmma_layout),)
            second = jnp.minimum(lo + 1, hi)
            carry = lax.fori_loop(lo, second, first_scores, carry)
            if pingpong:
                pl.when((wg == 0) & (hi - lo >= 2))(lambda: plgpu.barrier_arrive(schedule.at[0]))
            masked_from = jnp.clip(split, second, hi)
            carry = lax.fori_loop(second, masked_from, functools.partial(overlapped_step, masked=False), carry)
            carry = lax.fori_loop(masked_from, hi, functools.partial(overlapped_step, masked=True), carry)
            m, l, acc, _ = lax.fori_loop(jnp.maximum(hi - 1, lo), hi, last_pv, carry)
        else:
            if wait_k_in_pv:
                pl.when(hi > lo)(functools.partial(wait_k, lo))
            if pingpong and ring:  # the token starts at consumer 0; each waits for its first Q K^T's turn
                pl.when(wg == 0)(lambda: plgpu.barrier_arrive(schedule.at[0]))
                await_turn()
            elif pingpong:
                pl.when(wg == 1)(take_turn)  # consumer 0 goes first
            carry = lax.fori_loop(lo, split, functools.partial(block, masked=False), carry)
            m, l, acc = lax.fori_loop(split, hi, functools.partial(block, masked=True), carry)
            if pingpong and ring:  # the next consumer's last P V; the last consumer's token would go unawaited
                pl.when(wg < C - 1)(pass_turn)
            elif pingpong:
                pl.when(wg == 0)(take_turn)  # the turn consumer 1 waits for after its last block
        if C > 1:  # the staging below overlays the ring and the P buffers, which the other consumers may still read
            plgpu.barrier_arrive(loop_done)
            plgpu.barrier_wait(loop_done)

        def write_normalised():  # one partition: the merge is the normalisation, (out, lse) in token order
            _write_normalised(acc, m, l, io_refs[:3], t=t, consumer=wg, consumers=C, kvh=kvh, group=group,
                              o_smem=o_smem, m_smem=m_smem, ops=ops)

        def write_partial():  # several partitions: this one's float32 partial, merged after the kernel
            acc_ref, m_ref, l_ref = io_refs[3:]
            ops.store(f_smem, acc)
            ops.store(m_smem, m)
            ops.store(l_smem, l)
            plgpu.commit_smem()
            # only the rows its tokens can take (a decode tile's G of 64, in whole 8-row tiles: what is merged)
            r, mr = _partial_rows(io_refs[0].shape[1] // C, group)
            first = pl.multiple_of(wg * ROWS, ROWS)
            plgpu.copy_smem_to_gmem(f_smem.at[pl.ds(0, r)], acc_ref.at[item, kvh, pl.ds(first, r)])
            plgpu.copy_smem_to_gmem(m_smem.at[pl.ds(0, mr)], m_ref.at[item, kvh, pl.ds(first, mr)])
            plgpu.copy_smem_to_gmem(l_smem.at[pl.ds(0, mr)], l_ref.at[item, kvh, pl.ds(first, mr)])

        if num_parts == 1:
            write_normalised()
        else:
            pl.when(parts == 1)(write_normalised)
            pl.when(parts > 1)(write_partial)
        plgpu.wait_smem_to_gmem(0)


def _write_normalised(acc, m, l, io_refs, *, t, consumer, consumers: int, kvh, group: int, o_smem, m_smem,
                      ops: _Ops):
    """One consumer's 64 rows of tile `t` (accumulator acc [64, H], m base 2, l), normalised and written in token
    order: io_refs = (tok_ref i32[nt, BQ], out [T, N, H], lse f32[T, N]); the consumer's tokens are the tile's
    consumer*bq .. consumer*bq+bq-1 (bq = BQ / consumers), its token i rows i*G .. i*G+G-1, staged in `o_smem` [64,
    H] (out's dtype) and `m_smem` f32[64]; an empty slot (T) writes nothing. A row with no visible key (l = 0)
    gets out 0 and lse NEG_INF."""
    tok_ref, out_ref, lse_ref = io_refs
    num_tokens, G = out_ref.shape[0], group
    empty = l == 0.0
    safe = jnp.where(empty, 1.0, l)
    ops.store(o_smem, jnp.where(lax.broadcast_in_dim(empty, acc.shape, [0]), 0.0,
                                acc / lax.broadcast_in_dim(safe, acc.shape, [0])).astype(o_smem.dtype),
              optimized=_token_rows_tiled(G))
    ops.store(m_smem, jnp.where(empty, NEG_INF, (m + jnp.log2(safe)) * (1.0 / LOG2E)))
    plgpu.commit_smem()

    lse_by_tma = G % 4 == 0  # G float32 make a 16-byte TMA row (with N = K x G, every row offset aligned)

    bq = tok_ref.shape[1] // consumers  # this consumer's tokens: the tile's consumer*bq .. consumer*bq+bq-1

    def write_token(i, _):  # its token i: rows i*G .. i*G+G-1 -> out[tok, kvh*G : kvh*G+G, :]
        tok = tok_ref[t, consumer * bq + i]

        @pl.when(tok < num_tokens)  # an empty slot (tok == T) writes nothing
        def _():
            rows = pl.ds(pl.multiple_of(i * G, min(G, 8)), G)
            plgpu.copy_smem_to_gmem(o_smem.at[rows], out_ref.at[tok, pl.ds(kvh * G, G)])
            if lse_by_tma:
                plgpu.copy_smem_to_gmem(m_smem.at[pl.ds(i * G, G)], lse_ref.at[tok, pl.ds(kvh * G, G)])
        return ()

    def write_lse(r, _):  # G < 4: a row narrower than a TMA copy takes (16 bytes), a scalar store each
        tok = tok_ref[t, consumer * bq + lax.div(r, G)]

        @pl.when(tok < num_tokens)
        def _():
            lse_ref[tok, kvh * G + lax.rem(r, G)] = m_smem[r]
        return ()

    lax.fori_loop(0, bq, write_token, ())
    if not lse_by_tma:
        lax.fori_loop(0, bq * G, write_lse, ())


# ------------------------------------------------------------------------------------------ the wrappers
def _attend_tiles(q, k_cache, v_cache, layer, meta, launch: pa.Launch, *, interpret: bool, out_dtype, into=None,
                  codegen: Codegen = Codegen()):
    """One kernel launch over the work items of `launch` (`pa.Launch` of `_launch`: tokens i32[nt, BQ], T = empty
    slot, one sequence per tile, with their metadata for 64-row programs; `work` the programs' items, i32[4, W];
    `num_parts` the most partitions a tile may take). Returns ((out [T, N, H] in `out_dtype`, lse f32[T, N]) with
    the rows of the launch's tokens written: of tiles of one partition normalised by the kernel, of tiles split
    over several by the merge kernel after it (`_merge_partials`); None, or with `merge_kernel=False` the split
    tiles' merged rows for `pa._scatter_into`, which the buffers then lack). Into `into` = (out, lse)
    when given (passed to the kernel as mutable refs, i.e. aliased in and out: the other rows keep their values),
    else into fresh buffers whose other rows are undefined (uninitialised memory on a GPU, NaN in the
    interpreter), so the caller must cover every token.
    """
    codegen.check(interpret)
    T, N, H = q.shape
    K = k_cache.shape[3]
    tile_tok = launch.tok
    nt, bq = tile_tok.shape
    G = N // K
    rows = launch.lim_rows.shape[1]
    C = rows // ROWS  # consumer warpgroups
    if rows % ROWS or not 1 <= C <= MAX_CONSUMERS or launch.work is None or launch.programs:
        raise ValueError(f"a Mosaic launch has programs of 64 x (1 .. {MAX_CONSUMERS}) rows over the work "
                         f"items of its plan (mosaic_attention.plan_step), got {rows} rows")
    if bq * G > rows or bq % C:
        raise ValueError(f"a tile of {bq} tokens x {G} heads does not fit the kernel's {C} x {ROWS} rows")
    if interpret:
        check_interpreter_threads(C)
    qr = _query_rows(q, launch, K, rows)
    layer = jnp.reshape(layer, (1,)).astype(jnp.int32)  # a constant when the layer loop is unrolled: no kernel
    NP, items = launch.num_parts, launch.work
    W = items.shape[1]
    codegen = codegen.for_launch(interpret=interpret, consumers=C, num_parts=NP if is_memory_bound(T, bq, NP) else 1,
                                 head_dim=H, block_k=launch.block_k)
    f32 = jnp.float32
    operands = [layer, launch.seq, launch.full, launch.hi, launch.q_start, items, launch.lim_rows,
                meta.page_table.astype(jnp.int32), qr, k_cache, v_cache, tile_tok.astype(jnp.int32)]
    out_shape = []
    if into is None:
        out_shape = [jax.ShapeDtypeStruct((T, N, H), out_dtype), jax.ShapeDtypeStruct((T, N), f32)]
    else:
        out, lse = into
        if out.shape != (T, N, H) or out.dtype != out_dtype or lse.shape != (T, N) or lse.dtype != f32:
            raise ValueError(f"into must be (out {out_dtype}[{T}, {N}, {H}], lse float32[{T}, {N}]), got "
                             f"{out.dtype}{list(out.shape)}, {lse.dtype}{list(lse.shape)}")
        refs = [jax.new_ref(out, memory_space=plgpu.GMEM), jax.new_ref(lse, memory_space=plgpu.GMEM)]
        operands += refs
    if NP > 1:
        out_shape += [jax.ShapeDtypeStruct((NP, K, rows, H), f32), jax.ShapeDtypeStruct((NP, K, rows), f32),
                      jax.ShapeDtypeStruct((NP, K, rows), f32)]
    # `pl.kernel` on a Mosaic GPU mesh is what `plgpu.kernel` wraps (in a custom_vmap, which rejects the mutable
    # refs of `into`: "JaxprInputEffect ... does not have a corresponding jaxpr input", jax 0.10.2); the varying
    # axes check is off as there (its outputs are typed varying over no mesh axis inside shard_map).
    with jax_config._check_vma(False):
        outs = pl.kernel(
            functools.partial(_kernel, num_parts=NP, group=G, scale=H ** -0.5 * LOG2E, ops=_Ops(interpret),
                              out_dtype=out_dtype, block_k=launch.block_k, codegen=codegen),
            out_type=out_shape,
            mesh=plgpu.Mesh(grid=(W, K), grid_names=("item", "kvh"), num_threads=C + 1, thread_name="wg"),
            compiler_params=None if interpret else compiler_params(codegen.approx_math),
            interpret=_interpret_params() if interpret else False,
            name="paged_attention_mosaic",
        )(*operands)
    outs = list(outs)
    written = (jax.freeze(refs[0]), jax.freeze(refs[1])) if into is not None else (outs.pop(0), outs.pop(0))
    if NP == 1:
        return written, None
    if codegen.merge_kernel:
        return _merge_partials(written, outs, items, tile_tok, group=G, interpret=interpret,
                               approx_math=codegen.approx_math), None
    acc, m, l = (x[..., :bq * G, :] if x.ndim == 4 else x[..., :bq * G] for x in outs)
    return written, _merge_items(acc, m, l, items, tile_tok, T)


def _work_items(has_tokens, kv_hi, block_k: int, num_parts: int):
    """The programs' work items, i32[4, W] (W = max(nt, num_parts)): each program's tile (nt past the step's
    items: nothing to do), its partition and its tile's partitions; and the first item of the split tiles (those
    of several partitions) in order, W past the last (the merge kernel's work). Every tile that holds a token is one item or
    more; the programs a single tile would fill the GPU with (`num_parts`) are shared out: when the step holds
    fewer such tiles, n, than that, each tile of b key blocks gets 1 + floor((num_parts - n) x b / (the tiles'
    blocks)) partitions (at most b), so the tiles' partitions number at most num_parts, and every item of a tile
    with several partitions has an index below num_parts (where its partial goes). The partitions follow the keys
    the step really holds, not the static tile count (the engine's page table has a row per sequence slot, so a
    step's static tiles are many more than a long prompt's short chunk fills) nor the page table's capacity.
    has_tokens bool[nt]; kv_hi i32[nt]: keys each tile's furthest row sees."""
    nt = has_tokens.shape[0]
    W = max(nt, num_parts)
    n_blocks = jnp.where(has_tokens, _cdiv(kv_hi, block_k), 0)
    spare = jnp.maximum(num_parts - has_tokens.sum(), 0)  # partitions beyond a tile's first
    share = spare * n_blocks // jnp.maximum(n_blocks.sum(), 1)
    parts = jnp.where(has_tokens, jnp.minimum(1 + share, jnp.maximum(n_blocks, 1)), 0).astype(jnp.int32)
    first = jnp.cumsum(parts) - parts  # each tile's first item
    w = jnp.arange(W, dtype=jnp.int32)
    tile = jnp.repeat(jnp.arange(nt, dtype=jnp.int32), parts, total_repeat_length=W)
    tile = jnp.where(w < parts.sum(), tile, nt)
    t = jnp.minimum(tile, nt - 1)
    valid = tile < nt
    split = parts > 1  # the split tiles, in order: the merge kernel's programs (`_merge_partials`)
    split_first = jnp.full((W,), W, jnp.int32).at[jnp.where(split, jnp.cumsum(split) - 1, W)].set(
        first.astype(jnp.int32), mode="drop")
    return jnp.stack([tile, jnp.where(valid, w - first[t], 0), jnp.where(valid, parts[t], 0),
                      split_first]).astype(jnp.int32)


def _merge_items(acc, m, l, items, tile_tok, num_tokens: int):
    """The rows of the tiles split over several partitions, (tokens i32[NP, BQ] (T: none), out f32[NP, BQ, N, H],
    lse f32[NP, BQ, N]) for `pa._scatter_into`: the exact merge (log-sum-exp, base 2) of their partials acc
    f32[NP, K, R, H], m / l f32[NP, K, R] (item i's at i, R = the tiles' BQ x G rows). Entries of items that are not
    such a partition were never written (undefined): they pass only through selects, never into arithmetic that
    reaches an output."""
    NP, K, R, H = acc.shape
    nt, bq = tile_tok.shape
    T = num_tokens
    tile, part, parts = items[0, :NP], items[1, :NP], items[2, :NP]
    split = parts > 1  # [NP] the items of split tiles (all of which are below NP)
    group = jnp.where(split, jnp.arange(NP, dtype=jnp.int32) - part, 0)  # a split tile's items: its first item's
    same = split[None, :] & (group[None, :] == jnp.arange(NP, dtype=jnp.int32)[:, None])  # [group, item]
    m_max = jnp.where(same[:, :, None, None], m[None], -jnp.inf).max(axis=1)  # [NP, K, R]
    w = jnp.exp2(m - m_max[group])  # an item outside every group: undefined, but `same` selects it nowhere
    l_sum = jnp.where(same[:, :, None, None], (l * w)[None], 0.0).sum(axis=1)
    acc_sum = jnp.where(same[:, :, None, None, None], (acc * w[..., None])[None], 0.0).sum(axis=1)  # [NP, K, R, H]
    empty = l_sum == 0.0
    safe = jnp.where(empty, 1.0, l_sum)
    out = jnp.where(empty[..., None], 0.0, acc_sum / safe[..., None])
    lse = jnp.where(empty, NEG_INF, (m_max + jnp.log2(safe)) * pa.LN2)
    G = R // bq
    out = out.reshape(NP, K, bq, G, H).transpose(0, 2, 1, 3, 4).reshape(NP, bq, K * G, H)
    lse = lse.reshape(NP, K, bq, G).transpose(0, 2, 1, 3).reshape(NP, bq, K * G)
    tok = tile_tok[jnp.minimum(tile, nt - 1)].astype(jnp.int32)  # group g's tile is item g's
    tok = jnp.where(same.any(axis=1)[:, None], tok, T)  # only the split tiles' rows: the others are dropped
    return tok, out, lse


MERGE_SLOTS = 4  # partials of a split tile in flight in a merge program (`_merge_partials`), where they fit


def merge_slots(*, head_dim: int, out_itemsize: int, num_parts: int) -> int:
    """SMEM slots of a merge program: MERGE_SLOTS, or fewer where the partitions are fewer or a block's SMEM holds
    fewer [64, head_dim] float32 slots beside the output staging (head dim 256: 2)."""
    fixed = ROWS * head_dim * out_itemsize + ROWS * 4 + SMEM_MARGIN
    per_slot = ROWS * head_dim * 4 + 2 * ROWS * 4
    return max(1, min(MERGE_SLOTS, num_parts, (SMEM_PER_BLOCK - fixed) // per_slot))


def _merge_partials(written, partials, items, tile_tok, *, group: int, interpret: bool, approx_math: bool):
    """`written` = (out [T, N, H], lse f32[T, N]) with the rows of the tiles split over several partitions set, in
    token order, by one kernel (`_merge_kernel`) from their float32 partials = (acc [NP, K, 64 C, H], m base 2 / l
    [NP, K, 64 C], item i's at i: `_kernel`'s): the exact merge (log-sum-exp) of `_merge_items` (online, so equal
    to float32 rounding, not bit for bit), and
    `pa._scatter_into`'s placement, where XLA takes three fusions and a scatter for them. The buffers go in as
    mutable refs (aliased in and out, as a step's second launch takes the first's): the other rows keep their
    values. items i32[4, W] (`_work_items`), tile_tok i32[nt, BQ]."""
    out, lse = written
    acc, m, l = partials
    NP, K, R, H = acc.shape
    refs = [jax.new_ref(out, memory_space=plgpu.GMEM), jax.new_ref(lse, memory_space=plgpu.GMEM)]
    with jax_config._check_vma(False):  # as `_attend_tiles`
        pl.kernel(
            functools.partial(_merge_kernel, num_parts=NP, group=group, ops=_Ops(interpret)),
            out_type=[],
            # a program per split tile, kv head and consumer's rows; a tile of several partitions has two or more
            # items below NP, so a step has at most NP // 2 such tiles (and at most its nt tiles)
            mesh=plgpu.Mesh(grid=(min(NP // 2, tile_tok.shape[0]), K, R // ROWS), grid_names=("split", "kvh", "c")),
            compiler_params=None if interpret else compiler_params(approx_math),
            interpret=_interpret_params() if interpret else False,
            name="paged_attention_merge",
        )(items, tile_tok.astype(jnp.int32), acc, m, l, *refs)
    return jax.freeze(refs[0]), jax.freeze(refs[1])


def _merge_kernel(items_ref, tok_ref, acc_ref, m_ref, l_ref, out_ref, lse_ref, *, num_parts: int, group: int,
                  ops: _Ops):
    """One (split tile, kv head, consumer) program of `_merge_partials`, one warpgroup: the consumer's rows of the
    tile's partials, `merge_slots` in flight (TMA into a ring of SMEM slots, the slot refilled once read), merged
    online in registers (the running max rescales, as the kernel's softmax does), then normalised and written in
    token order as a one-partition program writes its own (`_write_normalised`). Only the rows the consumer's tokens
    take are copied (`_partial_rows`); the slots' other rows hold whatever they held, merged but never written. A
    consumer of the tile with no token (its first slot empty) does nothing."""
    H = acc_ref.shape[-1]
    C = acc_ref.shape[2] // ROWS
    slots = merge_slots(head_dim=H, out_itemsize=jnp.dtype(out_ref.dtype).itemsize, num_parts=num_parts)
    f32 = jnp.float32
    scratch = [plgpu.SMEM((slots, ROWS, H), f32, transforms=_swizzled(f32)),  # acc
               plgpu.SMEM((slots, ROWS), f32),  # m
               plgpu.SMEM((slots, ROWS), f32),  # l
               plgpu.SMEM((ROWS, H), out_ref.dtype,  # output staging, as `_kernel`'s
                          transforms=_swizzled(out_ref.dtype) if _token_rows_tiled(group) else ()),
               plgpu.SMEM((ROWS,), f32)]  # lse staging
    rows = _partial_rows(tok_ref.shape[1] // C, group)
    pl.run_scoped(functools.partial(_merge_program, (items_ref, tok_ref, acc_ref, m_ref, l_ref, out_ref, lse_ref),
                                    num_parts=num_parts, group=group, ops=ops, consumers=C, rows=rows),
                  *scratch, plgpu.Barrier(num_arrivals=3, num_barriers=slots))


def _merge_program(refs, acc_slots, m_slots, l_slots, o_smem, lse_smem, full, *, num_parts, group, ops, consumers,
                   rows):
    items_ref, tok_ref, out_ref = refs[0], refs[1], refs[5]
    split, kvh, c = lax.axis_index("split"), lax.axis_index("kvh"), lax.axis_index("c")
    first = items_ref[3, split]  # the tile's first item (num_parts or more: no such tile, nothing to do)

    @pl.when(first < num_parts)
    def _():
        t, parts = items_ref[0, first], items_ref[2, first]
        # a tile's empty slots are its last (`pa._sequence_tiles`): a consumer whose first slot is empty has none
        pl.when(tok_ref[t, c * (tok_ref.shape[1] // consumers)] < out_ref.shape[0])(functools.partial(
            _merge_rows, refs, (acc_slots, m_slots, l_slots), (o_smem, lse_smem), full, first=first, t=t,
            parts=parts, kvh=kvh, c=c, group=group, ops=ops, consumers=consumers, rows=rows))


def _merge_rows(refs, in_slots, staging, full, *, first, t, parts, kvh, c, group, ops, consumers, rows):
    """Consumer c's rows of split tile t, whose partitions are items first .. first+parts-1: fetched through the
    ring of slots, merged online, normalised and written in token order."""
    items_ref, tok_ref, acc_ref, m_ref, l_ref, out_ref, lse_ref = refs
    acc_slots, m_slots, l_slots = in_slots
    slots = acc_slots.shape[0]
    r, mr = rows
    base = pl.multiple_of(c * ROWS, ROWS)

    def fetch(p):  # partition p's partial into slot p % slots
        slot, item = lax.rem(p, slots), first + p
        plgpu.copy_gmem_to_smem(acc_ref.at[item, kvh, pl.ds(base, r)], acc_slots.at[slot, pl.ds(0, r)],
                                full.at[slot])
        plgpu.copy_gmem_to_smem(m_ref.at[item, kvh, pl.ds(base, mr)], m_slots.at[slot, pl.ds(0, mr)],
                                full.at[slot])
        plgpu.copy_gmem_to_smem(l_ref.at[item, kvh, pl.ds(base, mr)], l_slots.at[slot, pl.ds(0, mr)],
                                full.at[slot])

    for p in range(slots):
        pl.when(p < parts)(functools.partial(fetch, p))

    def merge(p, carry):
        m, l, acc = carry
        slot = lax.rem(p, slots)
        plgpu.barrier_wait(full.at[slot])
        m_p, l_p = ops.load_rows(m_slots.at[slot]), ops.load_rows(l_slots.at[slot])
        acc_p = ops.load(acc_slots.at[slot], plgpu.Layout.WGMMA)

        # The slot read: refill it, once the reads (generic proxy) are ordered before TMA's write (async proxy) by
        # fence.proxy.async, which the interpreter checks too. (At head dim 256 the running and the read
        # accumulators take 128 registers each: ptxas spills ~76 bytes a thread, with the refill here or after the
        # update alike, `scripts/kernel_resources.py`.)
        @pl.when(p + slots < parts)
        def _():
            plgpu.commit_smem()
            fetch(p + slots)

        m_new = jnp.maximum(m, m_p)
        a, b = jnp.exp2(m - m_new), jnp.exp2(m_p - m_new)
        acc = (acc * lax.broadcast_in_dim(a, acc.shape, [0]) + acc_p * lax.broadcast_in_dim(b, acc.shape, [0]))
        return m_new, l * a + l_p * b, acc

    m, l, acc = lax.fori_loop(0, parts, merge, ops.empty_rows(acc_slots.shape[-1]))
    o_smem, lse_smem = staging
    _write_normalised(acc, m, l, (tok_ref, out_ref, lse_ref), t=t, consumer=c, consumers=consumers, kvh=kvh,
                      group=group, o_smem=o_smem, m_smem=lse_smem, ops=ops)
    plgpu.wait_smem_to_gmem(0)


def _combine(q, k_cache, v_cache, layer, meta, tiles: pa.StepTiles, *, interpret: bool, out_dtype=None,
             codegen: Codegen = Codegen()):
    """(out [T, N, H] in `out_dtype` (default q's dtype, or float32), lse f32[T, N]) of a step whose tokens are
    laid out in the launches of `tiles` (`plan_step`), no token in two.

    The launches write their tokens' rows in place, one after the other into the same buffers (the second takes
    the first's output as an aliased input), split tiles' rows by each launch's merge kernel, so no scatter (with
    `merge_kernel=False`, XLA's merge and one scatter of split tiles' rows, after both: jax 0.11's kernels refuse
    an aliased buffer that a scatter inside a shard_map made varying over a mesh axis): the first
    allocates them, uninitialised, when the launches cover every token (a mixed step: every token is a decode or
    in a prefill tile), else they start as (0, NEG_INF), what a token in no launch gets."""
    T, N, H = q.shape
    out_dtype = jnp.dtype(q.dtype if out_dtype is None else out_dtype)
    if tiles.prefill is not None and tiles.prefill.lim_rows.shape[1] < 2 * ROWS:
        for name in ("pingpong", "max_registers"):
            if getattr(codegen, name):
                raise ValueError(f"{name} (the prefill consumers taking turns, or their registers) needs prefill "
                                 "programs of two consumers or more, got consumers=1")
    if out_dtype not in (jnp.dtype(q.dtype), jnp.dtype(jnp.float32)):
        raise ValueError(f"out_dtype must be q's dtype ({q.dtype}) or float32, got {out_dtype}")
    into = None
    if tiles.kind != MIXED:  # what a token no tile holds gets: out 0, lse NEG_INF (`pa.blank_buffers`)
        into, k_cache = pa.blank_buffers((T, N, H), out_dtype, k_cache)
    merged = []
    for launch in (tiles.decode, tiles.prefill):
        if launch is not None:
            into, split = _attend_tiles(q, k_cache, v_cache, layer, meta, launch, interpret=interpret,
                                        out_dtype=out_dtype, into=into, codegen=codegen)
            if split is not None:
                merged.append(split)
    return pa._scatter_into(into, merged) if merged else into


def _check(q, k_cache, v_cache, meta, interpret: bool):
    if plgpu is None:  # pragma: no cover - depends on the jax version
        raise RuntimeError("the Mosaic GPU attention kernels need jax.experimental.pallas.mosaic_gpu")
    check_shapes(q, k_cache, v_cache)
    if meta.page_table.shape[0] < 1 or meta.page_table.shape[1] < 1:
        raise ValueError(f"page_table must be [B >= 1, M >= 1], got {meta.page_table.shape}")


def block_q_for(num_heads: int, num_kv_heads: int, consumers: int = PREFILL_CONSUMERS) -> int:
    """Tokens per prefill tile: the query heads of a group x tokens fill the 64 rows of each of `consumers`
    consumer warpgroups."""
    return consumers * ROWS // (num_heads // num_kv_heads)


def _check_consumers(consumers: int, head_dim: int):
    """Raises for a consumer count the kernels lack (1 to 3), or whose program cannot fit the SMEM at `head_dim`
    even with 2 slots of 64 keys (three consumers at head dim 256: Q and the float32 staging alone are 294,912
    bytes), naming what fits."""
    if consumers not in range(1, MAX_CONSUMERS + 1):
        raise ValueError(f"consumers (warpgroups of 64 rows in a prefill program) must be 1 .. {MAX_CONSUMERS}, "
                         f"got {consumers}")
    if not rings_that_fit(consumers=consumers, head_dim=head_dim, block_k=BLOCK_K):
        most = max(c for c in range(1, MAX_CONSUMERS + 1)
                   if rings_that_fit(consumers=c, head_dim=head_dim, block_k=BLOCK_K))
        raise ValueError(f"consumers={consumers}: their program at head dim {head_dim} exceeds a block's "
                         f"{SMEM_PER_BLOCK} bytes of SMEM even with 2 K/V slots of {BLOCK_K} keys; at most "
                         f"{most} consumer(s) fit there")


def _launch(meta, tile_tok, *, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
            num_partitions: int | None, consumers: int = 1, block_k: int = BLOCK_K,
            block_k_name: str = "block_k") -> pa.Launch:
    """The `pa.Launch` of the tiles `tile_tok` for the Mosaic kernel: programs of `consumers` x 64 rows, key
    blocks of `block_k`, each tile split over up to `num_partitions` KV partitions (default: one wave of programs
    when the step holds one tile, `default_partitions`), chosen per step by the keys it holds (`_work_items`)."""
    check_block_k(block_k_name, block_k)
    if not supported_page_size(page_size, block_k):
        raise ValueError(f"{block_k_name} {block_k}: the page size ({page_size}) must divide it or be a multiple of it")
    T = meta.seq_ids.shape[0]
    num_parts = _launch_parts(meta, consumers=consumers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                              page_size=page_size, block_k=block_k, num_partitions=num_partitions)
    seq, full, hi, lim_rows = pa._tile_layout(meta, tile_tok, num_heads // num_kv_heads, consumers * ROWS)
    work = _work_items(tile_tok[:, 0] < T, hi, block_k, num_parts)
    q_tok, q_start = _query_order(tile_tok, T, num_heads // num_kv_heads)
    return pa.Launch(tok=tile_tok, seq=seq, full=full, hi=hi, lim_rows=lim_rows, row_tok=None, work=work,
                     block_k=block_k, num_parts=num_parts, programs=0, q_tok=q_tok, q_start=q_start)


def _launch_parts(meta, *, consumers: int, num_kv_heads: int, head_dim: int, page_size: int, block_k: int,
                  num_partitions: int | None) -> int:
    """The most KV partitions a tile of the launch may take (static): `num_partitions`, by default one wave of
    programs (`default_partitions`), but no more than the page table's key blocks."""
    if num_partitions is None:
        num_partitions = default_partitions(consumers=consumers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                            block_k=block_k)
    elif num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    return max(1, min(_cdiv(meta.page_table.shape[1] * page_size, block_k), num_partitions))


def is_memory_bound(num_tokens: int, block_q: int, num_parts: int) -> bool:
    """Whether a prefill launch is memory-bound (static: from shapes alone): its tiles may be split over several
    KV partitions and the step's `num_tokens` could not fill `num_parts` tiles of `block_q` tokens (e.g. one short
    chunk at a long context), so its programs stream more keys than their rows can use at the tensor cores' rate.
    `Codegen.for_launch` chooses the code of such launches apart, and `plan_step` their consumers."""
    return num_parts > 1 and num_tokens // block_q < num_parts


def prefill_consumers(meta, *, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                      num_partitions: int | None = None, block_k: int | None = None, interpret: bool = False,
                      stages: int | None = None, registers: bool | None = None) -> int:
    """Consumer warpgroups of a step's prefill programs when none are asked for (`plan_step`): compiled, three
    (FlashAttention-3's 192-row tile) at head dim 64 where their launch is compute-bound (`is_memory_bound`: no), else
    two (`PREFILL_CONSUMERS`); interpreted, two (jax's interpreter runs each warpgroup as a thread, and three
    consumers need `INTERPRETER_NPROC` of them, `check_interpreter_threads`: asked for, they run there too).
    Measured (docs/benchmarks.md): the llama3.2-1b shape's chunk 8192 at 1M, three
    consumers with FlashAttention-3's loop (`overlap`, on by default for them: `Codegen.for_launch`) against two,
    on an H100 155.4 against 186.5 ms (pages of 16; twenty-third session), on an H200 154.6 against 183.1 ms with
    pages of 16 and 147.0 against 158.2 with pages of 128 (thirty-eighth session); the whole 1M-token TTFT with them
    152.3 s on the H200 (pages of 128), against 197.0 s with two (pages of 16, sixteenth session). Not at head dim
    128 (the Llama-3-8B shape's chunk 2048 on an H100: 74.7 against 70.1 ms), and not for memory-bound launches
    (three consumers took the 8B shape's chunk 32 at 1M from 1.47 to 1.52 ms on the H100; at head dim 64 unmeasured).
    Nor where the code generation asked for (`stages`, `registers`: what the layers' calls will get, as
    `Codegen.for_launch` resolves them for a compute-bound launch) makes a three-consumer program too big for a
    block's SMEM (e.g. `block_k=192, stages=3, registers=False`, which fits two): two consumers, which it was asked
    of before three were the default."""
    if head_dim != 64 or interpret:
        return PREFILL_CONSUMERS
    c = MAX_CONSUMERS
    block_k = prefill_block_k(head_dim, page_size, c) if block_k is None else block_k
    parts = _launch_parts(meta, consumers=c, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                          block_k=block_k, num_partitions=num_partitions)
    bound = is_memory_bound(meta.seq_ids.shape[0], block_q_for(num_heads, num_kv_heads, c), parts)
    fits = Codegen(registers=registers, stages=stages).fits(consumers=c, head_dim=head_dim, block_k=block_k,
                                                            memory_bound=False)
    return PREFILL_CONSUMERS if bound or not fits else c


def _query_order(tile_tok, num_tokens: int, group: int):
    """(q_tok i32[Tq], q_start i32[nt]): the tokens of the tiles `tile_tok` (i32[nt, BQ], T = empty slot, a tile's
    empty slots its last) in the order of their tiles and slots, and where each tile's first token is among them
    (0 for a tile without one), so that a tile's tokens are q_tok[q_start : q_start + its tokens] and its query
    rows one slice of q gathered in this order (`_query_rows`). Each tile starts at a multiple of max(1, 8 //
    group) entries, i.e. of 8 rows: Mosaic copies a tiled SMEM buffer from GMEM in 8-row tiles (a slice that
    starts inside one would read the wrong rows); the gaps (a decode tile's token and one more at G = 4) and the
    end hold T. Tq (static) bounds what a step can need: at most nt x BQ entries (rounded up), and T tokens plus a
    gap a tile."""
    nt, bq = tile_tok.shape
    T = num_tokens
    align = max(1, 8 // group)
    valid = tile_tok < T
    count = valid.sum(axis=1, dtype=jnp.int32)  # tokens of each tile
    taken = _cdiv(count, align) * align  # entries each tile takes
    q_start = jnp.cumsum(taken, dtype=jnp.int32) - taken
    size = min(nt * _cdiv(bq, align) * align, T + (align - 1) * min(nt, T))
    size = _cdiv(size, align) * align
    dest = jnp.where(valid, q_start[:, None] + jnp.arange(bq, dtype=jnp.int32)[None, :], size)
    q_tok = jnp.full((size,), T, jnp.int32).at[dest.reshape(-1)].set(tile_tok.reshape(-1).astype(jnp.int32),
                                                                     mode="drop")
    return q_tok, jnp.where(count > 0, q_start, 0).astype(jnp.int32)


def _query_rows(q, launch: pa.Launch, num_kv_heads: int, rows: int):
    """The query rows the kernel copies its tiles' from, [K, Tq x G + rows, H] in q's dtype: kv head k's row
    i x G + g is head k x G + g of token q_tok[i] (`_query_order`), so a tile's rows (token x head of the group)
    are rows q_start x G .. of its kv head's, one TMA copy a consumer's 64; zeros past the launch's tokens, enough
    that a program's copy never leaves the array. A tile's rows past its tokens are zeros or the next tiles' (finite,
    never written out). One gather of q's tokens a layer (and the gaps: twice q's size for decode tiles at G = 4),
    where the tiles' own rows ([nt, K, rows, H], what the Triton kernels take) were 16 times q's size for decode
    tiles (G = 4 of 64 rows) and, for prefill tiles, as many times more as a step's sequence rows add partial tiles
    (a mixed step of 2,048 tokens and 256 rows at the Llama-3-8B shape: 118 MB a layer for q's 16 MB)."""
    T, N, H = q.shape
    K = num_kv_heads
    G = N // K
    size = launch.q_tok.shape[0]
    # zeros at T and past it: as many rows as are gathered, so XLA's fusion, which will not recompute an expensive
    # producer (the rope's sin and cos) for a gather that reads its rows more than once on average, still fuses q's
    # producer into this gather when the gaps make Tq > T (a decode step's tiles at G = 4: Tq = 2 x tiles)
    qs = jnp.concatenate([q, jnp.zeros((max(1, size - T), N, H), q.dtype)])[launch.q_tok]  # [Tq, N, H]
    qs = qs.reshape(size, K, G, H).transpose(1, 0, 2, 3).reshape(K, size * G, H)
    return jnp.pad(qs, ((0, 0), (0, rows), (0, 0)))


def plan_step(meta, *, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, kind: str = MIXED,
              num_partitions: int | None = None, decode_partitions: int | None = None,
              consumers: int | None = None, block_k: int | None = None, decode_block_k: int = BLOCK_K,
              stages: int | None = None, registers: bool | None = None, interpret: bool = False) -> pa.StepTiles:
    """A step's launches for `paged_attention_mosaic` (options as its own; heads and page size as the kernels see
    them): the tilings and per-tile metadata from the step's layout alone, computed once per step by the model
    and read by every layer's attention (`tiles=`). `consumers` None: `prefill_consumers` (for the interpreter when
    `interpret`), which also reads `stages` and `registers`, code generation options that every layer's call must
    be given too (`models.attention.split_kernel_options` gives them to both: `PLAN_AND_CALL`)."""
    if kind not in (MIXED, DECODE, PREFILL):
        raise ValueError(f"kind must be one of {(MIXED, DECODE, PREFILL)}, got {kind!r}")
    if consumers is None:
        consumers = prefill_consumers(meta, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                      page_size=page_size, num_partitions=num_partitions, block_k=block_k,
                                      interpret=interpret, stages=stages, registers=registers)
    _check_consumers(consumers, head_dim)
    block_k = prefill_block_k(head_dim, page_size, consumers) if block_k is None else block_k
    dec, pre = pa.step_tilings(meta, kind=kind, block_q=block_q_for(num_heads, num_kv_heads, consumers))
    dims = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size)
    return pa.StepTiles(
        decode=None if dec is None else _launch(meta, dec, num_partitions=decode_partitions, block_k=decode_block_k,
                                                block_k_name="decode_block_k", **dims),
        prefill=None if pre is None else _launch(meta, pre, num_partitions=num_partitions, consumers=consumers,
                                                 block_k=block_k, **dims), kind=kind)


def _single(q, k_cache, v_cache, layer, meta, tile_tok, *, interpret, num_partitions, out_dtype, codegen: Codegen,
            consumers=1, block_k=BLOCK_K):
    """Attention of every token of the step through the one launch over `tile_tok`."""
    launch = _launch(meta, tile_tok, num_heads=q.shape[1], num_kv_heads=k_cache.shape[3], head_dim=q.shape[2],
                     page_size=k_cache.shape[2], num_partitions=num_partitions, consumers=consumers, block_k=block_k)
    tiles = pa.StepTiles(decode=None, prefill=launch, kind=MIXED)  # covers every token, as a mixed step's do
    return _combine(q, k_cache, v_cache, layer, meta, tiles, interpret=interpret, out_dtype=out_dtype,
                    codegen=codegen)


@pa._jit
def prefill_attention(q, k_cache, v_cache, layer, meta, *, interpret: bool = False,
                      num_partitions: int | None = None, out_dtype=None, consumers: int | None = None,
                      block_k: int | None = None, approx_math: bool = True, lookahead: bool = True,
                      pingpong: bool | None = None, registers: bool | None = None, stages: int | None = None,
                      release_k: bool | None = None, max_registers: bool | None = None,
                      fma_softmax: bool | None = None,
                      wait_k_in_pv: bool = False, fenced_softmax: bool = False, overlap: bool | None = None,
                      merge_kernel: bool = True):
    """Chunked-prefill attention: every sequence's tokens in tiles of `consumers` x 64 // G tokens (each consumer
    warpgroup 64 rows), split-K over `num_partitions` (default: enough programs to fill the GPU). Arguments as
    `models.attention.paged_attention` (but `block_pages`); results out [T, N, H] in `out_dtype` (q's dtype by
    default, or float32), lse f32[T, N]. `consumers` None: `prefill_consumers`."""
    _check(q, k_cache, v_cache, meta, interpret)
    T, N, H = q.shape
    if consumers is None:
        consumers = prefill_consumers(meta, num_heads=N, num_kv_heads=k_cache.shape[3], head_dim=H,
                                      page_size=k_cache.shape[2], num_partitions=num_partitions, block_k=block_k,
                                      interpret=interpret, stages=stages, registers=registers)
    _check_consumers(consumers, H)
    B = meta.page_table.shape[0]
    bq = block_q_for(N, k_cache.shape[3], consumers)
    tiles = pa._sequence_tiles(meta.seq_ids, jnp.ones(T, bool), B, bq, T // bq + min(B, T))
    block_k = prefill_block_k(H, k_cache.shape[2], consumers) if block_k is None else block_k
    return _single(q, k_cache, v_cache, layer, meta, tiles, interpret=interpret, num_partitions=num_partitions,
                   out_dtype=out_dtype, consumers=consumers, block_k=block_k,
                   codegen=Codegen(approx_math, lookahead, pingpong, registers, stages, release_k, max_registers,
                                   fma_softmax, wait_k_in_pv, fenced_softmax, overlap, merge_kernel))


@pa._jit
def decode_attention(q, k_cache, v_cache, layer, meta, *, interpret: bool = False,
                     num_partitions: int | None = None, out_dtype=None, block_k: int = BLOCK_K,
                     approx_math: bool = True, lookahead: bool = True, stages: int | None = None,
                     release_k: bool | None = None, fma_softmax: bool | None = None, wait_k_in_pv: bool = False,
                     fenced_softmax: bool = False, overlap: bool | None = None, merge_kernel: bool = True):
    """Decode attention (split-K, FlashDecoding): one tile per query token, its G heads as rows, the keys split
    over `num_partitions` partitions merged by log-sum-exp (in the kernel when there is one). Results as
    `prefill_attention`."""
    _check(q, k_cache, v_cache, meta, interpret)
    tiles = pa._token_tiles(jnp.ones(q.shape[0], bool), q.shape[0])
    return _single(q, k_cache, v_cache, layer, meta, tiles, interpret=interpret, num_partitions=num_partitions,
                   out_dtype=out_dtype, block_k=block_k,
                   codegen=Codegen(approx_math, lookahead, stages=stages, release_k=release_k,
                                   fma_softmax=fma_softmax, wait_k_in_pv=wait_k_in_pv, fenced_softmax=fenced_softmax,
                                   overlap=overlap, merge_kernel=merge_kernel))


def _paged_attention_mosaic(q, k_cache, v_cache, layer, meta, *, interpret: bool = False,
                            num_partitions: int | None = None, decode_partitions: int | None = None,
                            kind: str = MIXED, out_dtype=None, tiles: pa.StepTiles | None = None,
                            consumers: int | None = None, block_k: int | None = None,
                            decode_block_k: int = BLOCK_K, approx_math: bool = True, lookahead: bool = True,
                            pingpong: bool | None = None, registers: bool | None = None,
                            stages: int | None = None, release_k: bool | None = None,
                            max_registers: bool | None = None,
                            fma_softmax: bool | None = None, wait_k_in_pv: bool = False, fenced_softmax: bool = False,
                            overlap: bool | None = None, merge_kernel: bool = True):
    """A mixed step (what attention="mosaic" runs): tokens of one-token sequences (decodes) through decode tiles,
    the others through prefill tiles, two kernel launches with grids fixed by (T, B); `kind` DECODE or PREFILL
    (static: the step holds only those) launches only that kernel (a token of the other kind gets out 0, lse
    NEG_INF). Results out [T, N, H] in `out_dtype` (default q's dtype; float32 for a KVP rank's partial, which
    the merge across ranks needs unrounded), lse f32[T, N]: with one partition per launch both kernels write
    into the same token-order buffers, no scatter (`_combine`). `tiles`: the step's launches planned once
    (`plan_step`, which takes the partitions and `kind` instead: giving them here too raises)."""
    _check(q, k_cache, v_cache, meta, interpret)
    if tiles is None:
        tiles = plan_step(meta, num_heads=q.shape[1], num_kv_heads=k_cache.shape[3], head_dim=q.shape[2],
                          page_size=k_cache.shape[2],
                          kind=kind, num_partitions=num_partitions, decode_partitions=decode_partitions,
                          consumers=consumers, block_k=block_k, decode_block_k=decode_block_k, stages=stages,
                          registers=registers, interpret=interpret)
    elif (num_partitions is not None or decode_partitions is not None or kind != MIXED
          or consumers is not None or block_k is not None or decode_block_k != BLOCK_K):
        raise ValueError("tiles were planned with their own options (plan_step); got num_partitions, "
                         "decode_partitions, kind, consumers or a block size too")
    return _combine(q, k_cache, v_cache, layer, meta, tiles, interpret=interpret, out_dtype=out_dtype,
                    codegen=Codegen(approx_math, lookahead, pingpong, registers, stages, release_k, max_registers,
                                    fma_softmax, wait_k_in_pv, fenced_softmax, overlap, merge_kernel))


paged_attention_mosaic = pa._jit(_paged_attention_mosaic, dynamic=("tiles",))
