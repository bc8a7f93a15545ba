"""`python -m mnemojax.generate --prompt "..."`: generate text for one prompt and print its latency.

Intentionally short: the logic lives in `mnemojax.LLM`.
"""
from __future__ import annotations

import statistics

from absl import app, flags

_MODEL = flags.DEFINE_string("model", "tiny", "Preset name or Hugging Face Llama directory.")
_PROMPT = flags.DEFINE_string("prompt", "Hello, mnemojax!", "The prompt text.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 32, "Tokens to generate.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 is greedy.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass.")
_TOP_K = flags.DEFINE_integer("top_k", -1, "Top-k sampling; -1 disables.")
_SEED = flags.DEFINE_integer("seed", None, "Sampling seed.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Model dtype.")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", None, "Longest prompt + output.")
_CHUNK_SIZE = flags.DEFINE_integer("chunk_size", 256, "Prefill chunk size.")


def main(argv):
    del argv
    from mnemojax import LLM, SamplingParams

    llm = LLM(model=_MODEL.value, dtype=_DTYPE.value, max_model_len=_MAX_MODEL_LEN.value,
              chunk_size=_CHUNK_SIZE.value)
    params = SamplingParams(max_tokens=_MAX_TOKENS.value, temperature=_TEMPERATURE.value, top_p=_TOP_P.value,
                            top_k=_TOP_K.value, seed=_SEED.value)
    llm.generate([_PROMPT.value], SamplingParams(max_tokens=2, temperature=0))  # compile outside the timing
    out = llm.generate([_PROMPT.value], params)[0]
    c, m = out.outputs[0], out.metrics
    tbt = m.tbt
    print(f"prompt: {_PROMPT.value!r} ({len(out.prompt_token_ids)} tokens)")
    print(f"output: {c.text!r}")
    print(f"tokens: {len(c.token_ids)}, finish_reason: {c.finish_reason}")
    print(f"TTFT: {m.ttft * 1e3:.1f} ms" + (f", TBT: mean {statistics.mean(tbt) * 1e3:.1f} ms, "
                                           f"max {max(tbt) * 1e3:.1f} ms" if tbt else ""))


if __name__ == "__main__":
    app.run(main)
