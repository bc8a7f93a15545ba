"""Attention kernel time vs chunk size at long context (Mnemosyne Figure 7 / Medha Figure 5b), and decode.

    python scripts/bench_attention.py [--contexts 262144,1048576] [--chunks 32,64,128,256,512,1024,2048,4096]
        [--impl pallas,mosaic] [--persistent] [--model_shape llama3-70b] [--repeats 5] [--decode_batches 1,8]
        [--no_baselines] [--profile] [--paired_decode 30]
    python scripts/bench_attention.py --impl mosaic --chunks "" --paired_decode 30 --calls 10   # decode only
    python scripts/bench_attention.py --impl mosaic,mosaic+consumers=1+approx_math=false   # kernel options
    python scripts/bench_attention.py --small     # tiny shapes, interpreted kernels: runs on a CPU (tests)

Meant for an NVIDIA H100 / H200 at Llama-3-8B attention shapes (32 query heads, 8 KV heads, head dim 128, bf16,
pages of 16; `--model_shape llama3-70b` for 64 query heads, 8 KV heads). `--impl` names one or more of the
engine's attention implementations (comma-separated; default the Triton kernels "pallas" and the Hopper Mosaic GPU
kernels "mosaic", issue 15), each timed on the same shapes and printed in its own tables, beside the same
baselines. A label may carry kernel options, `impl+name=value` (ints, true / false): tiling options go to the
step's plan, the others to each layer's call, so one run compares variants; `--persistent` adds, for each Triton
implementation named, the same kernels on their work-list grid (label "pallas+persistent"). One implementation
that fails (a kernel that does not compile on the device) is reported and the others are still timed.

One layer's paged KV cache holds one sequence of the largest context; a chunk of c query tokens is timed at the
end of an x-token context (its own keys included, bottom-right causal). As the engine runs a step: the step's plan
(tilings and per-tile metadata, `plan_attention`) is computed once, for the step's kind (prefill for chunks,
decode for one-token sequences: only those tiles are launched), and every layer's attention runs on it; "ms" is one
layer's attention (split-K merge included) and "plan ms" the plan's own time, paid once per step for all layers.
Each is the median of `--repeats` samples after a warm-up; a sample is one call dispatched and waited for on its
own (host dispatch included: on small calls that is part of what is measured), or with `--calls N`, N calls back to
back and one wait, per call: the device's time once the host keeps ahead, as an engine step waits once for all its
layers (the baselines are timed the same way). `--profile` also traces 10 calls at the largest context for each
chunk and decode and prints their GPU kernels (`trace.profile_calls`).

Figure 7 plots the *total* attention time of prefilling an n-token prompt in chunks of c: the sum over the
n/c chunks of the time of chunk i at context i*c. The script measures the chunk time at a few contexts
(`--samples` points from c to n), interpolates linearly in the context (the time of a chunk is affine in it)
and sums over all chunk ends; "vs 2048" is that total over the total with chunks of 2048 (Medha reports +11%
for chunks of 32 with Llama-3-70B on 8 H100s). The per-chunk table also gives the time per query token at
context n relative to chunks of 2048, achieved TFLOP/s (4 N H x visible (query, key) pairs) and bytes/s (K and V
of the context read once, q and out once).

Baselines on the same shapes (contiguous, unpaged K/V; only on a GPU): `jax.nn.dot_product_attention(
implementation="cudnn")` (causal is top-left there, so history keys unmasked + the chunk causal, merged by
log-sum-exp), PyTorch `scaled_dot_product_attention` with the flash backend (bottom-right causal bias,
grouped-query), and jax's own FlashAttention-3-style Mosaic GPU kernel (`attention_mgpu`, float16, non-causal,
chunks of a multiple of 128 only: what Mosaic GPU reaches on the device), each shown with which variant ran; one
that cannot run says why in its column. Decode: B sequences of one query token at each context, time and bytes/s.
`--paired_decode R` also times each decode row in turns with PyTorch SDPA's on the same shapes: R rounds of one
sample of each, the order alternating (`paired_times`), so that a drift of the device over the run moves both sides
of a round alike; it prints the median ratio ours / torch of the rounds, its quartiles and range, and in how many
rounds ours was faster (with `--profile`, torch's kernels beside ours at the largest context). Our call starts from
q in token order, as torch's does, so it launches q's gather into tile order (`_query_rows`) as a fusion of its own;
in the engine's decode layer that gather fuses with RoPE's (one fusion from the QKV projection's output, as
`scripts/aot_step.py --show_layer 3` lists), so there it adds no launch. `--chunks ""` times decode alone.

Prints the command, the hardware, and the tables last.
"""
from __future__ import annotations

import argparse
import functools
import os
import platform
import shlex
import statistics
import sys
import time

# JAX takes 75% of GPU memory up front by default; leave room for the PyTorch baseline's own allocator.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from mnemojax.bench import parse_with_small  # noqa: E402
from models.attention import (AttentionMetadata, attention, plan_attention, resolve_attention,  # noqa: E402
                              split_kernel_options)
from models.config import preset  # noqa: E402
from models.kernels import (ATTENTION_IMPLS, DECODE, MOSAIC, MOSAIC_INTERPRET, PALLAS, PALLAS_INTERPRET,  # noqa: E402
                            PREFILL)

MODEL_SHAPES = ("llama3-8b", "llama3-70b", "llama3.2-1b")
PERSISTENT = "+persistent"  # the label suffix of a Triton implementation timed on its persistent grid
SMALL = dict(contexts="256", chunks="4,16,64", decode_batches="1,3", num_heads=4, num_kv_heads=2, head_dim=16,
             page_size=4, impl="pallas_interpret", repeats=2, samples=3, dtype="float32")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="262144,1048576", help="comma-separated context lengths (tokens)")
    p.add_argument("--chunks", default="32,64,128,256,512,1024,2048,4096", help="comma-separated chunk sizes")
    p.add_argument("--decode_batches", default="1,8", help="comma-separated decode batch sizes")
    p.add_argument("--impl", default="pallas,mosaic",
                   help=f"comma-separated attention implementations to time, of: {', '.join(ATTENTION_IMPLS)}; "
                        "each may carry kernel options, e.g. mosaic+consumers=1+approx_math=true")
    p.add_argument("--persistent", action="store_true",
                   help="also time each Triton implementation named with its persistent work-list grid")
    p.add_argument("--model_shape", default=None, choices=MODEL_SHAPES,
                   help="take the attention shape (q heads, kv heads, head dim) of this preset")
    p.add_argument("--num_heads", type=int, default=32)
    p.add_argument("--num_kv_heads", type=int, default=8)
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--page_size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (median reported)")
    p.add_argument("--samples", type=int, default=6, help="contexts per chunk size for the Figure 7 total")
    p.add_argument("--calls", type=int, default=1,
                   help="calls back to back per timed sample, one wait at the end (1: each call dispatched and "
                        "waited for alone; more: the device time per call, as an engine step's layers run)")
    p.add_argument("--no_baselines", action="store_true", help="skip cuDNN and PyTorch")
    p.add_argument("--paired_decode", type=int, default=0,
                   help="rounds of each decode row timed in turns with PyTorch SDPA's on the same shapes (a round: "
                        "one sample of each, --calls calls; the order alternating): the median ratio of the rounds "
                        "and its spread (0: none)")
    p.add_argument("--block_q", type=int, default=None, help="kernel option: query tokens per prefill tile")
    p.add_argument("--block_k", type=int, default=None, help="kernel option: keys per prefill block")
    p.add_argument("--decode_block_k", type=int, default=None, help="kernel option: keys per decode block")
    p.add_argument("--profile", action="store_true",
                   help="also trace 10 calls at the largest context, each chunk and decode, and print their kernels")
    p.add_argument("--small", action="store_true", help="tiny shapes, interpreted kernels (runs on a CPU)")
    args = parse_with_small(p, argv, SMALL)
    args.impls = [x for x in args.impl.split(",") if x]
    if args.paired_decode < 0:
        p.error(f"--paired_decode: rounds must be >= 0, got {args.paired_decode}")
    for label in args.impls:
        check_label(p, "--impl", label)
    if args.persistent:
        triton = [impl for impl in args.impls if impl in (PALLAS, PALLAS_INTERPRET)]
        if not triton:
            p.error(f"--persistent: the persistent grid is the Triton kernels' ({PALLAS}, {PALLAS_INTERPRET}); "
                    f"--impl names none of them ({args.impl})")
        # Each Triton implementation's persistent grid right after its static grid.
        args.impls = [x for impl in args.impls for x in ((impl, impl + PERSISTENT) if impl in triton else (impl,))]
    if args.model_shape:
        c = preset(args.model_shape)
        args.num_heads, args.num_kv_heads, args.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
    return args


def step_kind(chunk: int) -> str:
    """The kind of a step whose sequences each bring `chunk` query tokens: one-token sequences are decodes."""
    return DECODE if chunk == 1 else PREFILL


def split_label(label: str) -> tuple[str, dict]:
    """(attention implementation, kernel options) of a row label: "pallas", "pallas+persistent" (the Triton
    kernels' persistent grid: persistent=True), or options spelled out, "mosaic+consumers=1+approx_math=true"
    (ints, true / false); each option goes to the implementation's kernels as a keyword (`attention(...)`)."""
    impl, *parts = label.split("+")
    options = {}
    for part in parts:
        name, eq, value = part.partition("=")
        if not eq:
            if part != PERSISTENT[1:]:
                raise ValueError(f"{label!r}: {part!r} is not an option=value (or +persistent)")
            options["persistent"] = True
        elif value.lower() in ("true", "false"):
            options[name] = value.lower() == "true"
        elif value.lstrip("-").isdigit():
            options[name] = int(value)
        else:
            raise ValueError(f"{label!r}: option {name} takes an int or true / false, got {value!r}")
    return impl, options


def check_label(p, flag: str, label: str):
    """Refuses (argparse error naming `flag`) a label of an unknown implementation, a malformed option, or the
    persistent grid on an implementation that has none."""
    try:
        impl, options = split_label(label)
    except ValueError as e:
        p.error(f"{flag}: {e}")
    if impl not in ATTENTION_IMPLS:
        p.error(f"{flag}: unknown attention implementation {impl!r} in {label!r}; valid: {', '.join(ATTENTION_IMPLS)}")
    if options.get("persistent") and impl not in (PALLAS, PALLAS_INTERPRET):
        p.error(f"{flag}: {label!r}: the persistent grid is the Triton kernels' ({PALLAS}, {PALLAS_INTERPRET})")


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def hardware() -> list[str]:
    d = jax.devices()[0]
    return [f"device: {d.device_kind} ({d.platform}, {jax.device_count()} devices), jax {jax.__version__}, "
            f"python {platform.python_version()}"]


def sample_time(fn, calls: int = 1, wait=jax.block_until_ready, clock=time.perf_counter) -> float:
    """Seconds per call of one sample: `fn()` `calls` times back to back, then `wait(result)` on the last (the device
    runs them in order)."""
    t0 = clock()
    for _ in range(calls - 1):
        fn()
    wait(fn())
    return (clock() - t0) / calls


def median_time(fn, repeats: int, calls: int = 1, wait=jax.block_until_ready) -> float:
    """Median seconds of one `fn()` over `repeats` samples after one warm-up run. A sample runs `fn()` `calls` times
    back to back and waits for the last (`sample_time`): with calls = 1 each call's host dispatch and wait are in its
    time; with more, the device time per call once the host keeps ahead of the device, as in an engine's step, which
    waits once for all its layers."""
    wait(fn())
    return statistics.median(sample_time(fn, calls, wait) for _ in range(repeats))


def paired_times(ours, peer, rounds: int, calls: int = 1, wait_ours=jax.block_until_ready,
                 wait_peer=jax.block_until_ready, clock=time.perf_counter) -> list[tuple[float, float]]:
    """(ours, peer) seconds per call in each of `rounds` rounds, after one warm-up call of each: a round takes one
    sample of each (`sample_time`, `calls` calls back to back), ours first in even rounds and the peer first in odd
    ones. Both samples of a round see the device in the same state (its clocks, its temperature, whatever else runs
    on it), so the ratio of a round is the comparison, and their spread over the rounds says how far it can be
    trusted; two medians taken at different times of a run differ by as much as the gap measured (decode, sixteenth
    session: identical kernels 1.049-1.113 ms in one run)."""
    wait_ours(ours())
    wait_peer(peer())
    pairs = []
    for r in range(rounds):
        if r % 2 == 0:
            a = sample_time(ours, calls, wait_ours, clock)
            b = sample_time(peer, calls, wait_peer, clock)
        else:
            b = sample_time(peer, calls, wait_peer, clock)
            a = sample_time(ours, calls, wait_ours, clock)
        pairs.append((a, b))
    return pairs


def paired_summary(pairs: list[tuple[float, float]]) -> dict:
    """Of (ours, peer) seconds per round: each side's median in ms, the median ratio ours / peer of the rounds with
    its quartiles and extremes (numpy's linear percentiles), and the rounds in which ours was faster."""
    ratios = [a / b for a, b in pairs]
    q1, mid, q3 = np.percentile(ratios, [25, 50, 75])
    return dict(rounds=len(pairs), ours_ms=statistics.median(a for a, _ in pairs) * 1e3,
                peer_ms=statistics.median(b for _, b in pairs) * 1e3, ratio=float(mid), ratio_q1=float(q1),
                ratio_q3=float(q3), ratio_min=min(ratios), ratio_max=max(ratios),
                ours_faster=sum(a < b for a, b in pairs))


# ------------------------------------------------------------------------------------------------ ceilings
def matmul_ceiling(dtype, sizes=(4096, 8192, 16384), repeats: int = 5) -> float:
    """Best measured FLOP/s of a square matmul in `dtype` over `sizes` (the device's practical peak)."""
    best = 0.0
    for n in sizes:
        a = jax.random.normal(jax.random.key(0), (n, n), dtype)
        f = jax.jit(lambda x, y: x @ y)
        best = max(best, 2 * n ** 3 / median_time(lambda: f(a, a), repeats))
    return best


def copy_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Measured bytes/s of reading and writing an `nbytes` array once (y = x + 1: both counted)."""
    x = jnp.zeros((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a + 1)
    return 2 * x.nbytes / median_time(lambda: f(x), repeats)


# ------------------------------------------------------------------------------------------------ shapes
def attn_flops(num_heads, head_dim, chunk, context) -> float:
    """4 N H x the (query, key) pairs a chunk of `chunk` tokens ending at `context` keys sees (causal)."""
    pairs = chunk * (context - chunk) + chunk * (chunk + 1) / 2
    return 4.0 * num_heads * head_dim * pairs


def attn_bytes(args, itemsize, chunk, context, batch=1, impl: str = "") -> float:
    """K and V of the context read once, q read and out written once: out in q's dtype from the kernels (Triton
    and Mosaic), float32 from the reference."""
    kv = 2 * context * args.num_kv_heads * args.head_dim * itemsize * batch
    out_itemsize = 4 if impl.startswith("reference") else itemsize
    return kv + chunk * batch * args.num_heads * args.head_dim * (itemsize + out_itemsize)


class PagedLayer:
    """One layer's paged cache holding `batch` sequences of up to `max_context` keys, random K/V."""

    def __init__(self, args, max_context: int, batch: int = 1, seed: int = 0, impl: str | None = None):
        S, K, H = args.page_size, args.num_kv_heads, args.head_dim
        self.args, self.batch, self.dtype = args, batch, jnp.dtype(args.dtype)
        self.pages = -(-max_context // S)
        shape = (1, 1 + batch * self.pages, S, K, H)
        kk, kv, self.kq = jax.random.split(jax.random.key(seed), 3)
        self.k = jax.random.normal(kk, shape, self.dtype)
        self.v = jax.random.normal(kv, shape, self.dtype)
        # Sequence b owns pages 1 + b*pages ... in a shuffled order (pages are not contiguous in a real pool).
        perm = np.random.default_rng(seed).permutation(batch * self.pages) + 1
        self.table = jnp.asarray(perm.reshape(batch, self.pages), jnp.int32)
        self.impl, options = split_label(impl or args.impls[0])
        self.impl = resolve_attention(self.impl, dtype=args.dtype, num_heads=args.num_heads,  # `auto` as the engine's
                                      num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, page_size=args.page_size)
        mosaic = self.impl in (MOSAIC, MOSAIC_INTERPRET)
        opts = {name: getattr(args, name) for name in ("block_q", "block_k", "decode_block_k")
                if getattr(args, name) is not None and not mosaic}  # Triton options
        opts.update(options)
        # As the engine runs it: the step's plan (tilings, per-tile metadata) once, every layer's attention on it.
        # Tiling options go to the plan, the others (code generation) to each layer's call.
        self.plan_opts, self.call_opts = split_kernel_options(self.impl, opts)
        dims = dict(num_heads=args.num_heads, num_kv_heads=K, head_dim=H, page_size=S)
        # The step's kind, as the engine passes it: a step of chunks launches only the prefill tiles, a step of
        # one-token sequences only the decode tiles (a mixed step would add a launch over empty tiles).
        self.plan = jax.jit(lambda meta, kind: plan_attention(self.impl, meta, kind=kind, **dims, **self.plan_opts),
                            static_argnums=1)
        self.layer = jax.jit(lambda q, k, v, meta, plan, kind: attention(
            self.impl, q, k, v, jnp.int32(0), meta, block_pages=8, kind=kind, plan=plan, **self.call_opts),
            static_argnums=5)

    def step(self, chunk: int, context: int):
        """Arguments of one step: every sequence's last `chunk` tokens at `context` keys."""
        B = self.batch
        q = jax.random.normal(self.kq, (B * chunk, self.args.num_heads, self.args.head_dim), self.dtype)
        positions = jnp.tile(jnp.arange(context - chunk, context, dtype=jnp.int32), B)
        return q, AttentionMetadata(seq_ids=jnp.repeat(jnp.arange(B, dtype=jnp.int32), chunk), positions=positions,
                                    page_table=self.table, kv_lens=jnp.full((B,), context, jnp.int32),
                                    kv_start=jnp.zeros((B,), jnp.int32))

    def calls(self, chunk: int, context: int):
        """(one layer's attention of the step (`step`) on the step's plan, computed here once; the plan's own
        computation, or None where the implementation has no plan), each a function of no arguments."""
        q, meta = self.step(chunk, context)
        kind = step_kind(chunk)
        plan = self.plan(meta, kind)
        return (lambda: self.layer(q, self.k, self.v, meta, plan, kind),
                None if plan is None else lambda: self.plan(meta, kind))

    def time(self, chunk: int, context: int, repeats: int) -> tuple[float, float]:
        """(seconds of one layer's attention on the step's plan, seconds of the plan: once per step, all layers)."""
        layer, plan = self.calls(chunk, context)
        calls = self.args.calls
        return median_time(layer, repeats, calls), (0.0 if plan is None else median_time(plan, repeats, calls))

    def profile(self, chunk: int, context: int, calls: int = 10):
        """The device's kernels over `calls` calls of one layer's attention on the step's plan (`profile_step`)."""
        from mnemojax.bench.trace import profile_calls

        layer, _ = self.calls(chunk, context)
        out = [layer()]
        return profile_calls(lambda: out.append(layer()), calls, lambda: jax.block_until_ready(out[-1]))


# ------------------------------------------------------------------------------------------------ baselines
def split_causal_attention(q, k, v, implementation=None):
    """Bottom-right causal attention of q [B, c, N, H] over k, v [B, n, K, H] (q = the last c tokens) with
    `jax.nn.dot_product_attention`, whose causal mask is top-left: the history keys unmasked plus the chunk's
    own keys causal, merged by log-sum-exp."""
    c, n = q.shape[1], k.shape[1]
    dpa = functools.partial(jax.nn.dot_product_attention, implementation=implementation, return_residual=True)
    o2, l2 = dpa(q, k[:, n - c:], v[:, n - c:], is_causal=c > 1)
    if n == c:
        return o2
    o1, l1 = dpa(q, k[:, :n - c], v[:, :n - c])
    l1, l2 = l1.astype(jnp.float32), l2.astype(jnp.float32)  # [B, c, N] (the residual is BTN since jax 0.7)
    m = jnp.maximum(l1, l2)
    w1, w2 = jnp.exp(l1 - m), jnp.exp(l2 - m)
    return o1 * (w1 / (w1 + w2))[..., None] + o2 * (w2 / (w1 + w2))[..., None]


def cudnn_time(args, chunk, context, repeats, batch=1) -> tuple[float | None, str]:
    """jax cuDNN flash attention on contiguous K/V (`split_causal_attention`)."""
    if jax.default_backend() not in ("gpu", "cuda"):
        return None, "no GPU"
    try:
        N, K, H, dt = args.num_heads, args.num_kv_heads, args.head_dim, jnp.dtype(args.dtype)
        ks = jax.random.split(jax.random.key(1), 3)
        q = jax.random.normal(ks[0], (batch, chunk, N, H), dt)
        k = jax.random.normal(ks[1], (batch, context, K, H), dt)
        v = jax.random.normal(ks[2], (batch, context, K, H), dt)
        f = jax.jit(functools.partial(split_causal_attention, implementation="cudnn"))
        return median_time(lambda: f(q, k, v), repeats, args.calls), "cudnn split+lse"
    except Exception as e:  # a baseline that cannot run is reported, not fatal
        return None, short_error(e)


def mgpu_config(block_kv: int):
    """The `attention_mgpu` tuning the benchmark runs (and `kernel_resources.py` disassembles): two consumer
    warpgroups of 64 q rows, `block_kv` keys a block, 2 K/V slots."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu as am

    return am.TuningConfig(block_q=64, block_kv=block_kv, max_concurrent_steps=2)


def mgpu_time(args, chunk, context, repeats, batch=1) -> tuple[float | None, str]:
    """jax's own FlashAttention-3-style Mosaic GPU kernel (`jax.experimental.pallas.ops.gpu.attention_mgpu`:
    two consumer warpgroups of 64 rows, a TMA producer, ping-pong scheduling, P in registers) on contiguous K/V,
    non-causal: every query sees all `context` keys (the chunk's own c^2 / 2 masked pairs computed too), one
    program per query head (no GQA packing). What Mosaic GPU reaches on this device, beside our paged kernels."""
    if jax.default_backend() not in ("gpu", "cuda"):
        return None, "no GPU"
    if chunk % 128 or context % 128:
        return None, "chunk and context multiples of 128 only"
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu as am
    except ImportError as e:
        return None, f"no attention_mgpu ({e.name})"
    N, K, H = args.num_heads, args.num_kv_heads, args.head_dim
    dt = jnp.float16  # its SMEM buffers are float16 (bf16 inputs are refused); the same speed on the tensor cores
    ks = jax.random.split(jax.random.key(2), 3)
    q = jax.random.normal(ks[0], (batch, chunk, N, H), dt)
    k = jax.random.normal(ks[1], (batch, context, K, H), dt)
    v = jax.random.normal(ks[2], (batch, context, K, H), dt)
    error = "no block size fits"
    for block_kv in (128, 64):  # its own tuning order (256 exceeds SMEM at head dim 128)
        try:
            f = jax.jit(functools.partial(am.attention, config=mgpu_config(block_kv)))
            return median_time(lambda: f(q, k, v), repeats, args.calls), f"jax mgpu f16 block_kv {block_kv}, all keys"
        except Exception as e:  # a baseline that cannot run is reported, not fatal
            error = short_error(e)
    return None, error


def torch_sdpa(args, chunk, context, batch=1):
    """(run, variant) of PyTorch SDPA, flash backend only, on random contiguous q, K and V on the GPU: bottom-right
    causal bias with grouped-query attention; `run()` launches one call (wait with `torch_wait`). (None, why) when
    there is no torch or no CUDA; errors (out of memory) raise."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right
    except ImportError as e:
        return None, f"no torch ({e.name})"
    if not torch.cuda.is_available():
        return None, "torch without CUDA"
    N, K, H = args.num_heads, args.num_kv_heads, args.head_dim
    dt = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    q = torch.randn(batch, N, chunk, H, device="cuda", dtype=dt)
    k = torch.randn(batch, K, context, H, device="cuda", dtype=dt)
    v = torch.randn(batch, K, context, H, device="cuda", dtype=dt)
    mask = causal_lower_right(chunk, context) if chunk > 1 else None  # one query token sees every key
    variant = "flash lower-right gqa" if chunk > 1 else "flash gqa"

    def run():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    try:
        run()
    except torch.OutOfMemoryError:  # a RuntimeError too, but repeating the KV heads would only need more
        raise
    except RuntimeError:  # no GQA in this flash build: repeat the KV heads (reads G times the bytes)
        k, v = (x.repeat_interleave(N // K, dim=1) for x in (k, v))
        variant += ", kv repeated"
        run()
    return run, variant


def torch_wait(_=None):
    import torch

    torch.cuda.synchronize()


def torch_release():
    """Hands the memory torch's caching allocator keeps back to the device (after a peer's tensors are dropped), so
    that the next row's cache, ours or torch's, finds it."""
    import torch

    torch.cuda.empty_cache()


def torch_time(args, chunk, context, repeats, batch=1) -> tuple[float | None, str]:
    """PyTorch SDPA's time (`torch_sdpa`), or why it has none."""
    try:
        run, variant = torch_sdpa(args, chunk, context, batch)
        if run is None:
            return None, variant
        return median_time(run, repeats, args.calls, wait=torch_wait), variant
    except Exception as e:  # reported in the table, not fatal
        return None, short_error(e)


def paired_decode(args, layer: "PagedLayer", context: int, profile: bool = False) -> dict:
    """`layer`'s decode (its sequences' one query token at `context` keys, on the step's plan: the plan itself, once
    a step, is not in it) and PyTorch SDPA's on the same shapes, timed in turns (`paired_times`, `--paired_decode`
    rounds of `--calls` calls): `paired_summary` and the variant torch ran; with `profile`, also torch's kernels over
    10 calls ("torch_profile", `trace.profile_calls`: the profiler records the CUDA kernels of the whole process,
    torch's among them; "torch_profile_error" if tracing fails). {"why": ...} when torch cannot run or the timing
    fails: reported in the table, and the run goes on to its other rows."""
    try:
        peer, variant = torch_sdpa(args, 1, context, layer.batch)
    except Exception as e:  # out of memory beside our cache, say
        return dict(why=short_error(e))
    if peer is None:
        return dict(why=variant)
    try:
        ours, _ = layer.calls(1, context)
        row = dict(paired_summary(paired_times(ours, peer, args.paired_decode, args.calls, wait_peer=torch_wait)),
                   variant=variant)
    except Exception as e:
        return dict(why=short_error(e))
    if profile:
        from mnemojax.bench.trace import profile_calls

        try:
            row["torch_profile"] = profile_calls(peer, 10, lambda: torch_wait(None))
        except Exception as e:  # the timings stand without it
            row["torch_profile_error"] = short_error(e)
    del peer
    torch_release()
    return row


# ------------------------------------------------------------------------------------------------ main
def figure7_total(times_at: dict[int, float], chunk: int, n: int) -> float:
    """Sum over the n/chunk chunks of the chunk time at context i*chunk, interpolated linearly in the context
    between the measured contexts `times_at` (context -> seconds)."""
    xs = sorted(times_at)
    ends = np.arange(1, n // chunk + 1) * chunk
    return float(np.interp(ends, xs, [times_at[x] for x in xs]).sum())


def sample_contexts(chunk: int, n: int, samples: int) -> list[int]:
    """`samples` contexts from `chunk` to `n` (n itself included), on chunk boundaries."""
    pts = np.linspace(chunk, n, max(2, samples))[:-1]
    return sorted({int(min(n, max(chunk, round(x / chunk) * chunk))) for x in pts} | {n})


def short_error(e: Exception, limit: int = 60) -> str:
    """An error as a table cell: its type and its message's first line, cut to `limit` characters."""
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:limit]}"


def fmt(x, spec=".3f", none="-"):
    return none if x is None else format(x, spec)


def paired_line(p: dict) -> str:
    """A decode row's paired timing (`paired_decode`) in one line, or why there is none."""
    if "why" in p:
        return f"not timed: {p['why']}"
    return (f"ours {p['ours_ms']:.3f} ms, torch {p['peer_ms']:.3f} ms; ours / torch over {p['rounds']} rounds: median "
            f"{p['ratio']:.3f} (quartiles {p['ratio_q1']:.3f}-{p['ratio_q3']:.3f}, range {p['ratio_min']:.3f}-"
            f"{p['ratio_max']:.3f}), ours faster in {p['ours_faster']}; {p['variant']}")


def progress(row: dict) -> str:
    """One measurement as it is taken (a run stopped before the tables keeps these lines): time, rate, the plan's
    time (once per step), and the baselines' times on the same shape."""
    rate = f"{row['tflops']:.4g} TFLOP/s" if "tflops" in row else f"{row['gbps']:.4g} GB/s"
    base = "; ".join(f"{name} {fmt(t and t * 1e3)} ms" for name, (t, _) in row["base"].items())
    return f"{row['ms']:.3f} ms, {rate}, plan {row['plan_ms']:.3f} ms" + (f"; {base}" if base else "")


def main(argv=None) -> dict:
    args = parse_args(argv)
    print("command:", shlex.join([os.path.basename(sys.argv[0]) if argv is None else "bench_attention.py",
                                  *(sys.argv[1:] if argv is None else argv)]))
    for line in hardware():
        print(line)
    itemsize = jnp.dtype(args.dtype).itemsize
    contexts, chunks = ints(args.contexts), ints(args.chunks)
    ref_chunk = (2048 if 2048 in chunks else max(chunks)) if chunks else None  # --chunks "": decode only
    results = {"prefill": [], "decode": [], "figure7": [], "errors": {}}
    baselines = {}  # (context, chunk, batch) -> the baselines' times: measured once, shown beside every impl

    def base_for(c, n, B=1):
        if args.no_baselines:
            return {}
        if (n, c, B) not in baselines:
            baselines[n, c, B] = {"cudnn": cudnn_time(args, c, n, args.repeats, batch=B),
                                  "torch": torch_time(args, c, n, args.repeats, batch=B)}
            if c > 1:
                baselines[n, c, B]["mgpu"] = mgpu_time(args, c, n, args.repeats, batch=B)
        return baselines[n, c, B]

    for impl, n in ((impl, n) for impl in args.impls for n in contexts):
        if impl in results["errors"]:
            continue
        try:
            measure(args, impl, n, chunks, ref_chunk, itemsize, results, base_for)
        except Exception as e:  # reported, and the other implementations are still timed
            results["errors"][impl] = short_error(e, 200)
            print(f"  {impl} context {n}: failed: {results['errors'][impl]}", flush=True)

    for impl in args.impls:
        if impl in results["errors"]:
            print(f"\n{impl}: failed, not timed: {results['errors'][impl]}")
        print_tables(args, impl, results, contexts, ref_chunk)
    return results


def measure(args, impl, n, chunks, ref_chunk, itemsize, results, base_for):
    """Times `impl` at context n: each chunk size (at n and at the Figure 7 sample contexts), then decode; the rows
    go to `results`."""
    layer = PagedLayer(args, n, impl=impl) if chunks else None  # decode alone: no prefill cache to hold
    totals = {}
    for c in chunks:
        if c > n:
            continue
        times = {x: layer.time(c, x, args.repeats) for x in sample_contexts(c, n, args.samples)}
        t, plan_t = times[n]
        if n % c == 0:  # the chunks tile the prompt exactly
            totals[c] = figure7_total({x: v[0] for x, v in times.items()}, c, n)
        results["prefill"].append(dict(
            impl=impl, context=n, chunk=c, ms=t * 1e3, plan_ms=plan_t * 1e3, us_per_token=t / c * 1e6,
            tflops=attn_flops(args.num_heads, args.head_dim, c, n) / t / 1e12,
            gbps=attn_bytes(args, itemsize, c, n, impl=impl) / t / 1e9, base=base_for(c, n)))
        print(f"  {impl} context {n} chunk {c}: {progress(results['prefill'][-1])}", flush=True)
        if args.profile and n == max(ints(args.contexts)):
            print(layer.profile(c, n).table(top=12), flush=True)
    if chunks:
        print(f"  {impl} context {n} whole-prefill attention s: "
              + ", ".join(f"chunk {c} {s:.3f}" for c, s in totals.items()), flush=True)
    mine = [r for r in results["prefill"] if r["impl"] == impl and r["context"] == n]
    for row in mine:
        if ref_chunk in totals:
            ref = next(r for r in mine if r["chunk"] == ref_chunk)
            row["per_token_vs_ref"] = row["us_per_token"] / ref["us_per_token"]
            row["total_s"] = totals.get(row["chunk"])
            row["total_vs_ref"] = totals[row["chunk"]] / totals[ref_chunk] if row["chunk"] in totals else None
    for B in ints(args.decode_batches):
        dec = PagedLayer(args, n, batch=B, seed=1, impl=impl)
        t, plan_t = dec.time(1, n, args.repeats)
        results["decode"].append(dict(impl=impl, context=n, batch=B, ms=t * 1e3, plan_ms=plan_t * 1e3,
                                      gbps=attn_bytes(args, itemsize, 1, n, batch=B, impl=impl) / t / 1e9,
                                      base=base_for(1, n, B)))
        print(f"  {impl} context {n} decode B={B}: {progress(results['decode'][-1])}", flush=True)
        profile = args.profile and n == max(ints(args.contexts))
        if profile:
            print(dec.profile(1, n).table(top=12), flush=True)
        if args.paired_decode:
            paired = results["decode"][-1]["paired"] = paired_decode(args, dec, n, profile)
            print(f"  {impl} context {n} decode B={B} paired with torch SDPA: {paired_line(paired)}", flush=True)
            if "torch_profile" in paired:
                trace = paired.pop("torch_profile")
                print(f"torch SDPA's kernels ({paired['variant']}):\n{trace.table(top=12)}", flush=True)
                if not trace.kernels:
                    print("  (the trace holds no kernel of torch's: the profiler did not record them, so torch's "
                          "GPU time is not known from it)", flush=True)
            if "torch_profile_error" in paired:
                print(f"  torch SDPA's kernels not traced: {paired['torch_profile_error']}", flush=True)
        del dec
    del layer


def print_tables(args, impl, results, contexts, ref_chunk):
    """The prefill, Figure 7 and decode tables of `impl` (appends its Figure 7 rows to results["figure7"]), the
    prefill tables only with chunks to time (`ref_chunk`), and the decode rows' paired timings with `--paired_decode`."""
    if ref_chunk is not None:
        print_prefill_tables(args, impl, results, contexts, ref_chunk)
    print_decode_tables(args, impl, results)


def print_prefill_tables(args, impl, results, contexts, ref_chunk):
    print(f"\nattention ({impl}), {args.num_heads} q heads, {args.num_kv_heads} kv heads, head dim "
          f"{args.head_dim}, {args.dtype}, page {args.page_size}; one layer, one sequence; median of "
          f"{args.repeats}")
    print(f"{'context':>8} {'chunk':>6} {'ms/chunk':>9} {'plan ms':>8} {'us/token':>9} {'TFLOP/s':>8} {'GB/s':>7} "
          f"{'tok vs ' + str(ref_chunk):>12} {'fig7 total s':>12} {'fig7 vs ' + str(ref_chunk):>13} "
          f"{'cudnn ms':>9} {'x cudnn':>8} {'torch ms':>9} {'x torch':>8} {'mgpu ms':>9}  baselines")
    for r in (r for r in results["prefill"] if r["impl"] == impl):
        cu, cu_how = r["base"].get("cudnn", (None, "skipped"))
        to, to_how = r["base"].get("torch", (None, "skipped"))
        mg, mg_how = r["base"].get("mgpu", (None, "skipped"))
        print(f"{r['context']:>8} {r['chunk']:>6} {r['ms']:>9.3f} {r['plan_ms']:>8.3f} {r['us_per_token']:>9.2f} "
              f"{r['tflops']:>8.4g} "
              f"{r['gbps']:>7.4g} {fmt(r.get('per_token_vs_ref'), '.3f'):>12} {fmt(r.get('total_s'), '.3f'):>12} "
              f"{fmt(r.get('total_vs_ref'), '.3f'):>13} {fmt(cu and cu * 1e3):>9} "
              f"{fmt(cu and r['ms'] / (cu * 1e3), '.2f'):>8} {fmt(to and to * 1e3):>9} "
              f"{fmt(to and r['ms'] / (to * 1e3), '.2f'):>8} {fmt(mg and mg * 1e3):>9}  {cu_how}; {to_how}; {mg_how}")
    for n in contexts:
        rows = {r["chunk"]: r for r in results["prefill"] if r["context"] == n and r["impl"] == impl}
        if not rows:  # failed before this context
            continue
        lo = min(rows)
        if ref_chunk in rows and lo != ref_chunk and rows[lo].get("total_vs_ref") is not None:
            f7 = dict(impl=impl, context=n, small=lo, ref=ref_chunk, per_token=rows[lo]["per_token_vs_ref"],
                      total=rows[lo]["total_vs_ref"])
            results["figure7"].append(f7)
            print(f"Figure 7 ({impl}) at {n} tokens: chunk {lo} vs {ref_chunk}: whole-prefill attention time x"
                  f"{f7['total']:.3f}, time per token at the full context x{f7['per_token']:.3f}")


def print_decode_tables(args, impl, results):
    print(f"\ndecode ({impl}): B sequences of one query token")
    print(f"{'context':>8} {'B':>4} {'ms':>9} {'plan ms':>8} {'GB/s':>7} {'cudnn ms':>9} {'torch ms':>9}  baselines")
    for r in (r for r in results["decode"] if r["impl"] == impl):
        cu, cu_how = r["base"].get("cudnn", (None, "skipped"))
        to, to_how = r["base"].get("torch", (None, "skipped"))
        print(f"{r['context']:>8} {r['batch']:>4} {r['ms']:>9.3f} {r['plan_ms']:>8.3f} {r['gbps']:>7.4g} "
              f"{fmt(cu and cu * 1e3):>9} "
              f"{fmt(to and to * 1e3):>9}  {cu_how}; {to_how}")
    paired = [r for r in results["decode"] if r["impl"] == impl and "paired" in r]
    if paired:
        print(f"\ndecode ({impl}) and PyTorch SDPA timed in turns: {args.paired_decode} rounds of one sample of each "
              f"({args.calls} calls back to back and one wait, its dispatch and wait spread over them), the order "
              f"alternating; ours on the step's plan (the plan, once a step, not in it); ratio: ours / torch per round")
        print(f"{'context':>8} {'B':>4} {'ours ms':>9} {'torch ms':>9} {'ratio':>7} {'q1':>7} {'q3':>7} {'min':>7} "
              f"{'max':>7} {'ours faster':>12}  torch")
        for r in paired:
            p = r["paired"]
            if "why" in p:
                print(f"{r['context']:>8} {r['batch']:>4}  not timed: {p['why']}")
                continue
            print(f"{r['context']:>8} {r['batch']:>4} {p['ours_ms']:>9.3f} {p['peer_ms']:>9.3f} {p['ratio']:>7.3f} "
                  f"{p['ratio_q1']:>7.3f} {p['ratio_q3']:>7.3f} {p['ratio_min']:>7.3f} {p['ratio_max']:>7.3f} "
                  f"{p['ours_faster']:>5} of {p['rounds']:<3}  {p['variant']}")
