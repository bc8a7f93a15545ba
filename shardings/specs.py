"""The one table of partition specs.

Field names spell the dimensions of the arrays they describe (letters below), so a reader sees what is split
where. Letters: l layers, d hidden, n query heads, k kv heads, h head dim, f MLP width, v vocab, p pages,
s slots in a page, t tokens of a step, b sequences of a step, m page-table columns, r logits rows, j top-k.

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
    # Step-plan arrays, one block of rows per KVP rank.
    tokens_t: P = P(KVP)
    seqs_b: P = P(KVP)
    page_table_bm: P = P(KVP, None)
    rows_r: P = P(KVP)
    rows_rj: P = P(KVP, None)

    def params(self, tie_word_embeddings: bool) -> dict:
        """Specs for the parameter pytree of `models.params` (same structure)."""
        specs = {
            "embed": self.embed_vd,
            "layers": {
                "attn_norm": self.norm_ld,
                "wq": self.wq_ldnh,
                "wk": self.wkv_ldkh,
                "wv": self.wkv_ldkh,
                "wo": self.wo_lnhd,
                "mlp_norm": self.norm_ld,
                "w_gate": self.w_in_ldf,
                "w_up": self.w_in_ldf,
                "w_down": self.w_down_lfd,
            },
            "final_norm": self.final_norm_d,
        }
        if not tie_word_embeddings:
            specs["lm_head"] = self.lm_head_dv
        return specs
