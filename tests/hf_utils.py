"""Tiny Hugging Face Llama checkpoints for reference tests, built offline on CPU.

`make_hf_checkpoint(path, ...)` writes what a real Llama-3 directory holds - `config.json`,
`generation_config.json`, safetensors weights (one file, or shards plus `model.safetensors.index.json`) and a
tokenizer - from a randomly initialised `transformers.LlamaForCausalLM`. `load_hf_model(path)` reads it back
as the float32, eager-attention reference model.

The tokenizer is the HF twin of `models.tokenizer.ByteTokenizer`: ids 0..255 are the bytes, 256 is
`<|begin_of_text|>` (BOS), 257 `<|end_of_text|>` (EOS), 258.. are `<|reserved_N|>` up to the model's vocab size,
and the chat template is the same. It is built with the `tokenizers` library, so nothing is downloaded.

Importable both as `tests.hf_utils` and as `hf_utils` (see `tests/__init__.py`).
"""
from __future__ import annotations

import os

from models.tokenizer import BYTE_CHAT_TEMPLATE, bytes_to_unicode

BOS_ID = 256
EOS_ID = 257

_TORCH_DTYPES = ("float32", "bfloat16", "float16")


def make_hf_checkpoint(
    path,
    *,
    vocab_size: int = 320,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 4096,
    rms_norm_eps: float = 1e-5,
    weight_scale: float = 1.0,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: int | str | None = None,
    tokenizer: bool = True,
) -> str:
    """Saves a random Llama checkpoint (and by default a byte tokenizer) under `path`; returns `str(path)`.

    Weights: `LlamaForCausalLM` initialised under `torch.manual_seed(seed)` in float32 (normal, std 0.02), every
    linear / embedding weight multiplied by `weight_scale` (a larger scale makes next-token distributions
    peaked, so greedy decoding is stable across implementations), and the RMSNorm weights set to
    `1 + 0.1 * randn` so that they matter. Saved in `dtype` ("float32", "bfloat16" or "float16");
    `max_shard_size` (e.g. "20KB") splits the weights into shards with an index file.
    """
    import torch
    import transformers

    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {_TORCH_DTYPES}, got {dtype!r}")
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)

    hf_config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim if head_dim is not None else hidden_size // num_heads,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=rms_norm_eps,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(hf_config).to(torch.float32)
    with torch.no_grad():
        # named_parameters() lists a tied lm_head/embedding once, so it is scaled once.
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.mul_(weight_scale)
    model = model.to(getattr(torch, dtype))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    if tokenizer:
        make_hf_tokenizer(vocab_size).save_pretrained(path)
    return path


def load_hf_model(path):
    """The checkpoint at `path` as a float32 `LlamaForCausalLM` in eval mode with eager attention."""
    import torch
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(
        os.fspath(path), dtype=torch.float32, attn_implementation="eager")
    return model.eval()




def make_hf_tokenizer(vocab_size: int = 320):
    """A `PreTrainedTokenizerFast` that encodes text to its UTF-8 bytes (ids 0..255), BOS first.

    A BPE model with the 256 byte symbols and no merges behind a `ByteLevel` pre-tokenizer, so every byte is
    one token; special tokens `<|begin_of_text|>` = 256, `<|end_of_text|>` = 257, `<|reserved_N|>` = N for
    258 <= N < vocab_size.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 258:
        raise ValueError(f"the byte tokenizer needs vocab_size >= 258 (256 bytes + BOS + EOS), got {vocab_size}")
    byte_chars = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={byte_chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_{i}|>" for i in range(258, vocab_size)]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", BOS_ID)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        chat_template=BYTE_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


SP_PIECES = ("\u2581", "\u2581\u2581", "\u2581hello", "\u2581world", "hello", "world", "\u2581a", "a", "b", ".", ",",
             "\u00e9", "\u2581\u00e9t\u00e9")
"""The word pieces of `make_sp_tokenizer`, after its specials and byte tokens."""


def make_sp_tokenizer():
    """A `PreTrainedTokenizerFast` built as Llama-2's SentencePiece tokenizer is: `<unk>` = 0, `<s>` = 1 (BOS),
    `</s>` = 2 (EOS), byte-fallback tokens `<0x00>`..`<0xFF>` = 3..258, then `SP_PIECES` (U+2581 is a space). Its
    decoder writes U+2581 as a space, turns byte tokens into bytes, and strips one space from the start of what it
    decodes: a run of tokens decoded alone loses its first word's space."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    vocab.update({p: 259 + i for i, p in enumerate(SP_PIECES)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in ("<unk>", "<s>", "</s>")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)
