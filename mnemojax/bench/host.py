"""Host time per engine step, split by part, against the device's (issue 12, item 4).

The engine's step is: `Scheduler.schedule()` (plan), `Executor._host_args` (the plan as numpy arrays, the
pipeline stacked), `Executor.put` (arrays onto the mesh), `Executor.run` (dispatching the jitted step),
`Executor.fetch` (`wait`: until its results are ready; `fetch`: their transfer to the host),
`Scheduler.update_from_output`, then `outputs`: the rest of the engine's collect (the results gathered per chunk,
detokenizing, the step's `RequestOutput`s; timed as `LLMEngine._collect` less its wait, fetch and update).
Synchronous (`async_scheduling=False`), `run` waits for its own step: all the other parts are host work the device
waits for. With async scheduling the engine launches step N+1 before it waits for step N, so the host's parts of
N+1 run while the device runs N: they are hidden as long as they take less than the device's step.

The workload: the tiny model, `--requests` requests (default 256) decoding together after short prompts, with a
page table as wide as `--max_model_len` tokens (default 1,048,576: 65,536 columns of 16-token pages per
sequence, as a 1M-context deployment has whatever the requests' actual lengths), and the same at 8,192 for
comparison. Each part is timed by wrapping the engine's own methods; `--steps` decode steps after a warm-up. The
requests' `--output_kind` (default delta, what the server streams; final_only is what `LLM.generate` asks for;
cumulative copies each request's lists in every step's output).

    python scripts/bench_host.py [--requests 256] [--steps 20] [--max_model_len 1048576] [--freeze_gc]
                                 [--output_kind delta|cumulative|final_only]

Prints, per page-table width and mode: ms per step of each part, the host parts' total, the step's wall time, and
how much of the host work is hidden behind the device: (host + device - step) / host, with the device's time
per step taken from the synchronous run of the same width (its `run`, which waits for the step); then the ms
spent in full garbage collections during all the measured steps (`--freeze_gc`: after the warm-up,
`gc.freeze()` the start-up objects as `python -m mnemojax.serve` does, so a full collection walks only what
serving created since). Then the ms one step's output of one request takes with a prompt as long as the table
(cumulative copies the prompt's ids each time; delta holds what the step added; final_only builds none). Last,
the server's case: `--requests` DELTA streams through `AsyncLLM`, and the ms per step its engine thread spends
handing the outputs to the callers' event loop.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time
from collections import defaultdict

import numpy as np

from mnemojax.bench import print_header

PARTS = ("schedule", "arrays", "put", "run", "wait", "fetch", "update", "outputs")
# the host's parts, besides dispatching the step (`run` when async)
HOST_PARTS = ("schedule", "arrays", "put", "fetch", "update", "outputs")


def _timed(log: dict, name: str, fn, inner: list | None = None):
    """`fn`, each call's seconds appended to `log[name]` (and added to `inner[0]` when given)."""
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            log[name].append(time.perf_counter() - t)
            if inner is not None:
                inner[0] += log[name][-1]
    return wrapper


def _timed_less(log: dict, name: str, fn, inner: list):
    """`fn`, each call's seconds less what the `inner`-timed calls inside it took appended to `log[name]`."""
    def wrapper(*args, **kwargs):
        inner[0] = 0.0
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            log[name].append(time.perf_counter() - t - inner[0])
    return wrapper


def _engine(requests: int, max_model_len: int, page_size: int, prompt_len: int, async_scheduling: bool = False):
    """The tiny model's engine for `requests` requests of `prompt_len`-token prompts (one prefill step), its page
    table `max_model_len` tokens wide (past the preset's 8K positions: only the table grows)."""
    from mnemojax.engine.llm_engine import EngineConfig, LLMEngine
    from mnemojax.engine.loader import load

    config = EngineConfig(model="tiny", page_size=page_size, max_num_seqs=requests,
                          max_num_batched_tokens=max(requests * prompt_len, 16), chunk_size=prompt_len,
                          num_pages=requests * 4 + 2, max_model_len=min(max_model_len, 8192), precompile=False,
                          async_scheduling=async_scheduling)
    loaded = load(config)
    if max_model_len > loaded.max_model_len:  # the tiny preset stops at 8K positions; only the table's width grows
        mc = dataclasses.replace(loaded.model_config, max_position_embeddings=max_model_len)
        loaded = dataclasses.replace(loaded, model_config=mc, max_model_len=max_model_len)
    return LLMEngine(config, loaded)


def long_prompt_output_ms(prompt_len: int, generated: int = 64, repeats: int = 20) -> dict[str, float]:
    """Ms to build one step's output (`LLMEngine.output`) of a request with a `prompt_len`-token prompt and
    `generated` tokens so far, per output kind that builds one in every step (a FINAL_ONLY request gets none before
    its end). The request is made by hand, never scheduled: an output reads the request's lists, not the device."""
    from mnemojax.scheduling.request import Request
    from mnemojax.scheduling.sampling_params import RequestOutputKind, SamplingParams

    engine = _engine(1, 8192, 16, 8)
    prompt = (np.arange(prompt_len) % 256).tolist()
    out = {}
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        req = Request(f"long-{kind.value}", prompt, SamplingParams(max_tokens=generated + repeats, output_kind=kind),
                      arrival_time=0.0, seed=0)
        req.output_token_ids.extend(range(generated))
        req.token_times.extend([0.0] * generated)
        engine.output(req)  # a DELTA request's first output holds the prompt; the later ones what a step added
        times = []
        for i in range(repeats):
            req.output_token_ids.append(i % 256)
            req.token_times.append(0.0)
            t = time.perf_counter()
            engine.output(req)
            times.append(time.perf_counter() - t)
        out[kind.value] = statistics.median(times) * 1e3
    return out


def delivery_ms(requests: int, tokens: int = 24) -> float:
    """Ms per engine step that `AsyncLLM`'s engine thread spends handing outputs to their callers (`_send`, and
    `_deliver` where it exists), mean over the decode steps of `requests` DELTA streams of `tokens` tokens each (the
    server's case: every request's output every step), after a warm-up run of the same."""
    import asyncio

    from mnemojax.engine.async_llm import AsyncLLM
    from mnemojax.scheduling.sampling_params import RequestOutputKind, SamplingParams

    prompt_len = 8
    llm = AsyncLLM(engine=_engine(requests, 8192, 16, prompt_len))
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    spent, steps = [0.0], [0]
    for name in ("_send", "_deliver"):
        if hasattr(llm, name):
            setattr(llm, name, _timed(defaultdict(list), name, getattr(llm, name), spent))
    step = llm.engine.step

    def counted():
        steps[0] += 1
        return step()

    llm.engine.step = counted

    async def streams():
        async def one(i):
            async for _ in llm.generate([i % 200 + 1] * prompt_len, params):
                pass
        await asyncio.gather(*(one(i) for i in range(requests)))

    try:
        asyncio.run(streams())  # warm-up: compiles
        spent[0], steps[0] = 0.0, 0
        asyncio.run(streams())
    finally:
        llm.shutdown()
    return spent[0] / max(steps[0], 1) * 1e3


def _waited_fetch(log: dict, fetch, inner: list):
    """`Executor.fetch` timed in two parts: `wait` for the step's results to be ready, then `fetch` them to the host
    (the transfers); both added to `inner[0]`."""
    import jax

    def wrapper(out):
        t0 = time.perf_counter()
        jax.block_until_ready(out)
        t1 = time.perf_counter()
        try:
            return fetch(out)
        finally:
            t2 = time.perf_counter()
            log["wait"].append(t1 - t0)
            log["fetch"].append(t2 - t1)
            inner[0] += t2 - t0
    return wrapper


def measure(requests: int, steps: int, max_model_len: int, page_size: int = 16,
            async_scheduling: bool = False, freeze_gc: bool = False, output_kind: str = "delta",
            logit_bias: bool = False, bad_words: bool = False) -> dict[str, float]:
    """Median ms per decode step of each part and of `step` (the whole `LLMEngine.step`); `host`: the host parts
    (with the dispatch in `run` when async, whose `run` does not wait); `full_gc`: ms in full (generation 2)
    garbage collections during all the measured steps together. `freeze_gc`: the server's
    `freeze_startup_objects()` after the warm-up. `output_kind`: a `RequestOutputKind` value, the requests'.
    `logit_bias`: every request fills its logits row's 16 bias slots. `bad_words`: every request bans 8 sequences of
    two tokens, which the host checks in every step (with async scheduling each is then a conditional slot)."""
    from mnemojax.engine.llm_engine import freeze_startup_objects
    from mnemojax.scheduling.sampling_params import RequestOutputKind, SamplingParams

    prompt_len = 8
    engine = _engine(requests, max_model_len, page_size, prompt_len, async_scheduling)
    log: dict[str, list[float]] = defaultdict(list)
    ex, sched = engine.executor, engine.scheduler
    sched.schedule = _timed(log, "schedule", sched.schedule)
    inside_collect = [0.0]  # what a collect spent waiting, fetching and in the scheduler's update
    sched.update_from_output = _timed(log, "update", sched.update_from_output, inside_collect)
    ex._host_args = _timed(log, "arrays", ex._host_args)
    ex.put = _timed(log, "put", ex.put)
    ex.run = _timed(log, "run", ex.run)
    ex.fetch = _waited_fetch(log, ex.fetch, inside_collect)  # inside `run` when synchronous, else in the collect
    engine._collect = _timed_less(log, "outputs", engine._collect, inside_collect)
    rng = np.random.default_rng(0)
    # --logit_bias: every request fills its row's slots (15 biases, and until the run's end min_tokens's EOS ban)
    bias = dict(min_tokens=steps + 8, logit_bias={t: 0.5 for t in range(1, 16)}) if logit_bias else {}
    if bad_words:  # --bad_words: 8 two-token sequences each
        bias["bad_words_token_ids"] = [[t, t + 1] for t in range(300, 316, 2)]
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True,
                            output_kind=RequestOutputKind(output_kind), **bias)
    for _ in range(requests):
        engine.add_request(rng.integers(0, 256, prompt_len).tolist(), params)
    for _ in range(4):  # prefill, first decodes, compiles
        engine.step()
    if freeze_gc:
        freeze_startup_objects()
    log.clear()
    walls = []
    full_gc = _FullCollections()
    gc.callbacks.append(full_gc)
    try:
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t)
    finally:
        gc.callbacks.remove(full_gc)
    out = {p: statistics.median(log[p]) * 1e3 if log[p] else 0.0 for p in PARTS}
    out["step"] = statistics.median(walls) * 1e3
    out["full_gc"] = full_gc.seconds * 1e3
    out["host"] = sum(out[p] for p in HOST_PARTS) + (out["run"] if async_scheduling else 0.0)
    while engine.has_unfinished():
        engine.step()
    return out


class _FullCollections:
    """A `gc.callbacks` entry that adds up the seconds spent in full (generation 2) collections."""

    def __init__(self):
        self.seconds, self._start = 0.0, None

    def __call__(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self._start = None


def hidden_fraction(m: dict[str, float], device_ms: float) -> float:
    """How much of the host's time per step overlapped the device's `device_ms`: (host + device - step) / host,
    in [0, 1] (0 when the step takes host + device, as when they run one after another)."""
    return min(1.0, max(0.0, m["host"] + device_ms - m["step"]) / m["host"]) if m["host"] > 0 else 0.0


def table(rows: dict[tuple[int, bool], dict[str, float]], requests: int, output_kind: str = "delta") -> str:
    head = (f"{'table width':>22} {'mode':>6} " + " ".join(f"{p:>8}" for p in PARTS)
            + f" {'host':>8} {'step':>8} {'hidden':>7} {'full_gc':>8}")
    lines = [f"ms per decode step, {requests} requests decoding ({output_kind} outputs; median); device time per "
             "step = the sync run's 'run'", head]
    for (width, async_), m in rows.items():
        hidden = hidden_fraction(m, rows[(width, False)]["run"])
        lines.append(f"{width:>15,} tokens {'async' if async_ else 'sync':>6} "
                     + " ".join(f"{m[p]:>8.2f}" for p in PARTS) + f" {m['host']:>8.2f} {m['step']:>8.2f} "
                     f"{hidden:>6.0%} {m['full_gc']:>8.2f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--max_model_len", type=int, default=1 << 20)
    p.add_argument("--freeze_gc", action="store_true",
                   help="freeze the start-up objects out of the garbage collector's reach, as the server does")
    p.add_argument("--output_kind", default="delta", choices=("delta", "cumulative", "final_only"),
                   help="the requests' output kind (delta: the server's; final_only: LLM.generate's)")
    p.add_argument("--logit_bias", action="store_true",
                   help="every request biases 16 tokens (15 logit_bias entries and min_tokens' EOS ban)")
    p.add_argument("--bad_words", action="store_true",
                   help="every request bans 8 sequences of two tokens (bad_words_token_ids)")
    args = p.parse_args(argv)
    print_header(argv)
    widths = sorted({8192, args.max_model_len})
    rows = {(w, a): measure(args.requests, args.steps, w, async_scheduling=a, freeze_gc=args.freeze_gc,
                            output_kind=args.output_kind, logit_bias=args.logit_bias, bad_words=args.bad_words)
            for w in widths for a in (False, True)}
    print(table(rows, args.requests, args.output_kind))
    n = args.max_model_len - 128
    lp = long_prompt_output_ms(n)
    print(f"one request's output per step with a {n:,}-token prompt (ms, median of 20): "
          + ", ".join(f"{k} {v:.3f}" for k, v in lp.items()) + ", final_only: none before the end (LLM.generate's)")
    print(f"AsyncLLM (the server's engine): {args.requests} DELTA streams, the engine thread's ms per step handing "
          f"outputs to the callers' event loop: {delivery_ms(args.requests):.3f}")
    print("sync: 'run' dispatches the step and waits for it (its 'wait' inside), the device's time as the host sees "
          "it, and the host parts run while the device idles. async: 'run' only dispatches, 'wait' is what is left "
          "of the device's step after the host's work for the next one; the step is max(host, device) when hidden.")
