"""The executor: turns a `StepPlan` into fixed-shape arrays and runs one jitted, shard_map-ed step.

The step function (forward + sampling + log-probs) is compiled once per shape bucket: the number of token rows
T, and of logits rows R, are rounded up to powers of two; the sequence rows B and page-table width M are fixed
by the engine's limits. The KV cache is donated, so it is updated in place.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mnemojax import sampler
from mnemojax.kv_manager import DUMMY_PAGE
from mnemojax.sampling_params import MAX_LOGPROBS
from mnemojax.scheduler import StepPlan
from models.llama import ModelSpec, StepBatch, forward
from shardings.specs import ShardingTable


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Per logits row: how to sample from it and what to score."""

    temperature: jax.Array  # f32[R] 0 => greedy
    top_k: jax.Array  # i32[R] <= 0 => disabled
    top_p: jax.Array  # f32[R]
    seeds: jax.Array  # u32[R]
    steps: jax.Array  # i32[R] index of the generated token (keys the sampler's random stream)
    targets: jax.Array  # i32[R] prompt token scored by this row; -1 => score the sampled token


@dataclasses.dataclass(frozen=True)
class RowResult:
    """Host-side results of one logits row."""

    token: int
    token_logprob: float
    target_logprob: float
    top_ids: np.ndarray
    top_logprobs: np.ndarray


def _bucket(n: int, minimum: int) -> int:
    return max(minimum, 1 << max(n - 1, 0).bit_length())


@dataclasses.dataclass
class _RowRef:
    """Where a logits row's result goes: (chunk index, token index within its request)."""

    chunk: int
    token_index: int
    is_sample: bool


class Executor:
    def __init__(self, spec: ModelSpec, params: dict, mesh, *, num_pages: int, page_size: int,
                 max_num_seqs: int, max_pages_per_seq: int, table: ShardingTable = ShardingTable()):
        self.spec = spec
        self.params = params
        self.mesh = mesh
        self.table = table
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_pages_per_seq = max_pages_per_seq
        c = spec.config
        cache_shape = (c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim)
        cache_sharding = NamedSharding(mesh, table.kv_lpskh)
        # Zeros, never uninitialized memory: 0 * NaN would poison masked attention (JAX_NOTES.md).
        alloc = jax.jit(lambda: jnp.zeros(cache_shape, spec.dtype), out_shardings=cache_sharding)
        self.k_cache, self.v_cache = alloc(), alloc()
        self._step = self._build_step()

    def _build_step(self):
        t = self.table
        batch_specs = StepBatch(token_ids=t.tokens_t, positions=t.tokens_t, seq_ids=t.tokens_t,
                                write_pages=t.tokens_t, write_slots=t.tokens_t, page_table=t.page_table_bm,
                                kv_lens=t.seqs_b, kv_start=t.seqs_b, logits_rows=t.rows_r)
        samp_specs = RowSampling(*([t.rows_r] * 6))
        out_specs = (t.kv_lpskh, t.kv_lpskh, (t.rows_r, t.rows_r, t.rows_r, t.rows_rj, t.rows_rj))
        param_specs = t.params(self.spec.config.tie_word_embeddings)
        spec = self.spec

        def step(params, k_cache, v_cache, batch: StepBatch, samp: RowSampling):
            logits, k_cache, v_cache = forward(spec, params, k_cache, v_cache, batch)
            tokens = sampler.sample(logits, samp.temperature, samp.top_k, samp.top_p, samp.seeds, samp.steps)
            lps = sampler.logprobs(logits, tokens, samp.targets, MAX_LOGPROBS)
            return k_cache, v_cache, (tokens, *lps)

        sharded = jax.shard_map(step, mesh=self.mesh,
                                in_specs=(param_specs, t.kv_lpskh, t.kv_lpskh, batch_specs, samp_specs),
                                out_specs=out_specs)
        self._batch_shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), (batch_specs, samp_specs))
        return jax.jit(sharded, donate_argnums=(1, 2))

    def prepare(self, plan: StepPlan) -> tuple[StepBatch, RowSampling, list[_RowRef]]:
        """Host side: the plan as numpy arrays, padded to the shape buckets."""
        S, M, B = self.page_size, self.max_pages_per_seq, self.max_num_seqs
        if len(plan.chunks) > B:
            raise ValueError(f"plan has {len(plan.chunks)} sequences, max_num_seqs is {B}")
        T = _bucket(plan.num_tokens, 16)
        tok = np.zeros(T, np.int32)
        pos = np.zeros(T, np.int32)
        seq = np.full(T, B - 1, np.int32)  # padding rows belong to the last row, never read
        wpage = np.full(T, DUMMY_PAGE, np.int32)
        wslot = np.zeros(T, np.int32)
        table = np.full((B, M), DUMMY_PAGE, np.int32)
        kv_lens = np.zeros(B, np.int32)
        rows: list[int] = []
        refs: list[_RowRef] = []
        samp = {k: [] for k in ("temperature", "top_k", "top_p", "seeds", "steps", "targets")}

        def add_row(row, ref, req, target):
            p = req.params
            rows.append(row)
            refs.append(ref)
            samp["temperature"].append(0.0 if p.greedy else p.temperature)
            samp["top_k"].append(p.top_k)
            samp["top_p"].append(p.top_p)
            samp["seeds"].append(req.seed & 0xFFFFFFFF)
            samp["steps"].append(len(req.output_token_ids))
            samp["targets"].append(target)

        t = 0
        for b, ch in enumerate(plan.chunks):
            req, s, n = ch.request, ch.start, ch.num_tokens
            idx = np.arange(s, s + n)
            tok[t:t + n] = [req.token_at(i) for i in range(s, s + n)]
            pos[t:t + n] = idx
            seq[t:t + n] = b
            pages = np.asarray(req.pages, np.int32)
            wpage[t:t + n] = pages[idx // S]
            wslot[t:t + n] = idx % S
            table[b, :len(pages)] = pages
            kv_lens[b] = s + n
            if req.prompt_logprobs is not None:
                # Row i scores prompt token i + 1; skip those already scored (before a preemption).
                done = len(req.prompt_logprobs)
                for i in range(max(s, done - 1), min(s + n, req.num_prompt_tokens - 1)):
                    add_row(t + i - s, _RowRef(b, i + 1, False), req, req.prompt_token_ids[i + 1])
            if ch.sample:
                add_row(t + n - 1, _RowRef(b, s + n, True), req, -1)
            t += n

        R = _bucket(len(rows), 8)
        pad = R - len(rows)
        batch = StepBatch(token_ids=tok, positions=pos, seq_ids=seq, write_pages=wpage, write_slots=wslot,
                          page_table=table, kv_lens=kv_lens, kv_start=np.zeros(B, np.int32),
                          logits_rows=np.asarray(rows + [0] * pad, np.int32))
        sampling = RowSampling(
            temperature=np.asarray(samp["temperature"] + [0.0] * pad, np.float32),
            top_k=np.asarray(samp["top_k"] + [0] * pad, np.int32),
            top_p=np.asarray(samp["top_p"] + [1.0] * pad, np.float32),
            seeds=np.asarray(samp["seeds"] + [0] * pad, np.uint32),
            steps=np.asarray(samp["steps"] + [0] * pad, np.int32),
            targets=np.asarray(samp["targets"] + [-1] * pad, np.int32))
        return batch, sampling, refs

    def execute(self, plan: StepPlan) -> list[tuple[_RowRef, RowResult]]:
        """Runs one step; returns the result of every logits row with where it belongs."""
        batch, sampling, refs = self.prepare(plan)
        batch, sampling = jax.device_put((batch, sampling), self._batch_shardings)
        self.k_cache, self.v_cache, out = self._step(self.params, self.k_cache, self.v_cache, batch, sampling)
        tokens, tok_lp, tgt_lp, top_ids, top_lp = jax.device_get(out)
        return [(ref, RowResult(int(tokens[i]), float(tok_lp[i]), float(tgt_lp[i]), top_ids[i], top_lp[i]))
                for i, ref in enumerate(refs)]
