"""Paged attention: the reference implementation of the attention contract (DESIGN.md), and the one switch.

`paged_attention(q, k_cache, v_cache, layer, meta, *, block_pages, ...) -> (out, lse)`: every query token attends to the keys of its own sequence
that sit in the paged cache at absolute positions <= its own (bottom-right causal: a step's query tokens are the
last tokens of their sequence), grouped-query, accumulated in float32, log-sum-exp in natural log. Where each
query token's keys are travels as one `AttentionMetadata`, passed whole to every implementation.

The work is blockwise over KV pages with an online softmax, so memory is (query tokens x block), never
(query tokens x context). The tokens go `row_block` at a time, and each row block runs only as many key blocks
as its own tokens can see, so a short prompt's rows never pay for the step's longest sequence. The step is
ragged: every token carries its sequence id, so a decode token is one row next to a 2048-token prefill chunk,
never padded to the chunk's length.

A token whose sequence has no visible key (an empty KVP shard, a padding row) gets out = 0 and lse = NEG_INF,
i.e. weight 0 in a log-sum-exp merge.

`attention(impl, ...)` is the one switch between this reference and the Pallas GPU kernels
(`models.pallas_attention`: Triton; `models.mosaic_attention`: Mosaic GPU, Hopper), by the names of `models.kernels`; `auto` is the only name that chooses, and a
kernel that was asked for and cannot run raises, it never falls back.
"""
from __future__ import annotations

import dataclasses
import inspect
import re

import jax
import jax.numpy as jnp
from jax import lax

from models import mosaic_attention, pallas_attention
from models.kernels import (AUTO, MIXED, MOSAIC, MOSAIC_INTERPRET, NEG_INF, PALLAS, PALLAS_INTERPRET, REFERENCE,
                            STEP_KINDS, resolve_attention_impl)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where each query token of a step finds its keys, on one KVP rank: device arrays, passed whole.

    T query tokens of B sequences laid end to end (any order); M page-table columns. Every field is an array
    (a pytree leaf); what is static about a step, its shapes, the arrays carry.
    """

    seq_ids: jax.Array  # i32[T] row of `page_table` each query token belongs to
    positions: jax.Array  # i32[T] absolute position of each query token in its sequence
    page_table: jax.Array  # i32[B, M] local page ids of each sequence, in token order; unused columns any id
    kv_lens: jax.Array  # i32[B] keys of each sequence held in this cache (this step's tokens included)
    kv_start: jax.Array  # i32[B] absolute position of each sequence's first key held here (0 unless KV-parallel)


# Hopper's names as jax's devices give them ("NVIDIA H100 80GB HBM3", "NVIDIA GH200 480GB", ...), for an abstract
# device, which has a kind but no compute capability.
_HOPPER_KINDS = re.compile(r"\bG?H(100|200|800|20)\b")


@dataclasses.dataclass(frozen=True)
class TargetDevice:
    """The device the code being traced is for (`target_device`)."""
    platform: str  # "cpu", "gpu" (NVIDIA, CUDA), "rocm", "tpu", ...
    kind: str  # jax's device_kind, e.g. "NVIDIA H100 80GB HBM3"
    capability: str  # compute capability of a CUDA device of this machine ("9.0"); "" for an abstract device
    abstract: bool  # only named (a compile target): no device of this machine


def target_device() -> TargetDevice:
    """The device the code being traced is for: the abstract mesh's device where the context names one that is
    not this machine's (inside a `shard_map` over a mesh of another machine's devices, e.g. a topology's
    compile-only ones: `mnemojax.bench.aot_step` compiles the step for a GPU this machine lacks; or under
    `jax.sharding.use_abstract_mesh`), else jax's default device, as jax 0.11's Pallas Triton lowering decides
    (its `gpu_info.get_device_kind`). An abstract device is known by its kind alone."""
    device = jax.devices()[0]
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    if abstract is not None and abstract.device_kind != getattr(device, "device_kind", None):
        platform = abstract.platform
        if platform in ("gpu", "cuda"):
            platform = "gpu" if abstract.device_kind.startswith(("NVIDIA", "Tesla")) else "rocm"
        return TargetDevice(platform, abstract.device_kind, "", abstract=True)
    platform = device.platform
    if platform in ("gpu", "cuda"):
        platform = "gpu" if "cuda" in device.client.platform_version.lower() else "rocm"
    return TargetDevice(platform, getattr(device, "device_kind", platform),
                        str(getattr(device, "compute_capability", "")), abstract=False)


def on_nvidia_gpu() -> bool:
    """Whether the code being traced is for an NVIDIA (CUDA) GPU (`target_device`), where the compiled Pallas
    kernels run."""
    return target_device().platform == "gpu"


def on_hopper_gpu() -> bool:
    """Whether the code being traced is for an NVIDIA GPU of compute capability 9.x (Hopper: H100, H200), where
    the compiled Mosaic GPU kernels (wgmma, TMA) run: by compute capability, or for an abstract device by name."""
    target = target_device()
    if target.platform != "gpu":
        return False
    return bool(_HOPPER_KINDS.search(target.kind)) if target.abstract else target.capability.startswith("9")


def resolve_attention(impl: str, *, dtype=None, num_heads: int | None = None, num_kv_heads: int | None = None,
                      head_dim: int | None = None, page_size: int | None = None) -> str:
    """The implementation that runs for `impl` on this machine. `auto`: `mosaic` on a Hopper GPU when the model is
    given (its dtype, heads, head dim and page size: the engine's loader gives them) and the Mosaic kernels
    support it (`mosaic_attention.supports`), else `pallas` on an NVIDIA GPU, else `reference`. The model-level
    functions below resolve `auto` without a model: `pallas` on an NVIDIA GPU, whatever the call's shapes."""
    model = (dtype, num_heads, num_kv_heads, head_dim, page_size)
    mosaic = (impl == AUTO and None not in model and on_hopper_gpu()
              and mosaic_attention.supports(dtype=dtype, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                            head_dim=head_dim, page_size=page_size))
    return resolve_attention_impl(impl, on_nvidia_gpu(), mosaic=mosaic)


def resolve_for_model(impl: str, config, dtype, page_size: int) -> str:
    """`resolve_attention` for the model `config` (`models.config.LlamaConfig`) run in `dtype` with KV pages of
    `page_size`: what `auto` means for it on the device the code is for (`target_device`). The engine's loader asks
    this, and the benchmarks that build a model themselves, so that their `auto` is the engine's."""
    return resolve_attention(impl, dtype=dtype, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
                             head_dim=config.head_dim, page_size=page_size)


def split_kernel_options(impl: str, options: dict) -> tuple[dict, dict]:
    """(tiling options, which go to `plan_attention`; the others, code generation such as the Mosaic kernels'
    `stages` or `approx_math`, which go to every layer's `attention(..., plan=...)` call) of the kernel options
    `options` for `impl`, by the planner's own parameters. The reference takes none: all go to the call, which
    raises naming them. The Mosaic planner also reads two code generation options (`stages`, `registers`:
    `mosaic_attention.PLAN_AND_CALL`, whether a three-consumer program fits), which go to both."""
    impl = resolve_attention(impl)
    if impl == REFERENCE:
        return {}, dict(options)
    mosaic = impl in (MOSAIC, MOSAIC_INTERPRET)
    planner = mosaic_attention.plan_step if mosaic else pallas_attention.plan_step
    tiling = set(inspect.signature(planner).parameters) - {"interpret"}  # the implementation's, never an option
    both = set(mosaic_attention.PLAN_AND_CALL) if mosaic else set()
    return ({k: v for k, v in options.items() if k in tiling},
            {k: v for k, v in options.items() if k not in tiling or k in both})


def plan_attention(impl: str, meta: AttentionMetadata, *, num_heads: int, num_kv_heads: int, head_dim: int,
                   page_size: int, kind: str = MIXED, **kernel_options):
    """What `attention(impl, ...)` can compute once per step and share between layers: for the kernels (pallas,
    mosaic and their interpreted forms) the step's tilings and per-tile metadata (`pallas_attention.StepTiles`,
    from the layout `meta` and static shapes alone: q's heads and the cache's page size and head dim as the
    kernels see them, i.e. per device), None for the reference. Pass it to every layer's `attention(...,
    plan=...)` with the same `impl`; `kind` and the kernel's tiling options go here instead of there."""
    if kind not in STEP_KINDS:
        raise ValueError(f"kind must be one of {STEP_KINDS}, got {kind!r}")
    impl = resolve_attention(impl)
    if impl == REFERENCE:
        if kernel_options:
            raise TypeError(f"the reference attention takes no kernel options, got {sorted(kernel_options)}")
        return None
    if impl in (MOSAIC, MOSAIC_INTERPRET):
        return mosaic_attention.plan_step(meta, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                          page_size=page_size, kind=kind, interpret=impl == MOSAIC_INTERPRET,
                                          **kernel_options)
    return pallas_attention.plan_step(meta, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                      page_size=page_size, kind=kind, **kernel_options)


def attention(impl: str, q, k_cache, v_cache, layer, meta: AttentionMetadata, *, block_pages: int,
              precision=None, kind: str = MIXED, out_dtype=None, plan=None, **kernel_options):
    """Paged attention by the implementation `impl` (see `models.kernels.ATTENTION_IMPLS`); arguments and results
    as `paged_attention`, but that the kernels (pallas, mosaic and their interpreted forms) give out in q's dtype
    (the model's: what they write straight in token order, rounded once from float32), the reference float32; lse
    is always float32. `out_dtype=float32` asks every implementation for float32 out (the kernels then write
    float32): what a
    KVP rank's partial must be, since the merge across ranks (`shardings.collectives.kvp_merge`) is exact only on
    unrounded partials. Any other `out_dtype` raises.
    `impl="pallas"` without an NVIDIA GPU, `impl="mosaic"` without a Hopper GPU, raise instead of running
    something else. `kernel_options` (tile and block sizes, for tuning) go to
    `models.pallas_attention.paged_attention_pallas` or `models.mosaic_attention.paged_attention_mosaic`
    (whose kernels take bf16/f16 only and ignore `precision`: wgmma, float32 accumulation). `kind` (static, one of
    `models.kernels.STEP_KINDS`) says which rows the step holds, so the kernels launch only the tiles it needs;
    a sequence of the other kind then gets no attention (out 0), so it must be right. `plan`: the step's
    `plan_attention(impl, ...)`, computed once per step (then `kind` and the tiling options are the plan's)."""
    if kind not in STEP_KINDS:
        raise ValueError(f"kind must be one of {STEP_KINDS}, got {kind!r}")
    if out_dtype is not None and jnp.dtype(out_dtype) != jnp.float32:
        raise ValueError(f"out_dtype must be None (the implementation's own) or float32, got {out_dtype}")
    impl = resolve_attention(impl)
    if plan is not None:
        if impl == REFERENCE:
            raise ValueError("the reference attention takes no plan (plan_attention gives it None)")
        kernel_options = dict(kernel_options, tiles=plan)
        if kind != plan.kind:
            raise ValueError(f"kind {kind!r} differs from the plan's ({plan.kind!r})")
        kind = MIXED  # the plan's: the kernels take it from there
    if impl == REFERENCE:
        if kernel_options:
            raise TypeError(f"the reference attention takes no kernel options, got {sorted(kernel_options)}")
        return paged_attention(q, k_cache, v_cache, layer, meta, block_pages=block_pages, precision=precision)
    if impl == PALLAS and not on_nvidia_gpu():
        raise RuntimeError("attention='pallas' needs an NVIDIA GPU; use 'reference' or 'pallas_interpret' "
                           f"(the step is traced for {target_device().kind!r})")
    if impl in (MOSAIC, MOSAIC_INTERPRET):
        if impl == MOSAIC and not on_hopper_gpu():
            raise RuntimeError("attention='mosaic' needs an NVIDIA Hopper GPU (compute capability 9.x: wgmma, TMA); "
                               "use 'pallas', 'reference' or 'mosaic_interpret' (the step is traced for "
                               f"{target_device().kind!r})")
        return mosaic_attention.paged_attention_mosaic(q, k_cache, v_cache, layer, meta, kind=kind,
                                                       interpret=impl == MOSAIC_INTERPRET, out_dtype=out_dtype,
                                                       **kernel_options)
    return pallas_attention.paged_attention_pallas(q, k_cache, v_cache, layer, meta, precision=precision, kind=kind,
                                                   interpret=impl == PALLAS_INTERPRET, out_dtype=out_dtype,
                                                   **kernel_options)


ROW_BLOCK = 256  # query tokens per row block of the reference (each block loops over only the keys it can see)


def paged_attention(q, k_cache, v_cache, layer, meta: AttentionMetadata, *, block_pages: int, precision=None,
                    row_block: int = ROW_BLOCK):
    """Reference paged attention over one layer of the cache.

    Args:
      q: [T, N, H] query tokens (RoPE applied), N query heads, H head dim.
      k_cache, v_cache: [L, P, S, K, H] paged cache (L local layers, P pages of S slots, K kv heads); this
        step's own K/V must already be written.
      layer: scalar index of the layer in the cache.
      meta: where each query token's keys are (`AttentionMetadata`).
      block_pages: pages per block of the online softmax (static).
      precision: matmul precision for the two einsums.
      row_block: query tokens per row block (static): the tokens are taken `row_block` at a time, and each row
        block runs only as many key blocks as its own tokens can see (their sequences' lengths, causally), not
        as many as the step's longest sequence needs. A step's tokens of one sequence are contiguous, so a short
        prompt's rows never pay for a long one's context, and a prefill chunk's first rows skip its last keys.
        The blocks skipped are ones every row of the row block masks entirely, which change nothing.

    Returns:
      out [T, N, H] float32 and lse [T, N] float32 (natural log). (The Pallas and Mosaic kernels give out in q's
      dtype unless asked for float32, see `attention`; callers take either.)
    """
    T, N, H = q.shape
    _, _, S, K, _ = k_cache.shape
    G = N // K
    M = meta.page_table.shape[1]
    bp = min(block_pages, M)
    C = bp * S  # keys per block
    R = min(row_block, T)
    num_row_blocks = -(-T // R)
    pad = num_row_blocks * R - T

    qg = (q.astype(jnp.float32) * (H ** -0.5)).reshape(T, K, G, H)
    tok_len = meta.kv_lens[meta.seq_ids]  # [T]
    tok_rel = meta.positions - meta.kv_start[meta.seq_ids]  # [T] a key at local index i is visible iff i <= tok_rel
    tok_seen = jnp.clip(jnp.minimum(tok_len, tok_rel + 1), 0)  # [T] keys visible to each token: indices below

    def rows(a):  # [T, ...] -> [num_row_blocks, R, ...], padding rows see no key
        return jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(num_row_blocks, R, *a.shape[1:])

    def row_block_attention(xs):
        qr, seq_ids, lens, rel, seen = xs  # [R, K, G, H], [R] x 4

        def body(j, carry):
            m, l, acc = carry
            cols = jnp.minimum(j * bp + jnp.arange(bp), M - 1)
            pages = meta.page_table[seq_ids[:, None], cols[None, :]]  # [R, bp]: only this block's columns
            kb = k_cache[layer, pages].reshape(R, C, K, H).astype(jnp.float32)
            vb = v_cache[layer, pages].reshape(R, C, K, H).astype(jnp.float32)
            s = jnp.einsum("tkgh,tckh->tkgc", qr, kb, precision=precision)
            idx = j * C + jnp.arange(C)
            valid = (idx[None, :] < lens[:, None]) & (idx[None, :] <= rel[:, None])  # [R, C]
            valid = valid[:, None, None, :]
            s = jnp.where(valid, s, NEG_INF)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.where(valid, jnp.exp(s - m_new[..., None]), 0.0)
            scale = jnp.exp(m - m_new)
            l = l * scale + p.sum(-1)
            acc = acc * scale[..., None] + jnp.einsum("tkgc,tckh->tkgh", p, vb, precision=precision)
            return m_new, l, acc

        # `full_like` keeps q's varying-axes type, which the loop carry must have inside shard_map.
        init = (jnp.full_like(qr[..., 0], NEG_INF), jnp.zeros_like(qr[..., 0]), jnp.zeros_like(qr))
        return lax.fori_loop(0, (jnp.max(seen) + C - 1) // C, body, init)  # only the blocks these rows see

    xs = (qg, meta.seq_ids, tok_len, tok_rel, tok_seen)
    m, l, acc = (a.reshape(num_row_blocks * R, *a.shape[2:])[:T]
                 for a in lax.map(row_block_attention, tuple(rows(a) for a in xs)))
    empty = l == 0.0
    safe_l = jnp.where(empty, 1.0, l)
    out = jnp.where(empty[..., None], 0.0, acc / safe_l[..., None])
    lse = jnp.where(empty, NEG_INF, m + jnp.log(safe_l))
    return out.reshape(T, N, H), lse.reshape(T, N)


def dense_attention_reference(q, k, v, q_positions, k_positions):
    """Plain softmax attention for tests: q [T, N, H], k/v [C, K, H], causal on absolute positions."""
    T, N, H = q.shape
    K = k.shape[1]
    qg = q.astype(jnp.float32).reshape(T, K, N // K, H) * (H ** -0.5)
    s = jnp.einsum("tkgh,ckh->tkgc", qg, k.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    mask = (k_positions[None, :] <= q_positions[:, None])[:, None, None, :]
    s = jnp.where(mask, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - lse[..., None])
    out = jnp.einsum("tkgc,ckh->tkgh", p, v.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return out.reshape(T, N, H), lse.reshape(T, N)
