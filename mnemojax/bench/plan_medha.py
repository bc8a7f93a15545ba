"""The planner at paper scale, beside Medha's numbers (`scripts/plan_medha.py`).

    python scripts/plan_medha.py [--serving] [--pipeline_padding]

Every number is the planner's (`mnemojax.sim.planner.simulate`: the simulator with the runtime predictor as the
clock), on Llama-3 8B shapes and `h100` with the predictor's default efficiency factors (no H100 profile is
fitted), micro-batches priced at their own size (an ideal ragged executor, as Medha's; `--pipeline_padding`
prices this repository's executor instead, which pads every micro-batch in flight to the token budget).

1. **SPP scales prefill.** One 1M-token prompt alone, tp 8, spp 1 to 16 (8 to 128 GPUs), fixed 4K chunks (Medha
   Figures 8-9 use 4K chunks to show TTFT without adaptive chunking): TTFT and the scaling efficiency
   TTFT(1) / (spp x TTFT(spp)). Medha: "TTFT latency under 15 seconds" for 1M tokens on 128 H100s, "80%+ scaling
   efficiency".
2. **When KVP pays off, decode.** One request decoding alone at 1M, 4M and 10M tokens of context, tp 8, spp 4
   (Medha's Llama-3 8B 3D setting), kvp 1, 2, 4 with the context split evenly over the ranks: time per output
   token. Medha (Figure 11, section 3.5): from kvp 1 to 4 TPOT falls 1.7x at 4M and 2.5x at 10M; at 10M kvp 2
   cuts it by almost 40%, to about 30 tokens/s; "we use KVP only for longer context lengths".
3. **When KVP pays off, serving** (`--serving`; minutes). Medha section 5.3 compares, on equal devices, 2D (spp
   8) with 3D (spp 4, kvp 2) for Llama-3 70B on 64 H100s with 5% long requests of 2M tokens: similar TTFT, 3D's
   TPOT over 2x lower at 1.75 QPS. Here, to stay within minutes of simulation: Llama-3 8B on 32 H100s, 2D (spp 4)
   against 3D (spp 2, kvp 2), tp 8, ShareGPT4-like short requests with 5% long ones of 1M tokens, two loads,
   adaptive chunking to 50 ms: short and long requests' TTFT, and the long requests' time per output token.
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time

import numpy as np

from mnemojax.sim import planner
from mnemojax.sim.simulator import TraceRequest, synthetic_trace

M = 1_000_000  # the papers' "1M", "10M": decimal


def _config(space: planner.SearchSpace, num_gpus: int = 128, model: str = "llama3-8b") -> planner.PlanConfig:
    return planner.PlanConfig(model=model, cluster=planner.Cluster(hardware="h100", num_gpus=num_gpus),
                              slo=planner.SLO(ttft_short_s=2.0, ttft_long_s=600.0, tbt_p99_ms=100.0),
                              space=space, workers=1, progress=False, capacity_scales="",
                              max_simulated_s=1e7)  # no horizon: a 10M-token prefill takes a while


def _served(space: planner.SearchSpace, trace, num_gpus: int = 128) -> list[planner.Served]:
    """The requests of `trace` as the one candidate of `space` serves them."""
    setup = planner.resolve(_config(space, num_gpus), trace)
    [c] = planner.candidates(setup)
    why = planner.infeasibility(c, setup)
    if why is not None:
        raise ValueError(f"{c.label}: {why}")
    served, _ = planner.served_requests(c, setup)
    return served


def spp_prefill(padding: bool) -> list[tuple[int, float]]:
    """(spp, TTFT seconds) of one 1M-token prompt alone, tp 8, fixed 4K chunks."""
    out = []
    for spp in (1, 2, 4, 8, 16):
        space = planner.SearchSpace(tp="8", spp=str(spp), kvp="1", replicas="1", chunk_size="4096",
                                    max_num_batched_tokens="4096", target_batch_time_ms="none",
                                    pipeline_padding=padding)
        [s] = _served(space, [TraceRequest(0.0, M, 1)])
        out.append((spp, s.ttft))
    return out


def kvp_decode(padding: bool) -> list[tuple[int, int, float]]:
    """(context, kvp, seconds per output token) of one request decoding alone, tp 8, spp 4."""
    out = []
    for context in (M, 4 * M, 10 * M):
        for kvp in (1, 2, 4):
            split = "none" if kvp == 1 else "auto"  # auto: the request split evenly over the ranks
            space = planner.SearchSpace(tp="8", spp="4", kvp=str(kvp), replicas="1", chunk_size="16384",
                                        max_num_batched_tokens="16384", target_batch_time_ms="none",
                                        max_tokens_per_kvp_rank=split, pipeline_padding=padding)
            [s] = _served(space, [TraceRequest(0.0, context, 9)])  # 8 gaps
            out.append((context, kvp, float(s.gaps.mean())))
    return out


def serving_2d_vs_3d(padding: bool, rates=(0.5, 1.5), duration_s: float = 120.0) -> list[dict]:
    """Short and long requests' TTFT and the long requests' time per output token, 2D vs 3D on 32 GPUs."""
    rows = []
    for qps in rates:
        trace = synthetic_trace(qps, duration_s, long_fraction=0.05, long_min_tokens=M, long_max_tokens=M, seed=0)
        for name, spp, kvp in (("2D spp4", 4, 1), ("3D spp2 kvp2", 2, 2)):
            space = planner.SearchSpace(tp="8", spp=str(spp), kvp=str(kvp), replicas="1", chunk_size="4096",
                                        target_batch_time_ms="50", pipeline_padding=padding)
            t = time.process_time()
            served = _served(space, trace, num_gpus=32)
            short = [s.ttft for s in served if not s.long]
            long = [s for s in served if s.long]
            tpot = [float(s.gaps.mean()) for s in long if s.gaps.size]
            rows.append({"qps": qps, "layout": name, "requests": len(served), "long": len(long),
                         "short_ttft_p50": float(np.percentile(short, 50)),
                         "short_ttft_p99": float(np.percentile(short, 99)),
                         "long_ttft_p50": float(np.percentile([s.ttft for s in long], 50)) if long else None,
                         "long_tpot_p50": float(np.percentile(tpot, 50)) if tpot else None,
                         "long_tpot_p90": float(np.percentile(tpot, 90)) if tpot else None,
                         "cpu_s": time.process_time() - t})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--serving", action="store_true", help="also part 3 (minutes of simulation)")
    ap.add_argument("--pipeline_padding", action="store_true",
                    help="price spp > 1 as this repository's executor runs it (default: ragged, as Medha's)")
    args = ap.parse_args(argv)
    t0 = time.process_time()
    print("command: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    print(f"Llama-3 8B, h100 (predictor's default factors), micro-batches "
          f"{'padded to the token budget' if args.pipeline_padding else 'ragged (Medha)'}\n")

    print("1. TTFT of a 1M-token prompt alone, tp 8, 4K chunks (Medha Fig. 8-9)")
    print(f"{'spp':>4} {'GPUs':>5} {'TTFT s':>8} {'speed-up':>9} {'efficiency':>11}")
    rows = spp_prefill(args.pipeline_padding)
    base = rows[0][1]
    for spp, ttft in rows:
        print(f"{spp:>4} {8 * spp:>5} {ttft:>8.1f} {base / ttft:>9.2f} {base / ttft / spp:>11.0%}")
    print("   Medha: 'TTFT latency under 15 seconds' for 1M tokens on 128 H100s; '80%+ scaling efficiency'.\n")

    print("2. Time per output token of one request decoding alone, tp 8, spp 4 (Medha Fig. 11)")
    print(f"{'context':>8} {'kvp':>4} {'GPUs':>5} {'ms/token':>9} {'tokens/s':>9} {'vs kvp 1':>9}")
    rows = kvp_decode(args.pipeline_padding)
    for context, kvp, tpot in rows:
        one = next(t for c, k, t in rows if c == context and k == 1)
        print(f"{context // M:>7}M {kvp:>4} {32 * kvp:>5} {tpot * 1e3:>9.1f} {1 / tpot:>9.1f} {one / tpot:>8.2f}x")
    print("   Medha: kvp 1 -> 4 cuts TPOT 1.7x at 4M and 2.5x at 10M; at 10M kvp 2 cuts it by almost 40%, to "
          "~30 tokens/s.\n")

    if args.serving:
        print("3. 2D (spp 4) vs 3D (spp 2, kvp 2), tp 8, 32 H100s, 5% long requests of 1M tokens, 120 s of arrivals "
              "(Medha section 5.3, scaled down)")
        print(f"{'QPS':>5} {'layout':<13} {'req':>4} {'long':>5} {'short TTFT p50':>15} {'p99':>7} "
              f"{'long TTFT p50':>14} {'long TPOT p50 ms':>17} {'p90':>7} {'CPU s':>6}")
        for r in serving_2d_vs_3d(args.pipeline_padding):
            f = (lambda x, s=1.0, spec="7.2f": "-" if x is None else format(x * s, spec))
            print(f"{r['qps']:>5} {r['layout']:<13} {r['requests']:>4} {r['long']:>5} "
                  f"{f(r['short_ttft_p50'], spec='15.2f')} {f(r['short_ttft_p99'])} "
                  f"{f(r['long_ttft_p50'], spec='14.1f')} {f(r['long_tpot_p50'], 1e3, '17.1f')} "
                  f"{f(r['long_tpot_p90'], 1e3)} {r['cpu_s']:>6.0f}")
        print("   Medha (70B, 64 H100s, 2M-token requests): similar TTFT; 3D's TPOT over 2x lower at 1.75 QPS.")
    print(f"\n({time.process_time() - t0:.0f} CPU s)")


if __name__ == "__main__":
    main()
