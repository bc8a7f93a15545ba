"""Runtime predictor: plain Python, no jax. How long a step plan takes, from the FLOPs and bytes of its work.

The scheduler (adaptive chunk sizes, ILRS remaining prefill time) and the simulator (the clock of its
discrete-event loop) ask it; the profile script (`scripts/profile_predictor.py`) fits its efficiency factors
from timed runs of the real executor and saves them to a profile file (`mnemojax/scheduling/profiles/<name>.json`).

The cost model, for one micro-batch on one device (one KVP rank, one pipeline stage, one tp shard):

* **Linear layers** (QKV, O, gate/up/down) of the stage's `ceil(L / spp)` layers (padding layers included:
  the executor runs them), and the LM head: FLOPs `2 x T x params`, bytes = the weights read once. `T` is
  the step's token rows *as the executor pads them* (a power of two, at least `pad_tokens_min`; fixed at the
  pipeline register's size when spp > 1), the LM head's rows `R` likewise (at least `pad_rows_min`). The LM
  head and the sampler run on *every* stage: the step is SPMD and each stage computes them on the
  last stage's rows (`from_last_stage`), so they are part of every stage's time.
* **Attention**, per layer, per request, by the engine's kernel names (`models.kernels`): with
  `attention="pallas"` (the Pallas kernels, costed as an ideal ragged paged kernel) the causal work
  of its query tokens over the keys on this rank, FLOPs `4 x visible_keys x heads x head_dim` (per tp shard)
  and its KV read once, `ctx x 2 x kv_heads x head_dim x dtype_bytes`. A request over several KVP ranks is
  costed on its busiest: the page manager fills its ranks in order, `max_tokens_per_kvp_rank` keys each, so
  its first rank holds `min(ctx, max_tokens_per_kvp_rank)` keys, all seen by its queries. With `attention="reference"` (the
  plain-jnp blockwise kernel of `models/attention.py`) every one of the T padded rows loops over the blocks
  of the *longest* sequence of the step: FLOPs `4 x T x blocks x block_tokens x heads x head_dim`, a gather
  of each row's K/V block (float32) with its own efficiency (past a cache-sized footprint per block, at the
  KV-read efficiency), the distinct KV bytes read once, and a fixed cost per (layer, block) iteration.
* **Roofline**: each component costs `max(flops / (peak x flops_eff), bytes / (bandwidth x bw_eff))`;
  components add up.
* **Collectives**: tp all-reduce, 2 per layer, of `T x D x dtype_bytes` (ring: `2 (tp-1)/tp x bytes /
  tp_bandwidth`); the KVP merge, per layer, a pmax and two psums of the attention output `T x heads x
  (head_dim + 2) x 4` bytes over kvp (the executor merges every row, shared or not); the SPP activation send
  `T x D x dtype_bytes` per step and the LM-head rows' psum over spp (`R x D`), across servers. Every call
  also costs `collective_latency`.
* **Overheads**: a fixed cost per step (dispatch, host-side preparation, transfers), per real token, per
  request (chunk) and per padded logits row (sampling, results).

Efficiency factors and overheads (`Profile`) default to plausible GPU values and are replaced by a profile.

What one call costs: `stage_time(chunks)` is one pipeline stage on one micro-batch; `step_time` is one
clocked step of the executor (every stage works at once, so it is the stage time of the slowest micro-batch
in flight: pass that one); `prefill_time` is a whole prefill through the pipeline; `decode_time` the time
between two tokens of a decoding request.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from collections.abc import Sequence
from typing import Any

from mnemojax.scheduling.buckets import bucket
from models.config import LlamaConfig
from models.kernels import (AUTO, INTERPRETED, MOSAIC, PALLAS, REFERENCE, check_attention_impl,
                            resolve_attention_impl)

PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")
"""Where shipped profiles live: `Predictor(..., profile="cpu")` reads `PROFILE_DIR/cpu.json`."""

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def default_profile(hardware: str) -> str | None:
    """The shipped profile of a hardware preset (`PROFILE_DIR/<hardware>.json`), or None if there is none."""
    path = os.path.join(PROFILE_DIR, f"{hardware}.json")
    return path if os.path.isfile(path) else None


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One device's ceilings. Efficiency factors (`Profile`) say how much of them a kernel reaches."""

    name: str
    matmul_flops: float
    """Dense matmul FLOP/s in the serving dtype (bf16 on GPUs, float32 on the CPU)."""
    memory_bandwidth: float
    """Device memory bytes/s (HBM on GPUs, DRAM on the CPU)."""
    tp_bandwidth: float
    """Bytes/s per device, one direction, for tp collectives (NVLink within a server)."""
    net_bandwidth: float
    """Bytes/s per device across servers: the SPP activation send and the KVP merge."""
    collective_latency: float
    """Seconds of fixed cost per collective call."""
    memory_bytes: float
    """Device memory, bytes."""
    nvidia_gpu: bool = False
    """An NVIDIA GPU: attention "auto" is costed as the Pallas kernels that run there (elsewhere, the reference)."""


HARDWARE: dict[str, Hardware] = {
    # A100 SXM4 80GB. Datasheet: 312e12 bf16 dense, 2.04e12 B/s HBM2e, NVLink 3 600 GB/s both directions
    # (300e9 each way), DGX A100 one 200 Gb/s HDR InfiniBand port per GPU (25e9). We take 90% of the
    # datasheet compute and bandwidth as the measured ceilings (the ratio the H200 measurements below show).
    "a100": Hardware("a100", matmul_flops=280e12, memory_bandwidth=1.8e12, tp_bandwidth=300e9,
                     net_bandwidth=25e9, collective_latency=10e-6, memory_bytes=81920 * 2**20, nvidia_gpu=True),
    # H100 SXM5 80GB. Datasheet: 989e12 bf16 dense, 3.35e12 B/s HBM3, NVLink 4 900 GB/s both directions
    # (450e9 each way), DGX H100 one 400 Gb/s NDR port per GPU (50e9). Same GH100 die and 700 W limit as the
    # H200, so its measured matmul ceiling applies; copy bandwidth ~90% of the datasheet, as on the H200.
    "h100": Hardware("h100", matmul_flops=790e12, memory_bandwidth=3.0e12, tp_bandwidth=450e9,
                     net_bandwidth=50e9, collective_latency=10e-6, memory_bytes=81559 * 2**20, nvidia_gpu=True),
    # H200 SXM 141GB: 790e12 bf16 matmul and 4.3e12 B/s device-to-device copy measured (datasheet 989e12,
    # 4.8e12); NVLink 4 and 400 Gb/s NDR per GPU as on H100; 143771 MiB as nvidia-smi reports it.
    "h200": Hardware("h200", matmul_flops=790e12, memory_bandwidth=4.3e12, tp_bandwidth=450e9,
                     net_bandwidth=50e9, collective_latency=10e-6, memory_bytes=143771 * 2**20, nvidia_gpu=True),
    # The 2-core AMD EPYC (Zen 5, AVX-512) KVM guest this project develops on, float32. numpy's 1024^3 sgemm
    # measured 64e9 FLOP/s on it under load (theoretical 2 cores x 2.6 GHz x 64 = 333e9); numpy copy 30e9 B/s
    # (read + write). "Collectives" between fake host devices are memory copies. Rough by design: the
    # fitted cpu profile's factors absorb the difference.
    "cpu": Hardware("cpu", matmul_flops=100e9, memory_bandwidth=30e9, tp_bandwidth=10e9, net_bandwidth=10e9,
                    collective_latency=20e-6, memory_bytes=23 * 2**30),
}
"""Hardware presets by name."""


@dataclasses.dataclass(frozen=True)
class Profile:
    """Efficiency factors and overheads (fitted by `scripts/profile_predictor.py`), and how the executor lays
    out the work (set by the profile script from the engine it timed). Defaults: plausible GPU values."""

    linear_flops_eff: float = 0.8
    """Fraction of `matmul_flops` the linear layers and the LM head reach when compute-bound."""
    linear_bw_eff: float = 0.85
    """Fraction of `memory_bandwidth` reading the weights when memory-bound (small batches)."""
    attn_flops_eff: float = 0.5
    """Fraction of `matmul_flops` attention reaches when compute-bound (long prefill chunks)."""
    attn_bw_eff: float = 0.7
    """Fraction of `memory_bandwidth` reading the KV cache (decodes)."""
    attn_gather_bw_eff: float = 1.0
    """Reference attention only: `memory_bandwidth` fraction of its per-row K/V block gathers (can exceed 1
    where the gathered pages sit in cache)."""
    attn_gather_cache_bytes: float | None = None
    """Reference attention only: bytes of one block's gathers (T rows x block_tokens keys x K/V, float32)
    that stay in cache; the rest spills and moves at `attn_bw_eff` instead. None: no limit."""
    attn_block_overhead_s: float = 0.0
    """Reference attention only: fixed seconds per (layer, KV block) iteration of its loop."""
    comm_bw_eff: float = 0.8
    """Fraction of `tp_bandwidth` / `net_bandwidth` collectives reach."""
    step_overhead_s: float = 1e-3
    """Fixed seconds per step: dispatch, host-side preparation of the plan, transfers in and out."""
    per_token_overhead_s: float = 1e-6
    """Seconds per real (unpadded) token: host-side preparation, embedding, elementwise work."""
    per_request_overhead_s: float = 2e-5
    """Seconds per request (chunk) in the step: host-side bookkeeping of its rows and pages."""
    per_row_overhead_s: float = 2e-6
    """Seconds per padded logits row: sampling, log-probs, reading the result back."""
    wake_factor: float = 1.0
    """A step the engine launches after idling (nothing in flight, waiting for a request) takes this many times its
    steady-state time: caches gone cold, worker threads parked, clocks lowered. Measured by
    `scripts/profile_predictor.py` (with `wake_overhead_s`: new requests' first tokens through the engine's loop
    after a second of sleep and at once, against their steps' steady-state time); the simulator applies it,
    the scheduler's step costs do not (it plans steady-state steps). 1: no such cost."""
    wake_overhead_s: float = 0.0
    """Seconds such a step takes on top of `wake_factor` x its time: the host's own wake-up (a request's admission,
    its scheduling and the step's launch run slower after a sleep, before the device starts). Measured with
    `wake_factor` by `scripts/profile_predictor.py`, through the engine's loop; the simulator applies it."""
    attention: str = PALLAS
    """The engine's attention kernels, by their names (`models.kernels`): "pallas" is costed as an ideal ragged
    paged kernel (each request's own causal work); "reference" as the plain-jnp blockwise kernel (every padded row
    runs the longest sequence's blocks: the kernel as it was fitted; it now runs each 256-row block over only its
    own rows' keys, so this overestimates steps that mix lengths until the model and profiles/cpu.json are redone);
    "auto" as the Pallas kernels on an NVIDIA GPU, the reference elsewhere (a profile does not know the model: the
    engine passes what it resolved, mosaic on Hopper for a model those kernels support, `attention=`); "mosaic"
    like "pallas" (its efficiencies unmeasured). "pallas_interpret" and "mosaic_interpret" (interpreters, for
    tests) have no cost model."""
    block_tokens: int = 128
    """Keys per block of the reference kernel: `block_pages x page_size` (8 x 16 by default)."""
    pad_tokens_min: int = 16
    """Token rows are padded to a power of two at least this large (the executor's buckets); 0: no padding."""
    pad_rows_min: int = 8
    """Logits rows likewise; 0: no padding."""

    def __post_init__(self):
        check_attention_impl(self.attention)
        if self.attention in INTERPRETED:
            raise ValueError(f"attention {self.attention!r} has no cost model (Pallas' interpreters are for tests); "
                             f"give {AUTO!r}, {REFERENCE!r}, {PALLAS!r} or {MOSAIC!r}")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "attn_gather_cache_bytes":
                if v is not None and not v > 0:
                    raise ValueError(f"{f.name} must be positive or None, got {v}")
            elif (f.name.endswith("_eff") or f.name == "wake_factor") and not 0 < v < math.inf:
                raise ValueError(f"{f.name} must be positive (and finite), got {v}")
            if (f.name.endswith("_s") or f.name.endswith("_min")) and not 0 <= v < math.inf:  # NaN too
                raise ValueError(f"{f.name} must not be negative (and must be finite), got {v}")
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be positive, got {self.block_tokens}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        """From a dict of field values; an unknown key is an error (a misspelt factor must not be ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown profile factor(s) {unknown}; known: {sorted(names)}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ChunkShape:
    """One request's share of a micro-batch, as the predictor needs it."""

    query_tokens: int
    """Tokens computed for this request in the step (1 for a decode)."""
    context_len: int
    """Keys it attends to after the step (num_computed + query_tokens)."""
    num_ranks: int = 1
    """KVP ranks its KV spans: its attention work is split over them, its linear work replicated on each."""

    def __post_init__(self):
        if self.query_tokens < 1 or self.num_ranks < 1:
            raise ValueError(f"query_tokens and num_ranks must be positive: {self}")
        if self.context_len < self.query_tokens:
            raise ValueError(f"context_len must include the query tokens: {self}")




def _causal_pairs(lo: int, hi: int, q_lo: int, q_hi: int) -> int:
    """(query, key) pairs with key <= query, queries at positions [q_lo, q_hi), keys at [lo, hi)."""

    def upto(t: int) -> int:  # pairs of the queries at positions [0, t)
        seen = min(max(t - lo, 0), hi - lo)  # keys the last of them sees, counting itself
        return seen * (seen + 1) // 2 + max(t - hi, 0) * (hi - lo)

    return upto(q_hi) - upto(q_lo)


def _ring_allreduce(nbytes: float, n: int, bandwidth: float, latency: float, calls: int = 1) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth + calls * latency


class Predictor:
    """Predicted seconds of executor steps for one model, hardware, parallel layout and profile.

    Args:
      model: the model's shapes.
      hardware: a `Hardware` or the name of a preset in `HARDWARE`.
      tp, spp, kvp: the mesh degrees.
      dtype_bytes: bytes per parameter / activation / KV element; None: the profile's dtype, else 2 (bf16).
      profile: a `Profile`, a dict (a profile file's contents, or just its factors), a path to a profile
        JSON, the name of a shipped profile (`PROFILE_DIR/<name>.json`), or None for the defaults. A profile
        file names the hardware it was fitted on; another `hardware` is an error.
      pipeline_tokens: with spp > 1 the executor pads every micro-batch to the pipeline register's rows,
        `bucket(max_num_batched_tokens)`; give that token budget here to cost it (None: pad each step alone).
      max_tokens_per_kvp_rank: the engine's limit of one request's tokens on one KVP rank; `prefill_time`
        spreads a request over ranks by it, as the page manager does (None: a request stays on one rank).
      block_tokens: keys per block of the reference attention, `min(block_pages, pages per sequence) x
        page_size` of the engine being predicted; None: the profile's (the engine it was fitted on).
      attention: the attention kernels the engine being predicted runs ("reference" or "pallas"); None: the
        profile's, resolved for `hardware`.
    """

    def __init__(self, model: LlamaConfig, hardware: Hardware | str, *, tp: int = 1, spp: int = 1, kvp: int = 1,
                 dtype_bytes: int | None = None, profile: Profile | dict | str | None = None,
                 pipeline_tokens: int | None = None, max_tokens_per_kvp_rank: int | None = None,
                 block_tokens: int | None = None, attention: str | None = None):
        for name, v in (("tp", tp), ("spp", spp), ("kvp", kvp)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if isinstance(hardware, str):
            if hardware not in HARDWARE:
                raise ValueError(f"unknown hardware {hardware!r}; known: {sorted(HARDWARE)}")
            hardware = HARDWARE[hardware]
        if model.num_heads % tp:
            raise ValueError(f"tp ({tp}) must divide the number of attention heads ({model.num_heads})")
        if spp > model.num_layers:
            raise ValueError(f"spp ({spp}) exceeds the number of layers ({model.num_layers})")
        self.model, self.hardware, self.tp, self.spp, self.kvp = model, hardware, tp, spp, kvp
        self.profile_info: dict[str, Any] = {}
        if isinstance(profile, Profile):
            self.profile = profile
        elif profile is None:
            self.profile = Profile()
        else:
            info = self.load_profile(profile) if isinstance(profile, str) else dict(profile)
            if isinstance(info.get("factors"), dict):  # a profile file's contents
                self.profile, self.profile_info = Profile.from_dict(info["factors"]), info
            else:  # just the factors
                self.profile = Profile.from_dict(info)
        if block_tokens is not None:
            self.profile = dataclasses.replace(self.profile, block_tokens=block_tokens)
        if attention is not None:
            self.profile = dataclasses.replace(self.profile, attention=attention)
        self.attention = resolve_attention_impl(self.profile.attention, hardware.nvidia_gpu)  # the kernels costed
        fitted_on = self.profile_info.get("hardware", hardware.name)
        if fitted_on != hardware.name:
            raise ValueError(f"the profile was fitted on hardware {fitted_on!r}, not {hardware.name!r}")
        if dtype_bytes is None:
            dtype_bytes = _DTYPE_BYTES.get(self.profile_info.get("dtype", "bfloat16"), 2)
        self.dtype_bytes = dtype_bytes
        self.max_tokens_per_kvp_rank = max_tokens_per_kvp_rank
        self.pipeline_tokens = (bucket(pipeline_tokens, self.profile.pad_tokens_min)
                                if pipeline_tokens is not None and spp > 1 else None)
        self.version = 0
        """Bumped by `set_profile`: a caller caching predictions compares it."""
        self.calibrating = False
        """True while an online calibration has not settled (the scheduler then keeps its target-unmet message)."""

        c = model
        self.layers_per_stage = -(-c.num_layers // spp)
        self.heads = c.num_heads // tp  # query heads per device
        self.kv_heads = max(c.num_kv_heads, tp) // tp  # kv heads per device (repeated when tp exceeds them)
        d, h = c.hidden_size, c.head_dim
        # Per layer, per device: QKV, O (column / row parallel over tp), gate, up, down.
        self.layer_params = (d * self.heads * h + 2 * d * self.kv_heads * h + self.heads * h * d
                             + 3 * d * c.intermediate_size // tp)
        self.lm_head_params = d * c.vocab_size  # replicated over tp, computed on every stage

    # ------------------------------------------------------------------ profiles
    _LAYOUT = ("attention", "block_tokens", "pad_tokens_min", "pad_rows_min")

    def set_profile(self, profile: Profile) -> None:
        """Replaces the efficiency factors and overheads in place (online calibration,
        `mnemojax.scheduling.calibration`); the fields that describe the executor's layout must not change."""
        changed = [k for k in self._LAYOUT if getattr(profile, k) != getattr(self.profile, k)]
        if changed:
            raise ValueError(f"set_profile changes the executor's layout fields {changed}")
        self.profile = profile
        self.version += 1

    def copy(self) -> Predictor:
        """An independent predictor of the same model, hardware, layout and (current) profile."""
        return copy.copy(self)

    @staticmethod
    def load_profile(path: str) -> dict[str, Any]:
        """A profile file's contents (a path, or the name of a shipped profile in `PROFILE_DIR`)."""
        if not os.path.exists(path) and os.sep not in path and not path.endswith(".json"):
            path = os.path.join(PROFILE_DIR, f"{path}.json")
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
        if not isinstance(info, dict) or not isinstance(info.get("factors"), dict):
            raise ValueError(f"{path}: not a profile (a JSON object with a 'factors' object)")
        Profile.from_dict(info["factors"])  # validates
        return info

    def save_profile(self, path: str, **metadata) -> dict[str, Any]:
        """Writes this predictor's factors with its hardware name, model, dtype and `metadata`; returns it."""
        info = {"hardware": self.hardware.name,
                "dtype": {4: "float32", 2: "bfloat16"}.get(self.dtype_bytes, str(self.dtype_bytes)),
                **metadata, "factors": self.profile.to_dict()}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(info, f, indent=2)
            f.write("\n")
        return info

    # ------------------------------------------------------------------ the cost model
    def padded_tokens(self, chunks: Sequence[ChunkShape]) -> int:
        """Token rows the executor runs for these chunks (T)."""
        if self.pipeline_tokens is not None:
            return self.pipeline_tokens
        return bucket(sum(ch.query_tokens for ch in chunks), self.profile.pad_tokens_min)

    def breakdown(self, chunks: Sequence[ChunkShape]) -> dict[str, float]:
        """Seconds of each component of `stage_time(chunks)` (they add up to it)."""
        p, hw, c, b = self.profile, self.hardware, self.model, self.dtype_bytes
        chunks = list(chunks)
        n_layers = self.layers_per_stage
        tokens = sum(ch.query_tokens for ch in chunks)
        T = self.padded_tokens(chunks)
        R = bucket(len(chunks), p.pad_rows_min)

        def roofline(flops, nbytes, flops_eff, bw_eff):
            return max(flops / (hw.matmul_flops * flops_eff), nbytes / (hw.memory_bandwidth * bw_eff))

        out: dict[str, float] = {}
        out["linear"] = roofline(2 * T * self.layer_params * n_layers, self.layer_params * n_layers * b,
                                 p.linear_flops_eff, p.linear_bw_eff)
        out["lm_head"] = roofline(2 * R * self.lm_head_params, self.lm_head_params * b,
                                  p.linear_flops_eff, p.linear_bw_eff)

        # Attention, per layer, on the busiest KVP rank of a multi-rank request (`_busiest_share`).
        kv_row = 2 * self.kv_heads * c.head_dim  # K and V elements per key
        shares = [self._busiest_share(ch) for ch in chunks]
        local = [keys for keys, _ in shares]
        kv_bytes = sum(local) * kv_row * b
        if self.attention in (PALLAS, MOSAIC):  # both costed as an ideal ragged paged kernel (mosaic: unmeasured)
            attn = 0.0
            for keys, visible in shares:
                attn += roofline(4 * visible * self.heads * c.head_dim, keys * kv_row * b,
                                 p.attn_flops_eff, p.attn_bw_eff)
            out["attention"] = attn * n_layers
        else:
            blocks = -(-max(local, default=0) // p.block_tokens)  # the longest sequence's
            flops = 4 * T * blocks * p.block_tokens * self.heads * c.head_dim
            gather = T * p.block_tokens * kv_row * 4  # bytes one block iteration gathers (float32)
            cached = gather if p.attn_gather_cache_bytes is None else min(gather, p.attn_gather_cache_bytes)
            gather_time = (cached / p.attn_gather_bw_eff + (gather - cached) / p.attn_bw_eff) / hw.memory_bandwidth
            out["attention"] = n_layers * (roofline(flops, kv_bytes, p.attn_flops_eff, p.attn_bw_eff)
                                           + blocks * (gather_time + p.attn_block_overhead_s))

        tp_bw, net_bw, lat = hw.tp_bandwidth * p.comm_bw_eff, hw.net_bandwidth * p.comm_bw_eff, \
            hw.collective_latency
        out["tp_allreduce"] = 2 * n_layers * _ring_allreduce(T * c.hidden_size * b, self.tp, tp_bw, lat)
        merge_bytes = T * self.heads * (c.head_dim + 2) * 4  # f32 output and two [T, N] vectors
        out["kvp_merge"] = n_layers * _ring_allreduce(merge_bytes, self.kvp, net_bw, lat, calls=3)
        out["spp_send"] = 0.0 if self.spp == 1 else (
            T * c.hidden_size * b / net_bw + lat + _ring_allreduce(R * c.hidden_size * b, self.spp, net_bw, lat))
        out["overhead"] = (p.step_overhead_s + tokens * p.per_token_overhead_s
                           + len(chunks) * p.per_request_overhead_s + R * p.per_row_overhead_s)
        return out

    def stage_time(self, chunks: Sequence[ChunkShape]) -> float:
        """Seconds one pipeline stage takes for one micro-batch, on one KVP rank.

        `chunks` is the micro-batch as that rank sees it: its own requests and the multi-rank requests it
        takes part in (`num_ranks` > 1). To cost a plan spread over KVP ranks, take the max over ranks.
        Includes the stage's `ceil(L / spp)` layers, the LM head and sampling (every stage runs them), the tp
        all-reduces, the KVP merge, the SPP activation send, and the step overheads.
        """
        return sum(self.breakdown(chunks).values())

    def step_time(self, chunks: Sequence[ChunkShape]) -> float:
        """Seconds of one clocked executor step in which `chunks` is the slowest micro-batch in flight.

        Every stage works at once on its own micro-batch, so a step lasts as long as its slowest stage: this is
        `stage_time(chunks)` (for spp == 1, the whole step).
        """
        return self.stage_time(chunks)

    def prefill_time(self, prompt_len: int, chunk_size: int, context_start: int = 0) -> float:
        """Seconds to prefill tokens [context_start, prompt_len) of one request alone, in chunks of
        `chunk_size`, through the pipeline: K + spp - 1 clocked steps (its K chunks enter one step apart, the
        last leaves spp - 1 steps after it entered), each as long as the slowest of its chunks in flight. With
        spp == 1 that is the sum of the chunks' stage times."""
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        if not 0 <= context_start <= prompt_len:
            raise ValueError(f"need 0 <= context_start ({context_start}) <= prompt_len ({prompt_len})")
        stages, pos = [], context_start
        while pos < prompt_len:
            n = min(chunk_size, prompt_len - pos)
            pos += n
            stages.append(self.stage_time([ChunkShape(n, pos, self._ranks(pos))]))
        if not stages:
            return 0.0
        # Step j holds chunks j - spp + 1 .. j (those that exist).
        return sum(max(stages[max(0, j - self.spp + 1):j + 1]) for j in range(len(stages) + self.spp - 1))

    def decode_time(self, context_len: int, num_ranks: int = 1, batch: int = 1) -> float:
        """Seconds between two tokens of a decoding request whose micro-batch holds `batch` such decodes at
        `context_len`: its token must leave the last stage before the next can enter, so spp stage times."""
        return self.spp * self.stage_time([ChunkShape(1, context_len, num_ranks)] * batch)

    def _busiest_share(self, ch: ChunkShape) -> tuple[float, float]:
        """(keys held, causal (query, key) pairs computed) of the KVP rank that works hardest on `ch`.

        The page manager fills a request's ranks in order: its i-th rank holds keys [i m, (i + 1) m) and the
        last the rest, m = `max_tokens_per_kvp_rank`; each rank attends the chunk's queries to its own keys.
        The first rank is full and every query sees all of it, so it is the busiest in bytes and, but for a
        chunk wider than m, in work: the maximum over ranks is taken all the same. Without a limit (a direct
        call with `num_ranks` > 1) the keys are taken as split evenly, ceil(ctx / ranks) each, an idealised
        KVP that no page manager gives."""
        q, ctx, n = ch.query_tokens, ch.context_len, ch.num_ranks
        if n == 1 or self.max_tokens_per_kvp_rank is None:
            return -(-ctx // n), (q * ctx - q * (q - 1) // 2) / n
        m = self.max_tokens_per_kvp_rank
        spans = [(i * m, min((i + 1) * m, ctx)) for i in range(n - 1)]
        spans.append((min((n - 1) * m, ctx), ctx))
        return (max(hi - lo for lo, hi in spans),
                max(_causal_pairs(lo, hi, ctx - q, ctx) for lo, hi in spans))

    def _ranks(self, context_len: int) -> int:
        """KVP ranks a request of `context_len` tokens spans: the page manager onboards rank r + 1 only once
        rank r holds `max_tokens_per_kvp_rank` of its tokens."""
        if self.max_tokens_per_kvp_rank is None:
            return 1
        return min(self.kvp, -(-context_len // self.max_tokens_per_kvp_rank))


def make_predictor(config, model: LlamaConfig, *, hardware: Hardware | str, dtype_bytes: int, profile: str | None,
                   pipeline_padding: bool, block_tokens: int | None = None,
                   attention: str | None = None) -> Predictor:
    """The runtime predictor of a deployment, for the engine and the simulator alike. `config` has the fields of
    `mnemojax.scheduling.config.ParallelConfig` and `SchedulerConfig` (an `EngineConfig` or a `SimConfig`);
    `pipeline_padding`: cost every micro-batch at the pipeline register's size (`max_num_batched_tokens` rows),
    as the executor runs it when spp > 1."""
    return Predictor(model, hardware, tp=config.tp, spp=config.spp, kvp=config.kvp, dtype_bytes=dtype_bytes,
                     profile=profile, pipeline_tokens=config.max_num_batched_tokens if pipeline_padding else None,
                     max_tokens_per_kvp_rank=config.max_tokens_per_kvp_rank, block_tokens=block_tokens,
                     attention=attention)
