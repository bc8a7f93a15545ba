"""The Llama-3 forward step, written as per-device code.

`forward` runs inside `jax.shard_map` over the (kvp, spp, tp) mesh: every array it sees is the local shard
(its stage's layers, its share of heads and MLP columns, its KVP rank's pages and rows), and the collectives
are explicit. On the 1x1x1 mesh the collectives are identities and this is plain single-device code.

Letters: T step tokens, D hidden, N query heads, K kv heads, H head dim, F MLP width, V vocab, R logits rows.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from models import rope
from models.attention import AttentionMetadata, attention, plan_attention, split_kernel_options
from models.config import LlamaConfig
from models.kernels import AUTO, MIXED, REFERENCE, check_attention_impl
from shardings.collectives import from_last_stage, kvp_merge
from shardings.mesh import KVP, SPP, TP
from shardings.specs import ShardingTable

LAYER_SCOPE = "layer_"  # jax.named_scope of a layer's ops: `layer_3` is this stage's fourth layer


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    """One micro-batch's ragged rows as one pipeline stage of one KVP rank sees them (device arrays, built by
    the executor from the scheduler's plan).

    Tokens of all sequences are laid end to end; padding rows write to the reserved dummy page 0 and belong to
    a sequence row whose outputs are never read.
    """

    token_ids: jax.Array  # i32[T] input token of each row
    write_pages: jax.Array  # i32[T] page that receives the token's K/V (0 = dummy page: not this rank's token)
    write_slots: jax.Array  # i32[T] slot within that page
    shared: jax.Array  # bool[T] the row's request spans several KVP ranks: merge its attention over them
    attn: AttentionMetadata  # each row's sequence and position, this rank's pages and keys of each sequence

    @staticmethod
    def partition_specs(table: ShardingTable) -> StepBatch:
        """The partition specs of a step's stacked micro-batches, [kvp, spp, ...] arrays, from `table`."""
        rows = table.stage_kst
        return StepBatch(token_ids=rows, write_pages=rows, write_slots=rows, shared=rows,
                         attn=AttentionMetadata(seq_ids=rows, positions=rows, page_table=table.stage_ksbm,
                                                kv_lens=rows, kv_start=rows))


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Static facts the forward needs besides the arrays: hashable, so it can be a jit static argument."""

    config: LlamaConfig
    dtype: str = "float32"  # parameter, activation and KV-cache dtype
    block_pages: int = 8  # KV pages per block of the reference attention's online softmax
    attention: str = AUTO  # a name of models.kernels.ATTENTION_IMPLS (auto: the GPU kernels on an NVIDIA GPU)
    # The kernels' options as (name, value) pairs (hashable), e.g. (("persistent", True),) or (("stages", 3),):
    # tiling options go to `models.attention.plan_attention` once per step, the others (code generation) to each
    # layer's attention call (`split_kernel_options`); none for the reference attention.
    attention_options: tuple = ()

    def __post_init__(self):
        check_attention_impl(self.attention)
        if self.attention_options and self.attention == REFERENCE:
            raise ValueError(f"attention_options: the reference attention takes none, got {self.attention_options}")

    @property
    def plan_options(self) -> dict:
        return split_kernel_options(self.attention, dict(self.attention_options))[0]

    @property
    def call_options(self) -> dict:
        return split_kernel_options(self.attention, dict(self.attention_options))[1]

    @property
    def precision(self):
        # float32 means float32: no TF32 / bf16 passes on accelerators.
        return lax.Precision.HIGHEST if self.dtype == "float32" else lax.Precision.DEFAULT

    @property
    def inv_freq(self) -> np.ndarray:
        return np.asarray(rope.inv_freq(self.config), np.float32)


def rms_norm(x, weight, eps):
    """HF LlamaRMSNorm: normalise in float32, cast back, then scale."""
    xf = x.astype(jnp.float32)
    xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def _layer(spec: ModelSpec, batch: StepBatch, carry, layer, kind: str = MIXED, plan=None):
    x, k_cache, v_cache = carry
    p, idx = layer
    dt, prec, eps = jnp.dtype(spec.dtype), spec.precision, spec.config.rms_norm_eps
    inv_freq = jnp.asarray(spec.inv_freq)

    h = rms_norm(x, p["attn_norm"], eps)
    q = jnp.einsum("td,dnh->tnh", h, p["wq"], precision=prec)
    k = jnp.einsum("td,dkh->tkh", h, p["wk"], precision=prec)
    v = jnp.einsum("td,dkh->tkh", h, p["wv"], precision=prec)
    q = rope.apply_rope(q, batch.attn.positions, inv_freq)
    k = rope.apply_rope(k, batch.attn.positions, inv_freq)
    k_cache = k_cache.at[idx, batch.write_pages, batch.write_slots].set(k.astype(k_cache.dtype))
    v_cache = v_cache.at[idx, batch.write_pages, batch.write_slots].set(v.astype(v_cache.dtype))
    # A KVP rank's out is a partial: float32 into the merge (the kernels' own bf16 would round it first).
    partial = lax.axis_size(KVP) > 1
    o, lse = attention(spec.attention, q, k_cache, v_cache, idx, batch.attn, block_pages=spec.block_pages,
                       precision=prec, kind=kind, out_dtype=jnp.float32 if partial else None, plan=plan,
                       **spec.call_options)
    o = kvp_merge(o, lse, batch.shared)
    attn = jnp.einsum("tnh,nhd->td", o.astype(dt), p["wo"], precision=prec)
    x = x + lax.psum(attn, TP)

    h = rms_norm(x, p["mlp_norm"], eps)
    gate = jnp.einsum("td,df->tf", h, p["w_gate"], precision=prec)
    up = jnp.einsum("td,df->tf", h, p["w_up"], precision=prec)
    down = jnp.einsum("tf,fd->td", jax.nn.silu(gate) * up, p["w_down"], precision=prec)
    x = x + lax.psum(down, TP)
    return (x, k_cache, v_cache), None


def forward(spec: ModelSpec, params: dict, k_cache, v_cache, register, batch: StepBatch, logits_rows,
            kind: str = MIXED):
    """Runs this stage's layers on its micro-batch.

    Stage 0 embeds the micro-batch's tokens; a later stage takes the activations the previous stage handed on
    (`register` [T, D]). `logits_rows` i32[R] are the rows whose next-token logits are wanted, read from the
    last stage (whose micro-batch is the one leaving the pipeline). `kind` (static, `models.kernels.STEP_KINDS`):
    the rows every stage's micro-batch holds, so the attention kernels launch only what they need.

    Returns (logits f32[R, V], k_cache, v_cache, x [T, D] to hand to the next stage).
    """
    first = lax.axis_index(SPP) == 0
    x = jnp.where(first, params["embed"][batch.token_ids], register)  # [T, D]
    carry = (x, k_cache, v_cache)
    # The attention kernels' tilings and per-tile metadata depend on the step's layout alone: planned once here,
    # read by every layer (None for the reference attention).
    plan = plan_attention(spec.attention, batch.attn, num_heads=params["layers"][0]["wq"].shape[-2],
                          num_kv_heads=k_cache.shape[3], head_dim=k_cache.shape[4], page_size=k_cache.shape[2],
                          kind=kind, **spec.plan_options) if params["layers"] else None
    # One layer after another, each reading its own weight buffers ([1, ...] here: this stage's share of
    # `models.params.split_layers`' [spp, ...]); a scan over stacked weights would copy every layer's slice.
    # Each layer's ops carry its name (`layer_i`, this stage's i-th) in their HLO metadata and in profiles.
    for i, layer in enumerate(params["layers"]):
        with jax.named_scope(f"{LAYER_SCOPE}{i}"):
            carry, _ = _layer(spec, batch, carry, (jax.tree.map(lambda a: a[0], layer), i), kind, plan)
    x, k_cache, v_cache = carry
    h = from_last_stage(rms_norm(x[logits_rows], params["final_norm"], spec.config.rms_norm_eps))
    if "lm_head" in params:
        logits = jnp.einsum("rd,dv->rv", h, params["lm_head"], precision=spec.precision,
                            preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("rd,vd->rv", h, params["embed"], precision=spec.precision,
                            preferred_element_type=jnp.float32)
    return logits, k_cache, v_cache, x
