"""Simulate a deployment: `python -m mnemojax.sim --qps 0.5 --long_fraction 0.05 --scheduler_policy ilrs`.

Intentionally short: the logic is in `mnemojax.simulator`. Prints a summary table; `--output_json` writes the
metrics and per-request records, `--plot_dir` the TTFT CDF and active-requests plots, `--save_trace` the trace.
"""
from __future__ import annotations

import dataclasses

from absl import app, flags

from mnemojax import simulator
from mnemojax.cli import define_flags, from_flags


@dataclasses.dataclass(frozen=True)
class TraceConfig:
    """The workload: a trace file, or a synthetic one from these fields."""

    trace: str | None = None
    """JSONL trace (arrival_time, prompt_tokens, output_tokens per line); default: a synthetic trace."""
    qps: float = 0.5
    """Synthetic trace: Poisson arrival rate."""
    duration_s: float = 600.0
    """Synthetic trace: seconds of arrivals."""
    long_fraction: float = 0.0
    """Synthetic trace: fraction of long requests."""
    long_min_tokens: int = 131072
    """Synthetic trace: shortest long prompt."""
    long_max_tokens: int = 1048576
    """Synthetic trace: longest long prompt."""
    seed: int = 0
    """Synthetic trace seed."""
    save_trace: str | None = None
    """Write the trace used to this JSONL file."""
    output_json: str | None = None
    """Write metrics and per-request records here."""
    plot_dir: str | None = None
    """Write ttft_cdf.png and active_requests.png here."""


def main(argv):
    del argv
    t = from_flags(TraceConfig)
    if t.trace:
        trace = simulator.load_trace(t.trace)
    else:
        trace = simulator.synthetic_trace(t.qps, t.duration_s, long_fraction=t.long_fraction,
                                          long_min_tokens=t.long_min_tokens, long_max_tokens=t.long_max_tokens,
                                          seed=t.seed)
    if t.save_trace:
        simulator.save_trace(trace, t.save_trace)
    config = from_flags(simulator.SimConfig)
    result = simulator.simulate(config, trace, plot_dir=t.plot_dir)
    m = result.metrics
    print(f"{config.model} on {config.hardware}, tp={config.tp} spp={config.spp} kvp={config.kvp}, "
          f"{len(trace)} requests ({m['short']['requests']} short, {m['long']['requests']} long), "
          f"{m['kv_pages_per_rank']} KV pages per rank")
    print(simulator.summary_table({config.scheduler_policy: m}))
    print(f"simulated {m['simulated_s']:.1f} s in {m['steps']} steps, {m['cpu_s']:.1f} CPU s; "
          f"stop: {m['stop_reason']}; preemptions {m['preemptions']}; TTFT/TBT in seconds/ms")
    if t.output_json:
        result.to_json(t.output_json)


def run():
    for cls in (simulator.SimConfig, TraceConfig):
        define_flags(cls)
    app.run(main)


if __name__ == "__main__":
    run()
