"""mnemojax: exact long-context Llama-3 serving in JAX.

The public names are imported lazily, so the plain-Python parts (scheduler, page manager, requests) can be
imported without jax.
"""
import importlib

_EXPORTS = {
    "LLM": "mnemojax.engine.llm",
    "SamplingParams": "mnemojax.scheduling.sampling_params",
    "BeamSearchParams": "mnemojax.scheduling.sampling_params",
    "StructuredOutputsParams": "mnemojax.scheduling.sampling_params",
    "RequestOutput": "mnemojax.scheduling.outputs",
    "CompletionOutput": "mnemojax.scheduling.outputs",
    "RequestMetrics": "mnemojax.scheduling.outputs",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mnemojax' has no attribute {name!r}")
