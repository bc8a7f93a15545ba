"""The one table of partition specs.

Field names spell the dimensions of the arrays they describe (letters below), so a reader sees what is split
where. Letters: l layers, d hidden, n query heads, k kv heads, h head dim, f MLP width, v vocab, p pages,
s slots in a page, t tokens of a step, b sequences of a step, m page-table columns, r logits rows, j top-k,
u page-table updates (i: an update's index and page), x the columns of a packed buffer.

Layout of the step (DESIGN.md): layer weights are stacked [L, ...] and split over `spp` (stages) and, within a
layer, over `tp` (heads / MLP columns); every KVP rank holds a full replica. KV pages are split over `spp`
(the stage's layers), `kvp` (each rank its own page pool) and `tp` (its share of kv heads). Step-plan arrays
have one block of rows per KVP rank.
"""
from __future__ import annotations

import dataclasses

from jax.sharding import PartitionSpec as P

from shardings.mesh import KVP, SPP, TP


@dataclasses.dataclass(frozen=True)
class ShardingTable:
    """Partition specs of every array the step touches."""

    # Parameters.
    embed_vd: P = P(None, None)
    norm_ld: P = P(SPP, None)
    wq_ldnh: P = P(SPP, None, TP, None)
    wkv_ldkh: P = P(SPP, None, TP, None)
    wo_lnhd: P = P(SPP, TP, None, None)
    w_in_ldf: P = P(SPP, None, TP)
    w_down_lfd: P = P(SPP, TP, None)
    final_norm_d: P = P(None)
    lm_head_dv: P = P(None, None)
    # KV cache: [layers, pages, slots, kv heads, head dim].
    kv_lpskh: P = P(SPP, KVP, None, TP, None)
    # Logits rows of the micro-batch leaving the pipeline, one block per KVP rank: [kvp, R] and [kvp, R, top-k].
    rows_kr: P = P(KVP, None)
    rows_krj: P = P(KVP, None, None)
    # The tokens the previous step sampled, every rank's logits rows on every device: [kvp, R_max]. The next step
    # reads a token sampled there but not yet seen by the host from it (async scheduling).
    sampled_kr: P = P(None, None)
    # Per token row of the micro-batch entering stage 0, where its input token is in `sampled_kr` (-1: given).
    entering_kt: P = P(KVP, None)
    # Page tables kept on the device between steps, one block per KVP rank: [kvp, B, M] (B sequence slots, M
    # page-table columns), and the step's updates to them in one array, [kvp, 2, U] (flat slot x column indices;
    # pages).
    table_kbm: P = P(KVP, None, None)
    updates_kiu: P = P(KVP, None, None)
    # The penalties' state kept on the device between steps, one block per KVP rank: per sequence slot (B + 1 rows,
    # as the page table's) the counts of the tokens sampled so far and the prompt's tokens, [kvp, B, V]; the slots an
    # update clears, [kvp, B] (its entries: `updates_kiu`, [kvp, 4, U]: slots, tokens, counts, in-prompt flags).
    penalty_kbv: P = P(KVP, None, None)
    penalty_kb: P = P(KVP, None)
    # The step's host arrays (its stacked micro-batches, logits rows, sampling columns and `entering_kt`) packed
    # into one int32 buffer per KVP rank, [kvp, X]: one host-to-device transfer a step, unpacked in the step.
    packed_kx: P = P(KVP, None)

    # The step's pipeline register: the activations each stage hands to the next, one block per (rank, stage).
    register_kstd: P = P(KVP, SPP, None, None)
    # Per-stage step-plan arrays, stacked [kvp, spp, ...]: each (rank, stage) sees its own micro-batch.
    stage_kst: P = P(KVP, SPP, None)
    stage_ksbm: P = P(KVP, SPP, None, None)

    def params(self, tie_word_embeddings: bool, *, split_layers: bool = True, split_kv_heads: bool = True) -> dict:
        """Specs for the parameter pytree of `models.params` (same structure).

        `split_layers=False` / `split_kv_heads=False` give the specs of the canonical (checkpoint) layout when
        its layer count or KV heads do not divide over spp / tp; `models.params.to_mesh_layout` then pads or
        repeats them into the sharded layout.
        """
        def drop(spec, axis, keep):
            return spec if keep else P(*(None if a == axis else a for a in spec))

        norm = drop(self.norm_ld, SPP, split_layers)
        specs = {
            "embed": self.embed_vd,
            "layers": {
                "attn_norm": norm,
                "wq": drop(self.wq_ldnh, SPP, split_layers),
                "wk": drop(drop(self.wkv_ldkh, SPP, split_layers), TP, split_kv_heads),
                "wv": drop(drop(self.wkv_ldkh, SPP, split_layers), TP, split_kv_heads),
                "wo": drop(self.wo_lnhd, SPP, split_layers),
                "mlp_norm": norm,
                "w_gate": drop(self.w_in_ldf, SPP, split_layers),
                "w_up": drop(self.w_in_ldf, SPP, split_layers),
                "w_down": drop(self.w_down_lfd, SPP, split_layers),
            },
            "final_norm": self.final_norm_d,
        }
        if not tie_word_embeddings:
            specs["lm_head"] = self.lm_head_dv
        return specs
