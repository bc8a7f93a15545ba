"""The attention kernels' names and what every implementation shares: plain Python, no jax.

One vocabulary for the kernel choice, read by the model (`models.attention.attention`, `ModelSpec.attention`),
the engine (`EngineConfig.attention`, `LLM(attention=...)`) and the runtime predictor's cost model
(`mnemojax.scheduling.predictor.Profile.attention`, which imports no jax, hence this module).
"""
from __future__ import annotations

AUTO = "auto"
REFERENCE = "reference"
PALLAS = "pallas"
PALLAS_INTERPRET = "pallas_interpret"
MOSAIC = "mosaic"
MOSAIC_INTERPRET = "mosaic_interpret"

ATTENTION_IMPLS = (AUTO, REFERENCE, PALLAS, PALLAS_INTERPRET, MOSAIC, MOSAIC_INTERPRET)
"""auto: `mosaic` on a Hopper GPU for a model the Mosaic kernels support (bf16/f16, their head dims, page sizes and
GQA groups: the engine resolves it once for the model it loads), else `pallas` on an NVIDIA GPU, else `reference`
(the only name that chooses: an explicitly named implementation that cannot run raises); reference:
`models.attention.paged_attention` (plain jax.numpy, any backend); pallas: the Pallas Triton kernels of
`models.pallas_attention`, compiled (NVIDIA GPU only); pallas_interpret: the same kernels in Pallas' interpreter
(any backend: slow, for tests); mosaic: the Pallas Mosaic GPU kernels of `models.mosaic_attention` (wgmma, TMA, warp
specialisation), compiled (NVIDIA Hopper GPU only, bf16/f16 caches); mosaic_interpret: the same kernels in jax's
Mosaic GPU interpreter (any backend: very slow, for tests).
On an H200 `mosaic` is the faster prefill (the Llama-3-8B prefill step at 32K 1.46x faster than `pallas`), decodes
as fast within 4%, and the engine's greedy tokens with it match the reference's (README, "Attention";
docs/benchmarks.md, issue 15). Where the model is not known (a bare `models.attention.attention("auto", ...)`),
`auto` on an NVIDIA GPU is `pallas`, which runs every dtype and shape."""

MIXED, DECODE, PREFILL = "mixed", "decode", "prefill"
STEP_KINDS = (MIXED, DECODE, PREFILL)
"""What a step's attention holds, so that the kernels launch only what it needs: `decode` only sequences of one
query token (decode tiles), `prefill` only sequences of two or more (prefill tiles), `mixed` either (both
kernels). Static for a compiled step; the reference attention runs one path for all."""


def step_kind(query_tokens) -> str:
    """The `STEP_KINDS` entry for a step whose sequences have these numbers of query tokens (none: `mixed`)."""
    sizes = list(query_tokens)
    if not sizes:
        return MIXED
    if all(n == 1 for n in sizes):
        return DECODE
    return PREFILL if all(n > 1 for n in sizes) else MIXED


INTERPRETED = (PALLAS_INTERPRET, MOSAIC_INTERPRET)
"""The implementations that interpret GPU kernels on any backend: for tests, with no cost model."""

# Large finite negative instead of -inf: a block with no valid key gives weight 0, not NaN (JAX_NOTES.md). The
# log-sum-exp of a query token with no visible key, in every implementation.
NEG_INF = -1e30


def check_attention_impl(impl: str) -> None:
    """Raises ValueError unless `impl` is one of ATTENTION_IMPLS."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention implementation {impl!r}; valid: {', '.join(ATTENTION_IMPLS)}")


def resolve_attention_impl(impl: str, nvidia_gpu: bool, mosaic: bool = False) -> str:
    """The implementation that runs for `impl`: `auto` is `mosaic` when `mosaic` (a Hopper GPU and a model the
    Mosaic kernels support: the caller knows), else `pallas` when `nvidia_gpu`, else `reference`; any other name is
    itself (whether it can run is its own check)."""
    check_attention_impl(impl)
    if impl == AUTO:
        return MOSAIC if mosaic else PALLAS if nvidia_gpu else REFERENCE
    return impl
