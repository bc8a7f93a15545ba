"""mnemojax: exact long-context Llama-3 serving in JAX."""
from mnemojax.llm import LLM
from mnemojax.outputs import CompletionOutput, RequestMetrics, RequestOutput
from mnemojax.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics"]
