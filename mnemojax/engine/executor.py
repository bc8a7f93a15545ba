"""The executor: turns step plans into fixed-shape arrays and runs one jitted, shard_map-ed step.

Each call feeds one micro-batch (a `StepPlan`) into the first pipeline stage and advances the pipeline by one
stage; it returns the micro-batch that leaves the last stage (with spp = 1, the same one) and what the step gave
back for each of its chunks, as the scheduler's `update_from_output` takes it.

Rows, per KVP rank (`mnemojax.scheduling.rows`, the rule the scheduler's budgets follow): a request whose KV spans
several ranks puts its query tokens in a *shared* row range, the same rows on each rank holding its KV (shared
ranges first, disjoint); each of its ranks computes attention over its own KV there and the step merges them.
Requests that live on one rank fill that rank's rows after the last shared range it holds: a rank holding none
uses the rows of the others' shared ranges for its own requests.

Shapes: token rows T are rounded up to a power of two (fixed at the token budget when spp > 1, since every
micro-batch in flight shares the pipeline register), logits rows R likewise; sequence rows B and page-table
width M are fixed by the engine's limits. The KV cache and the pipeline register are donated. The step's host
arrays reach the device in one transfer, packed into one int32 buffer per KVP rank (`Packing`), which the jitted
step slices back into its arrays.

Page tables stay on the device between steps (`page_table` [kvp, B, M]): each request holds a sequence slot
(a row of it) on each of its ranks while it runs, and a step sends only the page-table entries that changed
since the device last saw them (new pages, or a whole row when a slot changes hands or a preempted request comes
back), applied by a small jitted scatter before the step. A slot is given to another request only once its
holder has finished (or left the rank) and no micro-batch in the pipeline still reads it.

Penalties (presence, frequency, repetition) read per-slot state kept on the device the same way: on each rank the
counts of the tokens sampled so far (`token_counts` [kvp, B + 1, V]) and the prompt's tokens (`prompt_tokens`). A
request with penalties takes its logits row on its first rank, whose slot holds them: the step adds each token it
samples there (every stage samples the same tokens, so the stages' copies stay equal), and the host sets a slot up
only when such a request takes it (cleared; its prompt's distinct tokens; a preempted request's generated tokens),
by a small jitted scatter before the step, like the page table's.

Bad words are decided on the host, where every generated token is but (with async scheduling) the one the step
before sampled: a ban whose word's prefix ends in that token is sent as a conditional bias slot (`bias_cond`), which
the step keeps only where the row's input token is the prefix's last (with a pipeline, the host decides it by the
time the micro-batch leaves, when that token has reached it).

Async scheduling: `launch` runs a step without waiting for it and `collect` fetches its results later, so the
host schedules and prepares step N+1 while step N runs. `collect` waits for its step to end even when it has no
token to fetch, so the host is never more than one step ahead of the device. A token step N samples stays on the
device: every step writes its sampled tokens into `sampled` (every rank's rows, on every device), and a row of
step N+1 whose input is such a token (a decode scheduled before its token reached the host) reads it from there.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from collections import defaultdict
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
from jax.sharding import NamedSharding

from mnemojax.scheduling.buckets import bucket
from mnemojax.engine import sampler
from mnemojax.scheduling.kv_manager import DUMMY_PAGE
from mnemojax.scheduling.pipeline import Pipeline
from mnemojax.scheduling.request import RequestStatus
from mnemojax.scheduling.rows import layout
from mnemojax.scheduling.sampling_params import MAX_LOGPROBS
from mnemojax.scheduling.scheduler import ChunkOutput, StepPlan
from models.attention import AttentionMetadata, resolve_attention
from models.kernels import DECODE, MIXED, PREFILL, REFERENCE, step_kind
from models.llama import ModelSpec, StepBatch, forward
from shardings.collectives import from_every_rank, pipeline_shift
from shardings.mesh import KVP, SPP, TP
from shardings.specs import ShardingTable


_F32_MAX = float(np.finfo(np.float32).max)
_I32_MAX = int(np.iinfo(np.int32).max)
SAMPLED_TOKENS = "sampled_tokens"  # the named scope of the step's exchange of sampled tokens over the KVP ranks


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Per logits row: how to sample from it and what to score."""

    temperature: jax.Array  # f32[R] 0 => greedy
    top_k: jax.Array  # i32[R] <= 0 => disabled
    top_p: jax.Array  # f32[R]
    seeds: jax.Array  # u32[R, 2] the seed's high and low words (its threefry key, `sampler.seed_words`)
    steps: jax.Array  # i32[R] index of the generated token (keys the sampler's random stream)
    targets: jax.Array  # i32[R] prompt token scored by this row; -1 => score the sampled token
    want_top: jax.Array  # bool[R] its request asked for top log-probs (else the vocabulary top-k is skipped)
    min_p: jax.Array  # f32[R] 0 => disabled
    bias_ids: jax.Array  # i32[R, W] tokens whose logits get bias_values added (logit_bias, min_tokens' bans)
    bias_values: jax.Array  # f32[R, W] (0 in the unused slots)
    allow_only: jax.Array  # bool[R] only the bias slots' tokens may be drawn (allowed_token_ids)
    penalty_slot: jax.Array  # i32[R] the row's sequence slot, whose token counts its penalties read and its sampled
    # token is counted into (B + 1, past the slots, where neither: a row of a request without penalties)
    presence: jax.Array  # f32[R] presence_penalty (0: none)
    frequency: jax.Array  # f32[R] frequency_penalty (0: none)
    repetition: jax.Array  # f32[R] repetition_penalty (1: none)
    bias_cond: jax.Array  # i32[R, W] a slot counts only when the row's input token is this one (-1: always): the ban
    # of a bad word whose last prefix token was sampled by the previous step, still on the device when prepared
    mask_bits: jax.Array  # u32[R, M] the tokens a row may draw, token t bit t % 32 of word t // 32 (structured
    # outputs' regex); M = ceil(vocab / 32) in a step where some row has a mask, else 1 (unused: no mask code runs)
    masked: jax.Array  # bool[R] the row draws only the tokens of its mask_bits


class RowRef(NamedTuple):
    """Where a logits row's result goes (a named tuple: one is made per row per step, ~3x cheaper than a frozen
    dataclass)."""

    rank: int  # KVP rank whose logits row it is
    row: int  # index among that rank's logits rows
    chunk: int  # index of the chunk in its plan
    token_index: int  # index (in its request) of the token the row predicts
    is_sample: bool  # sample a new token (else: score prompt token `token_index`)


@dataclasses.dataclass
class MicroBatch:
    """A plan prepared for the device: numpy arrays with a leading [kvp] axis."""

    plan: StepPlan
    batch: StepBatch  # arrays [kvp, T, ...]
    rows: np.ndarray  # i32[kvp, R] logits rows
    sampling: RowSampling  # arrays [kvp, R]
    refs: list[RowRef]
    src: np.ndarray  # i32[kvp, T] where a row's input token is in the previous step's `sampled` (-1: in `batch`)
    logprobs: bool = False  # some logits row needs log-probs (a request's `logprobs`, or a prompt log-prob row)
    # with a pipeline, the conditional bans (`RowSampling.bias_cond`) as (rank, row, slot, request, position of the
    # row's input), which the host resolves when the micro-batch leaves (the step's input tokens are another's)
    pending: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Launched:
    """A step running on the device: the micro-batch that leaves the pipeline in it and its results, unfetched."""

    leaving: MicroBatch
    out: tuple | None  # device arrays (tokens, log-probs), None when the micro-batch has no logits row to fetch
    done: Any = None  # without a row to fetch: a device array of the step, which `collect` waits for




def _logprob_dict(top_ids: np.ndarray, top_lps: np.ndarray, k: int, token: int, token_lp: float) -> dict[int, float]:
    """The `k` top log-probs of a row, and the log-prob of `token` (the sampled or scored one)."""
    d = {int(i): float(lp) for i, lp in zip(top_ids[:k], top_lps[:k])}
    d[token] = token_lp
    return d


def _bad_word_bans(req, step: int) -> list[tuple[int, int]]:
    """The bans of `req`'s bad words of several tokens in the row that samples its generated token `step`, as
    (token, condition) pairs: the token is banned where the `step` tokens generated before it end with the word's
    prefix (vLLM's rule: the prompt's tokens never match). The host knows every one of them but, with async
    scheduling, the last: sampled by the step before, it is still on the device. Then the ban's condition is the
    prefix's last token, which the step compares with the row's input token; else it is -1 (banned outright)."""
    out = req.output_token_ids
    known = len(out)
    if not known <= step <= known + 1:
        raise RuntimeError(f"request {req.request_id}: a row samples token {step} of its output, but {known} "
                           f"tokens are on the host")
    bans = []
    for prefix, last in req.bad_words:
        k = len(prefix)
        if k > step:
            continue
        if step == known:
            if tuple(out[step - k:]) == prefix:
                bans.append((last, -1))
        elif tuple(out[step - k:known]) == prefix[:-1]:
            bans.append((last, prefix[-1]))
    return bans


def _resolved(mb: MicroBatch) -> MicroBatch:
    """`mb` with its conditional bans made plain ones (or none) on the host, from each row's input token, known by
    the time a micro-batch leaves a pipeline (its request's token was sampled at least two steps before; the host
    fetches every step's tokens before it launches the step after next). A copy: `mb` itself is unchanged (as
    `Executor.lower` needs)."""
    ids, values, cond = (a.copy() for a in (mb.sampling.bias_ids, mb.sampling.bias_values, mb.sampling.bias_cond))
    for r, row, j, req, q in mb.pending:
        if q < req.num_tokens:
            if req.token_at(q) != cond[r, row, j]:
                ids[r, row, j], values[r, row, j] = sampler.NO_TOKEN, 0.0
        elif not req.is_finished:  # a finished request's row is thrown away
            raise RuntimeError(f"request {req.request_id}: token {q} is not on the host when its row leaves the "
                               f"pipeline")
        cond[r, row, j] = -1
    sampling = dataclasses.replace(mb.sampling, bias_ids=ids, bias_values=values, bias_cond=cond)
    return dataclasses.replace(mb, sampling=sampling, pending=[])


assert DUMMY_PAGE == 0, "the device page table starts as zeros: unused entries read the dummy page"


@dataclasses.dataclass(frozen=True)
class Packing:
    """Where each of a step's host arrays lies in the one int32 buffer [kvp, X] that carries them all to the
    device (one transfer a step instead of one per array): the pytree's structure and each leaf's shape and dtype.
    Hashable: the jitted step takes it as a static argument and unpacks the buffer (`unpack`). Float32 and uint32
    leaves travel as their bits, bools as 0 / 1, so unpacking gives back exactly what was packed."""
    treedef: Any
    leaves: tuple[tuple[tuple[int, ...], str], ...]

    @staticmethod
    def pack(tree) -> tuple[np.ndarray, Packing]:
        """`tree`'s numpy leaves, each [kvp, ...] of a 4-byte dtype or bool, as one int32 array [kvp, X]."""
        leaves, treedef = jax.tree.flatten(tree)
        cols = []
        for a in leaves:
            if a.dtype == np.bool_:
                a = a.astype(np.int32)
            elif a.dtype.itemsize != 4:
                raise TypeError(f"a step's host array of dtype {a.dtype} cannot be packed (4-byte dtypes or bool)")
            cols.append(np.ascontiguousarray(a).reshape(a.shape[0], -1).view(np.int32))
        return np.concatenate(cols, axis=1), Packing(treedef, tuple((a.shape, a.dtype.str) for a in leaves))

    def unpack(self, packed: jax.Array):
        """The tree `pack` packed, from its buffer (traced, inside the step)."""
        out, at = [], 0
        for shape, dtype in self.leaves:
            n = int(np.prod(shape[1:], dtype=np.int64))
            a = packed[:, at:at + n].reshape(packed.shape[:1] + shape[1:])
            at += n
            dtype = np.dtype(dtype)
            out.append(a != 0 if dtype == np.bool_ else a if dtype == np.int32 else lax.bitcast_convert_type(a, dtype))
        return jax.tree.unflatten(self.treedef, out)


def _per_instance(method):
    """Caches `method`'s results per executor and arguments, in the executor: a class-level `lru_cache` holds every
    executor that ever ran a step, and its weights and KV cache with it, after its engine is gone."""
    name = f"_cached_{method.__name__}"

    @functools.wraps(method)
    def cached(self, *args):
        memo = self.__dict__.setdefault(name, {})
        if args not in memo:
            memo[args] = method(self, *args)
        return memo[args]

    return cached


class _Slots:
    """One KVP rank's sequence slots of the device page table: who holds each, and how much of the holder's page
    list the device has (`sent` pages of list `key`, the last of them `last`, to catch a list that changed)."""

    def __init__(self, num_slots: int):
        self.owner: list = [None] * num_slots
        self.key: list = [None] * num_slots
        self.sent = [0] * num_slots
        self.last = [-1] * num_slots
        self.of: dict[int, int] = {}  # id(request) -> slot (the owner is held, so its id stays unique)
        self.free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first

    def copy(self) -> _Slots:
        """The same slots (owners shared), for a state to restore."""
        other = copy.copy(self)
        other.owner, other.key, other.sent, other.last = list(self.owner), list(self.key), list(self.sent), \
            list(self.last)
        other.of, other.free = dict(self.of), list(self.free)
        return other

    def release(self, b: int) -> None:
        del self.of[id(self.owner[b])]
        self.owner[b], self.key[b], self.sent[b], self.last[b] = None, None, 0, -1
        self.free.append(b)


class Executor:
    """The device side of the engine: the weights, the paged KV cache and page table on the mesh, and the compiled
    step of each shape. `prepare` turns a `StepPlan` into a micro-batch's host arrays, `launch` / `collect` run it
    (through the `spp` pipeline) and hand back each chunk's sampled token and log-probs."""

    _one_token_scalars = True
    """`prepare` lays out a one-token chunk (a decode) by scalar writes rather than the general path's array
    operations: the same arrays, about 5x less host time for a batch of decodes (tests compare the two)."""

    def __init__(self, spec: ModelSpec, params: dict, mesh, *, num_pages: int, page_size: int,
                 max_num_seqs: int, max_pages_per_seq: int, max_num_batched_tokens: int,
                 max_tokens_per_rank: int | None, table: ShardingTable = ShardingTable(), channel=None,
                 max_logit_bias: int = 0):
        self.spec = spec
        self.params = params
        self.mesh = mesh
        self.table = table
        self.kvp, self.spp, self.tp = (mesh.shape[a] for a in (KVP, SPP, TP))
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_pages_per_seq = max_pages_per_seq
        self.max_tokens_per_rank = max_tokens_per_rank
        self.max_num_batched_tokens = max_num_batched_tokens
        # (token, bias) slots per logits row; one at least (unused: zeros), as a step's arrays cannot be empty
        self.bias_slots = max(1, max_logit_bias)
        self.mask_words = -(-spec.config.vocab_size // 32)  # a regex row's allowed-token bitmask, in uint32 words
        # Every micro-batch in flight must have the register's shape, so a pipeline fixes T.
        self.pipeline_tokens = bucket(max_num_batched_tokens, 16) if self.spp > 1 else None
        c = spec.config
        # params["layers"]: one dict per layer of a stage, leaves [spp, ...] (`models.params.split_layers`)
        num_layers, kv_heads = len(params["layers"]) * self.spp, params["layers"][0]["wk"].shape[2]
        cache_shape = (num_layers, self.kvp * num_pages, page_size, kv_heads, c.head_dim)
        # Zeros, never uninitialized memory: 0 * NaN would poison masked attention (JAX_NOTES.md).
        self._alloc_cache = jax.jit(lambda: jnp.zeros(cache_shape, spec.dtype),
                                    out_shardings=NamedSharding(mesh, table.kv_lpskh))
        self.k_cache, self.v_cache = self._alloc_cache(), self._alloc_cache()
        self.register = None
        self._shapes_run: set[tuple[int, int, str, bool]] = set()  # (T, R, kind, masked) of every step launched
        self.last_step_first_of_shape = False
        self.channel = channel  # multi-host: process 0's `mnemojax.engine.multihost.Leader`, which broadcasts each step
        self.in_flight: Pipeline[MicroBatch] = Pipeline(self.spp)
        # Attention kernels launch only the tiles a step's kind needs (models.kernels.STEP_KINDS): one compiled
        # step per kind. The reference attention has one path for every kind: one compiled step.
        self.kinds = resolve_attention(spec.attention) != REFERENCE
        self._steps = {}
        self._packed_sharding = NamedSharding(mesh, table.packed_kx)
        self._register_sharding = NamedSharding(mesh, table.register_kstd)
        self._sampled_sharding = NamedSharding(mesh, table.sampled_kr)
        # Rows 0..max_num_seqs-1 are the requests' slots; the last row is the padding rows' sequence, never
        # written: every padding row attends to nothing.
        self._alloc_table = jax.jit(lambda: jnp.zeros((self.kvp, max_num_seqs + 1, max_pages_per_seq), jnp.int32),
                                    out_shardings=NamedSharding(mesh, table.table_kbm))
        self.page_table = self._alloc_table()
        self._slots = [_Slots(max_num_seqs) for _ in range(self.kvp)]
        self._updates: list[list[np.ndarray]] = [[] for _ in range(self.kvp)]  # per rank: [2, n] (index, page)
        self._update_table = self._build_table_update()
        # The previous step's sampled tokens [kvp, R_max] (R_max: the most logits rows of any step shape), and
        # where each request's token sampled in it is (flat index), for the rows of the next step that read one.
        self.max_rows = max(R for _, R, _ in self.shape_buckets())
        self._alloc_sampled = jax.jit(lambda: jnp.zeros((self.kvp, self.max_rows), jnp.int32),
                                      out_shardings=self._sampled_sharding)
        self.sampled = self._alloc_sampled()
        self._sampled_at: dict[int, int] = {}  # id(request) -> rank * max_rows + row
        # The penalties' state, per KVP rank and sequence slot: the counts of the tokens sampled so far, [kvp, B + 1,
        # V] (each step adds its sampled tokens of requests with penalties), and the prompt's tokens, [kvp, B + 1, V]
        # (set by the host, `_penalty_init`, when such a request takes a slot on its sampling rank).
        V = c.vocab_size
        self._alloc_counts = jax.jit(lambda: jnp.zeros((self.kvp, max_num_seqs + 1, V), jnp.int32),
                                     out_shardings=NamedSharding(mesh, table.penalty_kbv))
        self._alloc_prompt = jax.jit(lambda: jnp.zeros((self.kvp, max_num_seqs + 1, V), bool),
                                     out_shardings=NamedSharding(mesh, table.penalty_kbv))
        self.token_counts, self.prompt_tokens = self._alloc_counts(), self._alloc_prompt()
        # per rank: the slots to clear and the (slot, token, count, in prompt) entries to scatter [4, n]
        self._penalty_inits: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(self.kvp)]
        self._update_penalties = self._build_penalty_update()

    def reset(self) -> None:
        """Forgets every micro-batch in flight and every sequence slot, as after a step that failed (the engine then
        preempts every request: `LLMEngine._recover`), and re-creates the device buffers such a step consumed
        (donated) without giving them back: the KV cache (zeros again), the sampled tokens and the token counts.
        Then checks that every device of this process still answers (a small array sent to each and fetched back):
        a lost device (a sticky GPU error) raises here, so the engine knows it cannot recover."""
        self.in_flight = Pipeline(self.spp)
        self._slots = [_Slots(self.max_num_seqs) for _ in range(self.kvp)]
        self._updates = [[] for _ in range(self.kvp)]
        self._sampled_at = {}
        self._penalty_inits = [[] for _ in range(self.kvp)]
        self.register = None
        self.page_table = self._alloc_table()
        if self.sampled.is_deleted():
            self.sampled = self._alloc_sampled()
        # every slot is forgotten: a request with penalties sets its own up again (a failed step consumed the
        # counts; a failed update of the penalties' state, both)
        if self.token_counts.is_deleted():
            self.token_counts = self._alloc_counts()
        if self.prompt_tokens.is_deleted():
            self.prompt_tokens = self._alloc_prompt()
        if self.k_cache.is_deleted() or self.v_cache.is_deleted():
            for cache in (self.k_cache, self.v_cache):
                if not cache.is_deleted():
                    cache.delete()  # its memory first: two whole caches may not fit
            self.k_cache, self.v_cache = self._alloc_cache(), self._alloc_cache()
        for d in self.mesh.devices.flat:
            if d.process_index == jax.process_index() and np.asarray(jax.device_put(np.int32(7), d)) != 7:
                raise RuntimeError(f"device {d} returned a wrong value after a failed step")

    # ---------------------------------------------------------------- device side
    def _step(self, kind: str):
        """The jitted step for steps of `kind` (built when first asked for)."""
        if kind not in self._steps:
            self._steps[kind] = self._build_step(kind)
        return self._steps[kind]

    def step_kind(self, plans) -> str:
        """The kind of a step running `plans` (every micro-batch in the pipeline): what its attention holds."""
        return step_kind(c.num_tokens for p in plans for c in p.chunks) if self.kinds else MIXED

    def _build_step(self, kind: str, mesh=None):
        """The jitted step of `kind` over `mesh` (default: the executor's; another mesh of the same shape for
        `lower_shape`)."""
        t, spec = self.table, self.spec
        mesh = self.mesh if mesh is None else mesh
        stage = StepBatch.partition_specs(t)
        samp = RowSampling(*([t.rows_kr] * len(dataclasses.fields(RowSampling))))
        param_specs = jax.tree.map(lambda a: a.sharding.spec, self.params)

        def step(params, k_cache, v_cache, register, sampled, page_table, counts, in_prompt, batch: StepBatch, rows,
                 samp: RowSampling, src):
            batch = jax.tree.map(lambda a: a[0, 0], batch)  # this (rank, stage)'s micro-batch
            batch = dataclasses.replace(batch, attn=dataclasses.replace(batch.attn, page_table=page_table[0]))
            rows, samp, src = rows[0], jax.tree.map(lambda a: a[0], samp), src[0]
            # Rows whose input token the previous step sampled read it here (only stage 0 embeds tokens; src
            # describes its micro-batch, and later stages ignore their token ids).
            given = jnp.where(src >= 0, sampled.reshape(-1)[jnp.maximum(src, 0)], batch.token_ids)
            batch = dataclasses.replace(batch, token_ids=given)
            logits, k_cache, v_cache, x = forward(spec, params, k_cache, v_cache, register[0, 0], batch, rows, kind)
            penalties = sampler.Penalties(counts[0], in_prompt[0], samp.penalty_slot, samp.presence, samp.frequency,
                                          samp.repetition)
            # A conditional slot (a bad word's ban) counts where the row's input token is its condition. Without a
            # pipeline that is the row's own input (a max over the one stage: the same values, which the sampler's
            # cond needs to know do not vary over it); with one, the host has resolved every condition (all -1).
            bias_ids, bias_values = samp.bias_ids, samp.bias_values
            if self.spp == 1:
                on = (samp.bias_cond < 0) | (samp.bias_cond == lax.pmax(given[rows], SPP)[:, None])
                bias_ids = jnp.where(on, bias_ids, sampler.NO_TOKEN)
                bias_values = jnp.where(on, bias_values, 0.0)
            masks = (samp.mask_bits, samp.masked) if samp.mask_bits.shape[-1] > 1 else None
            tokens = sampler.sample(logits, samp.temperature, samp.top_k, samp.top_p, samp.seeds, samp.steps,
                                    samp.min_p, bias_ids, bias_values, samp.allow_only, penalties, masks)
            # this rank's sampled tokens of requests with penalties counted in their slots (the others' rows
            # name no slot: dropped). Every stage samples the same tokens (the last stage's logits), so the
            # stages' copies stay equal.
            counts = counts.at[0, samp.penalty_slot, tokens].add(1, mode="drop")
            lps = sampler.logprobs(logits, tokens, samp.targets, MAX_LOGPROBS, jnp.any(samp.want_top))
            with jax.named_scope(SAMPLED_TOKENS):  # named, so a communication audit can tell it from the layers'
                sampled = lax.dynamic_update_slice(sampled, from_every_rank(tokens), (0, 0))
            out = jax.tree.map(lambda a: a[None], (tokens, *lps))
            return k_cache, v_cache, pipeline_shift(x)[None, None], sampled, counts, out

        out_specs = (t.kv_lpskh, t.kv_lpskh, t.register_kstd, t.sampled_kr, t.penalty_kbv,
                     (t.rows_kr, t.rows_kr, t.rows_kr, t.rows_krj, t.rows_krj))
        sharded = jax.shard_map(step, mesh=mesh,
                                in_specs=(param_specs, t.kv_lpskh, t.kv_lpskh, t.register_kstd, t.sampled_kr,
                                          t.table_kbm, t.penalty_kbv, t.penalty_kbv, stage, t.rows_kr, samp,
                                          t.entering_kt),
                                out_specs=out_specs)

        host_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), (stage, t.rows_kr, samp, t.entering_kt))

        def unpacked(params, k_cache, v_cache, register, sampled, page_table, counts, in_prompt, packed,
                     packing: Packing):
            # The host arrays, sliced out of the one buffer they came in and split as the step takes them: each
            # device keeps its part of its own rank's row (no communication).
            host = jax.tree.map(jax.reshard, packing.unpack(packed), host_shardings)
            return sharded(params, k_cache, v_cache, register, sampled, page_table, counts, in_prompt, *host)

        return jax.jit(unpacked, donate_argnums=(1, 2, 3, 4, 6), static_argnums=(9,))

    def _build_table_update(self):
        """A jitted in-place scatter of updates [kvp, 2, U] (flat slot x column indices; pages) into the page
        table; indices past the table are padding, dropped."""
        t = self.table

        def update(table, updates):
            flat = table[0].reshape(-1).at[updates[0, 0]].set(updates[0, 1], mode="drop")
            return flat.reshape(table.shape)

        sharded = jax.shard_map(update, mesh=self.mesh, in_specs=(t.table_kbm, t.updates_kiu), out_specs=t.table_kbm)
        self._updates_sharding = NamedSharding(self.mesh, t.updates_kiu)
        return jax.jit(sharded, donate_argnums=0)

    def update_buckets(self) -> list[int]:
        """Every size U of a page-table update: powers of two from 64 up to the whole table of one rank."""
        B, M = self.page_table.shape[1:]
        return [64 << i for i in range(max(1, bucket(B * M, 64).bit_length() - 6))]

    def apply_table_updates(self, updates: np.ndarray, broadcast: bool = True) -> None:
        """Scatters host updates [kvp, 2, U] (flat slot x column indices; pages) into the device page table, one
        transfer (multi-host: `broadcast` sends them to the followers first)."""
        if self.channel is not None and broadcast:
            self.channel.table(updates)
        self.page_table = self._update_table(self.page_table, self._to_mesh(updates, self._updates_sharding))

    @staticmethod
    def _to_mesh(a: np.ndarray, sharding: NamedSharding) -> jax.Array:
        """A host array placed on the mesh (each process fills its own devices' shards from the same array)."""
        if jax.process_count() == 1:
            return jax.device_put(a, sharding)
        return jax.make_array_from_callback(a.shape, sharding, lambda i: a[i])

    def _flush_table_updates(self) -> None:
        """Sends the page-table entries that changed since the last step (none: nothing runs)."""
        if not any(self._updates):
            return
        per_rank = [np.concatenate(u, axis=1) if u else np.zeros((2, 0), np.int32) for u in self._updates]
        U = bucket(max(u.shape[1] for u in per_rank), 64)
        updates = self._no_updates(U).copy()
        for r, u in enumerate(per_rank):
            updates[r, :, :u.shape[1]] = u
        self._updates = [[] for _ in range(self.kvp)]
        self.apply_table_updates(updates)

    @_per_instance
    def _no_updates(self, U: int) -> np.ndarray:
        """Updates [kvp, 2, U] that change nothing: every index past the table (dropped), pages 0 (read only:
        cached)."""
        B, M = self.page_table.shape[1:]
        none = np.stack(np.broadcast_arrays(np.int32(B * M), np.zeros((self.kvp, U), np.int32)), axis=1)
        none.flags.writeable = False
        return none

    def _build_penalty_update(self):
        """A jitted in-place update of the penalties' state (token counts, prompt tokens): the slots of `clear`
        [kvp, B + 1] zeroed, then entries [kvp, 4, U] (slots; tokens; counts added; prompt flags set) scattered
        (by (slot, token) pairs: a flat index would pass int32 at (B + 1) x V = 2**31); a slot past the state is
        padding, dropped."""
        t = self.table

        def update(counts, in_prompt, clear, entries):
            keep = ~clear[0][:, None]
            slot, token, count, mark = entries[0]
            counts = jnp.where(keep, counts[0], 0).at[slot, token].add(count, mode="drop")
            in_prompt = (in_prompt[0] & keep).at[slot, token].max(mark > 0, mode="drop")
            return counts[None], in_prompt[None]

        sharded = jax.shard_map(update, mesh=self.mesh,
                                in_specs=(t.penalty_kbv, t.penalty_kbv, t.penalty_kb, t.updates_kiu),
                                out_specs=(t.penalty_kbv, t.penalty_kbv))
        self._clear_sharding = NamedSharding(self.mesh, t.penalty_kb)
        return jax.jit(sharded, donate_argnums=(0, 1))

    def penalty_update_buckets(self) -> list[int]:
        """Every size U of a penalties' update: powers of two from 64 up to two vocabularies' worth (what one
        request's prompt and generated tokens can need, `_penalty_init`)."""
        most = bucket(2 * self.token_counts.shape[2], 64)
        return [64 << i for i in range(most.bit_length() - 6)]

    def apply_penalty_updates(self, clear: np.ndarray, entries: np.ndarray, broadcast: bool = True) -> None:
        """Clears the slots of `clear` [kvp, B + 1] in the penalties' state and scatters `entries` [kvp, 4, U] into
        it (multi-host: `broadcast` sends them to the followers first)."""
        if self.channel is not None and broadcast:
            self.channel.penalties(clear, entries)
        self.token_counts, self.prompt_tokens = self._update_penalties(
            self.token_counts, self.prompt_tokens, self._to_mesh(clear, self._clear_sharding),
            self._to_mesh(entries, self._updates_sharding))

    @_per_instance
    def _no_penalty_updates(self, U: int) -> tuple[np.ndarray, np.ndarray]:
        """(clear, entries [kvp, 4, U]) that change nothing: no slot, every entry's slot past the state (dropped)."""
        B1 = self.token_counts.shape[1]
        clear = np.zeros((self.kvp, B1), bool)
        entries = np.zeros((self.kvp, 4, U), np.int32)
        entries[:, 0] = B1
        clear.flags.writeable = entries.flags.writeable = False
        return clear, entries

    def _penalty_init(self, b: int, req) -> tuple[int, np.ndarray]:
        """(slot `b`, its entries [4, n]) that set a request with penalties up in the slot it takes on its sampling
        rank: its prompt's tokens (where a repetition penalty reads them) and the counts of the tokens it has
        generated (a preempted request's, recomputed). The device counts the tokens it samples from then on."""
        if req.num_unfetched:  # a token it sampled is not on the host yet, so it could not be counted here
            raise RuntimeError(f"request {req.request_id}: a slot is set up while a token it sampled is unseen")
        parts = []
        if req.params.repetition_penalty != 1:
            tokens = np.unique(np.asarray(req.prompt_token_ids, np.int32))
            parts.append(np.stack([np.full_like(tokens, b), tokens, np.zeros_like(tokens), np.ones_like(tokens)]))
        if req.output_token_ids:
            tokens, counts = np.unique(np.asarray(req.output_token_ids, np.int32), return_counts=True)
            parts.append(np.stack([np.full_like(tokens, b), tokens, counts.astype(np.int32), np.zeros_like(tokens)]))
        return b, np.concatenate(parts, axis=1) if parts else np.zeros((4, 0), np.int32)

    def _flush_penalty_inits(self) -> None:
        """Sets up the slots that requests with penalties took since the last step (none: nothing runs), in as
        few updates as the largest bucket allows."""
        if not any(self._penalty_inits):
            return
        inits, self._penalty_inits = self._penalty_inits, [[] for _ in range(self.kvp)]
        clear = np.zeros(self.token_counts.shape[:2], bool)
        per_rank = []
        for r, items in enumerate(inits):
            clear[r, [b for b, _ in items]] = True
            per_rank.append(np.concatenate([e for _, e in items], axis=1) if items else np.zeros((4, 0), np.int32))
        most = self.penalty_update_buckets()[-1]
        n = max(e.shape[1] for e in per_rank)
        for start in range(0, max(n, 1), most):  # the slots cleared with the first part
            U = bucket(min(most, max(1, n - start)), 64)
            entries = self._no_penalty_updates(U)[1].copy()
            for r, e in enumerate(per_rank):
                part = e[:, start:start + U]
                entries[r, :, :part.shape[1]] = part
            self.apply_penalty_updates(clear if start == 0 else self._no_penalty_updates(U)[0], entries)

    def _choice_slots(self, req, step: int) -> tuple[np.ndarray, np.ndarray, bool]:
        """The logits row's slots of a request with structured outputs' choices (`Request.choices`) that samples its
        generated token `step`: only the tokens allowed after the `step` tokens before it (all on the host: the
        scheduler does not decode a token of such a request before it has it)."""
        out = req.output_token_ids
        allowed = req.choices.get(tuple(out)) if step == len(out) else None
        if allowed is None:
            raise RuntimeError(f"request {req.request_id}: no choice allows a token after its {len(out)} generated "
                               f"tokens (row for token {step})")
        ids = np.full(self.bias_slots, sampler.NO_TOKEN, np.int32)
        ids[:len(allowed)] = allowed
        return ids, np.zeros(self.bias_slots, np.float32), True

    def _regex_mask(self, req, step: int) -> np.ndarray:
        """The logits row's allowed tokens (`RowSampling.mask_bits`) of a request with structured outputs' regex that
        samples its generated token `step`: those the regex allows after the `step` tokens before it (all on the
        host, as for choices)."""
        out = req.output_token_ids
        if step != len(out):
            raise RuntimeError(f"request {req.request_id}: its regex needs the {step} tokens before the row, and the "
                               f"host has {len(out)}")
        return req.regex.mask_after(out)

    def _slot(self, rank: int, req, span_i: int) -> int:
        """`req`'s sequence slot on `rank` (given one if it has none), its new page-table entries queued."""
        slots = self._slots[rank]
        b = slots.of.get(id(req))
        if b is None:
            b = self._free_slot(rank)
            slots.of[id(req)], slots.owner[b] = b, req
        pages = req.pages[span_i]
        key, sent = (req.num_preemptions, span_i), slots.sent[b]
        if slots.key[b] != key and span_i == 0 and req.params.penalized:  # a new holder on its sampling rank
            self._penalty_inits[rank].append(self._penalty_init(b, req))
        if slots.key[b] != key or sent > len(pages) or (sent and pages[sent - 1] != slots.last[b]):
            sent = 0  # a new holder, or a page list that is not the one the device has: send it whole
        if sent < len(pages):
            M = self.page_table.shape[2]
            new = np.asarray(pages[sent:], np.int32)
            self._updates[rank].append(np.stack([b * M + np.arange(sent, len(pages), dtype=np.int32), new]))
            slots.key[b], slots.sent[b], slots.last[b] = key, len(pages), pages[-1]
        return b

    def _free_slot(self, rank: int) -> int:
        slots = self._slots[rank]
        if not slots.free:  # take back the slots of requests that are done here and read by nothing in flight
            busy = {id(ch.request) for mb in self.in_flight for ch in mb.plan.chunks}
            for b, req in enumerate(slots.owner):
                if req is not None and id(req) not in busy and (
                        req.status is not RequestStatus.RUNNING or rank not in req.kv_ranks):
                    slots.release(b)
        if not slots.free:
            raise RuntimeError(f"rank {rank}: all {len(slots.owner)} sequence slots (max_num_seqs) are held")
        return slots.free.pop()

    # ---------------------------------------------------------------- host side
    def _row_layout(self, plan: StepPlan) -> tuple[list[int], list[int]]:
        """(Each chunk's first row on the ranks holding its request's KV, the rows each rank needs)."""
        return layout(((c.request.kv_ranks, c.num_tokens) for c in plan.chunks), self.kvp)

    def prepare(self, plan: StepPlan, T: int | None = None) -> MicroBatch:
        """The plan as numpy arrays [kvp, ...], padded to T token rows (by default the step's: `pipeline_tokens`
        with a pipeline, else the busiest rank's rows rounded up to a power of two, at least 16)."""
        starts, used = self._row_layout(plan)
        if T is None:
            T = self.pipeline_tokens or bucket(max(used), 16)
        K, S, B = self.kvp, self.page_size, self.max_num_seqs
        mt = self.max_tokens_per_rank
        tok = np.zeros((K, T), np.int32)
        src = np.full((K, T), -1, np.int32)
        pos = np.zeros((K, T), np.int32)
        seq = np.full((K, T), B, np.int32)  # padding rows: the reserved last row, no keys
        wpage = np.full((K, T), DUMMY_PAGE, np.int32)
        wslot = np.zeros((K, T), np.int32)
        shared = np.zeros((K, T), bool)
        table = np.zeros((K, 1, 1), np.int32)  # a stand-in: the step reads the device's `page_table`
        kv_lens = np.zeros((K, B + 1), np.int32)
        kv_start = np.zeros((K, B + 1), np.int32)
        rows: list[list[int]] = [[] for _ in range(K)]
        samp: list[list[tuple]] = [[] for _ in range(K)]
        refs: list[RowRef] = []
        # (rank, row, (its slots' ids, biases, allow-only), its bad words' bans, request, position of its input)
        biases: list[tuple] = []
        penalized: list[tuple[int, int, tuple]] = []  # (rank, row, (its slot, presence, frequency, repetition))
        masks: list[tuple[int, int, np.ndarray]] = []  # (rank, row, its allowed tokens' bits) of regex rows
        logprobs = False

        def add_row(rank, row, chunk_i, token_index, req, target, is_sample, slot):
            nonlocal logprobs
            p = req.params
            logprobs = logprobs or not is_sample or p.logprobs is not None
            refs.append(RowRef(rank, len(rows[rank]), chunk_i, token_index, is_sample))
            rows[rank].append(row)
            num_top = p.logprobs if is_sample else p.prompt_logprobs
            # the generated token's index keys its random stream (known before the tokens before it are)
            step = token_index - req.num_prompt_tokens if is_sample else len(req.output_token_ids)
            # Into the float32 / int32 columns: a top_k past the vocabulary keeps every token (the sampler clamps
            # it to the vocabulary), a temperature past float32's range is its largest (a flat distribution);
            # valid requests of either kind must not overflow the cast and fail the step.
            samp[rank].append((0.0 if p.greedy else min(p.temperature, _F32_MAX), min(p.top_k, _I32_MAX), p.top_p,
                               (req.seed >> 32, req.seed & 0xFFFFFFFF), step, target, bool(num_top), p.min_p))
            if is_sample and req.regex is not None:
                masks.append((rank, len(rows[rank]) - 1, self._regex_mask(req, step)))
            elif is_sample and req.choices is not None:
                biases.append((rank, len(rows[rank]) - 1, self._choice_slots(req, step), (), req, token_index - 1))
            elif is_sample and req.bias_early is not None:
                bias = req.bias_early if step < p.min_tokens else req.bias  # its stop tokens cannot end it yet
                if bias is not None:
                    bans = _bad_word_bans(req, step) if req.bad_words else ()
                    biases.append((rank, len(rows[rank]) - 1, bias, bans, req, token_index - 1))
            if is_sample and p.penalized:
                penalized.append((rank, len(rows[rank]) - 1,
                                  (slot, p.presence_penalty, p.frequency_penalty, p.repetition_penalty)))

        def place(chunk_i, ch, rank, span_i, t0, is_shared, logits):
            req, s, n = ch.request, ch.start, ch.num_tokens
            b = self._slot(rank, req, span_i)
            lo = span_i * mt if mt is not None else 0
            kv_start[rank, b] = lo
            kv_lens[rank, b] = max(0, min(s + n - lo, mt if mt is not None else s + n))
            if n == 1 and self._one_token_scalars:  # a decode: the same values by scalar writes (no temporaries)
                if s < req.num_tokens:
                    tok[rank, t0] = req.token_at(s)
                elif s == req.num_tokens and id(req) in self._sampled_at:
                    src[rank, t0] = self._sampled_at[id(req)]
                else:
                    raise ValueError(f"request {req.request_id}: token {s} is neither known nor sampled by the "
                                     "previous step")
                pos[rank, t0], seq[rank, t0], shared[rank, t0] = s, b, is_shared
                if s >= lo and (mt is None or s < lo + mt):
                    local = s - lo
                    wpage[rank, t0], wslot[rank, t0] = req.pages[span_i][local // S], local % S
                if logits and req.prompt_logprobs is not None and len(req.prompt_logprobs) - 1 <= s \
                        < req.num_prompt_tokens - 1:
                    add_row(rank, t0, chunk_i, s + 1, req, req.prompt_token_ids[s + 1], False, b)
                if logits and ch.sample:
                    add_row(rank, t0, chunk_i, s + 1, req, -1, True, b)
                return
            idx = np.arange(s, s + n)
            rows_ = slice(t0, t0 + n)
            known = min(s + n, req.num_tokens)
            tok[rank, t0:t0 + known - s] = [req.token_at(i) for i in range(s, known)]
            if known < s + n:  # a token sampled by the previous step, not yet on the host
                if s + n - known > 1 or id(req) not in self._sampled_at:
                    raise ValueError(f"request {req.request_id}: token {known} is neither known nor sampled by "
                                     "the previous step")
                src[rank, t0 + known - s] = self._sampled_at[id(req)]
            pos[rank, rows_] = idx
            seq[rank, rows_] = b
            shared[rank, rows_] = is_shared
            mine = (idx >= lo) & ((idx < lo + mt) if mt is not None else True)
            local = idx[mine] - lo
            if local.size:  # only the pages this chunk writes (the table itself is on the device)
                first = local[0] // S
                pages = np.asarray(req.pages[span_i][first:local[-1] // S + 1], np.int32)
                wpage[rank, t0 + np.flatnonzero(mine)] = pages[local // S - first]
            wslot[rank, t0 + np.flatnonzero(mine)] = local % S
            if not logits:
                return
            if req.prompt_logprobs is not None:
                # Row i scores prompt token i + 1; skip those already scored (before a preemption).
                done = len(req.prompt_logprobs)
                for i in range(max(s, done - 1), min(s + n, req.num_prompt_tokens - 1)):
                    add_row(rank, t0 + i - s, chunk_i, i + 1, req, req.prompt_token_ids[i + 1], False, b)
            if ch.sample:
                add_row(rank, t0 + n - 1, chunk_i, s + n, req, -1, True, b)

        for ci, ch in enumerate(plan.chunks):  # a shared chunk: the same rows on each rank holding its KV
            ranks = ch.request.kv_ranks
            for i, r in enumerate(ranks):
                place(ci, ch, r, i, starts[ci], len(ranks) > 1, logits=(i == 0))
        assert max(used) <= T, (used, T)

        R = self.logits_rows(T, max(len(x) for x in rows))
        pad_rows = np.zeros((K, R), np.int32)
        W = self.bias_slots
        M = self.mask_words if masks else 1
        cols = [np.zeros((K, R) + {3: (2,), 8: (W,), 9: (W,), 15: (W,), 16: (M,)}.get(j, ()), d)  # seeds: 2 words
                for j, d in enumerate((np.float32, np.int32, np.float32, np.uint32, np.int32, np.int32, bool,
                                       np.float32, np.int32, np.float32, bool, np.int32, np.float32, np.float32,
                                       np.float32, np.int32, np.uint32, bool))]
        cols[2][:] = 1.0  # top_p
        cols[5][:] = -1  # targets
        cols[11][:] = B + 1  # penalty_slot: none
        cols[14][:] = 1.0  # repetition
        cols[15][:] = -1  # bias_cond: none
        pending = []
        for r in range(K):
            pad_rows[r, :len(rows[r])] = rows[r]
            for j, values in enumerate(zip(*samp[r])) if samp[r] else []:
                cols[j][r, :len(values)] = values
        for r, row, (ids, values, only), bans, req, q in biases:  # every slot of the row: a request's are W long
            cols[8][r, row], cols[9][r, row], cols[10][r, row] = ids, values, only
            if bans:  # after the request's own slots (`LLMEngine.validate` counted them in max_logit_bias)
                used = int(np.count_nonzero(ids != sampler.NO_TOKEN))
                if used + len(bans) > W:
                    raise RuntimeError(f"request {req.request_id}: {used} slots and {len(bans)} bad words' bans "
                                       f"are more than the row's {W}")
                tokens, conds = zip(*bans)
                end = used + len(bans)
                cols[8][r, row, used:end], cols[9][r, row, used:end], cols[15][r, row, used:end] = \
                    tokens, -np.inf, conds
                if self.spp > 1:  # a pipeline's host resolves the conditions when the micro-batch leaves
                    pending += [(r, row, j, req, q) for j, cond in enumerate(conds, used) if cond >= 0]
        for r, row, bits in masks:
            cols[16][r, row], cols[17][r, row] = bits, True
        for r, row, (slot, presence, frequency, repetition) in penalized:
            cols[11][r, row], cols[12][r, row], cols[13][r, row], cols[14][r, row] = slot, presence, frequency, \
                repetition
        batch = StepBatch(token_ids=tok, write_pages=wpage, write_slots=wslot, shared=shared,
                          attn=AttentionMetadata(seq_ids=seq, positions=pos, page_table=table, kv_lens=kv_lens,
                                                 kv_start=kv_start))
        return MicroBatch(plan, batch, pad_rows, RowSampling(*cols), refs, src, logprobs, pending)

    def logits_rows(self, T: int, n: int) -> int:
        """Logits rows R of a step of T token rows whose busiest rank has n of them: a power of two up to one row
        per sequence (sampling), T itself beyond that (prompt log-probs), so every T has a few known R's."""
        cap = self._rows_cap(T)
        return bucket(n, 8) if n <= cap else T

    def _rows_cap(self, T: int) -> int:
        """The most logits rows of a step of T token rows that are counted in powers of two (one per sequence)."""
        return min(T, bucket(self.max_num_seqs, 8))

    def shape_buckets(self) -> list[tuple[int, int, str]]:
        """Every (T, R, kind) a step of this executor can have, smallest first: T a power of two from 16 up to the
        token budget's bucket (only that bucket with spp > 1), R as `logits_rows` gives, and with attention
        kernels each kind (`decode` only where decodes alone can fill T: up to one row per sequence, and R up to
        one per sequence); with the reference attention, `mixed` only."""
        Ts = [self.pipeline_tokens] if self.pipeline_tokens else \
            [16 << i for i in range(bucket(self.max_num_batched_tokens, 16).bit_length() - 4)]
        shapes = []
        for T in Ts:
            cap = self._rows_cap(T)
            Rs = [8 << i for i in range(cap.bit_length() - 3)]
            kinds = [MIXED] + ([PREFILL] if self.kinds else [])
            shapes += [(T, R, k) for R in Rs + ([T] if T > cap else []) for k in kinds]
            if self.kinds and (self.pipeline_tokens or T <= bucket(self.max_num_seqs, 16)):
                shapes += [(T, R, DECODE) for R in Rs]
        return shapes

    def warm_up(self, progress: Callable[[], None] | None = None, masked: bool = False) -> int:
        """Compiles the step of every shape in `shape_buckets()` by running it on all-padding arrays (every row
        writes the reserved page 0 and reads nothing), so that serving never compiles; with `masked`, each shape's
        variant with regex rows' masks too (`host_template(..., masked=True)`: no row is masked); `progress` is
        called after each. Runs on the followers too (multi-host): every process compiles and runs the same shapes
        in the same order by itself, so nothing is broadcast (a follower is in its own warm-up, not listening).
        Returns the number of shapes."""
        shapes = self.shape_buckets()
        for T, R, kind in shapes:
            for with_masks in (False, True)[:1 + masked]:
                self._launch(T, self.host_template(T, R, with_masks), fetch=True, kind=kind, broadcast=False)
                if progress is not None:
                    progress()
        for U in self.update_buckets():  # the page-table scatters, all dropped
            self.apply_table_updates(self._no_updates(U), broadcast=False)
        for U in self.penalty_update_buckets():  # the penalties' scatters, all dropped, no slot cleared
            self.apply_penalty_updates(*self._no_penalty_updates(U), broadcast=False)
        jax.block_until_ready((self.page_table, self.token_counts, self.prompt_tokens))
        return len(shapes)

    def has_in_flight(self) -> bool:
        return any(mb.plan.chunks for mb in self.in_flight)

    def _host_args(self, plan: StepPlan):
        """Pushes `plan` into the pipeline; returns (T, the step's host arrays, the micro-batch leaving); the
        step's kind is `step_kind` of the micro-batches then in the pipeline."""
        entering = self.prepare(plan)
        T = entering.src.shape[1]
        leaving = self.in_flight.push(entering, lambda: self.prepare(StepPlan([], []), T))
        if self.spp > 1 and leaving.pending:
            leaving = _resolved(leaving)
        # Stage s works on the micro-batch that entered s steps ago: stack them along the spp axis.
        stages = jax.tree.map(lambda *a: np.stack(a, axis=1) if len(a) > 1 else a[0][:, None],  # spp 1: a view
                              *(m.batch for m in self.in_flight))
        return T, (stages, leaving.rows, leaving.sampling, entering.src), leaving

    @_per_instance
    def host_template(self, T: int, R: int, masked: bool = False):
        """Zero host arrays of the shapes and dtypes `_host_args` gives for T token rows and R logits rows, with
        regex rows' masks if `masked` (what a multi-host follower receives into; read only, so cached per shape)."""
        mb = self.prepare(StepPlan([], []), T)
        stages = jax.tree.map(lambda a: np.zeros((a.shape[0], self.spp) + a.shape[1:], a.dtype), mb.batch)
        samp = jax.tree.map(lambda a: np.zeros((self.kvp, R) + a.shape[2:], a.dtype), mb.sampling)  # seeds: [.., 2]
        if masked:
            samp = dataclasses.replace(samp, mask_bits=np.zeros((self.kvp, R, self.mask_words), np.uint32))
        # no penalties (the values `prepare` gives a row without them): warm-up steps count nothing
        samp.penalty_slot[:], samp.repetition[:] = self.max_num_seqs + 1, 1.0
        return stages, np.zeros((self.kvp, R), np.int32), samp, mb.src

    def put(self, T: int, packed: tuple[np.ndarray, Packing]):
        """The step's arguments, its host arrays packed (`Packing.pack`) placed on the mesh in one transfer (on
        every process's own devices)."""
        buffer, packing = packed
        if self.register is None or self.register.shape[2] != T:
            self.register = self._register_alloc(T)()
        return (self.params, self.k_cache, self.v_cache, self.register, self.sampled, self.page_table,
                self.token_counts, self.prompt_tokens, self._to_mesh(buffer, self._packed_sharding), packing)

    def _launch(self, T: int, host, fetch: bool, kind: str, logprobs: bool = True, broadcast: bool = True):
        """Runs the step on `host` arrays (on every process: multi-host followers get them first, packed, unless
        not `broadcast`); `logprobs`: whether its results include the log-probs (else only the tokens are
        fetched)."""
        self._flush_table_updates()  # before the step, on every process (followers get them first too)
        self._flush_penalty_inits()
        R = host[1].shape[1]
        masked = host[2].mask_bits.shape[-1] > 1  # a step with regex rows: its own compiled variant
        packed = Packing.pack(host)
        if self.channel is not None and broadcast:
            self.channel.step(T, R, packed[0], fetch, kind, masked)
        key = (T, R, kind, masked)
        # What the engine's online calibration needs to trust a step's time: whether it ran a shape for the first
        # time (it compiled, or loaded from the compilation cache).
        self.last_step_first_of_shape = key not in self._shapes_run
        self._shapes_run.add(key)
        return self.run(self.put(T, packed), fetch, kind, logprobs)

    def run(self, args, fetch: bool, kind: str = MIXED, logprobs: bool = True):
        """Runs the step of `kind`; returns its sampled tokens and log-probs as numpy when `fetch`, else their
        device arrays (dispatched, not waited for). Without `logprobs` the log-prob entries are None: only the
        tokens are fetched (one transfer, not five), for steps where no row's request asked for log-probs."""
        self.k_cache, self.v_cache, self.register, self.sampled, self.token_counts, out = self._step(kind)(*args)
        if not logprobs:
            out = (out[0],) + (None,) * (len(out) - 1)
        return self.fetch(out) if fetch else out

    @staticmethod
    def fetch(out):
        """A step's device results as numpy (waits for the step)."""
        if jax.process_count() == 1:
            return jax.device_get(out)
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(out, tiled=True)  # global arrays: their full value

    @_per_instance
    def _register_alloc(self, T: int):
        """A jitted allocator of a zero register of T rows (cached: building one costs ~30 ms on a CPU)."""
        shape = (self.kvp, self.spp, T, self.spec.config.hidden_size)
        return jax.jit(lambda: jnp.zeros(shape, self.spec.dtype), out_shardings=self._register_sharding)

    @contextlib.contextmanager
    def _unchanged(self):
        """A block after which the pipeline, the slots and the queued page-table updates are as before it."""
        saved = self.in_flight.copy(), ([s.copy() for s in self._slots], [list(u) for u in self._updates],
                                         [list(u) for u in self._penalty_inits])
        try:
            yield
        finally:
            self.in_flight, (self._slots, self._updates, self._penalty_inits) = saved

    def lower(self, plan: StepPlan) -> jax.stages.Lowered:
        """The step as it would run for `plan`, lowered but not run (for inspecting its HLO); state unchanged."""
        with self._unchanged():
            T, host, _ = self._host_args(plan)
            return self._step(self.step_kind(m.plan for m in self.in_flight)).lower(*self.put(T, Packing.pack(host)))

    def lower_shape(self, T: int, R: int, kind: str, mesh=None, lowering_platforms=None) -> jax.stages.Lowered:
        """The step of shape (T token rows, R logits rows, `kind`), lowered but not run, over `mesh` (default:
        the executor's): another mesh of the same shape may hold another machine's devices (a topology's
        compile-only devices, `mnemojax.bench.aot_step`), which the step is then lowered (and can be compiled)
        for, or be an `AbstractMesh` naming a device, lowered for `lowering_platforms` (as jax's). Its arguments
        are abstract, with the executor's shapes and partition specs; the parameters may be abstract too
        (`jax.ShapeDtypeStruct`s with shardings, `models.params.abstract_step_params`) for an executor that only
        lowers."""
        mesh = self.mesh if mesh is None else mesh
        if dict(mesh.shape) != dict(self.mesh.shape):
            raise ValueError(f"mesh must have the executor's shape {dict(self.mesh.shape)}, got {dict(mesh.shape)}")
        buffer, packing = Packing.pack(self.host_template(T, R))
        register = jax.ShapeDtypeStruct((self.kvp, self.spp, T, self.spec.config.hidden_size), self.spec.dtype,
                                        sharding=self._register_sharding)
        packed = jax.ShapeDtypeStruct(buffer.shape, buffer.dtype, sharding=self._packed_sharding)
        args = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, a.sharding.spec)),
            (self.params, self.k_cache, self.v_cache, register, self.sampled, self.page_table, self.token_counts,
             self.prompt_tokens, packed))
        return self._build_step(kind, mesh).trace(*args, packing).lower(lowering_platforms=lowering_platforms)

    def step_rows(self, plan: StepPlan) -> tuple[int, int]:
        """(Token rows T, logits rows R) of the step that would run `plan`; state unchanged."""
        with self._unchanged():
            T, host, _ = self._host_args(plan)
            return T, host[1].shape[1]

    def execute(self, plan: StepPlan) -> tuple[StepPlan, list[ChunkOutput]]:
        """Feeds `plan` into stage 0 and advances the pipeline one stage, waiting for the step.

        Returns the plan whose micro-batch left the last stage in this step (an empty plan while the pipeline
        fills) and one `ChunkOutput` per chunk of it: the sampled token, the log-probs asked for.
        """
        return self.collect(self.launch(plan, fetch=True))

    def launch(self, plan: StepPlan, fetch: bool = False) -> Launched:
        """`execute` without waiting: the step is dispatched and its results stay on the device until `collect`.
        A chunk of `plan` may end one token past its request's known tokens when the previous step launched
        sampled that token (async scheduling: the row reads it on the device). `fetch`: wait for the results now
        (multi-host followers fetch in every step, so the leader does too)."""
        T, host, leaving = self._host_args(plan)
        has_rows = bool(leaving.refs)
        # Multi-host: every process fetches the same arrays (the followers' `run` fetches them all).
        logprobs = leaving.logprobs or jax.process_count() > 1
        out = self._launch(T, host, fetch and has_rows, self.step_kind(m.plan for m in self.in_flight), logprobs)
        self.in_flight.pop()
        self._sampled_at = {id(leaving.plan.chunks[r.chunk].request): r.rank * self.max_rows + r.row
                            for r in leaving.refs if r.is_sample}
        # Without rows there is nothing to fetch, but `collect` still waits for the step: a host that never waited
        # for steps of prefill chunks would queue a long prompt's every chunk on the device at once, and a short
        # request arriving then would run behind all of them, whatever the scheduler decided.
        return Launched(leaving, out, None) if has_rows else Launched(leaving, None, out[0])

    def collect(self, launched: Launched) -> tuple[StepPlan, list[ChunkOutput]]:
        """The plan whose micro-batch left the pipeline in `launched`'s step and its `ChunkOutput`s (waits for
        the step to end, and fetches its results when it has any)."""
        mb, out = launched.leaving, launched.out
        if out is None:
            jax.block_until_ready(launched.done)
            return mb.plan, [ChunkOutput()] * len(mb.plan.chunks)
        if not isinstance(out[0], np.ndarray):
            out = self.fetch(out)
        return mb.plan, self._chunk_outputs(mb, out)

    @staticmethod
    def _chunk_outputs(mb: MicroBatch, out) -> list[ChunkOutput]:
        """The fetched results of `mb`'s logits rows, gathered per chunk as plain values."""
        tokens, tok_lp, tgt_lp, top_ids, top_lp = out
        sampled: dict[int, int] = {}
        logprobs: dict[int, dict[int, float]] = {}
        prompt: dict[int, list[dict[int, float]]] = defaultdict(list)
        for ref in mb.refs:
            p = mb.plan.chunks[ref.chunk].request.params
            at = ref.rank, ref.row
            if ref.is_sample:
                sampled[ref.chunk] = token = int(tokens[at])
                if p.logprobs is not None:
                    logprobs[ref.chunk] = _logprob_dict(top_ids[at], top_lp[at], p.logprobs, token, float(tok_lp[at]))
            else:
                scored = mb.plan.chunks[ref.chunk].request.prompt_token_ids[ref.token_index]
                prompt[ref.chunk].append(_logprob_dict(top_ids[at], top_lp[at], p.prompt_logprobs, scored,
                                                       float(tgt_lp[at])))
        return [ChunkOutput(sampled.get(i), logprobs.get(i), tuple(prompt[i])) for i in range(len(mb.plan.chunks))]
