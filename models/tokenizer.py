"""Tokenizers: the built-in byte tokenizer of the tiny model, and Hugging Face tokenizers of real checkpoints.

The engine uses the subset both kinds share: `encode(text, add_special_tokens=...)`,
`decode(ids, skip_special_tokens=...)`, `bos_token_id`, `eos_token_id` and
`apply_chat_template(messages, add_generation_prompt=..., tokenize=...)`. As with Llama-3's own tokenizer,
the chat template writes the BOS token into its text, so encode a templated conversation with
`add_special_tokens=False` (or ask for `tokenize=True`).
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
"""Any of these in a checkpoint directory means it carries a Hugging Face tokenizer."""


BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""`ByteTokenizer`'s chat template as Jinja (what Hugging Face tokenizers carry): its HF twin's, and what
/tokenizer_info shows. `ByteTokenizer.apply_chat_template` writes the same text without Jinja."""


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are the bytes, then special tokens up to `vocab_size`.

    Special tokens: 256 `<|begin_of_text|>` (BOS), 257 `<|end_of_text|>` (EOS), 258.. `<|reserved_N|>` (N is the
    id). Like a Hugging Face tokenizer, `encode` turns the text of a special token into its id, so a chat
    template can write BOS as text. `tests/hf_utils.make_hf_tokenizer` builds the same tokenizer as an HF one.

    Chat template (`chat_template`, the HF twin's), for messages `[{"role": r, "content": c}, ...]`:
        <|begin_of_text|><|r|>\\nc\\n ... <|r|>\\nc\\n
    followed by `<|assistant|>\\n` when `add_generation_prompt`. The role markers are plain text (bytes).
    """

    chat_template = BYTE_CHAT_TEMPLATE
    bos_token = "<|begin_of_text|>"
    eos_token = "<|end_of_text|>"
    bos_token_id = 256
    eos_token_id = 257

    def __init__(self, vocab_size: int = 320):
        if vocab_size < 258:
            raise ValueError(f"ByteTokenizer needs vocab_size >= 258 (256 bytes + BOS + EOS), got {vocab_size}")
        self.vocab_size = vocab_size
        self._special_ids = {self.bos_token: self.bos_token_id, self.eos_token: self.eos_token_id}
        self._special_ids.update({f"<|reserved_{i}|>": i for i in range(258, vocab_size)})
        self._special_texts = {i: s for s, i in self._special_ids.items()}
        self._special_re = re.compile("|".join(re.escape(s) for s in self._special_ids))

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def all_special_ids(self) -> list[int]:
        return list(range(256, self.vocab_size))

    def token_bytes(self, tid: int) -> bytes:
        """The bytes token `tid` adds to a decoded text: its byte; a special token's text in UTF-8."""
        tid = int(tid)
        if 0 <= tid < 256:
            return bytes([tid])
        if tid not in self._special_texts:
            raise ValueError(f"token id {tid} is outside the vocabulary [0, {self.vocab_size})")
        return self._special_texts[tid].encode("utf-8")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`: its UTF-8 bytes, special-token texts as their ids, BOS first if asked."""
        ids = [self.bos_token_id] if add_special_tokens else []
        pos = 0
        for m in self._special_re.finditer(text):
            ids.extend(text[pos:m.start()].encode("utf-8"))
            ids.append(self._special_ids[m.group()])
            pos = m.end()
        ids.extend(text[pos:].encode("utf-8"))
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of `ids`: bytes decoded as UTF-8 (invalid sequences become U+FFFD); special tokens dropped, or
        written as their text when `skip_special_tokens` is False."""
        parts: list[str] = []
        run = bytearray()
        for i in (int(i) for i in ids):
            if 0 <= i < 256:
                run.append(i)
                continue
            if i not in self._special_texts:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
            if not skip_special_tokens:
                parts.append(run.decode("utf-8", errors="replace"))
                run.clear()
                parts.append(self._special_texts[i])
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = False,
                            return_dict: bool = False, continue_final_message: bool = False,
                            chat_template: str | None = None, documents=None, **template_variables):
        """The conversation as text (`tokenize=False`), or as token ids; `return_dict=True` wraps the ids as
        `{"input_ids": ids}` like a Hugging Face tokenizer. The text starts with BOS (see the class docstring).
        `continue_final_message`: the last message stays open (its closing newline left out), as transformers
        renders it, for the reply to continue. `documents` and `template_variables` are accepted as a Jinja
        template's are, and unused: this template reads none. Its template is fixed: another `chat_template` is a
        ValueError (it needs a Hugging Face tokenizer)."""
        if chat_template is not None:
            raise ValueError("the built-in byte tokenizer has one fixed chat template; another chat_template needs "
                             "a Hugging Face tokenizer")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if continue_final_message and not messages:
            raise ValueError("continue_final_message needs a message to continue")
        text = self.bos_token + "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        if continue_final_message:
            text = text[:-1]
        if add_generation_prompt:
            text += "<|assistant|>\n"
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids} if return_dict else ids


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table: the alphabet of byte-level BPE tokens (Llama-3's)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1))
                 + list(range(ord("\u00ae"), ord("\u00ff") + 1)))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def special_ids(tokenizer) -> frozenset[int]:
    """The ids of `tokenizer`'s special tokens (those `decode(..., skip_special_tokens=True)` leaves out): its
    `all_special_ids`, and a Hugging Face tokenizer's added tokens marked special."""
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False))
    return frozenset(ids)


def is_byte_level(tokenizer) -> bool:
    """Whether `tokenizer` decodes each token to bytes of its own, whatever tokens surround it: the built-in
    `ByteTokenizer`, and Hugging Face tokenizers whose decoder is `ByteLevel` (Llama-3's). Then decoding a run of
    tokens that starts after a whole character gives that run's own text. Not so for SentencePiece-style decoders
    (Llama-2's `Metaspace`, or `Replace` + `Strip`): they drop the space that starts the first token decoded."""
    if isinstance(tokenizer, ByteTokenizer):
        return True
    # a slow tokenizer has no backend_tokenizer, and a fast one may have no decoder
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return decoder is not None and b'"type":"ByteLevel"' in decoder.__getstate__()


def spaces_between_special_tokens_matter(tokenizer) -> bool:
    """Whether `tokenizer`'s decode puts spaces between special tokens unless told not to (vLLM's
    `spaces_between_special_tokens`; a slow tokenizer under transformers 4 does), tried on two special tokens. Fast
    tokenizers, transformers 5's and the built-in byte tokenizer never do."""
    special = sorted(getattr(tokenizer, "all_special_ids", None) or [])
    if tokenizer is None or isinstance(tokenizer, ByteTokenizer) or len(special) < 2:
        return False
    ids = special[:2]
    return (tokenizer.decode(ids, skip_special_tokens=False) !=
            tokenizer.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False))


def token_bytes_fn(tokenizer) -> Callable[[int], bytes]:
    """`token_bytes(id)` for `tokenizer`: the bytes a token adds to a decoded text (a token that is not whole UTF-8
    by itself, a piece of a character, has its own bytes, not U+FFFD's); a special token gives its text in UTF-8.

    `ByteTokenizer`: its byte. Hugging Face: a byte-level BPE token (its decoder is `ByteLevel`, as Llama-3's) maps
    its symbols back through GPT-2's byte table; a SentencePiece byte-fallback token `<0xNN>` is that byte; any other
    token is its piece as UTF-8, with SentencePiece's `\u2581` as a space."""
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.token_bytes
    specials = special_ids(tokenizer)
    byte_level = is_byte_level(tokenizer)
    table = {c: b for b, c in bytes_to_unicode().items()}

    def token_bytes(tid: int) -> bytes:
        piece = tokenizer.convert_ids_to_tokens(int(tid))
        if tid in specials or not isinstance(piece, str):
            return tokenizer.decode([tid], skip_special_tokens=False).encode("utf-8")
        if byte_level and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        m = _BYTE_FALLBACK.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    return token_bytes


RENDER_ARGUMENTS = frozenset({"conversation", "messages", "add_generation_prompt", "tokenize", "return_dict",
                              "chat_template", "tools", "documents", "continue_final_message", "tokenizer_kwargs",
                              "return_assistant_tokens_mask", "padding", "truncation", "max_length"})
"""`apply_chat_template`'s own arguments: not template variables, so not for `chat_template_kwargs` to set."""


def has_hf_tokenizer(path_or_preset: str | os.PathLike) -> bool:
    """Whether `load_tokenizer` gives a Hugging Face tokenizer for this model (read without loading it): a
    directory with tokenizer files."""
    path = os.fspath(path_or_preset)
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES)


def load_tokenizer(path_or_preset: str | os.PathLike):
    """The tokenizer for a model: `"tiny"` -> `ByteTokenizer()`; a checkpoint directory with tokenizer files
    (`TOKENIZER_FILES`) -> `transformers.AutoTokenizer.from_pretrained(path)`; a directory without them ->
    None (the engine then takes token-id prompts only)."""
    if path_or_preset == "tiny":
        return ByteTokenizer()
    path = os.fspath(path_or_preset)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no model preset or checkpoint directory named {path!r}")
    if not has_hf_tokenizer(path):
        return None
    import transformers

    return transformers.AutoTokenizer.from_pretrained(path)
