"""Incremental detokenization: the text equals a whole decode, stop strings are found where they complete, and
only what could still change is held back."""
import numpy as np
import pytest

from mnemojax.engine.detokenizer import Detokenizer
from mnemojax.scheduling.sampling_params import RequestOutputKind, SamplingParams
from models.tokenizer import ByteTokenizer
from tests.hf_utils import make_hf_tokenizer

BYTES = ByteTokenizer()


def _run(tok, ids, **params):
    """Feeds `ids` one at a time; returns the detokenizer, the stop string (or None) and every stable text seen."""
    d = Detokenizer(tok, SamplingParams(**params))
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
def test_final_only_decodes_once_at_the_end_unless_it_has_stop_strings(tok):
    """A FINAL_ONLY request shows nothing while it runs: without stop strings nothing is decoded before the flush
    (the tokenizer is not called), and the text then equals the token-by-token one; with stop strings it is
    decoded token by token, to find them."""
    rng = np.random.default_rng(1)
    ids = list("héllo wörld ✓ 😀".encode()) + [int(t) for t in rng.integers(0, 320, 40)]

    class Counting:
        calls = 0

        def decode(self, ids, skip_special_tokens=True):
            Counting.calls += 1
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    final = dict(output_kind=RequestOutputKind.FINAL_ONLY)
    d, stop, stables = _run(Counting(), ids, **final)
    assert stop is None and Counting.calls == 1 and set(stables[:-1]) == {""}
    assert d.text == _run(tok, ids)[0].text == tok.decode(ids, skip_special_tokens=True)
    Counting.calls = 0
    d, stop, _ = _run(Counting(), ids, stop=["ö"], **final)
    assert stop == "ö" and d.text == "héllo w" and Counting.calls > 1


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
