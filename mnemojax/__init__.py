"""mnemojax: exact long-context Llama-3 serving in JAX.

The public names are imported lazily, so the plain-Python parts (scheduler, page manager, requests) can be
imported without jax.
"""
import importlib

_EXPORTS = {
    "LLM": "mnemojax.llm",
    "SamplingParams": "mnemojax.sampling_params",
    "RequestOutput": "mnemojax.outputs",
    "CompletionOutput": "mnemojax.outputs",
    "RequestMetrics": "mnemojax.outputs",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mnemojax' has no attribute {name!r}")
