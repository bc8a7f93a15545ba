"""Structured outputs' regex on the host: the pattern against Python's `re`, the refused syntax, each token's text,
and the allowed-token masks against a finite language written out by hand."""
import itertools
import re

import numpy as np
import pytest

from mnemojax.engine.structured import RegexState, TokenGuide, token_texts
from mnemojax.scheduling.regex import Regex, RegexError

PATTERNS = [r"(yes|no)[0-9]{2,3}\.?", r"[a-c]+x?", r"\d{2}-\d", r"(ab|a)*b", r"[^a-c]{1,3}", r"a{0,2}b{2,}",
            r"(?:x|y)+?z", r"\w+@\w\.c", "", "a|", r"[\]\-a]+", r"\.\*\+", r"^ab$", r"(?P<n>a)b", r"a{,2}", r"x{a}",
            r"[-a]b", r"\s\S\W\D", r"a.b", r"(a|b|)c?", r"[\x41-\x43\u0061]{2}", r"\{\}|\|", "é+x"]
ALPHABET = "abcxyz09.-@ \n]*+{}|AéB"


@pytest.mark.parametrize("pattern", PATTERNS)
def test_fullmatch_agrees_with_python_re_on_every_short_string(pattern):
    """Every string of up to 3 characters over ALPHABET (13,000 of them), and the pattern's own matches found among
    them: `Regex.fullmatch` is `re.fullmatch` with re.ASCII (so \\d \\w \\s are ASCII)."""
    rx, want = Regex(pattern), re.compile(pattern, re.ASCII)
    matched = 0
    for n in range(4):
        for chars in itertools.product(ALPHABET, repeat=n):
            s = "".join(chars)
            assert rx.fullmatch(s) == bool(want.fullmatch(s)), (pattern, s)
            matched += rx.fullmatch(s)
    longer = {r"(yes|no)[0-9]{2,3}\.?": "no123.", r"a{0,2}b{2,}": "aabbbb", r"\w+@\w\.c": "ab_9@x.c",
              r"(?:x|y)+?z": "xyxyz", r"\d{2}-\d": "09-1", r"x{a}": "x{a}", r"\s\S\W\D": "\ta.-"}
    if pattern in longer:
        assert rx.fullmatch(longer[pattern]) and not rx.fullmatch(longer[pattern] + "a")
    elif pattern not in ("", "a|"):
        assert matched, pattern  # the short strings reach some matches


@pytest.mark.parametrize("pattern, message", [
    ("(a", "missing '\\)' at position 0"), ("a)", "unbalanced '\\)' at position 1"), ("*a", "nothing to repeat"),
    ("a{3,1}", "maximum below its minimum"), ("(?=a)", "look-arounds"), (r"(a)\1", r"the escape \\1"),
    ("a$b", "'\\$' before the pattern's end"), ("[a", "missing '\\]'"), ("a++", "possessive"),
    ("[z-a]", "out of order"), (r"\q", r"the escape \\q"), ("a{2000}", "above 1000"), ("a^", "'\\^' after"),
    ("(?i)a", "look-arounds, flags"), ("[[:alpha:]]", "POSIX"), ("\\", "trailing backslash"),
    (r"\012", "octal escapes"), ("a**", "multiple repeat"), ("a{2}{3}", "multiple repeat"), ("a?*", "multiple"),
    ("a*??", "multiple repeat"), ("(" * 400 + "a" + ")" * 400, "nested too deeply"),
])
def test_syntax_it_cannot_take_is_refused_with_its_position(pattern, message):
    with pytest.raises(RegexError, match=message):
        Regex(pattern)


def test_a_pattern_that_matches_nothing_has_a_dead_start():
    assert Regex(r"[^\s\S]").start == 0 and Regex(r"a[^\s\S]|b").start != 0


def test_token_texts_of_a_byte_tokenizer_and_a_sentencepiece_one():
    """The text a token adds after another: a byte tokenizer's bytes (ASCII alone; a lead byte of a longer UTF-8
    character is None), SentencePiece's pieces with their spaces (U+2581) and byte-fallback tokens; special tokens
    and ids past the tokenizer are None."""
    from tests.hf_utils import SP_PIECES, make_hf_tokenizer, make_sp_tokenizer

    texts = token_texts(make_hf_tokenizer(), 300)
    assert texts[ord("a")] == "a" and texts[ord(" ")] == " " and texts[ord("\n")] == "\n"
    assert texts[0xC3] is None and texts[256] is None and texts[257] is None and texts[299] is None
    sp = token_texts(make_sp_tokenizer(), 259 + len(SP_PIECES) + 3)
    piece = {p: sp[259 + i] for i, p in enumerate(SP_PIECES)}
    assert piece["\u2581hello"] == " hello" and piece["hello"] == "hello" and piece["\u2581"] == " "
    assert piece["\u2581\u00e9t\u00e9"] == " \u00e9t\u00e9" and piece["\u00e9"] == "\u00e9"
    assert sp[3 + 0x41] == "A" and sp[3 + 0xC3] is None  # byte fallback: one ASCII byte, a lead byte
    assert sp[0] is None and sp[1] is None and sp[2] is None and sp[-1] is None


# A vocabulary of strings (None: a token that is never allowed), and a finite language written out.
VOCAB = ["a", "b", "ab", "ba", "abc", "c", "-", "1", "12", "123", None, "b-1", "", "x", "ca"] + ["z"] * 20 + ["c-"]
EOS = 12  # the empty string's id: an EOS token's text is not walked
LANGUAGE = [f"{w}-{n}" for w in ("ab", "abc", "ba", "c") for n in ("1", "12", "123", "2")]


def _reference(prefix_text: str) -> list[int]:
    ok = {t for t, s in enumerate(VOCAB) if s and any(w.startswith(prefix_text + s) for w in LANGUAGE)}
    return sorted(ok | ({EOS} if prefix_text in LANGUAGE else set()))


def test_allowed_tokens_and_their_mask_bits_keep_a_whole_match_possible():
    """After every start of a word of the language (and token sequences reaching it), the allowed tokens are those
    whose text keeps the output a start of a word, EOS where it is one; the mask has token t at bit t % 32 of
    word t // 32."""
    guide = TokenGuide(Regex(r"(ab|abc|ba|c)-(1|12|123|2)"), VOCAB, [EOS])
    assert guide.words == 2
    starts = sorted({w[:i] for w in LANGUAGE for i in range(len(w) + 1)})
    for text in starts:
        state = guide.regex.walk(guide.regex.start, text)
        assert state, text
        allowed = np.flatnonzero(guide.allowed(state)).tolist()
        assert allowed == _reference(text), text
        bits = guide.mask(state)
        assert bits.dtype == np.uint32 and bits.shape == (2,)
        unpacked = [t for t in range(len(VOCAB)) if bits[t // 32] >> (t % 32) & 1]
        assert unpacked == allowed, text
    assert VOCAB[35] == "c-" and _reference("")[-1] == 35  # token 35, allowed first ("c-1"): bit 3 of word 1
    assert guide.mask(guide.regex.start)[1] == 1 << 3 and guide.mask(guide.regex.walk(guide.regex.start, "c"))[1] == 0


def test_a_requests_walk_follows_its_tokens_and_refuses_one_that_was_not_allowed():
    guide = TokenGuide(Regex(r"(ab|abc|ba|c)-(1|12|123|2)"), VOCAB, [EOS])
    walk = RegexState(guide)
    out = [2, 5]  # "ab", "c"
    assert walk.mask_after(out[:0]).tolist() == guide.mask(guide.regex.start).tolist()
    assert walk.mask_after(out).tolist() == guide.mask(guide.regex.walk(guide.regex.start, "abc")).tolist()
    out += [6, 9]  # "-", "123": a whole word, so EOS alone
    assert np.flatnonzero(np.unpackbits(walk.mask_after(out).view(np.uint8), bitorder="little")).tolist() == [EOS]
    with pytest.raises(RuntimeError, match="token 13 leaves no match possible"):
        RegexState(guide).mask_after([13])  # "x"


def test_a_multi_host_follower_receives_regex_steps_as_the_leader_sends_them(monkeypatch):
    """A step with regex rows carries their masks (a wider buffer): process 0's header says so, and a follower
    replaying process 0's broadcasts receives every step into a template of the shape that was sent (a wrong shape
    would block or misread a real collective)."""
    from mnemojax import SamplingParams, StructuredOutputsParams
    from mnemojax.engine import multihost
    from mnemojax.engine.llm_engine import EngineConfig, LLMEngine

    sent = []
    monkeypatch.setattr(multihost, "_broadcast", lambda tree: sent.append(np.array(tree)) or tree)
    engine = LLMEngine(EngineConfig(model="tiny", max_model_len=64, page_size=4, chunk_size=16,
                                    max_num_batched_tokens=32), channel=multihost.Leader())
    so = StructuredOutputsParams(regex=r"[a-z]-[0-9]")
    ids = [engine.add_request("Code:", SamplingParams(max_tokens=8, temperature=0, structured_outputs=so)),
           engine.add_request("Hello", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))]
    while engine.has_unfinished():
        engine.step()
    assert re.fullmatch(r"[a-z]-[0-9]", engine.pop_finished(ids[0]).outputs[0].text)
    headers = [a for a in sent if a.shape == (4,) and a[0] == multihost.STEP]
    assert any(h[3] >> 6 for h in headers) and any(not h[3] >> 6 for h in headers)  # masked steps, then plain ones
    # (the plain request goes on alone after the regex one's EOS)
    replay = iter(sent + [np.array([multihost.STOP, 0, 0, 0], np.int32)])

    def received(tree):
        got = next(replay)
        assert got.shape == np.shape(tree) and got.dtype == np.asarray(tree).dtype
        return got

    monkeypatch.setattr(multihost, "_broadcast", received)
    assert multihost.follow(engine.executor) == len(headers)
