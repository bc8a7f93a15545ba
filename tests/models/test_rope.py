"""models.rope against transformers' Llama RoPE: inverse frequencies bit for bit, rotations at long positions."""
import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama import modeling_llama

from models import rope
from models.config import LlamaConfig, RopeScaling, preset

LLAMA31 = RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192)


def _config(head_dim, theta, scaling=None, max_pos=131072):
    return LlamaConfig(vocab_size=16, hidden_size=4 * head_dim, intermediate_size=8, num_layers=1, num_heads=4,
                       num_kv_heads=2, head_dim=head_dim, max_position_embeddings=max_pos, rope_theta=theta,
                       rope_scaling=scaling)


CONFIGS = {
    "tiny": preset("tiny"),
    "llama3-8b": preset("llama3-8b"),
    "llama3.1-8b": dataclasses.replace(preset("llama3-8b"), rope_scaling=LLAMA31, max_position_embeddings=131072),
    "llama3.2-1b": preset("llama3.2-1b"),
    "llama3.2-3b": preset("llama3.2-3b"),
    "hf-test-checkpoint": _config(16, 10000.0, max_pos=4096),  # tests/hf_utils.py defaults
    "linear-h32": _config(32, 10000.0, RopeScaling("linear", 4.0)),
    "linear-h64-factor3": _config(64, 500000.0, RopeScaling("linear", 3.0)),
    "llama3-h64-odd-factors": _config(64, 500000.0, RopeScaling("llama3", 3.0, 1.5, 7.0, 5000)),
}


def _hf_inv_freq(config: LlamaConfig):
    """(inv_freq, attention_factor) from transformers' own init function for the config's rope type."""
    hf_config = transformers.LlamaConfig(**config.to_hf_dict())
    rope_type = config.rope_scaling.rope_type if config.rope_scaling else "default"
    if rope_type in ROPE_INIT_FUNCTIONS:
        fn = ROPE_INIT_FUNCTIONS[rope_type]
    else:  # transformers 5 moved "default" onto the rotary embedding class
        fn = modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters
    inv, attention_factor = fn(hf_config, device="cpu")
    return inv.numpy(), attention_factor


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_inv_freq_bitwise_equal_to_transformers(name):
    """Bit for bit: one float32 ulp of inv_freq is a 6e-3 rad angle error at position 1e5."""
    ours = rope.inv_freq(CONFIGS[name])
    hf, attention_factor = _hf_inv_freq(CONFIGS[name])
    assert attention_factor == 1.0  # HF scales cos/sin by this; rope.apply_rope does not.
    assert ours.dtype == np.float64 and ours.shape == (CONFIGS[name].head_dim // 2,)
    assert np.array_equal(ours.astype(np.float32).astype(np.float64), ours)  # float32 values
    np.testing.assert_array_equal(ours.astype(np.float32), hf)


def test_inv_freq_within_one_ulp_over_a_sweep():
    """torch's float32 pow is off by one ulp for a few (theta, head_dim) pairs that no Llama 3 uses; ours is
    correctly rounded there. Everything else, including the scaling arithmetic, agrees exactly."""
    mismatched = 0
    for theta, head_dim, scaling in itertools.product(
            [10000.0, 500000.0, 1e6, 123456.7], [16, 64, 96, 128, 256],
            [None, RopeScaling("linear", 2.5), LLAMA31, RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)]):
        config = _config(head_dim, theta, scaling)
        ours = rope.inv_freq(config).astype(np.float32)
        hf, _ = _hf_inv_freq(config)
        ulps = np.abs(ours.view(np.int32).astype(np.int64) - hf.view(np.int32))
        assert ulps.max() <= 2, (theta, head_dim, scaling, ulps)
        assert np.count_nonzero(ulps) <= 2, (theta, head_dim, scaling, ulps)
        mismatched += np.count_nonzero(ulps)
    assert mismatched < 50  # out of 9_600 entries


def test_llama3_scaling_regimes():
    """Independent of HF: high frequencies kept, low ones divided by factor, the middle in between."""
    base = rope.inv_freq(_config(128, 500000.0))
    scaled = rope.inv_freq(_config(128, 500000.0, LLAMA31))
    wavelen = 2 * np.pi / base
    high, low = wavelen < 8192 / 4, wavelen > 8192 / 1
    assert high.any() and low.any() and (~high & ~low).any()
    np.testing.assert_array_equal(scaled[high], base[high])
    np.testing.assert_allclose(scaled[low], base[low] / 8, rtol=1e-7)
    mid = ~high & ~low
    assert np.all(scaled[mid] < base[mid]) and np.all(scaled[mid] > base[mid] / 8)


def _hf_apply(config, x, positions):
    """transformers' LlamaRotaryEmbedding + apply_rotary_pos_emb on x [T, N, H]."""
    hf_config = transformers.LlamaConfig(**config.to_hf_dict())
    rotary = modeling_llama.LlamaRotaryEmbedding(hf_config)
    assert rotary.attention_scaling == 1.0
    q = torch.from_numpy(np.array(x.astype(jnp.float32))).to(_TORCH_DTYPES[x.dtype]).permute(1, 0, 2)[None]
    cos, sin = rotary(q, torch.from_numpy(np.asarray(positions, np.int64))[None])
    out, _ = modeling_llama.apply_rotary_pos_emb(q, q, cos, sin)
    return out[0].permute(1, 0, 2).float().numpy()


_TORCH_DTYPES = {jnp.dtype(jnp.float32): torch.float32, jnp.dtype(jnp.bfloat16): torch.bfloat16}
_apply_rope = jax.jit(rope.apply_rope)


def _inputs(config, dtype, seed=0, tokens=256):
    rng = np.random.default_rng(seed)
    positions = np.concatenate([[0, 1, 2, 8191, 8192, 99999, 100000],
                                rng.integers(0, 100001, tokens - 7)]).astype(np.int32)
    x = jnp.asarray(rng.standard_normal((tokens, 4, config.head_dim)), dtype)
    return x, jnp.asarray(positions)


@pytest.mark.parametrize("name", ["tiny", "llama3-8b", "llama3.1-8b", "llama3.2-1b", "linear-h32"])
def test_apply_rope_matches_transformers_float32(name):
    config = CONFIGS[name]
    x, positions = _inputs(config, jnp.float32)
    ours = _apply_rope(x, positions, rope.inv_freq(config))
    assert ours.dtype == jnp.float32 and ours.shape == x.shape
    ref = _hf_apply(config, x, positions)
    # 1e-5 relative to the scale of the output: an element where x1*cos - x2*sin cancels to ~0 has no
    # meaningful elementwise relative error (the largest seen is ~5e-7 absolute, from 1-ulp cos/sin).
    np.testing.assert_allclose(np.asarray(ours), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("name", ["tiny", "llama3.2-1b"])
def test_apply_rope_matches_transformers_bfloat16_exactly(name):
    """HF casts cos/sin to the input dtype before rotating, and so do we: bf16 results agree bit for bit."""
    config = CONFIGS[name]
    x, positions = _inputs(config, jnp.bfloat16, seed=1)
    ours = _apply_rope(x, positions, rope.inv_freq(config))
    assert ours.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(ours.astype(jnp.float32)), _hf_apply(config, x, positions))


def test_relative_position_property():
    """<rope(q, m), rope(k, n)> depends only on m - n, and rotation keeps norms (no HF involved)."""
    config = CONFIGS["tiny"]
    inv = rope.inv_freq(config)
    rng = np.random.default_rng(2)
    q, k = (jnp.asarray(rng.standard_normal((1, 1, config.head_dim)), jnp.float32) for _ in range(2))
    dots = []
    for m in [5, 105, 1005]:
        rq = _apply_rope(q, jnp.array([m], jnp.int32), inv)
        rk = _apply_rope(k, jnp.array([m - 3], jnp.int32), inv)
        dots.append(float(jnp.sum(rq * rk)))
        np.testing.assert_allclose(float(jnp.linalg.norm(rq)), float(jnp.linalg.norm(q)), rtol=1e-6)
    np.testing.assert_allclose(dots, dots[0], rtol=1e-4)
    at_zero = _apply_rope(q, jnp.array([0], jnp.int32), inv)
    np.testing.assert_array_equal(np.asarray(at_zero), np.asarray(q))


def test_apply_rope_batched_leading_dims():
    config = CONFIGS["tiny"]
    inv = rope.inv_freq(config)
    x, positions = _inputs(config, jnp.float32, tokens=16)
    batched = _apply_rope(jnp.stack([x, x[::-1]]), jnp.stack([positions, positions[::-1]]), inv)
    np.testing.assert_array_equal(np.asarray(batched[0]), np.asarray(_apply_rope(x, positions, inv)))
    np.testing.assert_array_equal(np.asarray(batched[1]), np.asarray(_apply_rope(x[::-1], positions[::-1], inv)))


def test_apply_rope_rejects_wrong_inv_freq_length():
    with pytest.raises(ValueError, match="inv_freq"):
        rope.apply_rope(jnp.zeros((2, 1, 16)), jnp.zeros((2,), jnp.int32), np.ones(4))
