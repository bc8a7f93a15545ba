"""The planner's prediction against the real engine, on fake CPU devices (`scripts/validate_plan.py`).

    python scripts/validate_plan.py [--layouts 1,1,1:2,1,1:1,1,2:1,2,1] [--num_requests 60] [--rate 3]
        [--wait_quiet 600] [--predictor_profile P] [--save_predictor_profile PATH] [--output_json out.json]

For each layout `tp,spp,kvp` the planner plans the tiny model (float32) on the `cpu` hardware preset with the
shipped CPU profile, over one trace, with that layout alone in its search space; its candidate's serve command
line is read by the server's own flag definitions (`mnemojax.serving.server.define_serve_flags`) into the engine's
config. A child process, spawned with exactly the layout's number of fake CPU devices (`JAX_NUM_CPU_DEVICES`),
builds that `LLMEngine`, runs one step of every shape bucket (so that nothing compiles later), and replays the
trace in real time. A request is added when the wall clock reaches its arrival time and
stepped with the others (the simulator admits arrivals between steps the same way); its TTFT counts from that
scheduled arrival time. Prompts are random byte tokens; every request generates exactly its output tokens
(`ignore_eos`).

Reported for each layout: TTFT P50 / P90 / P99 of all, short and long requests and TBT P50 / P90 / P99,
predicted (the planner's simulation) and measured, with the relative error, and other processes' share of
the CPUs while the measured pass ran (this machine is shared; another busy process slows every step).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import shlex
import sys
import time
from collections import deque
from collections.abc import Sequence

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before jax is imported (only the child processes import it)

import numpy as np  # noqa: E402

from mnemojax.sim import planner  # noqa: E402
from mnemojax.bench.profile_predictor import OtherLoad, hardware_lines, wait_for_quiet  # noqa: E402
from mnemojax.bench.serving import LengthMix, synthetic_trace  # noqa: E402
from mnemojax.sim.simulator import TraceRequest  # noqa: E402

LONG_THRESHOLD = 2048
"""Prompts longer than this are long (the trace's long prompts have 3000 tokens, its short ones at most 1000)."""


def validation_trace(num_requests: int, rate: float, seed: int = 0) -> list[TraceRequest]:
    """Poisson arrivals; short prompts lognormal around 200 tokens (at most 1000), 10% long prompts of 3000
    tokens; 32 output tokens each."""
    mix = LengthMix(short_prompt_len=200, short_prompt_max=1000, long_fraction=0.1, long_prompt_len=3000,
                    output_len=32, output_max=32)
    return synthetic_trace(num_requests, rate, mix=mix, seed=seed)


def plan_layout(tp: int, spp: int, kvp: int, trace: Sequence[TraceRequest], *, chunk_size: int = 256,
                max_num_batched_tokens: int = 512, max_num_seqs: int = 16, target_batch_time_ms: float = 50.0,
                policy: str = "ilrs", predictor_profile: str | None = None) -> planner.PlanResult:
    """The planner's plan of one layout (its only candidate) for the tiny model on CPU devices; the predictor
    profile (default: the shipped `cpu`) prices the simulation and goes into the serve command, so the engine's
    scheduler uses the same one."""
    max_model_len = -(-max(r.prompt_tokens + r.output_tokens for r in trace) // 16) * 16
    devices = tp * spp * kvp
    cfg = planner.PlanConfig(
        model="tiny", dtype="float32", predictor_profile=predictor_profile,
        cluster=planner.Cluster(hardware="cpu", num_gpus=devices, gpus_per_host=devices),
        workload=planner.Workload(long_threshold_tokens=LONG_THRESHOLD),
        slo=planner.SLO(ttft_short_s=1.0, ttft_long_s=5.0, tbt_p99_ms=200.0),
        space=planner.SearchSpace(tp=str(tp), spp=str(spp), kvp=str(kvp), replicas="1",
                                  chunk_size=str(chunk_size), target_batch_time_ms=str(target_batch_time_ms),
                                  scheduler_policy=policy, max_num_batched_tokens=str(max_num_batched_tokens),
                                  max_num_seqs=max_num_seqs, num_pages=1 + 4 * (max_model_len // 16)),
        workers=1, progress=False, capacity_scales="", top=1)
    result = planner.plan(cfg, trace=trace)
    if result.best is None:
        raise RuntimeError(f"layout tp={tp} spp={spp} kvp={kvp}: {[o.reason for o in result.outcomes]}")
    return result


# ------------------------------------------------------------------------------------------------ the engine
def engine_config(argv: Sequence[str]):
    """The `EngineConfig` that `python -m mnemojax.serve <argv>` would run."""
    from absl import flags

    from mnemojax.cli import from_flags
    from mnemojax.engine.llm_engine import EngineConfig
    from mnemojax.serving.server import define_serve_flags

    fv = flags.FlagValues()
    define_serve_flags(fv)
    fv(["serve", *argv])
    return from_flags(EngineConfig, fv)


def replay(engine, trace: Sequence[TraceRequest], long_threshold: int, seed: int = 0) -> list[planner.Served]:
    """Replays `trace` in real time on `engine`; the requests as served (TTFT from their scheduled arrival)."""
    from mnemojax.scheduling.sampling_params import SamplingParams

    rng = np.random.default_rng(seed)
    pending = deque(sorted(trace, key=lambda r: r.arrival_time))
    t0 = time.perf_counter() - pending[0].arrival_time
    sent: list[tuple[str, TraceRequest]] = []
    while pending or engine.has_unfinished():
        now = time.perf_counter()
        while pending and t0 + pending[0].arrival_time <= now:
            r = pending.popleft()
            prompt = rng.integers(0, 256, r.prompt_tokens).tolist()
            rid = engine.add_request(prompt, SamplingParams(max_tokens=r.output_tokens, ignore_eos=True,
                                                            temperature=0.0), arrival_time=t0 + r.arrival_time)
            sent.append((rid, r))
        if engine.has_unfinished():
            engine.step()
        elif pending:
            time.sleep(max(0.0, t0 + pending[0].arrival_time - time.perf_counter()))
    out = []
    for rid, r in sent:
        m = engine.pop_finished(rid).metrics
        out.append(planner.Served(r.prompt_tokens > long_threshold, m.first_token_time - (t0 + r.arrival_time),
                                  True, np.diff(np.asarray(m.token_times, dtype=float))))
    return out


def measure(argv: Sequence[str], trace: Sequence[TraceRequest], long_threshold: int, wait_quiet_s: float,
            save_profile: str | None = None) -> dict:
    """Builds the engine of a serve command line, compiles every shape bucket, then replays the trace, measured;
    with `save_profile`, writes the predictor profile the engine calibrated online while serving it. Runs in a
    child process with the layout's fake devices."""
    import jax

    from mnemojax.engine.llm_engine import LLMEngine

    config = dataclasses.replace(engine_config(argv), precompile=False)  # compiled below, timed on its own
    t = time.perf_counter()
    engine = LLMEngine(config)
    built = time.perf_counter() - t
    warm = engine.precompile()
    if wait_quiet_s:
        wait_for_quiet(wait_quiet_s, window_s=5.0, log=lambda s: print(s, file=sys.stderr))
    t = time.perf_counter()
    with OtherLoad() as load:
        served = replay(engine, trace, long_threshold, seed=2)
    if save_profile:
        engine.save_predictor_profile(save_profile)
    return {"served": [(s.long, s.ttft, s.gaps.tolist()) for s in served], "other_cpu": load.fraction,
            "devices": len(jax.devices()), "build_s": built, "warm_up_s": warm,
            "measured_pass_s": time.perf_counter() - t}


def _measure_in_child(argv: Sequence[str], trace: Sequence[TraceRequest], devices: int, long_threshold: int,
                      wait_quiet_s: float, save_profile: str | None = None) -> dict:
    """`measure` in a spawned process that sees exactly `devices` CPU devices."""
    saved = dict(os.environ)
    os.environ["JAX_NUM_CPU_DEVICES"] = str(devices)
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count"))
    os.environ["XLA_FLAGS"] = flags
    try:
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            return pool.apply(measure, (list(argv), list(trace), long_threshold, wait_quiet_s, save_profile))
    finally:
        os.environ.clear()
        os.environ.update(saved)


# ------------------------------------------------------------------------------------------------ comparison
def compare(predicted: dict, measured: dict) -> list[tuple[str, float | None, float | None, float | None]]:
    """(metric, predicted, measured, predicted / measured - 1) for every percentile both have."""
    rows = []
    for k in predicted:
        p, m = predicted[k], measured.get(k)
        rows.append((k, p, m, None if p is None or not m else p / m - 1))
    return rows


def validate_layout(tp: int, spp: int, kvp: int, trace: Sequence[TraceRequest], wait_quiet_s: float = 0.0,
                    save_profile: str | None = None, **plan_kw) -> dict:
    """Plans, measures and compares one layout; returns a JSON-ready record."""
    result = plan_layout(tp, spp, kvp, trace, **plan_kw)
    best = result.best
    cmd = result.serve_command(best)
    predicted_served, _ = planner.served_requests(best.candidate, result.setup)
    predicted = planner.latency_percentiles(predicted_served)
    m = _measure_in_child(cmd.argv, trace, tp * spp * kvp, LONG_THRESHOLD, wait_quiet_s, save_profile)
    measured_served = [planner.Served(long, ttft, True, np.asarray(gaps)) for long, ttft, gaps in m.pop("served")]
    measured = planner.latency_percentiles(measured_served)
    return {"layout": {"tp": tp, "spp": spp, "kvp": kvp}, "candidate": best.candidate.label,
            "serve_command": cmd.shell(), "predicted": predicted, "measured": measured,
            "rows": compare(predicted, measured), **m}


def format_layout(rec: dict) -> str:
    lay = rec["layout"]
    lines = [f"layout tp={lay['tp']} spp={lay['spp']} kvp={lay['kvp']} ({rec['devices']} fake CPU devices): "
             f"{rec['candidate']}; other processes used {rec['other_cpu']:.0%} of the CPUs during the measured pass",
             f"  {rec['serve_command']}",
             f"  {'metric':<18} {'predicted':>10} {'measured':>10} {'error':>8}"]
    for k, p, m, e in rec["rows"]:
        unit = 1e3 if k.endswith("_s") else 1.0  # TTFT in ms here, like TBT
        name = k[:-2] + "_ms" if k.endswith("_s") else k
        lines.append(f"  {name:<18} {_num(p, unit):>10} {_num(m, unit):>10} "
                     f"{'-' if e is None else f'{e:+.0%}':>8}")
    return "\n".join(lines)


def _num(x: float | None, scale: float) -> str:
    return "-" if x is None else f"{x * scale:.1f}"


def main(argv: Sequence[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", default="1,1,1:2,1,1:1,1,2:1,2,1",
                    help="colon-separated tp,spp,kvp layouts")
    ap.add_argument("--num_requests", type=int, default=60)
    ap.add_argument("--rate", type=float, default=3.0, help="Poisson arrival rate, requests/s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wait_quiet", type=float, default=0.0, metavar="SECONDS",
                    help="before each measured pass, wait up to this long for other processes to go quiet")
    ap.add_argument("--predictor_profile", default=None,
                    help="profile pricing the plan and the engine's scheduler (default: the shipped cpu profile)")
    ap.add_argument("--save_predictor_profile", default=None, metavar="PATH",
                    help="write the profile each layout's engine calibrated online while serving the trace (PATH, "
                         "with the layout before its extension when there are several), to give back as "
                         "--predictor_profile")
    ap.add_argument("--output_json", default=None)
    args = ap.parse_args(argv)
    print("command: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    cpu, _, system = hardware_lines()  # (the second line: this process's jax devices, not the children's)
    import jax

    print(f"{cpu}\njax {jax.__version__}; {system}")
    trace = validation_trace(args.num_requests, args.rate, args.seed)
    n_long = sum(r.prompt_tokens > LONG_THRESHOLD for r in trace)
    print(f"trace: {len(trace)} requests at {args.rate:g}/s ({n_long} long of 3000 tokens), 32 output tokens each; "
          f"tiny model, float32, predictor profile {args.predictor_profile or 'cpu (shipped)'}")
    records = []
    for spec in args.layouts.split(":"):
        tp, spp, kvp = (int(x) for x in spec.split(","))
        t = time.perf_counter()
        save = args.save_predictor_profile
        if save and ":" in args.layouts:
            root, ext = os.path.splitext(save)
            save = f"{root}-{tp}-{spp}-{kvp}{ext}"
        rec = validate_layout(tp, spp, kvp, trace, args.wait_quiet, save_profile=save,
                              predictor_profile=args.predictor_profile)
        rec["wall_s"] = time.perf_counter() - t
        records.append(rec)
        print(format_layout(rec), flush=True)
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump([dict(r, rows=[list(x) for x in r["rows"]]) for r in records], f, indent=1)
    return records


if __name__ == "__main__":
    main()
