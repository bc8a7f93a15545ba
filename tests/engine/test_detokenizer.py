"""Incremental detokenization: the text equals a whole decode, stop strings are found where they complete, and
only what could still change is held back."""
import numpy as np
import pytest

from mnemojax.engine.detokenizer import Detokenizer
from mnemojax.scheduling.sampling_params import RequestOutputKind, SamplingParams
from models.tokenizer import ByteTokenizer
from tests.hf_utils import SP_PIECES, make_hf_tokenizer, make_sp_tokenizer

BYTES = ByteTokenizer()


def _run(tok, ids, prompt=(), **params):
    """Feeds `ids` one at a time; returns the detokenizer, the stop string (or None) and every stable text seen."""
    d = Detokenizer(tok, SamplingParams(**params), prompt)
    stables, stop = [], None
    for t in ids:
        stop = d.add([t])
        stables.append(d.stable_text)
        if stop is not None:
            break
    else:
        d.flush()
    stables.append(d.stable_text)
    return d, stop, stables


@pytest.mark.parametrize("tok", [BYTES, make_hf_tokenizer()], ids=["byte", "hf-byte-level-bpe"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_text_equals_whole_decode_and_stable_text_only_grows(tok, skip_special_tokens):
    """Random bytes (mostly not valid UTF-8), multi-byte characters split over tokens, and special tokens."""
    rng = np.random.default_rng(0)
    words = [list("héllo wörld ✓ 😀".encode()), list(rng.integers(0, 256, 40)), [256, 257, 300]]
    for trial in range(20):
        ids = [int(t) for w in rng.permutation(len(words)) for t in words[w]]
        ids += [int(t) for t in rng.integers(0, 320, 30)]
        d, stop, stables = _run(tok, ids, skip_special_tokens=skip_special_tokens)
        assert stop is None
        assert d.text == tok.decode(ids, skip_special_tokens=skip_special_tokens)
        for a, b in zip(stables, stables[1:]):
            assert b.startswith(a)  # nothing shown is ever taken back
        assert stables[-1] == d.text


@pytest.mark.parametrize("tok", [BYTES, make_hf_tokenizer()], ids=["byte", "hf-byte-level-bpe"])
def test_final_only_decodes_once_at_the_end_unless_it_has_stop_strings(tok, monkeypatch):
    """A FINAL_ONLY request shows nothing while it runs: without stop strings nothing is decoded before the flush
    (the tokenizer is called once), and the text then equals the token-by-token one; with stop strings it is
    decoded token by token, to find them."""
    rng = np.random.default_rng(1)
    ids = list("héllo wörld ✓ 😀".encode()) + [int(t) for t in rng.integers(0, 320, 40)]
    expected = _run(tok, ids)[0].text
    assert expected == tok.decode(ids, skip_special_tokens=True)
    calls = []
    decode = tok.decode
    monkeypatch.setattr(tok, "decode", lambda ids, **kw: calls.append(1) or decode(ids, **kw))

    final = dict(output_kind=RequestOutputKind.FINAL_ONLY)
    d, stop, stables = _run(tok, ids, **final)
    assert stop is None and len(calls) == 1 and set(stables[:-1]) == {""}
    assert d.text == expected
    calls.clear()
    d, stop, _ = _run(tok, ids, stop=["ö"], **final)
    assert stop == "ö" and d.text == "héllo w" and len(calls) > 1


def test_incomplete_character_is_not_text_until_its_last_byte():
    d = Detokenizer(BYTES, SamplingParams())
    check = "✓".encode()  # three bytes
    assert d.add([ord("a")]) is None and d.stable_text == "a"
    d.add([check[0]])
    d.add([check[1]])
    assert d.text == "a" and d.stable_text == "a"
    d.add([check[2]])
    assert d.text == "a✓"


def test_stop_string_cuts_the_text_and_finishes():
    d, stop, _ = _run(BYTES, list(b"say hello world"), stop=["lo w", "zz"])
    assert stop == "lo w" and d.finished and d.text == "say hel"
    d, stop, _ = _run(BYTES, list(b"say hello world"), stop=["lo w"], include_stop_str_in_output=True)
    assert stop == "lo w" and d.text == "say hello w"


def test_stop_string_completed_by_a_multibyte_character():
    d, stop, _ = _run(BYTES, list("x=✓!".encode()), stop=["=✓"])
    assert stop == "=✓" and d.text == "x"


def test_only_a_possible_start_of_a_stop_string_is_held_back():
    d = Detokenizer(BYTES, SamplingParams(stop=["hello", "abc"]))
    d.add(list(b"xyz"))
    assert d.stable_text == "xyz"  # no stop string starts with any tail of "xyz"
    d.add(list(b"hel"))
    assert d.stable_text == "xyz"  # "hel" may become "hello"
    d.add(list(b"p"))
    assert d.stable_text == "xyzhelp"
    d.add(list(b"ab"))
    assert d.stable_text == "xyzhelp"
    d.flush()
    assert d.stable_text == "xyzhelpab"


def test_adding_after_finish_raises():
    d, stop, _ = _run(BYTES, list(b"ab"), stop=["b"])
    assert stop == "b"
    with pytest.raises(RuntimeError, match="finished"):
        d.add([1])


def _time_tokens(stop: list[str], ids: list[int]) -> float:
    import time

    d = Detokenizer(BYTES, SamplingParams(stop=stop))
    t0 = time.perf_counter()
    for t in ids:
        d.add([t])
        d.stable_text
    return time.perf_counter() - t0


def test_stop_strings_cost_per_token_does_not_grow_with_their_length():
    """A long stop string costs about what a short one does per token, not time proportional to its length (here
    no tail of the output starts it, so a check that tries every possible length of held-back text tries all)."""
    ids = list(b"b" * 1500)
    short = min(_time_tokens(["ab"], ids) for _ in range(3))
    long = min(_time_tokens(["a" * 1023 + "b"], ids) for _ in range(3))
    assert long < 10 * short, (long, short)


@pytest.mark.parametrize("seed", range(5))
def test_stop_and_held_back_text_match_a_brute_force_reference(seed):
    rng = np.random.default_rng(seed)
    alphabet = list(b"ab")
    stops = ["".join(chr(c) for c in rng.choice(alphabet, int(rng.integers(1, 7)))) for _ in range(3)]
    ids = [int(c) for c in rng.choice(alphabet, 40)]
    d = Detokenizer(BYTES, SamplingParams(stop=stops))
    text = ""
    for t in ids:
        text += chr(t)
        stop = d.add([t])
        if any(s in text for s in stops):
            s = next(s for s in stops if s in text)  # the first stop string (in the request's order) present
            assert stop == s and d.text == text[:text.find(s)]
            return
        assert stop is None
        held = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        assert d.stable_text == text[:len(text) - held]


def _sp_ids(tok, rng, n):
    """`n` tokens of `make_sp_tokenizer`: word pieces, "é" and "✓" as byte-fallback tokens (split characters),
    and its BOS / EOS; whole pieces only, so every run of byte tokens is valid UTF-8 (see the next tests)."""
    pieces = [[tok.convert_tokens_to_ids(p)] for p in SP_PIECES]
    pieces += [[3 + b for b in "é".encode()], [3 + b for b in "✓".encode()], [1], [2]]
    out = []
    while len(out) < n:
        out += pieces[int(rng.integers(len(pieces)))]
    return out


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_sentencepiece_text_is_what_the_output_adds_to_the_prompt(skip_special_tokens):
    """A SentencePiece decoder drops the space that starts the first token it decodes, so windows decoded alone
    lost every word's space ("helloworld"). The text is what the output adds to the prompt's text, as Hugging Face
    decodes the two together (vLLM's convention: "The capital is" goes on with " Paris"); with no prompt, the whole
    decode of the output. Nothing shown is taken back."""
    tok = make_sp_tokenizer()
    rng = np.random.default_rng(0)
    words = [tok.convert_tokens_to_ids(p) for p in SP_PIECES if p.startswith("\u2581") and p.strip("\u2581")]
    for trial in range(30):
        prompt = [1] + [int(t) for t in rng.choice(words, int(rng.integers(1, 9)))]
        ids = _sp_ids(tok, rng, 25)
        d, stop, stables = _run(tok, ids, prompt, skip_special_tokens=skip_special_tokens)
        whole = tok.decode(prompt + ids, skip_special_tokens=skip_special_tokens)
        before = tok.decode(prompt, skip_special_tokens=skip_special_tokens)
        assert whole.startswith(before) and d.text == whole[len(before):], (prompt, ids)
        assert all(b.startswith(a) for a, b in zip(stables, stables[1:])) and stables[-1] == d.text
        alone, _, _ = _run(tok, ids, skip_special_tokens=skip_special_tokens)
        assert alone.text == tok.decode(ids, skip_special_tokens=skip_special_tokens), ids


def test_sentencepiece_words_keep_their_spaces_and_stop_strings_span_them():
    tok = make_sp_tokenizer()
    ids = [tok.convert_tokens_to_ids(p) for p in ["\u2581hello", "\u2581world", ".", "\u2581a", "b"]]
    prompt = [1, tok.convert_tokens_to_ids("\u2581a")]
    d, stop, _ = _run(tok, ids, prompt)
    assert stop is None and d.text == " hello world. ab"
    d, stop, _ = _run(tok, ids, prompt, stop=["o w"])
    assert stop == "o w" and d.text == " hell"
    d, stop, _ = _run(tok, ids, prompt, output_kind=RequestOutputKind.FINAL_ONLY)
    assert d.text == " hello world. ab"


def test_sentencepiece_stray_byte_is_one_replacement_character():
    """A byte token that continues no character is one U+FFFD, and the whole character before it stays as it was
    shown (as UTF-8 decoding with replacement, and a byte-level tokenizer, write it). The tokenizers library's
    `ByteFallback` decoder differs here: a run of byte tokens that is not all valid UTF-8 becomes one U+FFFD per
    token, the complete "✓" too, which the stream has already shown."""
    tok = make_sp_tokenizer()
    ids = [tok.convert_tokens_to_ids("hello")] + [3 + b for b in "✓".encode()] + [3 + 0x80]
    d, _, stables = _run(tok, ids, [1, tok.convert_tokens_to_ids("\u2581a")])
    assert d.text == "hello✓\ufffd" and "hello✓" in stables
    assert tok.decode(ids) == "hello" + "\ufffd" * 4
    # a prompt that ends inside a character: its words before still give the output's first word its space
    d, _, _ = _run(tok, [tok.convert_tokens_to_ids("\u2581world")], [1, tok.convert_tokens_to_ids("\u2581a"), 3 + 0xE2])
    assert d.text == " world"
    d, _, _ = _run(tok, ids[:-1] + [3 + 0xC3])  # it ends inside a character ("é" is C3 A9)
    assert d.text == "hello✓\ufffd"


@pytest.mark.parametrize("stop, min_tokens, text, found", [
    ("is", 0, " ", "is"),  # the first " is" stops at once
    ("is", 5, " is Lee, th", "is"),  # " is" ends in token 3: not a stop; "this" ends in token 13
    ("Le", 5, " is ", "Le"),  # starts in token 5, ends in token 6: a stop (vLLM's window reaches back)
    ("ee", 6, " is L", "ee"),  # ends in token 7, after the first 6: a stop
    ("ee", 7, " is Lee, this is", None),  # ends in token 7, one of the first 7: no stop, nor later
])
def test_stop_strings_in_the_first_min_tokens_tokens_do_not_count(stop, min_tokens, text, found):
    """vLLM's min_tokens: a stop string ending in the text of the first min_tokens tokens is no stop; one ending
    later is, even if it began inside them. One byte per token: token i (from 1) is character i."""
    ids = list(b" is Lee, this is")
    d, got, _ = _run(BYTES, ids, stop=[stop], min_tokens=min_tokens, max_tokens=len(ids))
    assert (got, d.text) == (found, text)
