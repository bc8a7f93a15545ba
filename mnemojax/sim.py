"""Simulate a deployment: `python -m mnemojax.sim --qps 0.5 --long_fraction 0.05 --policy ilrs`.

Intentionally short: the logic is in `mnemojax.simulator`. Prints a summary table; `--output_json` writes the
metrics and per-request records, `--plot_dir` the TTFT CDF and active-requests plots, `--save_trace` the trace.
"""
from __future__ import annotations

from absl import app, flags

from mnemojax import simulator
from mnemojax.predictor import HARDWARE
from mnemojax.scheduler import POLICIES

_MODEL = flags.DEFINE_string("model", "llama3-8b", "Model preset (models.config.PRESETS).")
_HARDWARE = flags.DEFINE_enum("hardware", "h100", sorted(HARDWARE), "Device preset of the runtime predictor.")
_TP = flags.DEFINE_integer("tp", 8, "Tensor parallelism.")
_SPP = flags.DEFINE_integer("spp", 1, "Sequence pipeline stages.")
_KVP = flags.DEFINE_integer("kvp", 1, "KV-cache parallel ranks.")
_POLICY = flags.DEFINE_enum("policy", "ilrs", list(POLICIES), "Prefill order.")
_TRACE = flags.DEFINE_string("trace", None, "JSONL trace (arrival_time, prompt_tokens, output_tokens per line); "
                             "default: a synthetic trace from the flags below.")
_QPS = flags.DEFINE_float("qps", 0.5, "Synthetic trace: Poisson arrival rate.")
_DURATION = flags.DEFINE_float("duration_s", 600.0, "Synthetic trace: seconds of arrivals.")
_LONG_FRACTION = flags.DEFINE_float("long_fraction", 0.0, "Synthetic trace: fraction of long requests.")
_LONG_MIN = flags.DEFINE_integer("long_min_tokens", 131072, "Synthetic trace: shortest long prompt.")
_LONG_MAX = flags.DEFINE_integer("long_max_tokens", 1048576, "Synthetic trace: longest long prompt.")
_SEED = flags.DEFINE_integer("seed", 0, "Synthetic trace seed.")
_SAVE_TRACE = flags.DEFINE_string("save_trace", None, "Write the trace used to this JSONL file.")
_TARGET = flags.DEFINE_float("target_batch_time_ms", 30.0, "Adaptive chunking target; 0: token budget only.")
_CHUNK = flags.DEFINE_integer("chunk_size", 4096, "Largest prefill chunk.")
_BUDGET = flags.DEFINE_integer("max_num_batched_tokens", 8192, "Token budget of a step, per KVP rank.")
_MAX_SEQS = flags.DEFINE_integer("max_num_seqs", 256, "Requests running at once.")
_PPB = flags.DEFINE_float("ppb_max_share", 0.5, "Prefill-prefill batching cap (0: off).")
_MAX_PER_RANK = flags.DEFINE_integer("max_tokens_per_kvp_rank", None, "Most tokens of one request per KVP rank.")
_NUM_PAGES = flags.DEFINE_integer("num_pages", None, "KV pages per KVP rank (default: from device memory).")
_SLO_MIN = flags.DEFINE_float("ttft_slo_min_s", 1.0, "TTFT deadline: this + ttft_slo_per_token_s x prompt.")
_SLO_PER_TOKEN = flags.DEFINE_float("ttft_slo_per_token_s", 1e-3, "TTFT deadline seconds per prompt token.")
_SLO_FACTOR = flags.DEFINE_float("ttft_slo_prefill_factor", 0.0,
                                 "TTFT deadline at least this x the predicted isolated prefill time.")
_PROFILE = flags.DEFINE_string("profile", None, "Predictor profile (name or path).")
_PAD = flags.DEFINE_bool("pipeline_padding", False, "Cost micro-batches at the executor's pipeline register size.")
_MAX_SIM = flags.DEFINE_float("max_simulated_s", None, "Stop at this simulated time.")
_OUTPUT_JSON = flags.DEFINE_string("output_json", None, "Write metrics and per-request records here.")
_PLOT_DIR = flags.DEFINE_string("plot_dir", None, "Write ttft_cdf.png and active_requests.png here.")


def main(argv):
    del argv
    if _TRACE.value:
        trace = simulator.load_trace(_TRACE.value)
    else:
        trace = simulator.synthetic_trace(_QPS.value, _DURATION.value, long_fraction=_LONG_FRACTION.value,
                                          long_min_tokens=_LONG_MIN.value, long_max_tokens=_LONG_MAX.value,
                                          seed=_SEED.value)
    if _SAVE_TRACE.value:
        simulator.save_trace(trace, _SAVE_TRACE.value)
    config = simulator.SimConfig(
        model=_MODEL.value, hardware=_HARDWARE.value, tp=_TP.value, spp=_SPP.value, kvp=_KVP.value,
        policy=_POLICY.value, target_batch_time_ms=_TARGET.value or None, chunk_size=_CHUNK.value,
        max_num_batched_tokens=_BUDGET.value, max_num_seqs=_MAX_SEQS.value, ppb_max_share=_PPB.value,
        ttft_slo_min_s=_SLO_MIN.value, ttft_slo_per_token_s=_SLO_PER_TOKEN.value,
        ttft_slo_prefill_factor=_SLO_FACTOR.value, num_pages=_NUM_PAGES.value,
        max_tokens_per_kvp_rank=_MAX_PER_RANK.value, profile=_PROFILE.value, pipeline_padding=_PAD.value,
        max_simulated_s=_MAX_SIM.value)
    result = simulator.simulate(config, trace, plot_dir=_PLOT_DIR.value)
    m = result.metrics
    print(f"{config.model} on {config.hardware}, tp={config.tp} spp={config.spp} kvp={config.kvp}, "
          f"{len(trace)} requests ({m['short']['requests']} short, {m['long']['requests']} long), "
          f"{m['kv_pages_per_rank']} KV pages per rank")
    print(simulator.summary_table({config.policy: m}))
    print(f"simulated {m['simulated_s']:.1f} s in {m['steps']} steps, {m['cpu_s']:.1f} CPU s; "
          f"stop: {m['stop_reason']}; preemptions {m['preemptions']}; TTFT/TBT in seconds/ms")
    if _OUTPUT_JSON.value:
        result.to_json(_OUTPUT_JSON.value)


if __name__ == "__main__":
    app.run(main)
