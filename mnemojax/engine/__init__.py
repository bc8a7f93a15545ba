"""The engine: built parts (`loader`) run by the `executor` (one jitted step on the mesh), the `sampler`,
the incremental `detokenizer`, and `LLMEngine` (`llm_engine`), which joins them to the scheduler; `LLM` is the
offline interface, `AsyncLLM` the one the server uses, `multihost` runs one engine over several processes.
`python -m mnemojax.engine --prompt "..."` generates for one prompt and prints its latency.

Names are imported lazily so `import mnemojax.engine.loader` does not build the whole engine.
"""
import importlib

_EXPORTS = {"LLMEngine": "mnemojax.engine.llm_engine", "EngineConfig": "mnemojax.engine.llm_engine",
            "LLM": "mnemojax.engine.llm", "AsyncLLM": "mnemojax.engine.async_llm"}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mnemojax.engine' has no attribute {name!r}")
