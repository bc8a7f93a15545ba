"""Simulate a deployment: `python -m mnemojax.sim --qps 0.5 --long_fraction 0.05 --scheduler_policy ilrs`.

Intentionally short: the logic is in `mnemojax.sim.simulator`. Prints a summary table; `--output_json` writes the
metrics and per-request records, `--plot_dir` the TTFT CDF and active-requests plots, `--save_trace` the trace.
"""
from __future__ import annotations

import dataclasses


from mnemojax.sim import simulator
from mnemojax.cli import define_flags, from_flags, no_arguments, output_path, run_command, usage_errors


@dataclasses.dataclass(frozen=True)
class Outputs:
    """What to write besides the summary table (the workload's flags are `simulator.Workload`'s, the planner's)."""

    save_trace: str | None = None
    """Write the trace used to this JSONL file."""
    output_json: str | None = None
    """Write metrics and per-request records here."""
    plot_dir: str | None = None
    """Write ttft_cdf.png and active_requests.png here."""


def main(argv):
    no_arguments(argv)
    with usage_errors():
        t = from_flags(Outputs)
        output_path("save_trace", t.save_trace)  # before the run, not after it
        output_path("output_json", t.output_json)
        output_path("plot_dir", t.plot_dir, directory=True)
        trace = from_flags(simulator.Workload).requests()
        config = from_flags(simulator.SimConfig)
        sim = simulator.Simulator(config, trace)  # checks the pages and the KV split
    if t.save_trace:
        simulator.save_trace(trace, t.save_trace)
    result = sim.run()
    if t.plot_dir is not None:
        simulator.plot(result, t.plot_dir)
    m = result.metrics
    print(f"{config.model} on {config.hardware}, tp={config.tp} spp={config.spp} kvp={config.kvp}, "
          f"{len(trace)} requests ({m['short']['requests']} short, {m['long']['requests']} long), "
          f"{m['kv_pages_per_rank']} KV pages per rank")
    print(simulator.summary_table({config.scheduler_policy: m}))
    print(f"simulated {m['simulated_s']:.1f} s in {m['steps']} steps, {m['cpu_s']:.1f} CPU s; "
          f"stop: {m['stop_reason']}; preemptions {m['preemptions']}; TTFT/TBT in seconds/ms"
          + (f"; {m['not_arrived']} requests arrive after the horizon" if m["not_arrived"] else ""))
    if t.output_json:
        result.to_json(t.output_json)


def run():
    define_flags(simulator.SimConfig)
    define_flags(simulator.Workload, skip=("long_threshold_tokens",))  # SimConfig's flag serves both
    define_flags(Outputs)
    run_command(main)


if __name__ == "__main__":
    run()
