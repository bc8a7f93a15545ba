"""Greedy decode throughput of mnemojax against Hugging Face `transformers` `generate`, same weights, CPU.

    python scripts/bench_vs_hf.py [--new_tokens 64] [--prompt_len 128] [--batches 1,16]

Builds a random ~19M-parameter Llama checkpoint in a temporary directory (`tests.hf_utils.make_hf_checkpoint`),
then for each batch size generates `--new_tokens` greedy tokens after `--prompt_len`-token prompts, with the
engine (`mnemojax.LLM`) and with HF `generate` (eager and sdpa attention), each warmed up on other prompts of the
same shapes first and timed as the best of `--repeats` runs. Throughput is batch * new_tokens / wall time of the
whole call (prefill included, for both). It checks that the greedy tokens agree, shows where the engine's step
time goes (jitted step alone, its attention loop over KV pages, host work around it), and prints a table last.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before jax is imported; one real CPU device, no fake ones
os.environ.setdefault("TQDM_DISABLE", "1")  # no HF save/load progress bars (the engine's loader still shows one)


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

from mnemojax import LLM, SamplingParams  # noqa: E402
from models.llama import StepBatch  # noqa: E402
from tests.hf_utils import load_hf_model, make_hf_checkpoint  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--new_tokens", type=int, default=64, help="greedy tokens generated per prompt")
    p.add_argument("--prompt_len", type=int, default=128, help="tokens per prompt (random ids)")
    p.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement; the best is reported")
    p.add_argument("--vocab_size", type=int, default=8192)
    p.add_argument("--hidden_size", type=int, default=384)
    p.add_argument("--intermediate_size", type=int, default=1024)
    p.add_argument("--num_layers", type=int, default=8)
    p.add_argument("--num_heads", type=int, default=6)
    p.add_argument("--num_kv_heads", type=int, default=2)
    p.add_argument("--weight_scale", type=float, default=1.0, help="see make_hf_checkpoint; 1.0 = HF init")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wait_quiet", type=float, default=0.0, metavar="SECONDS",
                   help="per timed run, wait up to this long for one during which other processes leave the "
                        "CPUs (nearly) idle; 0: no waiting")
    return p.parse_args()


def hardware() -> list[str]:
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return [
        f"cpu: {cpu}, {os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable)",
        f"python {platform.python_version()}, jax {jax.__version__}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), transformers {transformers.__version__}",
        f"jax devices: {jax.devices()}",
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r} JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')!r}",
    ]


def best_of(repeats: int, fn):
    """(best wall seconds, result of that run) over `repeats` calls of `fn`."""
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        runs.append((time.perf_counter() - t0, out))
    return min(runs, key=lambda r: r[0])


class OtherLoad:
    """`with OtherLoad() as load: ...`, then `load.fraction`: the share of the machine's CPU time that other
    processes used meanwhile ((busy time of all CPUs - this process's) / (wall time x cores), /proc/stat)."""

    def __enter__(self):
        self._start = self._sample()
        return self

    def __exit__(self, *exc):
        (busy0, own0, t0), (busy1, own1, t1) = self._start, self._sample()
        self.fraction = max(0.0, ((busy1 - busy0) - (own1 - own0)) / ((t1 - t0) * os.cpu_count()))

    @staticmethod
    def _sample():
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
        t = os.times()
        busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
        return busy, t.user + t.system, time.monotonic()


QUIET = 0.1  # a run is "quiet" when other processes used under this share of the CPUs meanwhile


def quiet_run(fn, max_wait_s: float):
    """(result of `fn()`, other processes' CPU share during it). With `max_wait_s` > 0, waits for a quiet
    2-second window before each try and tries again until one run itself was quiet, for at most `max_wait_s`
    (then the last run is returned as it is). PyTorch's threads slow down many-fold when another process takes
    a core, so a shared machine otherwise measures its neighbours."""
    deadline = time.monotonic() + max_wait_s
    while True:
        while time.monotonic() < deadline:
            with OtherLoad() as idle:
                time.sleep(2.0)
            if idle.fraction < QUIET:
                break
        with OtherLoad() as load:
            out = fn()
        if load.fraction < QUIET or time.monotonic() >= deadline:
            return out, load.fraction


# ------------------------------------------------------------------------------------------------ the engine
class StepTimer:
    """Wraps an executor's `launch`, `prepare` and jitted step (`_step(kind)`) to time the parts of every step,
    and keeps the jitted step and its arguments of the last prefill and the last all-decode step, to time it
    alone.

    Only the executor's method names are assumed, not their signatures. The wrapped step blocks until its results
    are ready, so with async scheduling the host no longer overlaps the next step: the parts are timed one after
    another ("execute" is the whole `launch`).
    """

    def __init__(self, executor):
        self.ex = executor
        self.step_fns = {}  # kind -> the jitted step it ran
        self.steps: list[dict] = []  # per launch: kind ("prefill" or "decode") and seconds of each part
        self.args = {}  # kind -> (args of the jitted step, positions of its donated arguments)
        self._orig = executor.prepare, executor._step, executor.launch

        def timed(name, fn):
            def wrapper(*args, **kwargs):
                t0 = time.perf_counter()
                out = fn(*args, **kwargs)
                if name == "step":
                    jax.block_until_ready(out)
                    donated = [i for i, a in enumerate(args) if isinstance(a, jax.Array) and a.is_deleted()]
                    self.args[self.steps[-1]["kind"]] = (args, donated)
                self.steps[-1][name] = self.steps[-1].get(name, 0.0) + time.perf_counter() - t0
                return out
            return wrapper

        def launch(plan, *args, **kwargs):
            self.steps.append({"kind": "decode" if all(ch.num_tokens == 1 for ch in plan.chunks) else "prefill"})
            return timed("execute", self._orig[2])(plan, *args, **kwargs)

        def step_for(kind):
            fn = self._orig[1](kind)
            self.step_fns[self.steps[-1]["kind"]] = fn
            return timed("step", fn)

        executor.prepare, executor._step = timed("prepare", self._orig[0]), step_for
        executor.launch = launch

    def restore(self):
        self.ex.prepare, self.ex._step, self.ex.launch = self._orig


def time_jitted_step(step_fn, args, donated, repeats: int, n: int = 20) -> float:
    """Best-of-`repeats` mean seconds of the jitted step alone on fixed arguments. The donated ones (KV cache,
    pipeline register) are zeros of the same shapes, threaded from call to call: the engine's state is not
    touched, and the work per call is the same. Arguments deleted since by other calls (the page table, which the
    engine's later updates donated) are zeros of the same shape too: every row then reads the reserved page 0,
    the same amount of work."""
    state = [jnp.zeros(args[i].shape, args[i].dtype, device=args[i].sharding) for i in donated]
    args = [jnp.zeros(a.shape, a.dtype, device=a.sharding) if isinstance(a, jax.Array) and a.is_deleted() else a
            for a in args]

    def loop():
        nonlocal state
        for _ in range(n):
            a = list(args)
            for i, s in zip(donated, state):
                a[i] = s
            out = step_fn(*a)
            state = list(out[:len(donated)])  # donated inputs come back as the leading outputs
            jax.block_until_ready(out)

    loop()  # warm-up: the shape bucket was compiled by the run that produced these arguments
    return best_of(repeats, loop)[0] / n


def engine_run(llm, prompts, n):
    """One timed `LLM.generate`: (wall s, token lists, mean TTFT s, median TBT s)."""
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)  # timed: no bar
    wall = time.perf_counter() - t0
    return (wall, [o.outputs[0].token_ids for o in outs], statistics.mean(o.metrics.ttft for o in outs),
            statistics.median(t for o in outs for t in o.metrics.tbt))


def engine_profile(llm, prompts, n, repeats) -> dict:
    """Where the engine's time goes: one more run with the executor's parts timed per step, then the jitted
    step alone on that run's prefill and last decode step, with and without KV blocks for the attention."""
    timer = StepTimer(llm.engine.executor)
    try:
        wall = engine_run(llm, prompts, n)[0]
    finally:
        timer.restore()
    cfg = llm.engine.config
    keys_per_block = cfg.page_size * min(cfg.block_pages, -(-llm.engine.max_model_len // cfg.page_size))
    prof = {"wall": wall, "steps": timer.steps}
    for kind, calls in (("prefill", 3), ("decode", 20)):
        args, donated = timer.args[kind]
        b = next(i for i, a in enumerate(args) if isinstance(a, StepBatch))
        batch = args[b]
        # kv_lens = 0: the attention's loop over KV page blocks runs 0 times; everything else is unchanged.
        no_attn = list(args)
        no_attn[b] = dataclasses.replace(batch, attn=dataclasses.replace(batch.attn,
                                                                          kv_lens=jnp.zeros_like(batch.attn.kv_lens)))
        prof[kind] = dict(alone=time_jitted_step(timer.step_fns[kind], args, donated, repeats, calls),
                          no_attn=time_jitted_step(timer.step_fns[kind], no_attn, donated, repeats, calls),
                          kv_blocks=-(-int(np.max(np.asarray(batch.attn.kv_lens))) // keys_per_block),
                          token_rows=int(batch.token_ids.shape[-1]))
    return prof


def describe_profile(prof: dict, other: float) -> str:
    lines = []
    for kind in ("prefill", "decode"):
        p = prof[kind]
        lines.append(f"  engine {kind} step, jitted step alone: {p['alone'] * 1e3:7.2f} ms ({p['token_rows']} token "
                     f"rows, {p['kv_blocks']} KV blocks), of which the attention's loop over KV blocks "
                     f"{(p['alone'] - p['no_attn']) * 1e3:.2f} ms")
    dec = [s for s in prof["steps"] if s["kind"] == "decode"]
    med = {k: statistics.median(s.get(k, 0.0) for s in dec) for k in ("execute", "prepare", "step")}
    rest = [s["execute"] - s.get("prepare", 0.0) - s.get("step", 0.0) for s in dec]
    worst = max(range(len(dec)), key=lambda i: dec[i]["execute"])
    outside = (prof["wall"] - sum(s["execute"] for s in prof["steps"])) / len(prof["steps"])
    lines.append(f"  engine decode steps, profiled run ({len(dec)} of {len(prof['steps'])} steps, other processes "
                 f"{other:.0%} of the CPUs), median: execute {med['execute'] * 1e3:.2f} ms = prepare "
                 f"{med['prepare'] * 1e3:.2f} + jitted step and wait {med['step'] * 1e3:.2f} + rest (device_put, "
                 f"device_get, pipeline register) {statistics.median(rest) * 1e3:.2f} ms; slowest: decode step "
                 f"{worst + 1}, execute {dec[worst]['execute'] * 1e3:.2f} ms of which rest {rest[worst] * 1e3:.2f} ms; "
                 f"engine outside execute {outside * 1e3:.2f} ms per step")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ HF
class TokenClock(BaseStreamer):
    """A `generate` streamer that only notes when each step's tokens arrive (the first put is the prompt)."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def hf_run(model, prompts, n):
    """One timed `generate`: (wall s, token lists, TTFT s, median TBT s)."""
    ids = torch.tensor(prompts, dtype=torch.long)
    clock = TokenClock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0, streamer=clock)
    wall = time.perf_counter() - t0
    token_times = clock.times[1:]
    tbt = [b - a for a, b in zip(token_times, token_times[1:])]
    return wall, out[:, ids.shape[1]:].tolist(), token_times[0] - t0, statistics.median(tbt) if tbt else 0.0


def first_divergence(model, prompt, ours, theirs):
    """At the first differing generated token: both picks, their HF logits and HF's top-2 logit gap."""
    d = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    ids = torch.tensor([list(prompt) + list(ours[:d])])
    with torch.inference_mode():
        logits = model(ids).logits[0, -1].double()
    top2 = torch.topk(logits, 2)
    return (f"first differs at token {d}: engine {ours[d]} (HF logit {logits[ours[d]]:.6f}), HF {theirs[d]} "
            f"(logit {logits[theirs[d]]:.6f}); HF's top-2 gap {float(top2.values[0] - top2.values[1]):.2e}")


def agreement(name, model, prompts, ours, theirs) -> str:
    same = [a == b for a, b in zip(ours, theirs)]
    line = f"  greedy tokens engine vs {name}: {sum(same)}/{len(same)} prompts identical"
    for i, ok in enumerate(same):
        if not ok:
            match = sum(a == b for a, b in zip(ours[i], theirs[i]))
            line += f"\n    prompt {i}: {match}/{len(ours[i])} tokens match; " + first_divergence(
                model, prompts[i], ours[i], theirs[i])
    return line


# ------------------------------------------------------------------------------------------------ main
def main():
    args = parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # progress shows when redirected to a file
    batches = [int(b) for b in args.batches.split(",")]
    n, plen, maxb = args.new_tokens, args.prompt_len, max(batches)
    print("command: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    print("\n".join(hardware()))

    with tempfile.TemporaryDirectory() as tmp:
        path = make_hf_checkpoint(
            os.path.join(tmp, "llama"), vocab_size=args.vocab_size, hidden_size=args.hidden_size,
            intermediate_size=args.intermediate_size, num_layers=args.num_layers, num_heads=args.num_heads,
            num_kv_heads=args.num_kv_heads, weight_scale=args.weight_scale, seed=args.seed, tokenizer=False)
        hf = {"eager": load_hf_model(path),
              "sdpa": transformers.LlamaForCausalLM.from_pretrained(
                  path, dtype=torch.float32, attn_implementation="sdpa").eval()}
        for m in hf.values():
            m.generation_config.eos_token_id = None  # exactly n tokens, EOS not suppressed (ignore_eos twin)
        n_params = sum(p.numel() for p in hf["eager"].parameters())

        page_size = 16
        pages_per_seq = -(-(plen + n) // page_size)
        llm = LLM(model=path, dtype="float32", max_model_len=plen + n, page_size=page_size,
                  num_pages=1 + maxb * pages_per_seq, max_num_seqs=maxb, chunk_size=plen,
                  max_num_batched_tokens=maxb * plen)  # every prompt prefills in one step, as in HF
        n_engine = sum(x.size for x in jax.tree.leaves(llm.engine.executor.params))
        print(f"model: Llama, vocab {args.vocab_size}, hidden {args.hidden_size}, MLP {args.intermediate_size}, "
              f"{args.num_layers} layers, {args.num_heads} heads / {args.num_kv_heads} kv heads, untied, "
              f"weight_scale {args.weight_scale}: {n_params:,} parameters (engine holds {n_engine:,}), float32")
        print(f"workload: random prompts of {plen} tokens, {n} greedy new tokens, batches {batches}, "
              f"best of {args.repeats} timed runs after a warm-up on other prompts of the same shapes")
        print(f"engine: page_size {page_size}, {1 + maxb * pages_per_seq} pages, block_pages "
              f"{llm.engine.config.block_pages}, prefill of all prompts in one step\n")

        rng = np.random.default_rng(args.seed)
        all_prompts = rng.integers(0, args.vocab_size, (maxb, plen)).tolist()
        all_warm = rng.integers(0, args.vocab_size, (maxb, plen)).tolist()
        rows = []
        for b in batches:
            prompts, warm = all_prompts[:b], all_warm[:b]
            runners = {"engine": lambda p: engine_run(llm, p, n)}
            runners.update({f"HF {name}": (lambda p, m=m: hf_run(m, p, n)) for name, m in hf.items()})
            for run in runners.values():
                run(warm)  # compiles the engine's prefill and decode buckets of these shapes; warms torch
            best = {}
            for _ in range(args.repeats):  # interleaved, so a noisy neighbour slows all of them alike
                for name, run in runners.items():
                    res, other = quiet_run(lambda: run(prompts), args.wait_quiet)
                    if name not in best or res[0] < best[name][0]:
                        best[name] = (*res, other)
            print(f"batch {b}")
            for name, (wall, _, ttft, tbt, other) in best.items():
                print(f"  {name:9s}: {wall:7.3f} s  {b * n / wall:8.1f} tok/s  TTFT {ttft * 1e3:7.1f} ms  "
                      f"TBT median {tbt * 1e3:6.2f} ms  (other processes {other:4.0%} of the CPUs)")
            ours = best["engine"][1]
            for name, model in hf.items():
                print(agreement(f"HF {name}", model, prompts, ours, best[f"HF {name}"][1]))
            prof, other = quiet_run(lambda: engine_profile(llm, prompts, n, args.repeats), args.wait_quiet)
            print(describe_profile(prof, other) + "\n")
            fastest = min(hf, key=lambda k: best[f"HF {k}"][0])
            rows.append((b, b * n / best["engine"][0], b * n / best[f"HF {fastest}"][0], fastest))

    print(f"decode throughput, tokens/s = batch * {n} / wall time (prefill of {plen}-token prompts included); "
          f"HF column is the faster of eager and sdpa")
    print(f"{'batch':>5}  {'engine tok/s':>12}  {'HF tok/s':>9}  {'HF attn':>7}  {'engine/HF':>9}")
    for b, e, h, name in rows:
        print(f"{b:>5}  {e:>12.1f}  {h:>9.1f}  {name:>7}  {e / h:>9.2f}")
