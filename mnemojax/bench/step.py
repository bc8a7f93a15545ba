"""Whole-model step efficiency on one GPU: prefill MFU and decode MBU against measured ceilings, and an exact
1M-token prefill + decode (TTFT, TBT).

    python scripts/bench_step.py [--model llama3-8b] [--attention pallas,mosaic] [--prefill_context 32768]
        [--chunk 2048] [--decode_contexts 32768,131072,524288] [--repeats 5]
    python scripts/bench_step.py --long [--long_model llama3.2-1b] [--long_tokens 1048576] [--long_chunk 8192]
        [--long_decode 128]
    python scripts/bench_step.py --small          # tiny model and shapes, interpreted kernels (runs on a CPU)

The step is `models.llama.forward` (all layers, the LM head for the last row) inside `jax.shard_map` on the
1x1x1 (kvp, spp, tp) mesh, jitted with the KV cache donated: the engine's device step without its sampler and
host work. Random bf16 weights (`models.params.init_params`), a paged KV cache of zeros big enough for the
longest context (timing does not depend on the values), one sequence.

- Prefill MFU: one chunk of `--chunk` tokens ending at `--prefill_context` tokens. FLOPs = 2 x weights x
  tokens (every projection and the MLP) + 4 N H x visible (query, key) pairs per layer (attention, causal) +
  2 D V (the LM head row); MFU = FLOPs / time / the measured ceiling (the best of large square bf16 matmuls).
- Decode MBU: one token at each of `--decode_contexts`; bytes = every weight once (the embedding: one row)
  + the K and V of the context in every layer; MBU = bytes / time / the measured device bandwidth (a large
  y = x + 1: bytes read + written over its time).
- `--long`: prefill `--long_tokens` tokens exactly (every chunk attends to all keys before it) in chunks of
  `--long_chunk`, then `--long_decode` greedy tokens: TTFT = the whole prefill (first chunk to the first
  token's logits), TBT = median decode step. One warm-up chunk and decode step compile first.

Each implementation of `--attention` (e.g. `pallas,mosaic`: the Triton kernels beside the Mosaic GPU ones;
`pallas+persistent`: the Triton kernels on their persistent work-list grid) gets its own model and rows in the
same run, with its time relative to the first implementation's on the same row.
Median of `--repeats` after a warm-up, `block_until_ready` on every timed call. Prints the command, the
hardware, and the table last.
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time

# Llama-3-8B weights (16 GB) and a 512K-token KV cache (64 GB) share one GPU: let JAX take 90% of its memory
# (bench_attention, imported below, would otherwise leave 40% to PyTorch).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from mnemojax.bench import parse_with_small  # noqa: E402
from mnemojax.bench.attention import (PERSISTENT, check_label, copy_bandwidth, hardware, matmul_ceiling,  # noqa: E402
                                      median_time, split_label)
from models.attention import AttentionMetadata, resolve_for_model  # noqa: E402
from models.config import PRESETS, LlamaConfig, preset  # noqa: E402
from models.kernels import ATTENTION_IMPLS  # noqa: E402
from models.llama import ModelSpec, StepBatch, forward  # noqa: E402
from models.params import init_params, split_layers  # noqa: E402
from shardings.mesh import make_mesh  # noqa: E402
from shardings.specs import ShardingTable  # noqa: E402

SMALL = dict(model="tiny", long_model="tiny", dtype="float32", attention="pallas_interpret", prefill_context=192,
             chunk=64, decode_contexts="64,320", page_size=16, repeats=2, long_tokens=256, long_chunk=64,
             long_decode=4, matmul_sizes="256", copy_mib=16)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b", choices=sorted(PRESETS))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--attention", default="pallas", help="comma-separated attention implementations, each timed "
                                                          f"in the same run ({', '.join(ATTENTION_IMPLS)}; "
                                                          f"pallas{PERSISTENT}: the Triton kernels' persistent grid)")
    p.add_argument("--page_size", type=int, default=16)
    p.add_argument("--block_pages", type=int, default=8, help="pages per block of the reference attention")
    p.add_argument("--prefill_context", type=int, default=32768, help="context after the timed prefill chunk")
    p.add_argument("--chunk", type=int, default=2048, help="tokens of the timed prefill chunk")
    p.add_argument("--decode_contexts", default="32768,131072,524288", help="comma-separated contexts")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--matmul_sizes", default="4096,8192,16384", help="square matmuls for the FLOP/s ceiling")
    p.add_argument("--copy_mib", type=int, default=4096, help="array size for the bandwidth ceiling")
    p.add_argument("--long", action="store_true", help="also the exact long prefill + decode (TTFT, TBT)")
    p.add_argument("--long_model", default="llama3.2-1b", choices=sorted(PRESETS))
    p.add_argument("--long_tokens", type=int, default=1 << 20)
    p.add_argument("--long_chunk", type=int, default=8192)
    p.add_argument("--long_decode", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--small", action="store_true", help="tiny model and shapes, interpreted kernels (a CPU)")
    args = parse_with_small(p, argv, SMALL)
    args.impls = [a for a in args.attention.split(",") if a]
    for a in args.impls:
        check_label(p, "--attention", a)
    if args.small:
        args.long = True
    return args


# ------------------------------------------------------------------------------------------------ the model
def weight_count(c: LlamaConfig) -> tuple[int, int]:
    """(matmul weights of all decoder layers, of the LM head): q, k, v, o projections and the SwiGLU MLP."""
    per_layer = (c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
                 + c.num_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size)
    return c.num_layers * per_layer, c.vocab_size * c.hidden_size


def step_flops(c: LlamaConfig, tokens: int, context: int) -> float:
    """Model FLOPs of one step: `tokens` query tokens ending at `context`, one logits row."""
    layers, head = weight_count(c)
    pairs = tokens * (context - tokens) + tokens * (tokens + 1) / 2
    return 2.0 * layers * tokens + 4.0 * c.num_heads * c.head_dim * pairs * c.num_layers + 2.0 * head


def decode_bytes(c: LlamaConfig, context: int, itemsize: int) -> float:
    """Bytes a one-token decode step must read: every weight once, one embedding row, the context's K and V."""
    layers, head = weight_count(c)
    norms = (2 * c.num_layers + 1) * c.hidden_size
    kv = 2 * c.num_layers * context * c.num_kv_heads * c.head_dim
    return (layers + head + norms + c.hidden_size + kv) * itemsize


class Model:
    """A model on the 1x1x1 mesh with a paged KV cache for one sequence of up to `max_tokens` tokens, and the
    jitted forward step (KV cache donated)."""

    def __init__(self, name: str, args, max_tokens: int, attention: str):
        self.config = c = preset(name)
        self.mesh = make_mesh(1, 1, 1)
        self.page_size = args.page_size
        self.max_pages = -(-max_tokens // args.page_size)
        impl, options = split_label(attention)
        impl = resolve_for_model(impl, c, args.dtype, args.page_size)  # `auto` as the engine resolves it
        self.spec = ModelSpec(c, args.dtype, args.block_pages, impl, attention_options=tuple(sorted(options.items())))
        table = ShardingTable()
        named = lambda specs: jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs)  # noqa: E731
        self.params = split_layers(init_params(c, dtype=jnp.dtype(args.dtype), seed=args.seed,
                                               shardings=named(table.params(c.tie_word_embeddings))), 1)
        shape = (c.num_layers, 1 + self.max_pages, args.page_size, c.num_kv_heads, c.head_dim)
        alloc = jax.jit(lambda: jnp.zeros(shape, args.dtype), out_shardings=NamedSharding(self.mesh, table.kv_lpskh))
        self.k, self.v = alloc(), alloc()
        stage = StepBatch.partition_specs(table)
        self._batch_sharding = named(stage)
        self._rows_sharding = NamedSharding(self.mesh, table.rows_kr)
        self._register_sharding = NamedSharding(self.mesh, table.register_kstd)
        param_specs = jax.tree.map(lambda a: a.sharding.spec, self.params)
        spec = self.spec

        def step(params, k, v, register, batch, rows):
            batch = jax.tree.map(lambda a: a[0, 0], batch)
            logits, k, v, _ = forward(spec, params, k, v, register[0, 0], batch, rows[0])
            return jnp.argmax(logits, -1).astype(jnp.int32)[None], k, v

        self._step = jax.jit(jax.shard_map(
            step, mesh=self.mesh, in_specs=(param_specs, table.kv_lpskh, table.kv_lpskh, table.register_kstd,
                                            stage, table.rows_kr),
            out_specs=(table.rows_kr, table.kv_lpskh, table.kv_lpskh)), donate_argnums=(1, 2))
        self._registers = {}

    def batch(self, tokens, start: int):
        """Device arguments of a step feeding `tokens` (host ints) at positions start, start+1, ..."""
        n, S = len(tokens), self.page_size
        pos = np.arange(start, start + n, dtype=np.int32)
        pages = 1 + pos // S  # the sequence owns pages 1, 2, ... in order
        table = np.arange(1, 1 + self.max_pages, dtype=np.int32)[None]
        arrays = StepBatch(
            token_ids=np.asarray(tokens, np.int32), write_pages=pages.astype(np.int32),
            write_slots=(pos % S).astype(np.int32), shared=np.zeros(n, bool),
            attn=AttentionMetadata(seq_ids=np.zeros(n, np.int32), positions=pos, page_table=table,
                                   kv_lens=np.array([start + n], np.int32), kv_start=np.zeros(1, np.int32)))
        arrays = jax.tree.map(lambda a: a[None, None], arrays)
        if n not in self._registers:
            self._registers[n] = jax.device_put(np.zeros((1, 1, n, self.config.hidden_size), self.spec.dtype),
                                                self._register_sharding)
        rows = jax.device_put(np.array([[n - 1]], np.int32), self._rows_sharding)
        return jax.device_put(arrays, self._batch_sharding), self._registers[n], rows

    def run(self, args):
        """One step; returns the greedy next token of the last row (a device array), updating the cache."""
        batch, register, rows = args
        token, self.k, self.v = self._step(self.params, self.k, self.v, register, batch, rows)
        return token


# ------------------------------------------------------------------------------------------------ benchmarks
def prefill_mfu(model: Model, context: int, chunk: int, repeats: int, ceiling: float) -> dict:
    rng = np.random.default_rng(0)
    step = model.batch(rng.integers(0, model.config.vocab_size, chunk), context - chunk)
    t = median_time(lambda: model.run(step), repeats)
    flops = step_flops(model.config, chunk, context)
    return dict(kind="prefill", context=context, tokens=chunk, ms=t * 1e3, tflops=flops / t / 1e12,
                util=flops / t / ceiling)


def decode_mbu(model: Model, context: int, repeats: int, bandwidth: float, itemsize: int) -> dict:
    step = model.batch([1], context - 1)
    t = median_time(lambda: model.run(step), repeats)
    nbytes = decode_bytes(model.config, context, itemsize)
    return dict(kind="decode", context=context, tokens=1, ms=t * 1e3, gbps=nbytes / t / 1e9,
                util=nbytes / t / bandwidth)


def long_run(model: Model, total: int, chunk: int, decode: int, label: str = "") -> dict:
    """Exact prefill of `total` random tokens in chunks, then `decode` greedy tokens: TTFT and TBT. The TTFT is
    printed as soon as it is measured, after `label`."""
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, model.config.vocab_size, total)
    starts = list(range(0, total, chunk))
    jax.block_until_ready(model.run(model.batch(prompt[:chunk], 0)))  # compile (rewritten by the timed run)
    if total % chunk:
        jax.block_until_ready(model.run(model.batch(prompt[starts[-1]:], starts[-1])))
    t0 = time.perf_counter()
    for s in starts:
        token = model.run(model.batch(prompt[s:s + chunk], s))
    token = int(jax.device_get(token)[0, 0])
    ttft = time.perf_counter() - t0
    # printed now: a run stopped during the decode (a device call's time limit) keeps it
    print(f"  {label} exact prefill of {total} tokens in chunks of {chunk}: TTFT {ttft:.3f} s", flush=True)
    jax.block_until_ready(model.run(model.batch([token], total)))  # compile the decode step (rewritten below)
    tbt = []
    for i in range(decode):
        t1 = time.perf_counter()
        token = int(jax.device_get(model.run(model.batch([token], total + i)))[0, 0])
        tbt.append(time.perf_counter() - t1)
    return dict(tokens=total, chunk=chunk, ttft_s=ttft, tbt_ms=statistics.median(tbt) * 1e3, decoded=decode)


def main(argv=None) -> dict:
    args = parse_args(argv)
    print("command:", shlex.join([os.path.basename(sys.argv[0]) if argv is None else "bench_step.py",
                                  *(sys.argv[1:] if argv is None else argv)]))
    for line in hardware():
        print(line)
    dtype = jnp.dtype(args.dtype)
    ceiling = matmul_ceiling(dtype, [int(x) for x in args.matmul_sizes.split(",")], args.repeats)
    bandwidth = copy_bandwidth(args.copy_mib << 20, args.repeats)
    print(f"measured ceilings: {ceiling / 1e12:.4g} TFLOP/s ({args.dtype} matmul), "
          f"{bandwidth / 1e9:.4g} GB/s (device copy, read + write)", flush=True)
    decode_contexts = [int(x) for x in args.decode_contexts.split(",") if x]
    rows, longs = [], {}
    for impl in args.impls:  # one model at a time: a GPU holds one 8B model and its cache, not two
        model = Model(args.model, args, max(args.prefill_context, *decode_contexts), impl)
        rows.append(dict(prefill_mfu(model, args.prefill_context, args.chunk, args.repeats, ceiling), impl=impl))
        print(f"  {impl} prefill: {rows[-1]['ms']:.3f} ms", flush=True)
        for ctx in decode_contexts:
            rows.append(dict(decode_mbu(model, ctx, args.repeats, bandwidth, dtype.itemsize), impl=impl))
            print(f"  {impl} decode at {ctx}: {rows[-1]['ms']:.3f} ms", flush=True)
        if args.long:
            if args.long_model != args.model or args.long_tokens + args.long_decode > model.max_pages * args.page_size:
                del model
                model = Model(args.long_model, args, args.long_tokens + args.long_decode, impl)
            longs[impl] = long_run(model, args.long_tokens, args.long_chunk, args.long_decode, impl)
        del model

    print(f"\n{args.model}, {args.dtype}, page {args.page_size}, one sequence; "
          f"median of {args.repeats}; ceilings {ceiling / 1e12:.4g} TFLOP/s, {bandwidth / 1e9:.4g} GB/s")
    first = {}  # the first implementation's time of each row: the others' ratio to it
    print(f"{'attention':<18} {'step':<8} {'context':>8} {'tokens':>7} {'ms':>10} {'TFLOP/s':>9} {'GB/s':>8} "
          f"{'MFU/MBU':>8} {'vs ' + args.impls[0]:>12}")
    for r in rows:
        ref = first.setdefault((r["kind"], r["context"]), r["ms"])
        print(f"{r['impl']:<18} {r['kind']:<8} {r['context']:>8} {r['tokens']:>7} {r['ms']:>10.3f} "
              f"{r['tflops'] if 'tflops' in r else float('nan'):>9.4g} {r.get('gbps', float('nan')):>8.4g} "
              f"{r['util']:>8.1%} {r['ms'] / ref:>11.2f}x")
    for impl, long in longs.items():
        print(f"{args.long_model}, attention={impl}: exact prefill of {long['tokens']} tokens in chunks of "
              f"{long['chunk']}: TTFT {long['ttft_s']:.3f} s; {long['decoded']} greedy tokens: TBT "
              f"{long['tbt_ms']:.3f} ms (median)")
    long = longs.get(args.impls[0])
    return dict(ceiling=ceiling, bandwidth=bandwidth, rows=rows, long=long, longs=longs)
