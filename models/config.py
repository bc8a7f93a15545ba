"""Llama-3 model configuration: frozen dataclasses, presets, and Hugging Face `config.json` conversion.

`LlamaConfig.from_hf_config` reads the `config.json` of the Llama 3, 3.1, 3.2 and 3.3 checkpoints, in both the
transformers-4 spelling (`rope_theta` + `rope_scaling`) and the transformers-5 spelling (`rope_parameters`).
It rejects every key it does not understand and is not known to be harmless, and every value that would change
the math in a way this package does not implement (biases, another activation, another RoPE variant), so a
checkpoint is either served exactly or refused with an error that names the offending key.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

ROPE_TYPES = ("linear", "llama3")
"""RoPE scaling variants that `models.rope` implements (no scaling is `rope_scaling=None`)."""

_HF_DEFAULT_ROPE_THETA = 10000.0
"""transformers' `default_theta`: what HF uses when a config names no RoPE base at all."""
_HF_DEFAULT_RMS_NORM_EPS = 1e-6
"""`transformers.LlamaConfig`'s default `rms_norm_eps` (Llama-2's); real Llama-3 configs always set 1e-5."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How the RoPE inverse frequencies are rescaled for long context (see `models.rope.inv_freq`)."""

    rope_type: str
    """"linear" (every inverse frequency divided by `factor`) or "llama3" (Llama 3.1's piecewise rule: low
    frequencies divided by `factor`, high ones kept, a smooth interpolation in between)."""
    factor: float
    """Context extension factor: 8 for Llama 3.1 / 3.3, 32 for Llama 3.2."""
    low_freq_factor: float | None = None
    """llama3 only: wavelengths above `original_max_position_embeddings / low_freq_factor` are fully scaled."""
    high_freq_factor: float | None = None
    """llama3 only: wavelengths below `original_max_position_embeddings / high_freq_factor` are not scaled."""
    original_max_position_embeddings: int | None = None
    """llama3 only: the context length of pre-training (8192 for every Llama 3.x)."""

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type: unsupported RoPE scaling {self.rope_type!r}; supported: {ROPE_TYPES}")
        _check_number("factor", self.factor, positive=True)
        llama3_fields = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if self.rope_type == "linear":
            for name in llama3_fields:
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}: only used by rope_type 'llama3', got {getattr(self, name)!r}")
            return
        _check_number("low_freq_factor", self.low_freq_factor, positive=True)
        _check_number("high_freq_factor", self.high_freq_factor, positive=True)
        _check_int("original_max_position_embeddings", self.original_max_position_embeddings, positive=True)
        if not self.high_freq_factor > self.low_freq_factor:
            # The smoothing rule divides by (high - low).
            raise ValueError(f"high_freq_factor ({self.high_freq_factor}) must exceed "
                             f"low_freq_factor ({self.low_freq_factor})")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape and numerics of a Llama-3-architecture decoder (pre-norm RMSNorm, GQA, RoPE, SwiGLU MLP)."""

    vocab_size: int
    """Rows of the embedding table and of the LM head."""
    hidden_size: int
    """Width of the residual stream (D)."""
    intermediate_size: int
    """Width of the SwiGLU MLP (F): gate and up project D -> F, down projects F -> D."""
    num_layers: int
    """Number of decoder blocks (L)."""
    num_heads: int
    """Query heads per layer (N)."""
    num_kv_heads: int
    """Key/value heads per layer (K); each serves N / K query heads (GQA; K == N is MHA, K == 1 is MQA)."""
    head_dim: int
    """Size of one attention head (H); N * H need not equal D (the O projection maps N * H -> D)."""
    max_position_embeddings: int
    """Longest context the checkpoint is meant for; positions beyond it are not refused here."""
    rms_norm_eps: float = 1e-5
    """Epsilon inside every RMSNorm: x / sqrt(mean(x^2) + eps) * weight."""
    rope_theta: float = 500000.0
    """RoPE base: inverse frequency i is rope_theta ** (-2i / head_dim) before any scaling."""
    rope_scaling: RopeScaling | None = None
    """Long-context rescaling of the RoPE frequencies; None for plain RoPE."""
    tie_word_embeddings: bool = False
    """True when the LM head reuses the embedding table (Llama 3.2 1B and 3B)."""
    bos_token_id: int | None = None
    """Token the tokenizer puts first (`<|begin_of_text|>` = 128000 for Llama 3); None if unknown."""
    eos_token_ids: tuple[int, ...] = ()
    """Tokens that end generation, e.g. `<|end_of_text|>` and, for Instruct models, `<|eot_id|>`."""

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            _check_int(name, getattr(self, name), positive=True)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotate-half RoPE, got {self.head_dim}")
        _check_number("rms_norm_eps", self.rms_norm_eps, positive=True)
        _check_number("rope_theta", self.rope_theta, positive=True)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"rope_scaling must be a RopeScaling or None, got {type(self.rope_scaling).__name__}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"tie_word_embeddings must be a bool, got {self.tie_word_embeddings!r}")
        if self.bos_token_id is not None:
            _check_token_id("bos_token_id", self.bos_token_id, self.vocab_size)
        if not isinstance(self.eos_token_ids, tuple):
            raise ValueError(f"eos_token_ids must be a tuple of ints, got {self.eos_token_ids!r}")
        for t in self.eos_token_ids:
            _check_token_id("eos_token_ids", t, self.vocab_size)

    # ------------------------------------------------------------------ Hugging Face conversion

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> LlamaConfig:
        """Builds a config from a Hugging Face Llama `config.json` dict (or `transformers.LlamaConfig.to_dict()`).

        Missing optional keys take transformers' defaults, so the result computes what HF would compute:
        `num_key_value_heads` = `num_attention_heads`, `head_dim` = `hidden_size // num_attention_heads`,
        `rms_norm_eps` = 1e-6, `rope_theta` = 10000, no RoPE scaling, untied embeddings. The size keys
        (vocab, hidden, intermediate, layers, heads, max positions) are required. A missing `bos_token_id` /
        `eos_token_id` is left unknown (HF's defaults 1 / 2 are Llama-2 tokenizer ids).

        Raises ValueError naming the key for a missing required key, a value that changes the math in a way
        not implemented here, or a key that is neither understood nor on the harmless list.
        """
        if not isinstance(d, dict):
            raise ValueError(f"expected a config dict, got {type(d).__name__}")
        unknown = sorted(k for k in d if k not in _UNDERSTOOD_KEYS and k not in _HARMLESS_KEYS
                         and k not in _REQUIRED_VALUES)
        if unknown:
            raise ValueError(f"unsupported config key(s) {unknown}: not understood by mnemojax and not known to be "
                             "harmless; refusing to guess what they do")
        for key, allowed in _REQUIRED_VALUES.items():
            if key in d and not _value_in(d[key], allowed):
                raise ValueError(f"{key}={d[key]!r} is not supported (mnemojax implements {key} in {list(allowed)})")

        def required(key):
            if d.get(key) is None:
                raise ValueError(f"config is missing required key {key!r}")
            return d[key]

        for key in ("rms_norm_eps", "rope_theta", "tie_word_embeddings"):  # HF's default only when it is absent
            if key in d and d[key] is None:
                raise ValueError(f"{key} is null: give a value, or leave the key out for its default")
        hidden, num_heads = required("hidden_size"), required("num_attention_heads")
        head_dim = d.get("head_dim")
        if head_dim is None:
            if not isinstance(hidden, int) or not isinstance(num_heads, int) or hidden % num_heads:
                raise ValueError(f"head_dim is not given and hidden_size ({hidden!r}) is not a multiple of "
                                 f"num_attention_heads ({num_heads!r})")
            head_dim = hidden // num_heads
        max_pos = required("max_position_embeddings")
        rope_theta, rope_scaling = _rope_from_hf(d, max_pos)
        num_kv_heads = d.get("num_key_value_heads")
        eps = d.get("rms_norm_eps")
        tie = d.get("tie_word_embeddings")
        try:
            return cls(
                vocab_size=required("vocab_size"),
                hidden_size=hidden,
                intermediate_size=required("intermediate_size"),
                num_layers=required("num_hidden_layers"),
                num_heads=num_heads,
                num_kv_heads=num_heads if num_kv_heads is None else num_kv_heads,
                head_dim=head_dim,
                max_position_embeddings=max_pos,
                rms_norm_eps=_HF_DEFAULT_RMS_NORM_EPS if eps is None else _float("rms_norm_eps", eps),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                tie_word_embeddings=False if tie is None else tie,
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=_eos_ids("eos_token_id", d.get("eos_token_id")),
            )
        except ValueError as e:  # name the config.json keys, not this class's fields
            raise ValueError(_HF_NAME.sub(lambda m: _HF_KEYS[m.group(0)], str(e))) from None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> LlamaConfig:
        """Reads `path/config.json` of a local Hugging Face Llama directory.

        If `path/generation_config.json` exists and names `eos_token_id`, those ids are added (after the
        config's own ones, duplicates dropped): Llama-3 Instruct checkpoints list `<|eot_id|>` only there.
        """
        path = os.fspath(path)
        config_file = os.path.join(path, "config.json")
        if not os.path.isdir(path):
            raise FileNotFoundError(f"model {path!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a "
                                    "local checkpoint directory (hub ids are not downloaded)")
        if not os.path.isfile(config_file):
            raise FileNotFoundError(f"no config.json in {path!r}")
        config = cls.from_hf_config(json_object(config_file))
        gen_file = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_file):
            gen = json_object(gen_file)
            extra = _eos_ids("generation_config.json eos_token_id", gen.get("eos_token_id"))
            for t in extra:
                _check_token_id(f"{gen_file} eos_token_id", t, config.vocab_size)
            eos = config.eos_token_ids + tuple(t for t in dict.fromkeys(extra) if t not in config.eos_token_ids)
            config = dataclasses.replace(config, eos_token_ids=eos)
        return config

    def mesh_layout(self, *, tp: int, spp: int) -> tuple[int, int]:
        """(layers, kv heads) of the parameters as laid out on a mesh with these tp and spp degrees.

        Layers are padded with zero layers to a multiple of `spp` (uneven stages). A zero layer is an exact
        identity: its attention and MLP outputs are 0 and the residual passes through unchanged. KV heads are
        repeated when `tp` exceeds their number, so each tp rank holds the one KV head its query heads use.
        """
        if self.num_heads % tp:
            raise ValueError(f"tp ({tp}) must divide the number of attention heads ({self.num_heads})")
        if tp <= self.num_kv_heads and self.num_kv_heads % tp:
            raise ValueError(f"tp ({tp}) must divide the number of KV heads ({self.num_kv_heads}) or be a multiple "
                             "of it")
        if tp > self.num_kv_heads and tp % self.num_kv_heads:
            raise ValueError(f"tp ({tp}) must be a multiple of the number of KV heads ({self.num_kv_heads}) or "
                             "divide it")
        if self.intermediate_size % tp:
            raise ValueError(f"tp ({tp}) must divide the MLP width intermediate_size ({self.intermediate_size})")
        if spp > self.num_layers:
            raise ValueError(f"spp ({spp}) exceeds the number of layers ({self.num_layers})")
        return -(-self.num_layers // spp) * spp, max(self.num_kv_heads, tp)

    def kv_page_bytes(self, *, page_size: int, tp: int, spp: int, dtype_bytes: int) -> int:
        """Bytes of one KV page on one device: K and V of its stage's layers and its tp share of the KV heads, in
        the mesh layout. The engine sizes its cache and the simulator its page pool with this one formula."""
        num_layers, kv_heads = self.mesh_layout(tp=tp, spp=spp)
        return 2 * (num_layers // spp) * page_size * (kv_heads // tp) * self.head_dim * dtype_bytes

    def to_hf_dict(self) -> dict[str, Any]:
        """Keyword arguments for `transformers.LlamaConfig(**d)`; `from_hf_config` reads them back unchanged.

        Uses the `rope_theta` / `rope_scaling` spelling, which transformers 4 and 5 both accept.
        """
        eos = self.eos_token_ids
        return {
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": _rope_scaling_to_hf(self.rope_scaling),
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (None if not eos else eos[0] if len(eos) == 1 else list(eos)),
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
        }


def json_object(file: str) -> dict:
    """The JSON object in `file`; a file that is not JSON, or holds no object, raises ValueError naming it."""
    with open(file, encoding="utf-8") as f:
        try:
            d = json.load(f)
        except ValueError as e:
            raise ValueError(f"{file} is not JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(d).__name__}")
    return d


_GENERATION_FIELDS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature", "top_p": "top_p",
                      "top_k": "top_k", "min_p": "min_p", "max_new_tokens": "max_tokens"}
"""generation_config.json keys -> the `SamplingParams` fields they give defaults for (vLLM's)."""


def generation_defaults(path: str | os.PathLike) -> dict[str, Any]:
    """The sampling defaults a model's creator wrote in `path/generation_config.json` ({} without the file), as
    vLLM's `--generation-config auto` reads them (the file's `GenerationConfig.to_diff_dict()`, which in
    transformers 5 is every value the file sets): `repetition_penalty`, `temperature`, `top_p`, `top_k`, `min_p` and
    `max_tokens` (from `max_new_tokens`). `do_sample` is not read (vLLM does not either): `temperature` decides."""
    file = os.path.join(os.fspath(path), "generation_config.json")
    if not os.path.isfile(file):
        return {}
    gen = json_object(file)
    return {field: gen[key] for key, field in _GENERATION_FIELDS.items() if gen.get(key) is not None}


# ---------------------------------------------------------------------- what from_hf_config accepts

_UNDERSTOOD_KEYS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
    "rope_parameters", "tie_word_embeddings", "bos_token_id", "eos_token_id",
})
"""Keys read into `LlamaConfig`."""

_REQUIRED_VALUES: dict[str, tuple] = {
    "model_type": ("llama",),
    "hidden_act": ("silu",),
    "attention_bias": (False,),     # q/k/v/o biases
    "mlp_bias": (False,),           # gate/up/down biases
    "partial_rotary_factor": (1.0,),  # RoPE on a fraction of head_dim only
    "is_encoder_decoder": (False,),
    "add_cross_attention": (False,),
    "pruned_heads": ({},),          # heads removed from some layers: per-layer shapes
}
"""Keys that change the math unless they hold the value Llama 3 uses: accepted only with that value."""

_HARMLESS_KEYS = frozenset({
    # Bookkeeping.
    "architectures", "transformers_version", "_name_or_path", "_commit_hash", "torch_dtype", "dtype",
    "use_bfloat16", "id2label", "label2id", "num_labels", "problem_type", "finetuning_task", "tokenizer_class",
    "prefix", "task_specific_params", "torchscript", "tf_legacy_loss", "keys_to_ignore_at_inference",
    "_attn_implementation", "_attn_implementation_autoset", "_attn_implementation_internal",
    # Outputs HF returns besides the logits, and its KV-cache switch.
    "use_cache", "output_attentions", "output_hidden_states", "return_dict", "output_scores",
    "return_dict_in_generate",
    # Training only: weight init, and attention dropout (HF applies it only in training mode).
    "initializer_range", "attention_dropout",
    # Token ids the forward pass never reads.
    "pad_token_id", "sep_token_id", "decoder_start_token_id",
    # The same function split differently: `chunk_size_feed_forward` runs the MLP over chunks of the
    # sequence; `pretraining_tp` > 1 made transformers 4 compute the projections as sums of `pretraining_tp`
    # slices (the same math up to float rounding; transformers 5 dropped it). Llama ignores the decoder flags.
    "chunk_size_feed_forward", "pretraining_tp", "is_decoder", "tie_encoder_decoder",
    "cross_attention_hidden_size",
    # Generation defaults that transformers 4 kept in every config; sampling is set per request here.
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty",
    "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
    "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens",
})
"""Keys that do not change what the model computes at inference: accepted with any value and ignored."""

_ROPE_SCALING_KEYS = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
}
"""The keys each RoPE type reads from `rope_scaling` / `rope_parameters` (besides its type, theta and
`partial_rotary_factor`); any other key there is refused."""


def _value_in(value, allowed: tuple) -> bool:
    # `False == 0` and `1 == 1.0` are intended; a bool is not a number here (`True == 1.0` would pass).
    if isinstance(value, bool) != isinstance(allowed[0], bool):
        return False
    return value in allowed


def _rope_from_hf(d: dict, max_position_embeddings) -> tuple[float, RopeScaling | None]:
    """(rope_theta, rope_scaling) from either HF spelling, with HF's defaults and precedence made explicit."""
    params, scaling = d.get("rope_parameters"), d.get("rope_scaling")
    if params is not None and scaling is not None:
        raise ValueError("config has both rope_parameters and rope_scaling; expected one of them")
    key = "rope_parameters" if params is not None else "rope_scaling"
    rope = params if params is not None else scaling
    if rope is None:
        rope = {}
    if not isinstance(rope, dict):
        raise ValueError(f"{key} must be a dict, got {rope!r}")
    rope = dict(rope)

    theta, top_theta = rope.pop("rope_theta", None), d.get("rope_theta")
    if theta is not None and top_theta is not None and (
            _float(f"{key}.rope_theta", theta) != _float("rope_theta", top_theta)):
        raise ValueError(f"rope_theta ({top_theta}) disagrees with {key}.rope_theta ({theta})")
    theta = theta if theta is not None else top_theta if top_theta is not None else _HF_DEFAULT_ROPE_THETA
    theta = _float("rope_theta", theta)

    rope_type, legacy_type = rope.pop("rope_type", None), rope.pop("type", None)
    if rope_type is not None and legacy_type is not None and rope_type != legacy_type:
        raise ValueError(f"{key}.rope_type ({rope_type!r}) disagrees with {key}.type ({legacy_type!r})")
    rope_type = rope_type or legacy_type or "default"
    if rope_type not in _ROPE_SCALING_KEYS:
        raise ValueError(f"{key}.rope_type={rope_type!r} is not supported; supported: {sorted(_ROPE_SCALING_KEYS)}")
    if "partial_rotary_factor" in rope:
        prf = rope.pop("partial_rotary_factor")
        if not _value_in(prf, (1.0,)):
            raise ValueError(f"{key}.partial_rotary_factor={prf!r} is not supported (only 1.0)")
    extra = sorted(set(rope) - _ROPE_SCALING_KEYS[rope_type])
    if extra:
        raise ValueError(f"unsupported key(s) {extra} in {key} for rope_type {rope_type!r}")
    if rope_type == "default":
        return theta, None

    def need(name):
        if rope.get(name) is None:
            raise ValueError(f"{key}.{name} is required for rope_type {rope_type!r}")
        return _float(f"{key}.{name}", rope[name])

    if rope_type == "linear":
        return theta, RopeScaling("linear", factor=need("factor"))
    # transformers fills a missing original_max_position_embeddings with max_position_embeddings.
    original = rope.get("original_max_position_embeddings")
    return theta, RopeScaling(
        "llama3",
        factor=need("factor"),
        low_freq_factor=need("low_freq_factor"),
        high_freq_factor=need("high_freq_factor"),
        original_max_position_embeddings=max_position_embeddings if original is None else original,
    )


def _rope_scaling_to_hf(scaling: RopeScaling | None) -> dict | None:
    if scaling is None:
        return None
    out = {"rope_type": scaling.rope_type, "factor": scaling.factor}
    if scaling.rope_type == "llama3":
        out.update(low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor,
                   original_max_position_embeddings=scaling.original_max_position_embeddings)
    return out


def _eos_ids(key: str, value) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = value if isinstance(value, (list, tuple)) else [value]
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool):
            raise ValueError(f"{key} must be an int or a list of ints, got {value!r}")
    return tuple(ids)


def _float(name: str, value) -> float:
    """`value` as a float if it is an int or a float (not a bool or a string); else ValueError naming it."""
    _check_number(name, value, positive=False)
    return float(value)


def _check_int(name: str, value, *, positive: bool) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")


def _check_number(name: str, value, *, positive: bool) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if positive and not value > 0:
        raise ValueError(f"{name} must be positive, got {value}")


_HF_KEYS = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
            "num_kv_heads": "num_key_value_heads", "eos_token_ids": "eos_token_id"}
"""This class's field names that config.json spells otherwise."""
_HF_NAME = re.compile(r"\b(" + "|".join(_HF_KEYS) + r")\b")


def _check_token_id(name: str, value, vocab_size: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab_size:
        raise ValueError(f"{name}: {value!r} is not a token id in [0, {vocab_size})")


# ---------------------------------------------------------------------- presets

_LLAMA3_VOCAB = 128256
_LLAMA3_BOS = 128000
# <|end_of_text|>, <|eom_id|> (3.1+ tool calls), <|eot_id|> (end of an Instruct turn).
_LLAMA3_EOS = (128001, 128009)
_LLAMA31_EOS = (128001, 128008, 128009)
_LLAMA31_ROPE = RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=8192)
_LLAMA32_ROPE = dataclasses.replace(_LLAMA31_ROPE, factor=32.0)

PRESETS: dict[str, LlamaConfig] = {
    # Random-weight test model with the byte tokenizer: ids 0..255 are bytes, 256 = BOS, 257 = EOS,
    # 258..319 reserved (320 = 5 * 64 keeps the vocab divisible by any tp degree up to 8).
    "tiny": LlamaConfig(
        vocab_size=320, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
        head_dim=16, max_position_embeddings=8192, rope_theta=10000.0, bos_token_id=256, eos_token_ids=(257,)),
    "llama3-8b": LlamaConfig(
        vocab_size=_LLAMA3_VOCAB, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, max_position_embeddings=8192, rope_theta=500000.0,
        bos_token_id=_LLAMA3_BOS, eos_token_ids=_LLAMA3_EOS),
    "llama3-70b": LlamaConfig(
        vocab_size=_LLAMA3_VOCAB, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
        num_kv_heads=8, head_dim=128, max_position_embeddings=8192, rope_theta=500000.0,
        bos_token_id=_LLAMA3_BOS, eos_token_ids=_LLAMA3_EOS),
    "llama3.2-1b": LlamaConfig(
        vocab_size=_LLAMA3_VOCAB, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
        num_kv_heads=8, head_dim=64, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling=_LLAMA32_ROPE, tie_word_embeddings=True, bos_token_id=_LLAMA3_BOS, eos_token_ids=_LLAMA31_EOS),
    "llama3.2-3b": LlamaConfig(
        vocab_size=_LLAMA3_VOCAB, hidden_size=3072, intermediate_size=8192, num_layers=28, num_heads=24,
        num_kv_heads=8, head_dim=128, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling=_LLAMA32_ROPE, tie_word_embeddings=True, bos_token_id=_LLAMA3_BOS, eos_token_ids=_LLAMA31_EOS),
}
"""Built-in configs by name: `tiny` for tests and demos, the others with the published Llama 3 shapes."""


def preset(name: str) -> LlamaConfig:
    """The built-in config called `name` (see `PRESETS`)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}") from None
