"""Rotary position embedding (RoPE), bit-for-bit with Hugging Face transformers' Llama in float32.

Convention: "rotate half" (the first and second halves of a head are the two coordinates of each rotated
pair, not interleaved even/odd elements); HF's Llama q/k weights are already permuted for it.

Why float32 step by step: at position p the angle is p * inv_freq, so one float32 ulp of inv_freq (6e-8
relative) moves the angle by up to 6e-3 rad at p = 100000. Meta's reference code and HF both compute
inv_freq in float32 (`1.0 / (theta ** (arange(0, H, 2) / H))`, rounding the power and then the reciprocal),
which differs by one ulp from the correctly rounded value in about a quarter of the entries. `inv_freq`
therefore repeats HF's float32 operations one by one (numpy's float32 arithmetic is IEEE, like torch's) instead
of computing the exact value in float64 (that would be 3e-2 off HF at position 1e5); it returns float64 only
as a container - every entry is a float32 value, so casting it to float32 is lossless. The power itself is
rounded correctly here, while torch's float32 `pow` is one ulp off in rare cases: none for head_dim 16, 32,
64 or 128 at theta 1e4 or 5e5 (every Llama 3 and our test models), one entry for e.g. head_dim 96 or 256.

HF multiplies cos/sin by an `attention_scaling` that its rope-init functions return; it is 1.0 for the
default, linear and llama3 types (only yarn / longrope use another value), so it is not applied here.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from models.config import LlamaConfig

_f32 = np.float32


def inv_freq(config: LlamaConfig) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] (float64 array of float32 values), scaled per `config.rope_scaling`.

    Mirrors `LlamaRotaryEmbedding.compute_default_rope_parameters` and, in
    `transformers/modeling_rope_utils.py`, `_compute_linear_scaling_rope_parameters` and
    `_compute_llama3_parameters`, operation by operation in float32 (torch's `scalar / t` is
    `t.reciprocal() * scalar`, so it is written that way).
    """
    dim = config.head_dim
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(_f32) / _f32(dim)
    power = (np.float64(_f32(config.rope_theta)) ** exponent.astype(np.float64)).astype(_f32)
    inv = _f32(1.0) / power
    scaling = config.rope_scaling
    if scaling is None:
        pass
    elif scaling.rope_type == "linear":
        inv = inv / _f32(scaling.factor)
    elif scaling.rope_type == "llama3":
        inv = _llama3_scaling(inv, scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor,
                              scaling.original_max_position_embeddings)
    else:
        raise ValueError(f"unsupported rope_type {scaling.rope_type!r}")
    assert inv.dtype == np.float32, inv.dtype
    return inv.astype(np.float64)


def _llama3_scaling(inv: np.ndarray, factor: float, low_freq_factor: float, high_freq_factor: float,
                    old_context_len: int) -> np.ndarray:
    """Llama 3.1's rule: keep wavelengths < old_context_len / high_freq_factor, divide those
    > old_context_len / low_freq_factor by `factor`, interpolate smoothly in between (float32, as HF does)."""
    factor, low = _f32(factor), _f32(low_freq_factor)
    low_freq_wavelen = _f32(old_context_len / low_freq_factor)
    high_freq_wavelen = _f32(old_context_len / high_freq_factor)
    wavelen = (_f32(1.0) / inv) * _f32(2 * math.pi)
    scaled = np.where(wavelen > low_freq_wavelen, inv / factor, inv)
    smooth = ((_f32(1.0) / wavelen) * _f32(old_context_len) - low) / _f32(high_freq_factor - low_freq_factor)
    smoothed = (_f32(1.0) - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(_f32)


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: np.ndarray | jnp.ndarray) -> jnp.ndarray:
    """Rotates x [T, N, H] (tokens, heads, head_dim) by the angles positions [T] * inv_freq [H/2].

    As HF: the angle is float32(position) * float32(inv_freq) (exact positions up to 2**24), cos and sin are
    taken in float32 and cast to x's dtype, and the rotation runs in x's dtype. Returns x's dtype. Any
    leading dims shared by x and positions (e.g. a batch) broadcast.
    """
    half = x.shape[-1] // 2
    inv = jnp.asarray(inv_freq, dtype=jnp.float32)
    if inv.shape != (half,):
        raise ValueError(f"inv_freq has shape {inv.shape}, expected ({half},) for head_dim {x.shape[-1]}")
    angle = positions.astype(jnp.float32)[..., None] * inv          # [T, H/2]
    cos = jnp.cos(angle).astype(x.dtype)[..., None, :]               # [T, 1, H/2]
    sin = jnp.sin(angle).astype(x.dtype)[..., None, :]
    x1, x2 = x[..., :half], x[..., half:]                             # [T, N, H/2] each
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
