"""Plan a deployment: `python -m mnemojax.plan --num_gpus 64 --qps 0.5 --long_fraction 0.05 --ttft_long_s 60`.

Intentionally short: the logic is in `mnemojax.sim.planner`. Searches the (tp, spp, kvp, replicas, KV split,
chunking, policy) candidates for the workload with the simulator, prints the ranked table, the serve command
lines of the best, and the infeasible candidates with their reasons; `--output_dir` writes plan.json,
pareto.png and capacity.png. Every field of `planner.PlanConfig` (and of its nested configs) is a flag; the
search-space flags (--tp, --spp, --kvp, --chunk_size, --scheduler_policy, ...) take comma-separated lists.
"""
from __future__ import annotations


from mnemojax.sim import planner
from mnemojax.cli import define_flags, from_flags, no_arguments, output_path, run_command, usage_errors


def main(argv):
    no_arguments(argv)
    with usage_errors():
        config = from_flags(planner.PlanConfig)
        output_path("output_dir", config.output_dir, directory=True)  # before the search, not after it
        setup = planner.resolve(config)  # the model, the trace and the deadlines
    result = planner.plan(config, setup=setup)
    print(result.report(), end="")
    if config.output_dir:
        print("wrote " + " ".join(result.save(config.output_dir)))


def run():
    define_flags(planner.PlanConfig)
    run_command(main)


if __name__ == "__main__":
    run()
