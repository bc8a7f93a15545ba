"""SamplingParams: defaults, normalization, and one ValueError per bad field that names the field."""
import math
import re

import numpy as np
import pytest

from mnemojax.scheduling.sampling_params import MAX_LOGPROBS, ParamError, SamplingParams, truncate_prompt


def test_defaults_and_normalization():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (16, 1.0, 1.0, -1, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.logprobs is None and p.prompt_logprobs is None
    assert not p.greedy
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0) and not p.penalized
    assert all(SamplingParams(**{k: v}).penalized
               for k, v in (("presence_penalty", -0.5), ("frequency_penalty", 0.1), ("repetition_penalty", 1.01)))
    assert type(SamplingParams(repetition_penalty=np.int64(2)).repetition_penalty) is float

    p = SamplingParams(stop="###", stop_token_ids=(7, np.int64(9)), temperature=0, top_k=np.int32(4))
    assert p.stop == ["###"]
    assert p.stop_token_ids == [7, 9] and all(type(t) is int for t in p.stop_token_ids)
    assert type(p.top_k) is int and type(p.temperature) is float
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


@pytest.mark.parametrize("temperature, greedy", [(0, True), (0.0, True), (1e-6, True), (1e-5, False), (0.7, False)])
def test_greedy_threshold(temperature, greedy):
    assert SamplingParams(temperature=temperature).greedy is greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_tokens=1, temperature=0.0, top_p=1e-9, top_k=0),
        dict(top_k=-1, top_p=1.0, seed=0),
        dict(top_k=1, seed=2**63 - 1, logprobs=0, prompt_logprobs=MAX_LOGPROBS),
        dict(temperature=100, top_p=1, stop=["a", "\n\n"], stop_token_ids=[0, 5]),
        dict(ignore_eos=True, skip_special_tokens=False, include_stop_str_in_output=True),
        dict(presence_penalty=-2, frequency_penalty=2.0, repetition_penalty=2.0 ** -126),
        dict(presence_penalty=2.0, frequency_penalty=-2, repetition_penalty=2.0 ** 127),
    ],
)
def test_accepts_boundary_values(kwargs):
    SamplingParams(**kwargs).validate(vocab_size=6)


# (kwargs, field named in the message, limit the message states)
BAD = [
    (dict(max_tokens=0), "max_tokens", "at least 1, got 0"),
    (dict(max_tokens=-5), "max_tokens", "at least 1"),
    (dict(max_tokens=1.5), "max_tokens", "int"),
    (dict(max_tokens="3"), "max_tokens", "int"),
    (dict(max_tokens=True), "max_tokens", "int"),
    (dict(temperature=-0.1), "temperature", ">= 0"),
    (dict(temperature=math.nan), "temperature", "finite number >= 0, got nan"),
    (dict(temperature=math.inf), "temperature", "finite"),
    (dict(temperature="1"), "temperature", "number"),
    (dict(temperature=False), "temperature", "number"),
    (dict(top_p=1.5), "top_p", "(0, 1], got 1.5"),
    (dict(top_p=0.0), "top_p", "(0, 1]"),
    (dict(top_p=-0.5), "top_p", "(0, 1]"),
    (dict(top_p=math.nan), "top_p", "(0, 1]"),
    (dict(top_p=None), "top_p", "(0, 1]"),
    (dict(top_k=-3), "top_k", "-1 or 0 (disabled), or at least 1, got -3"),
    (dict(top_k=2.0), "top_k", "at least 1"),
    (dict(seed=-1), "seed", "[0, 2**63)"),
    (dict(seed=2**63), "seed", "[0, 2**63)"),
    (dict(seed=1.0), "seed", "int"),
    (dict(seed=True), "seed", "int"),
    (dict(seed="7"), "seed", "int"),
    (dict(stop=""), "stop", "non-empty"),
    (dict(stop=["ok", ""]), "stop", "non-empty"),
    (dict(stop=["ok", 3]), "stop", "strings"),
    (dict(stop=5), "stop", "strings"),
    (dict(stop_token_ids=[1, -2]), "stop_token_ids", ">= 0"),
    (dict(stop_token_ids=[1.0]), "stop_token_ids", "ints"),
    (dict(stop_token_ids=[True]), "stop_token_ids", "ints"),
    (dict(stop_token_ids=3), "stop_token_ids", "ints"),
    (dict(ignore_eos=1), "ignore_eos", "bool"),
    (dict(skip_special_tokens="yes"), "skip_special_tokens", "bool"),
    (dict(include_stop_str_in_output=None), "include_stop_str_in_output", "bool"),
    (dict(logprobs=-1), "logprobs", f"between 0 and {MAX_LOGPROBS}"),
    (dict(logprobs=MAX_LOGPROBS + 1), "logprobs", "between 0 and 20, got 21"),
    (dict(logprobs=2.0), "logprobs", "between 0 and 20"),
    (dict(logprobs=True), "logprobs", "between 0 and 20"),
    (dict(prompt_logprobs=21), "prompt_logprobs", "between 0 and 20, got 21"),
    (dict(prompt_logprobs=-1), "prompt_logprobs", "between 0 and 20"),
    (dict(allowed_token_ids=[]), "allowed_token_ids", "must not be empty"),
    (dict(allowed_token_ids=[3, -1]), "allowed_token_ids", "ints >= 0"),
    (dict(allowed_token_ids=[1.0]), "allowed_token_ids", "ints >= 0"),
    (dict(allowed_token_ids=5), "allowed_token_ids", "list of token ids"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens", "int >= 1, or -1 (the model's max_model_len), got 0"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens", "int >= 1, or -1"),
    (dict(truncate_prompt_tokens=2.0), "truncate_prompt_tokens", "int >= 1, or -1"),
    (dict(truncate_prompt_tokens=True), "truncate_prompt_tokens", "int >= 1, or -1"),
    (dict(presence_penalty=2.5), "presence_penalty", "[-2, 2], got 2.5"),
    (dict(presence_penalty=math.nan), "presence_penalty", "[-2, 2]"),
    (dict(presence_penalty="1"), "presence_penalty", "[-2, 2]"),
    (dict(frequency_penalty=-2.01), "frequency_penalty", "[-2, 2], got -2.01"),
    (dict(frequency_penalty=True), "frequency_penalty", "[-2, 2]"),
    (dict(repetition_penalty=0), "repetition_penalty", "a number > 0, from 2**-126 to 2**127 (float32's normal "
                                                       "range), got 0"),
    (dict(repetition_penalty=-1.0), "repetition_penalty", "> 0"),
    (dict(repetition_penalty=math.inf), "repetition_penalty", "2**127"),
    (dict(repetition_penalty=math.nan), "repetition_penalty", "2**127"),
    (dict(repetition_penalty=1e39), "repetition_penalty", "got 1e+39"),  # inf in float32
    (dict(repetition_penalty=1e-46), "repetition_penalty", "got 1e-46"),  # 0 in float32
]


@pytest.mark.parametrize("kwargs, field, limit", BAD, ids=[f"{f}={list(k.values())[0]!r}" for k, f, _ in BAD])
def test_rejects_bad_field_with_named_message(kwargs, field, limit):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert message.startswith(field + " "), message  # the field is named first, vLLM style
    assert limit in message, message


def test_validate_checks_stop_token_ids_against_vocab():
    p = SamplingParams(stop_token_ids=[0, 99, 100, 7])
    p.validate()  # no vocabulary given: any non-negative id
    p.validate(vocab_size=101)
    with pytest.raises(ValueError, match=re.escape("stop_token_ids must be in [0, 100)") + ".*got \\[100\\]"):
        p.validate(vocab_size=100)
    with pytest.raises(ValueError, match="vocab_size must be a positive int"):
        p.validate(vocab_size=0)


def test_validate_sees_changes_after_construction():
    p = SamplingParams()
    p.top_p = 2.0
    with pytest.raises(ValueError, match=re.escape("top_p must be in (0, 1], got 2.0")):
        p.validate()
    p.top_p = 0.5
    p.max_tokens = 0
    with pytest.raises(ValueError, match="max_tokens must be at least 1, got 0"):
        p.validate(vocab_size=10)


@pytest.mark.parametrize("field, value", [("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0), ("top_k", -2),
                                          ("seed", -1), ("stop", [""]), ("stop_token_ids", [-1]),
                                          ("ignore_eos", 1), ("logprobs", 21), ("prompt_logprobs", -1)])
def test_errors_name_their_field(field, value):
    """The HTTP server reports `ParamError.param` as the OpenAI error's `param`."""
    with pytest.raises(ParamError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field and str(e.value).startswith(field)


def test_truncate_prompt_keeps_the_last_k_tokens():
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens; -1 is max_model_len; None, or a k at least the
    prompt's length, changes nothing; a k past max_model_len is refused, naming the field and the limit."""
    ids = [5, 6, 7, 8, 9]
    assert truncate_prompt(ids, None, 4) == ids
    assert truncate_prompt(ids, 2, 100) == [8, 9] and truncate_prompt(ids, 1, 100) == [9]
    assert truncate_prompt(ids, 5, 100) == ids and truncate_prompt(ids, 9, 100) == ids
    assert truncate_prompt(ids, -1, 3) == [7, 8, 9] and truncate_prompt(ids, -1, 8) == ids
    longer = re.escape("truncate_prompt_tokens (9) is greater than max_model_len (8)")
    with pytest.raises(ParamError, match=longer) as e:
        truncate_prompt(ids, 9, 8)
    assert e.value.param == "truncate_prompt_tokens"
    with pytest.raises(ParamError, match="got 0"):
        truncate_prompt(ids, 0, 8)
    assert SamplingParams(truncate_prompt_tokens=np.int64(3)).truncate_prompt_tokens == 3


def test_allowed_token_ids_are_distinct_ints_in_the_vocabulary():
    p = SamplingParams(allowed_token_ids=(9, np.int32(4), 9, 2))
    assert p.allowed_token_ids == [9, 4, 2] and all(type(t) is int for t in p.allowed_token_ids)
    p.validate(vocab_size=10)
    with pytest.raises(ParamError, match=re.escape("allowed_token_ids must be in [0, 9) (the vocabulary), got [9]")):
        p.validate(vocab_size=9)


def test_bad_words_are_strings_with_text_and_their_token_ids_lists_in_the_vocabulary():
    p = SamplingParams(bad_words=("foo", " bar"), bad_words_token_ids=[(np.int64(3), 4), [5]])
    assert p.bad_words == ["foo", " bar"] and p.bad_words_token_ids == [[3, 4], [5]]
    assert all(type(t) is int for q in p.bad_words_token_ids for t in q)
    p.validate(vocab_size=6)
    with pytest.raises(ParamError, match=re.escape("bad_words_token_ids must be in [0, 5) (the vocabulary), got [5]")):
        p.validate(vocab_size=5)
    for words in ("foo", ["foo", 3]):
        with pytest.raises(ParamError, match="bad_words must be a list of strings") as e:
            SamplingParams(bad_words=words)
        assert e.value.param == "bad_words"
    with pytest.raises(ParamError, match="bad_words must not be empty or only spaces"):
        SamplingParams(bad_words=["ok", " \n"])
    for seqs in ([[]], [3], [[1, -1]], [[1.0]]):
        with pytest.raises(ParamError, match="bad_words_token_ids must be a list of non-empty lists") as e:
            SamplingParams(bad_words_token_ids=seqs)
        assert e.value.param == "bad_words_token_ids"
