"""models.config: Hugging Face config.json parsing (both rope spellings), rejection of what we do not implement,
presets checked against the published Llama 3 shapes, and the round trip through transformers.LlamaConfig."""
import dataclasses
import json

import pytest
import transformers

from models.config import PRESETS, LlamaConfig, RopeScaling, generation_defaults, preset

LLAMA31_ROPE = RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                           original_max_position_embeddings=8192)

# The config.json files as published on the Hugging Face Hub (meta-llama/...), written out by hand.
META_LLAMA_3_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.40.0.dev0", "use_cache": True, "vocab_size": 128256,
}
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}
LLAMA_32_1B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256,
}
LLAMA_33_70B_INSTRUCT = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 8192, "initializer_range": 0.02, "intermediate_size": 28672, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 64, "num_hidden_layers": 80,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.47.0.dev0", "use_cache": True, "vocab_size": 128256,
}

REAL_CONFIGS = {
    "Meta-Llama-3-8B": (META_LLAMA_3_8B, LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=None,
        tie_word_embeddings=False, bos_token_id=128000, eos_token_ids=(128001,))),
    "Llama-3.1-8B": (LLAMA_31_8B, LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=LLAMA31_ROPE, tie_word_embeddings=False, bos_token_id=128000, eos_token_ids=(128001,))),
    "Llama-3.2-1B": (LLAMA_32_1B, LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
        head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dataclasses.replace(LLAMA31_ROPE, factor=32.0), tie_word_embeddings=True,
        bos_token_id=128000, eos_token_ids=(128001,))),
    "Llama-3.3-70B-Instruct": (LLAMA_33_70B_INSTRUCT, LlamaConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8,
        head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=LLAMA31_ROPE, tie_word_embeddings=False, bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009))),
}


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_real_config_json(name):
    d, expected = REAL_CONFIGS[name]
    assert LlamaConfig.from_hf_config(d) == expected


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_real_config_through_transformers_5_spelling(name):
    """HF re-serialises the same file with `rope_parameters` and ~a dozen generic keys; same result."""
    d, expected = REAL_CONFIGS[name]
    hf = transformers.LlamaConfig.from_dict(dict(d)).to_dict()
    assert LlamaConfig.from_hf_config(hf) == expected


@pytest.mark.parametrize("kwargs, expected", [
    # No head_dim, no num_key_value_heads: HF derives both (MHA, hidden // heads).
    (dict(vocab_size=300, hidden_size=96, intermediate_size=200, num_hidden_layers=3, num_attention_heads=6,
          max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2),
     LlamaConfig(vocab_size=300, hidden_size=96, intermediate_size=200, num_layers=3, num_heads=6, num_kv_heads=6,
                 head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1,
                 eos_token_ids=(2,))),
    # MQA, explicit head_dim with heads * head_dim != hidden, linear rope, tied, several eos, no bos.
    (dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
          num_key_value_heads=1, head_dim=12, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=5000.0,
          rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=True, bos_token_id=None,
          eos_token_id=[3, 5]),
     LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4, num_kv_heads=1,
                 head_dim=12, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=5000.0,
                 rope_scaling=RopeScaling("linear", 2.0), tie_word_embeddings=True, bos_token_id=None,
                 eos_token_ids=(3, 5))),
    # llama3 rope in the new spelling, GQA.
    (dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5,
          rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
          bos_token_id=256, eos_token_id=257),
     LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=500000.0,
                 rope_scaling=RopeScaling("llama3", 32.0, 1.0, 4.0, 1024), bos_token_id=256, eos_token_ids=(257,))),
])
def test_transformers_to_dict(kwargs, expected):
    """Every key of a real `transformers.LlamaConfig(...).to_dict()` is understood or known harmless."""
    d = transformers.LlamaConfig(**kwargs).to_dict()
    assert LlamaConfig.from_hf_config(d) == expected
    assert LlamaConfig.from_hf_config(json.loads(json.dumps(d))) == expected  # as read back from config.json


def test_hf_defaults_for_missing_optional_keys():
    d = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
         "num_attention_heads": 2, "max_position_embeddings": 32}
    c = LlamaConfig.from_hf_config(d)
    hf = transformers.LlamaConfig(**d)
    assert (c.num_kv_heads, c.head_dim, c.rms_norm_eps, c.tie_word_embeddings) == (
        hf.num_key_value_heads, hf.head_dim, hf.rms_norm_eps, hf.tie_word_embeddings)
    assert c.rope_theta == hf.rope_parameters["rope_theta"] == 10000.0
    assert c.rope_scaling is None and c.bos_token_id is None and c.eos_token_ids == ()


def test_null_head_dim_and_legacy_rope_type_key():
    d = dict(LLAMA_31_8B, head_dim=None, rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 8192})
    assert LlamaConfig.from_hf_config(d) == REAL_CONFIGS["Llama-3.1-8B"][1]


@pytest.mark.parametrize("rope", [{"rope_type": "default", "rope_theta": 500000.0}, {"type": "default"}])
def test_default_rope_type_means_no_scaling(rope):
    key = "rope_parameters" if "rope_theta" in rope else "rope_scaling"
    d = {**META_LLAMA_3_8B, "rope_scaling": None, key: rope}
    assert LlamaConfig.from_hf_config(d) == REAL_CONFIGS["Meta-Llama-3-8B"][1]


def test_llama3_original_max_defaults_to_max_position_embeddings_like_hf():
    rope = {k: v for k, v in LLAMA_31_8B["rope_scaling"].items() if k != "original_max_position_embeddings"}
    d = dict(LLAMA_31_8B, rope_scaling=rope, max_position_embeddings=16384)
    hf = transformers.LlamaConfig.from_dict(dict(d))
    c = LlamaConfig.from_hf_config(d)
    assert c.rope_scaling.original_max_position_embeddings == 16384
    assert hf.rope_parameters["original_max_position_embeddings"] == 16384


def test_harmless_keys_with_unusual_values_are_accepted():
    d = dict(LLAMA_31_8B, pretraining_tp=2, attention_dropout=0.1, use_cache=False, pad_token_id=128004,
             initializer_range=0.5, torch_dtype="float16", _name_or_path="/x", temperature=0.6, top_p=0.9)
    assert LlamaConfig.from_hf_config(d) == REAL_CONFIGS["Llama-3.1-8B"][1]


@pytest.mark.parametrize("change, key", [
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "mistral"}, "model_type"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"is_encoder_decoder": True}, "is_encoder_decoder"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}}, "yarn"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "longrope"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "attention_factor": 1.5}}, "attention_factor"),
    ({"rope_scaling": {"rope_type": "linear"}}, "factor"),
    ({"rope_scaling": {"rope_type": "linear", "type": "llama3", "factor": 2.0}}, "type"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, "factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}, "rope_parameters"),  # and rope_scaling
    ({"rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, "rope_theta"),
    ({"sliding_window": 4096}, "sliding_window"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
    ({"num_hidden_layers": None}, "num_hidden_layers"),
    ({"num_key_value_heads": 5}, "num_key_value_heads"),  # config.json's names, not the fields'
    ({"eos_token_id": "128001"}, "eos_token_id"),
    ({"eos_token_id": 128256}, "eos_token_id: 128256"),
])
def test_rejects_what_changes_the_math_or_is_not_understood(change, key):
    d = dict(LLAMA_31_8B, **change)
    with pytest.raises(ValueError, match=key):
        LlamaConfig.from_hf_config(d)


def test_missing_head_dim_needs_divisible_hidden_size():
    d = dict(META_LLAMA_3_8B, hidden_size=4000, num_attention_heads=48, num_key_value_heads=8)
    with pytest.raises(ValueError, match="head_dim"):
        LlamaConfig.from_hf_config(d)


@pytest.mark.parametrize("change, field", [
    ({"num_kv_heads": 3}, "num_kv_heads"),
    ({"num_layers": 0}, "num_layers"),
    ({"vocab_size": -1}, "vocab_size"),
    ({"head_dim": 15}, "head_dim"),
    ({"hidden_size": 64.0}, "hidden_size"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
    ({"bos_token_id": 320}, "bos_token_id"),
    ({"eos_token_ids": [257]}, "eos_token_ids"),
    ({"tie_word_embeddings": 1}, "tie_word_embeddings"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
])
def test_post_init_validation_names_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(preset("tiny"), **change)


@pytest.mark.parametrize("kwargs, field", [
    (dict(rope_type="yarn", factor=2.0), "rope_type"),
    (dict(rope_type="linear", factor=0.0), "factor"),
    (dict(rope_type="linear", factor=2.0, low_freq_factor=1.0), "low_freq_factor"),
    (dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0),
     "original_max_position_embeddings"),
    (dict(rope_type="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=4.0,
          original_max_position_embeddings=8192), "high_freq_factor"),
])
def test_rope_scaling_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RopeScaling(**kwargs)


def test_frozen_and_hashable():
    c = preset("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.num_layers = 2
    assert hash(c) == hash(dataclasses.replace(c))


def _param_count(c: LlamaConfig) -> int:
    d, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layer = d * q + 2 * d * kv + q * d + 3 * d * c.intermediate_size + 2 * d
    return c.vocab_size * d * (1 if c.tie_word_embeddings else 2) + c.num_layers * layer + d


@pytest.mark.parametrize("name, params", [
    # Parameter counts published on the model cards / safetensors metadata.
    ("llama3-8b", 8_030_261_248),
    ("llama3-70b", 70_553_706_496),
    ("llama3.2-1b", 1_235_814_400),
    ("llama3.2-3b", 3_212_749_824),
])
def test_full_size_presets_match_published_parameter_counts(name, params):
    assert _param_count(preset(name)) == params


def test_presets_match_the_real_config_files():
    assert preset("llama3-8b") == dataclasses.replace(REAL_CONFIGS["Meta-Llama-3-8B"][1],
                                                      eos_token_ids=(128001, 128009))
    assert preset("llama3.2-1b") == dataclasses.replace(REAL_CONFIGS["Llama-3.2-1B"][1],
                                                        eos_token_ids=(128001, 128008, 128009))
    c70 = preset("llama3-70b")
    assert (c70.rope_scaling, c70.max_position_embeddings, c70.rope_theta, c70.head_dim) == (
        None, 8192, 500000.0, 128)
    c3 = preset("llama3.2-3b")
    assert (c3.rope_scaling, c3.tie_word_embeddings, c3.num_heads * c3.head_dim) == (
        preset("llama3.2-1b").rope_scaling, True, 3072)


def test_tiny_preset():
    c = preset("tiny")
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads,
            c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling, c.bos_token_id,
            c.eos_token_ids) == (320, 128, 256, 4, 8, 2, 16, 8192, 10000.0, None, 256, (257,))


def test_unknown_preset_lists_the_known_names():
    with pytest.raises(ValueError) as e:
        preset("llama2-7b")
    for name in PRESETS:
        assert name in str(e.value)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_to_hf_dict_round_trip(name):
    c = preset(name)
    hf = transformers.LlamaConfig(**c.to_hf_dict())
    # transformers reads the same model...
    assert (hf.num_hidden_layers, hf.num_key_value_heads, hf.head_dim, hf.tie_word_embeddings, hf.rms_norm_eps) == (
        c.num_layers, c.num_kv_heads, c.head_dim, c.tie_word_embeddings, c.rms_norm_eps)
    assert hf.rope_parameters["rope_theta"] == c.rope_theta
    assert hf.rope_parameters["rope_type"] == (c.rope_scaling.rope_type if c.rope_scaling else "default")
    # ...and its serialised form parses back to the same config.
    assert LlamaConfig.from_hf_config(hf.to_dict()) == c
    assert LlamaConfig.from_hf_config(c.to_hf_dict()) == c


def test_from_pretrained_unions_generation_config_eos(tmp_path):
    """Files written by transformers itself, as in a Llama-3-Instruct checkpoint directory."""
    hf = transformers.LlamaConfig.from_dict(dict(META_LLAMA_3_8B, eos_token_id=128009))
    hf.save_pretrained(tmp_path)
    transformers.GenerationConfig(bos_token_id=128000, eos_token_id=[128001, 128009], do_sample=True,
                                  temperature=0.6, top_p=0.9).save_pretrained(tmp_path)
    c = LlamaConfig.from_pretrained(tmp_path)
    assert c.eos_token_ids == (128009, 128001)
    assert c == dataclasses.replace(REAL_CONFIGS["Meta-Llama-3-8B"][1], eos_token_ids=(128009, 128001))


def test_from_pretrained_without_generation_eos(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_32_1B))
    assert LlamaConfig.from_pretrained(str(tmp_path)) == REAL_CONFIGS["Llama-3.2-1B"][1]
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 128000, "temperature": 0.6}))
    assert LlamaConfig.from_pretrained(tmp_path) == REAL_CONFIGS["Llama-3.2-1B"][1]


def test_from_pretrained_missing_directory(tmp_path):
    # a typo'd preset or a hub id: neither a preset nor a directory (not "no config.json in it")
    for name in (tmp_path / "nope", "llama3-8B", "meta-llama/Llama-3.1-8B-Instruct"):
        with pytest.raises(FileNotFoundError, match="is neither a preset .*llama3-8b.* nor a local checkpoint"):
            LlamaConfig.from_pretrained(name)


def test_from_pretrained_names_generation_configs_bad_eos(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_32_1B))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 999999]}))
    with pytest.raises(ValueError, match=r"generation_config.json eos_token_id: 999999 is not a token id"):
        LlamaConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("key", ["rms_norm_eps", "rope_theta", "tie_word_embeddings"])
def test_an_explicit_null_is_not_the_default(key):
    """HF's default applies to a key left out; a null was taken for it silently (transformers 5.23 refuses
    `rms_norm_eps` and `tie_word_embeddings` null, and a null `rope_theta` fails when its model is built)."""
    with pytest.raises(ValueError, match=f"{key} is null"):
        LlamaConfig.from_hf_config(dict(LLAMA_32_1B, **{key: None}))


@pytest.mark.parametrize("file", ["config.json", "generation_config.json"])
@pytest.mark.parametrize("text, error", [("{", "is not JSON"), ("[1]", "must hold a JSON object, got list")])
def test_config_files_that_are_no_json_object_are_named(tmp_path, file, text, error):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_32_1B))
    (tmp_path / file).write_text(text)
    with pytest.raises(ValueError, match=f"{file} {error}"):
        LlamaConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("key, value", [("num_hidden_layers", 0), ("num_key_value_heads", 3),
                                        ("num_attention_heads", 5), ("eos_token_id", [128001, -1])])
def test_from_hf_config_errors_name_the_config_json_key(key, value):
    with pytest.raises(ValueError, match=key):
        LlamaConfig.from_hf_config(dict(LLAMA_32_1B, **{key: value}))


def test_tp_must_divide_the_mlp_width():
    c = dataclasses.replace(preset("tiny"), intermediate_size=129)
    assert c.mesh_layout(tp=1, spp=1) == (c.num_layers, c.num_kv_heads)
    with pytest.raises(ValueError, match=r"tp \(2\) must divide the MLP width intermediate_size \(129\)"):
        c.mesh_layout(tp=2, spp=1)


@pytest.mark.parametrize("gen", [
    dict(do_sample=True, temperature=0.6, top_p=0.9),  # Llama-3.1-8B-Instruct's
    dict(do_sample=True, temperature=1.0, top_p=0.5, top_k=50, max_new_tokens=64),  # values equal to HF's defaults
    dict(do_sample=True, temperature=0.3, top_k=5, repetition_penalty=1.0),  # a neutral one passes
    dict(do_sample=True, temperature=0.7, min_p=0.05),
    dict(repetition_penalty=1.1),
    dict(),
])
def test_generation_defaults_are_what_the_file_changes_from_transformers(tmp_path, gen):
    """The fields vLLM's --generation-config auto reads, as transformers' `to_diff_dict` sees the file (the oracle;
    in transformers 5 a value equal to its old default, top_k 50, is still the file's choice)."""
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=[2, 3], **gen).save_pretrained(tmp_path)
    diff = transformers.GenerationConfig.from_pretrained(tmp_path).to_diff_dict()
    names = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "max_new_tokens": "max_tokens", "repetition_penalty": "repetition_penalty"}
    want = {names[k]: v for k, v in diff.items() if k in names}
    assert generation_defaults(tmp_path) == want


def test_generation_defaults_read_the_repetition_penalty(tmp_path):
    """No file: no defaults. A `repetition_penalty` is a default vLLM reads (refused before penalties existed)."""
    assert generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.1, "do_sample": True}))
    assert generation_defaults(tmp_path) == {"repetition_penalty": 1.1}
