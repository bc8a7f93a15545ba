"""`python -m mnemojax.engine --prompt "..."`: generate text for one prompt and print its latency.

Intentionally short: the logic lives in `LLMEngine`. The flags are every `EngineConfig` field (the same as
`python -m mnemojax.serve`) and the fields of `GenerateConfig` below.
"""
from __future__ import annotations

import dataclasses
import statistics


from mnemojax.cli import define_flags, from_flags, no_arguments, run_command, usage_errors


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    """The one prompt and how to sample it."""

    prompt: str = "Hello, mnemojax!"
    """The prompt text."""
    max_tokens: int = 32
    """Tokens to generate."""
    temperature: float = 0.0
    """0 is greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Top-k sampling; -1 disables."""
    min_p: float = 0.0
    """Min-p sampling (keep tokens at least min_p times as likely as the top one); 0 disables."""
    sampling_seed: int | None = None
    """Sampling seed (default: the engine's seed)."""


def main(argv):
    no_arguments(argv)
    from mnemojax.engine.llm import LLM
    from mnemojax.engine.llm_engine import EngineConfig
    from mnemojax.scheduling.sampling_params import SamplingParams

    with usage_errors():
        config, g = from_flags(EngineConfig), from_flags(GenerateConfig)
        params = SamplingParams(max_tokens=g.max_tokens, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                                min_p=g.min_p, seed=g.sampling_seed)
        llm = LLM(**dataclasses.asdict(config))
        llm.engine.validate(llm.engine.tokenize(g.prompt), params)  # a prompt too long, say: named, no traceback
    llm.generate([g.prompt], SamplingParams(max_tokens=2, temperature=0))  # compile outside the timing
    llm.engine.reset_prefix_cache()  # else the timed prompt's KV would be the warm-up's, and its TTFT a cache hit
    out = llm.generate([g.prompt], params)[0]
    c, m = out.outputs[0], out.metrics
    tbt = m.tbt
    print(f"prompt: {g.prompt!r} ({len(out.prompt_token_ids)} tokens)")
    print(f"output: {c.text!r}")
    print(f"tokens: {len(c.token_ids)}, finish_reason: {c.finish_reason}")
    print(f"TTFT: {m.ttft * 1e3:.1f} ms" + (f", TBT: mean {statistics.mean(tbt) * 1e3:.1f} ms, "
                                           f"max {max(tbt) * 1e3:.1f} ms" if tbt else ""))


def run():
    from mnemojax.engine.llm_engine import EngineConfig

    for cls in (EngineConfig, GenerateConfig):
        define_flags(cls)
    run_command(main)


if __name__ == "__main__":
    run()
