"""Host time per engine step, split by part, against the device's (issue 12, item 4).

The engine's step is: `Scheduler.schedule()` (plan), `Executor._host_args` (the plan as numpy arrays, the
pipeline stacked), `Executor.put` (arrays onto the mesh), `Executor.run` (the jitted step, then `device_get` of
its results: the device's time as the host sees it), and `Scheduler.update_from_output` plus detokenizing and
outputs. Everything but `run` is host work the device waits for while the host loop does not overlap them.

The workload: the tiny model, `--requests` requests (default 256) decoding together after short prompts, with a
page table as wide as `--max_model_len` tokens (default 1,048,576: 65,536 columns of 16-token pages per
sequence, as a 1M-context deployment has whatever the requests' actual lengths), and the same at 8,192 for
comparison. Each part is timed by wrapping the engine's own methods; `--steps` decode steps after a warm-up.

    python scripts/bench_host.py [--requests 256] [--steps 20] [--max_model_len 1048576]

Prints, per page-table width: ms per step of each part, the host total, the device (run) time, and how much of
the host work is hidden behind the device (none while the loop runs its parts one after another).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections import defaultdict

import numpy as np

from mnemojax.bench import print_header

PARTS = ("schedule", "arrays", "put", "run", "update")


def _timed(log: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            log[name].append(time.perf_counter() - t)
    return wrapper


def measure(requests: int, steps: int, max_model_len: int, page_size: int = 16) -> dict[str, float]:
    """Median ms per decode step of each part, `host` (all but run), `step` (the whole `LLMEngine.step`)."""
    from mnemojax.engine.llm_engine import EngineConfig, LLMEngine
    from mnemojax.engine.loader import load
    from mnemojax.scheduling.sampling_params import SamplingParams

    prompt_len = 8
    config = EngineConfig(model="tiny", page_size=page_size, max_num_seqs=requests,
                          max_num_batched_tokens=max(requests * prompt_len, 16), chunk_size=prompt_len,
                          num_pages=requests * 4 + 2, max_model_len=min(max_model_len, 8192), precompile=False)
    loaded = load(config)
    if max_model_len > loaded.max_model_len:  # the tiny preset stops at 8K positions; only the table's width grows
        mc = dataclasses.replace(loaded.model_config, max_position_embeddings=max_model_len)
        loaded = dataclasses.replace(loaded, model_config=mc, max_model_len=max_model_len)
    engine = LLMEngine(config, loaded)
    log: dict[str, list[float]] = defaultdict(list)
    ex, sched = engine.executor, engine.scheduler
    sched.schedule = _timed(log, "schedule", sched.schedule)
    sched.update_from_output = _timed(log, "update", sched.update_from_output)
    ex._host_args = _timed(log, "arrays", ex._host_args)
    ex.put = _timed(log, "put", ex.put)
    ex.run = _timed(log, "run", ex.run)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for _ in range(requests):
        engine.add_request(rng.integers(0, 256, prompt_len).tolist(), params)
    for _ in range(4):  # prefill, first decodes, compiles
        engine.step()
    log.clear()
    walls = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
    out = {p: statistics.median(log[p]) * 1e3 for p in PARTS}
    out["step"] = statistics.median(walls) * 1e3
    out["host"] = out["step"] - out["run"]
    while engine.has_unfinished():
        engine.step()
    return out


def hidden_fraction(m: dict[str, float]) -> float:
    """How much of the host parts' time overlapped the device's: the parts' times beyond the step's wall time, as
    a fraction of the host parts (0 when they run one after another: they then add up to at most the step)."""
    host_parts = sum(m[p] for p in PARTS if p != "run")
    return min(1.0, max(0.0, sum(m[p] for p in PARTS) - m["step"]) / host_parts) if host_parts else 0.0


def table(rows: dict[int, dict[str, float]], requests: int) -> str:
    head = f"{'table width':>22} " + " ".join(f"{p:>9}" for p in PARTS) + f" {'host':>9} {'step':>9} {'hidden':>7}"
    lines = [f"ms per decode step, {requests} requests decoding (median)", head]
    for width, m in rows.items():
        hidden = hidden_fraction(m)
        lines.append(f"{width:>15,} tokens " + " ".join(f"{m[p]:>9.2f}" for p in PARTS)
                     + f" {m['host']:>9.2f} {m['step']:>9.2f} {hidden:>6.0%}")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--max_model_len", type=int, default=1 << 20)
    args = p.parse_args(argv)
    print_header(argv)
    widths = sorted({8192, args.max_model_len})
    rows = {w: measure(args.requests, args.steps, w) for w in widths}
    print(table(rows, args.requests))
    print("'run' is the jitted step and the fetch of its results (the device's time as the host sees it); the rest "
          "is host work the device waits for, since the host loop does not yet overlap the device.")
