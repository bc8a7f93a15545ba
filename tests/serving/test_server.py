"""The OpenAI-compatible server, driven by the real `openai` client and raw HTTP on loopback.

One `AsyncLLM` serves three apps (no key; an API key; a queue of 1), each on its own port. Results are compared
with the offline `LLM` on the same engine configuration: the server must return exactly what the library does.
"""
import asyncio
import concurrent.futures
import itertools
import json
import logging
import pathlib
import re
import socket
import threading
import time
import urllib.parse

import httpx
import numpy as np
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from mnemojax import LLM, BeamSearchParams, SamplingParams
from mnemojax.engine.beam_search import BeamSearch
from mnemojax.serving.app import build_app
from mnemojax.engine.async_llm import AsyncLLM
from models.tokenizer import ByteTokenizer
from tests.server_utils import ThreadServer, metrics, wait_for

# 63 usable pages of 4 tokens: far fewer than 64 clients need at once, so the load test also runs out of pages.
KW = dict(max_model_len=128, page_size=4, num_pages=64, chunk_size=16, max_num_batched_tokens=64, max_num_seqs=32)
MAX_BYTES = 64 * 1024
FUZZ_EXAMPLES = 40  # per operation and generation mode


@pytest.fixture(scope="module")
def llm():
    llm = AsyncLLM("tiny", **KW)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def offline():
    return LLM("tiny", **KW)


@pytest.fixture(scope="module")
def served(llm):
    s = ThreadServer(build_app(llm, served_model_name="tiny", max_queue=10_000, max_request_bytes=MAX_BYTES))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def url(served):
    return served.url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return ["".join(chr(c) for c in rng.integers(32, 127, int(rng.integers(3, 40)))) for _ in range(n)]


def _lps(out):
    return [d[t] for t, d in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)]


# ---------------------------------------------------------------- the API against the library
def test_models_and_health(client, url):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{url}/health").status_code == 200
    # vLLM's /ping (GET and POST: /health's answer) and /version (the installed package's)
    assert httpx.get(f"{url}/ping").status_code == httpx.post(f"{url}/ping").status_code == 200
    pyproject = (pathlib.Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert httpx.get(f"{url}/version").json() == {"version": re.search(r'^version = "(.+)"', pyproject, re.M)[1]}


def test_completions_equal_offline(client, offline):
    prompts = _prompts(3)
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=3)
    ref = offline.generate(prompts, params)
    got = client.completions.create(model="tiny", prompt=prompts, max_tokens=10, temperature=0, logprobs=3)
    assert [c.index for c in got.choices] == [0, 1, 2]
    for c, r in zip(got.choices, ref):
        assert c.text == r.outputs[0].text
        assert c.finish_reason == r.outputs[0].finish_reason == "length"
        np.testing.assert_allclose(c.logprobs.token_logprobs, _lps(r), rtol=0, atol=1e-6)
        assert all(3 <= len(top) <= 4 for top in c.logprobs.top_logprobs)
    assert got.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in ref)
    assert got.usage.completion_tokens == 30


def test_token_id_prompt_seed_and_stop(client, offline):
    ids = [256, 72, 105, 33, 10, 40]
    ref = offline.generate([ids], SamplingParams(max_tokens=12, temperature=0.9, seed=11))[0].outputs[0]
    got = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0.9, seed=11)
    assert got.choices[0].text == ref.text
    # a stop string taken from the output itself cuts the text there
    stop = ref.text[4:6]
    ref_stop = offline.generate([ids], SamplingParams(max_tokens=12, temperature=0.9, seed=11, stop=stop))[0]
    got = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0.9, seed=11, stop=stop)
    assert got.choices[0].text == ref_stop.outputs[0].text == ref.text[:ref.text.find(stop)]
    assert got.choices[0].finish_reason == "stop"


def test_min_p_top_k_min_tokens_and_logit_bias_reach_the_engine(client, offline, url):
    """vLLM's extra sampling fields and OpenAI's logit_bias: the same tokens as the library with the same values
    (min_p 1 keeps only the top token, so the hot request is the greedy one)."""
    ids = [256, 72, 105, 33, 10, 40]
    greedy = offline.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0]
    got = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=1.5, seed=3,
                                    extra_body={"min_p": 1.0, "ignore_eos": True})
    assert got.choices[0].text == greedy.text
    params = SamplingParams(max_tokens=8, temperature=1.2, seed=3, min_p=0.2, top_k=20, ignore_eos=True)
    ref = offline.generate([ids], params)[0].outputs[0]
    got = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=1.2, seed=3,
                                    extra_body={"min_p": 0.2, "top_k": 20, "ignore_eos": True})
    assert got.choices[0].text == ref.text
    # OpenAI's logit_bias (string keys) and vLLM's min_tokens: a stop token the greedy run would stop at first
    stop = greedy.token_ids[0]
    params = SamplingParams(max_tokens=8, temperature=0, logit_bias={72: 2.0, stop + 1: -1.5}, min_tokens=3,
                            stop_token_ids=[stop])
    ref = offline.generate([ids], params)[0].outputs[0]
    got = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0,
                                    logit_bias={"72": 2, str(stop + 1): -1.5},
                                    extra_body={"min_tokens": 3, "stop_token_ids": [stop]})
    assert got.choices[0].text == ref.text and len(ref.token_ids) > 3
    # max_tokens null (the rest of the context, vLLM's): min_tokens is checked against that room, not a stand-in
    r = httpx.post(f"{url}/v1/completions",
                   json={"model": "tiny", "prompt": ids, "max_tokens": None, "min_tokens": 20, "temperature": 0,
                         "stop_token_ids": [stop]}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 20
    r = httpx.post(f"{url}/v1/completions",
                   json={"model": "tiny", "prompt": ids, "max_tokens": None, "min_tokens": 500}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    assert "max_tokens (122)" in r.json()["error"]["message"]  # 128 - 6 prompt tokens


def test_n_choices_with_seed(client):
    one = client.completions.create(model="tiny", prompt="abc", max_tokens=8, temperature=1.0, seed=5)
    three = client.completions.create(model="tiny", prompt="abc", max_tokens=8, temperature=1.0, seed=5, n=3)
    assert sorted(c.index for c in three.choices) == [0, 1, 2]
    assert three.choices[0].text == one.choices[0].text  # choice j draws with seed + j
    assert len({c.text for c in three.choices}) > 1
    assert three.usage.prompt_tokens == one.usage.prompt_tokens


def test_chat_equals_offline_and_streams(client, offline):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello there"}]
    tok = ByteTokenizer()
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)
    ref = offline.generate([ids], SamplingParams(max_tokens=9, temperature=0, logprobs=2))[0]
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=9, temperature=0,
                                         logprobs=True, top_logprobs=2)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == ref.outputs[0].text
    np.testing.assert_allclose([t.logprob for t in got.choices[0].logprobs.content], _lps(ref), rtol=0, atol=1e-6)
    assert all(len(t.top_logprobs) == 2 for t in got.choices[0].logprobs.content)
    assert got.usage.prompt_tokens == len(ids)

    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=9, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 9


def test_streamed_text_equals_whole_text(client):
    kw = dict(model="tiny", prompt="stream me", max_tokens=20, temperature=0.8, seed=3, logprobs=1)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    streamed_lps = [lp for c in chunks if c.choices and c.choices[0].logprobs
                    for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed_lps == whole.choices[0].logprobs.token_logprobs
    assert chunks[-1].usage.completion_tokens == 20


def test_continuous_usage_stats_count_each_choices_tokens_so_far(client):
    """vLLM's `continuous_usage_stats` (with `include_usage`): each chunk carries its choice's prompt tokens and the
    tokens it has generated so far (never fewer than its chunks have shown: a token whose text is an incomplete
    character is counted when generated, shown later; all 6 by its last chunk); without `include_usage` it adds
    nothing, and `include_usage` alone puts usage in the last chunk only."""
    kw = dict(model="tiny", prompt=[256, 72, 105], max_tokens=6, temperature=0.8, seed=5, logprobs=0, n=2,
              stream=True, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(**kw, stream_options={"include_usage": True,
                                                                   "continuous_usage_stats": True}))
    shown, counted = {0: 0, 1: 0}, {0: 0, 1: 0}
    for c in chunks[:-1]:
        (choice,) = c.choices
        shown[choice.index] += len(choice.logprobs.tokens) if choice.logprobs else 0
        assert c.usage.prompt_tokens == 3 and c.usage.total_tokens == 3 + c.usage.completion_tokens
        assert shown[choice.index] <= c.usage.completion_tokens and counted[choice.index] <= c.usage.completion_tokens
        counted[choice.index] = c.usage.completion_tokens
        if choice.finish_reason is not None:
            assert c.usage.completion_tokens == 6
    assert shown == counted == {0: 6, 1: 6} and not chunks[-1].choices
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (3, 12)
    plain = list(client.completions.create(**kw, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 12
    alone = list(client.completions.create(**kw, stream_options={"continuous_usage_stats": True,
                                                                  "include_usage": False}))
    assert all(c.usage is None for c in alone)


def test_sse_wire_format_ends_with_done(url):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("kw, param, match", [
    (dict(prompt=""), "prompt", "must not be empty"),
    (dict(prompt=[]), "prompt", "must not be empty"),
    (dict(prompt="x" * 120, max_tokens=20), "prompt", "max_model_len"),
    (dict(prompt="a", temperature=-1), "temperature", ">= 0"),
    (dict(prompt="a", top_p=1.5), "top_p", r"\(0, 1\]"),
    (dict(prompt="a", extra_body={"top_k": -5}), "top_k", "top_k"),
    (dict(prompt="a", max_tokens=0), "max_tokens", "at least 1"),
    (dict(prompt="a", n=100), "n", "between 1 and 8"),
    (dict(prompt=[5, 99999]), "prompt", "outside the vocabulary"),
    (dict(prompt="a", extra_body={"min_p": 1.5}), "min_p", r"min_p must be in \[0, 1\], got 1.5"),
    (dict(prompt="a", presence_penalty=2.5), "presence_penalty", r"presence_penalty must be in \[-2, 2\], got 2.5"),
    (dict(prompt="a", frequency_penalty=-3), "frequency_penalty", r"must be in \[-2, 2\], got -3"),
    (dict(prompt="a", extra_body={"repetition_penalty": 0}), "repetition_penalty", "a number > 0, from 2"),
    # vLLM's extensions that change what is sampled: refused, not silently ignored
    (dict(prompt="a", extra_body={"min_tokens": 10}), "min_tokens", r"from 0 to max_tokens \(4\), got 10"),
    (dict(prompt="a", logit_bias={"x1": 1}), "logit_bias", "keys must be token ids"),
    (dict(prompt="a", logit_bias={"5": 101}), "logit_bias", r"values must be in \[-100, 100\], got \{5: 101"),
    (dict(prompt="a", logit_bias={"320": 1}), "logit_bias", r"token ids must be in \[0, 320\)"),
    (dict(prompt="a", logprobs=21), "logprobs", "between 0 and 20"),
    # choice j draws with seed + j, which must stay below 2**63 (not a 500 from the last choice's seed)
    (dict(prompt="a", n=2, seed=2**63 - 1), "seed", r"at most 2\*\*63 - 2"),
])
def test_bad_completion_input_is_400_naming_the_field(client, kw, param, match):
    kw = {"model": "tiny", "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError, match=match) as e:
        client.completions.create(**kw)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"


def test_bad_chat_input_is_400(client):
    with pytest.raises(openai.BadRequestError, match="messages must not be empty"):
        client.chat.completions.create(model="tiny", messages=[])
    # the prompt is the messages through the chat template: the error names the field the client sent
    with pytest.raises(openai.BadRequestError, match="max_tokens") as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}], max_tokens=500)
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError, match="max_model_len") as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 200}])
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user"}], temperature="hot")
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError, match="between 0 and 20") as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}], max_tokens=2,
                                       logprobs=True, top_logprobs=50)
    assert e.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError, match=r"at most 2\*\*63 - 3") as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}], max_tokens=2, n=3,
                                       seed=2**63 - 2)
    assert e.value.body["param"] == "seed"


@pytest.mark.parametrize("endpoint, field, value", [
    ("completions", "guided_grammar", "root ::= 'a'"),
    ("chat", "logits_processors", ["my_module:processor"]),
])
def test_vllm_fields_that_would_change_the_output_are_refused(client, endpoint, field, value):
    """vLLM's request fields mnemojax does not implement: a 400 naming the field when set to anything but its
    neutral value (which passes), never silently ignored."""
    kw = dict(model="tiny", max_tokens=2, temperature=0)
    create = client.completions.create if endpoint == "completions" else client.chat.completions.create
    kw.update(prompt="a") if endpoint == "completions" else kw.update(messages=[{"role": "user", "content": "a"}])
    with pytest.raises(openai.BadRequestError, match=f"{field} is not supported") as e:
        create(**kw, extra_body={field: value})
    assert e.value.body["param"] == field


def test_guided_choice_and_structured_outputs_choice(client, offline, url):
    """vLLM's `guided_choice` and `structured_outputs: {"choice": [...]}` (completions and chat): the text is one of
    the choices, the same as the library's `StructuredOutputsParams(choice=...)`; what cannot be honoured is a 400
    naming the field."""
    from mnemojax import StructuredOutputsParams

    choices = ["red", "green", "blue"]
    kw = dict(model="tiny", prompt="The sky is", max_tokens=8, temperature=0)
    want = offline.generate(["The sky is"], SamplingParams(max_tokens=8, temperature=0, structured_outputs=
                                                           StructuredOutputsParams(choice=choices)))[0].outputs[0]
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        c = client.completions.create(**kw, extra_body=extra).choices[0]
        assert (c.text, c.finish_reason) == (want.text, "stop") and c.text in choices
    sampled = client.completions.create(**{**kw, "temperature": 1.0}, n=8, seed=5,
                                        extra_body={"guided_choice": choices}).choices
    assert {c.text for c in sampled} <= set(choices)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Pick one"}],
                                          max_tokens=8, extra_body={"guided_choice": choices})
    assert chat.choices[0].message.content in choices
    for extra, param, message in (
            ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs", "grammar is not supported"),
            ({"structured_outputs": {"choice": choices, "backend": "x"}}, "structured_outputs", "backend is not"),
            ({"guided_choice": []}, "guided_choice", "guided_choice must be a non-empty list"),
            ({"guided_choice": choices, "structured_outputs": {"choice": choices}}, "guided_choice", "not both"),
            ({"guided_choice": choices, "ignore_eos": True}, "structured_outputs", "not supported with ignore_eos"),
            ({"guided_choice": choices, "use_beam_search": True, "n": 2},
             "guided_choice", "guided_choice is not supported with use_beam_search")):
        with pytest.raises(openai.BadRequestError, match=message) as e:
            client.completions.create(**kw, extra_body=extra)
        assert e.value.body["param"] == param, extra
    body = json.dumps({**kw, "structured_outputs": {"choice": ["ok", "\ud800"]}})  # JSON's escape: a lone surrogate
    r = httpx.post(f"{url}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs"
    assert "cannot be tokenized" in r.json()["error"]["message"]


def test_guided_regex_and_structured_outputs_regex(client, offline):
    """vLLM's `guided_regex` and `structured_outputs: {"regex": ...}` (completions, chat and a stream): the text
    matches the pattern whole, the same as the library's `StructuredOutputsParams(regex=...)`; what cannot be
    honoured is a 400 naming the field."""
    import re

    from mnemojax import StructuredOutputsParams

    pattern = r"[0-9]{3}-[a-z]{2,4}"
    kw = dict(model="tiny", prompt="The code is", max_tokens=12, temperature=0)
    want = offline.generate(["The code is"], SamplingParams(max_tokens=12, temperature=0, structured_outputs=
                                                           StructuredOutputsParams(regex=pattern)))[0].outputs[0]
    assert re.fullmatch(pattern, want.text) and want.finish_reason == "stop"
    for extra in ({"guided_regex": pattern}, {"structured_outputs": {"regex": pattern}}):
        c = client.completions.create(**kw, extra_body=extra).choices[0]
        assert (c.text, c.finish_reason) == (want.text, "stop")
    chunks = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Code?"}],
                                            max_tokens=12, temperature=1.0, seed=4, n=3, stream=True,
                                            extra_body={"guided_regex": pattern})
    texts = ["", "", ""]
    for chunk in chunks:
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
    assert all(re.fullmatch(pattern, t) for t in texts), texts
    for extra, param, message in (
            ({"guided_regex": "(ab"}, "guided_regex", r"guided_regex '\(ab': missing '\)' at position 0"),
            ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "guided_choice or guided_regex, not "
                                                                             "both"),
            ({"guided_regex": "a", "structured_outputs": {"regex": "a"}}, "guided_regex", "not both"),
            ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
            ({"guided_regex": "[^\\s\\S]"}, "structured_outputs", "matches no string"),
            ({"guided_regex": "a+", "use_beam_search": True, "n": 2}, "guided_regex",
             "guided_regex is not supported with use_beam_search")):
        with pytest.raises(openai.BadRequestError, match=message) as e:
            client.completions.create(**kw, extra_body=extra)
        assert e.value.body["param"] == param, extra


def test_guided_json_structured_outputs_json_and_response_format_json_schema(client, offline):
    """vLLM's `guided_json` (with `guided_whitespace_pattern`), `structured_outputs: {"json": ...}` (with its
    options) and OpenAI's `response_format: {"type": "json_schema"}`: the text is JSON the schema accepts, the same as
    the library's `StructuredOutputsParams(json=...)`; `{"type": "json_object"}` is the library's `json_object`; what
    cannot be honoured is a 400 naming the field given."""
    import jsonschema

    from mnemojax import StructuredOutputsParams

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                               "maximum": 9}}, "required": ["ok"]}
    kw = dict(model="tiny", prompt="The answer is", max_tokens=24, temperature=0)
    want = offline.generate(["The answer is"], SamplingParams(max_tokens=24, temperature=0, structured_outputs=
                                                             StructuredOutputsParams(json=schema, whitespace_pattern=
                                                                                     " ?")))[0].outputs[0]
    jsonschema.validate(json.loads(want.text), schema)
    for extra in ({"guided_json": schema, "guided_whitespace_pattern": " ?"},
                  {"guided_json": json.dumps(schema), "guided_whitespace_pattern": " ?"},
                  {"structured_outputs": {"json": schema, "whitespace_pattern": " ?"}},
                  {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
                   "guided_whitespace_pattern": " ?"}):
        c = client.completions.create(**kw, extra_body=extra).choices[0]
        assert (c.text, c.finish_reason) == (want.text, "stop"), extra
    tight = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "JSON?"}], max_tokens=24, temperature=1.0, seed=3, n=3,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}},
        extra_body={"guided_whitespace_pattern": ""})  # no whitespace at all: '{"ok":true}' 
    for ch in tight.choices:
        assert ch.finish_reason == "stop" and " " not in ch.message.content
        jsonschema.validate(json.loads(ch.message.content), schema)
    anything = offline.generate(["The answer is"], SamplingParams(max_tokens=24, temperature=0, structured_outputs=
                                                                 StructuredOutputsParams(json_object=True,
                                                                                         whitespace_pattern="")))
    c = client.completions.create(**kw, extra_body={"response_format": {"type": "json_object"},  # (vLLM's, for
                                                    "guided_whitespace_pattern": ""}).choices[0]  # completions too)
    assert (c.text, c.finish_reason) == (anything[0].outputs[0].text, anything[0].outputs[0].finish_reason)
    assert c.text.startswith("{")
    for extra, param, message in (
            ({"guided_json": {"type": "string", "format": "iri"}}, "guided_json",
             "guided_json: at /format: format 'iri' is not supported"),
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "array"}}}},
             "response_format", "response_format: at /: an array whose items may be any JSON values"),
            ({"guided_json": schema, "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}},
             "guided_json", "guided_json or response_format, not both"),
            ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "only applies with guided_json"),
            ({"guided_json": schema, "guided_whitespace_pattern": "x"}, "guided_json", "not JSON whitespace"),
            ({"structured_outputs": {"json": schema, "disable_any_whitespace": "yes"}}, "structured_outputs",
             "disable_any_whitespace must be true or false"),
            ({"response_format": {"type": "structural_tag"}}, "response_format", "'structural_tag' is not "
                                                                                  "supported"),
            ({"guided_json": schema, "use_beam_search": True, "n": 2}, "guided_json",
             "guided_json is not supported with use_beam_search")):
        with pytest.raises(openai.BadRequestError, match=message) as e:
            client.completions.create(**kw, extra_body=extra)
        assert e.value.body["param"] == param, extra


def test_priority_needs_the_priority_policy(client):
    """vLLM's `priority` under this server's FCFS engine (the library's default): 0 runs, anything else is a 400
    naming it (vLLM's rule), and so is a priority that is no integer."""
    kw = dict(model="tiny", max_tokens=2, temperature=0)
    chat = dict(messages=[{"role": "user", "content": "a"}])
    for create, where in ((client.completions.create, dict(prompt="a")), (client.chat.completions.create, chat)):
        with pytest.raises(openai.BadRequestError, match="priority 5 needs scheduler_policy 'priority'") as e:
            create(**kw, **where, extra_body={"priority": 5})
        assert e.value.body["param"] == "priority"
        with pytest.raises(openai.BadRequestError) as e:
            create(**kw, **where, extra_body={"priority": "high"})
        assert e.value.body["param"] == "priority"
        assert create(**kw, **where, extra_body={"priority": 0}).usage.completion_tokens == 2


def test_priority_under_the_priority_policy_changes_no_output(client):
    """A server whose engine runs vLLM's priority policy takes any integer priority, and a request's choices (n,
    beam search, chat) are those the FCFS server gives it."""
    served = AsyncLLM("tiny", **KW, scheduler_policy="priority")
    s = ThreadServer(build_app(served, served_model_name="tiny"))
    try:
        other = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120)
        bodies = [dict(prompt="ab", max_tokens=5, n=2, temperature=0.8, seed=3),
                  dict(prompt="ab", max_tokens=5, n=2, temperature=0, extra_body={"use_beam_search": True})]
        for body in bodies:
            want = [c.text for c in client.completions.create(model="tiny", **body).choices]
            extra = {**body.pop("extra_body", {}), "priority": -7}
            got = [c.text for c in other.completions.create(model="tiny", **body, extra_body=extra).choices]
            assert got == want and len(set(want)) == 2
        chat = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
        assert other.chat.completions.create(**chat, extra_body={"priority": 2}).choices[0].message.content == \
            client.chat.completions.create(**chat).choices[0].message.content
    finally:
        s.stop()
        served.shutdown()


def test_spaces_between_special_tokens_false_changes_nothing_with_the_byte_tokenizer(client):
    """vLLM's spaces_between_special_tokens: the byte tokenizer (as fast tokenizers, and vLLM's fast detokenizer)
    never puts spaces between special tokens, so false gives the same text."""
    kw = dict(model="tiny", prompt="ab", max_tokens=6, temperature=0)
    body = {"skip_special_tokens": False, "allowed_token_ids": [256, 257], "ignore_eos": True}
    a = client.completions.create(**kw, extra_body=body).choices[0]
    b = client.completions.create(**kw, extra_body={**body, "spaces_between_special_tokens": False}).choices[0]
    assert "><|" in a.text and a.text == b.text


def test_return_token_ids_shows_the_prompts_and_each_choices_ids(client, offline, url):
    """vLLM's return_token_ids: completions' choices carry the prompt's ids (BOS included) and their generated ids,
    whole or streamed (each chunk its new ids, the prompt's in a choice's first chunk only); chat's response carries
    the templated prompt's ids (streamed: each choice's role chunk), its choices their ids; without it, none."""
    tok = offline.get_tokenizer()
    prompts = _prompts(2, seed=7)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ref = [out.outputs[0].token_ids for out in offline.generate(prompts, greedy)]
    kw = dict(model="tiny", prompt=prompts, max_tokens=6, temperature=0, n=2)
    body = {"ignore_eos": True, "return_token_ids": True}
    got = client.completions.create(**kw, extra_body=body)
    assert [(c.token_ids, c.prompt_token_ids) for c in got.choices] == [
        (ref[i // 2], tok.encode(prompts[i // 2])) for i in range(4)]
    plain = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].model_extra
    assert "token_ids" not in plain and "prompt_token_ids" not in plain
    chunks = list(client.completions.create(**kw, stream=True, extra_body=body))
    for i in range(4):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == i]
        assert sum((m.token_ids for m in mine), []) == ref[i // 2]
        assert [getattr(m, "prompt_token_ids", None) for m in mine] == [tok.encode(prompts[i // 2])] + [None] * (
            len(mine) - 1)

    messages = [{"role": "user", "content": "Hi there"}]
    ids = httpx.post(f"{url}/tokenize", json={"model": "tiny", "messages": messages}).json()["tokens"]
    want = offline.generate([ids], greedy)[0].outputs[0].token_ids
    kw = dict(model="tiny", messages=messages, max_tokens=6, temperature=0, extra_body=body)
    got = client.chat.completions.create(**kw)
    assert got.prompt_token_ids == ids and got.choices[0].token_ids == want
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].prompt_token_ids == ids
    assert all(getattr(ch, "prompt_token_ids", None) is None for ch in chunks[1:])
    assert sum((ch.choices[0].token_ids for ch in chunks[1:] if ch.choices), []) == want


def test_the_response_id_is_the_clients_request_id(client):
    """vLLM's request_id, and its X-Request-Id header, which wins, name the response ("cmpl-<id>", "chatcmpl-<id>"),
    each chunk of a stream too; requests that give the same id run side by side; without one the id is fresh."""
    kw = dict(model="tiny", prompt="ab", max_tokens=2, temperature=0)
    assert client.completions.create(**kw, extra_body={"request_id": "job-7"}).id == "cmpl-job-7"
    assert client.completions.create(**kw, extra_body={"request_id": "job-7"},
                                     extra_headers={"X-Request-Id": "hdr-1"}).id == "cmpl-hdr-1"
    assert client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}], max_tokens=2,
                                          extra_body={"request_id": "c1"}).id == "chatcmpl-c1"
    assert {c.id for c in client.completions.create(**kw, stream=True, extra_body={"request_id": "s"})} == {"cmpl-s"}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        same = list(pool.map(lambda _: client.completions.create(**{**kw, "max_tokens": 8},
                                                                 extra_body={"request_id": "dup"}), range(3)))
    assert [(r.id, r.usage.completion_tokens) for r in same] == [("cmpl-dup", 8)] * 3
    ids = {client.completions.create(**kw).id for _ in range(2)}
    assert len(ids) == 2 and all(re.fullmatch(r"cmpl-[0-9a-f]{32}", i) for i in ids)


# ---------------------------------------------------------------- beam search (vLLM's use_beam_search)
# The first prompt's search ends some beams at EOS (found by running the library's), the second's runs to the length.
BEAM_PROMPTS = ["~7U-)_$cm/`EtvVUcVf2jQgQ=(Q}#VJ Si", "Gqn* )B*'8]Q:zb\\yj,#rF%MDHH=NN|a"]


def _beam_choices(offline, prompts, params, include_stop=False):
    """What the server's choices must hold, from the library's `LLM.beam_search` as vLLM's server shows its
    sequences: (text, token ids, finish reason, stop reason, the tokens' log-probs), prompt by prompt, best first.
    A sequence ending in EOS finished with "stop" (EOS its stop reason), its EOS in the token ids only with
    include_stop_str_in_output and never in the text; the text is the byte tokenizer's decode."""
    tok = offline.get_tokenizer()
    eos, out = tok.eos_token_id, []
    for prompt, res in zip(prompts, offline.beam_search(prompts, params)):
        start = len(prompt) if isinstance(prompt, list) else len(tok.encode(prompt))
        for s in res.sequences:
            gen = s.tokens[start:]
            stop = not params.ignore_eos and gen[-1] == eos
            ids = gen if include_stop or not stop else gen[:-1]
            out.append((tok.decode(gen[:-1] if stop else gen, skip_special_tokens=True), ids,
                        "stop" if stop else "length", eos if stop else None, [d[t] for d, t in zip(s.logprobs, ids)]))
    return out


@pytest.mark.parametrize("length_penalty, include_stop", [(1.0, False), (0.5, True)])
def test_beam_search_completions_are_the_librarys_sequences(client, offline, url, length_penalty, include_stop):
    """use_beam_search with n = 3 over two prompts: each prompt's 3 choices are the library's 3 best sequences, best
    first (text, tokens, finish and stop reasons, log-probs with their top entries); usage counts the tokens
    returned. A sequence that ended at EOS shows it among its tokens only with include_stop_str_in_output. /metrics
    counts the 6 choices as finished requests, not the engine requests of the searches' steps."""
    params = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=length_penalty)
    want = _beam_choices(offline, BEAM_PROMPTS, params, include_stop)
    before = metrics(url)
    got = client.completions.create(model="tiny", prompt=BEAM_PROMPTS, n=3, max_tokens=6, temperature=0, logprobs=2,
                                    extra_body={"use_beam_search": True, "length_penalty": length_penalty,
                                                "include_stop_str_in_output": include_stop,
                                                "return_tokens_as_token_ids": True, "return_token_ids": True})
    assert [c.index for c in got.choices] == list(range(6))
    assert [(c.text, c.finish_reason, c.stop_reason) for c in got.choices] == [w[:1] + w[2:4] for w in want]
    assert {c.finish_reason for c in got.choices[:3]} == {"stop"} and {c.finish_reason for c in got.choices[3:]} == {
        "length"}
    for c, (_, ids, _, _, lps) in zip(got.choices, want):
        assert c.token_ids == ids and c.logprobs.tokens == [f"token_id:{t}" for t in ids]
        np.testing.assert_allclose(c.logprobs.token_logprobs, lps, rtol=0, atol=1e-6)
        for t, top in zip(ids, c.logprobs.top_logprobs):  # the top 2, and the token's own when not among them
            assert len(top) == 2 + (f"token_id:{t}" not in list(top)[:2])
    tok = offline.get_tokenizer()
    assert got.usage.prompt_tokens == sum(len(tok.encode(p)) for p in BEAM_PROMPTS)
    assert got.usage.completion_tokens == sum(len(w[1]) for w in want)
    after = metrics(url)
    grew = {k: after[k] - before.get(k, 0.0) for k in after if k.startswith(("mnemojax_request_success_total",
                                                                            "mnemojax_prompt_tokens_total",
                                                                            "mnemojax_generation_tokens_total"))}
    assert {k: v for k, v in grew.items() if v} == {
        "mnemojax_request_success_total{finished_reason=stop}": 3,
        "mnemojax_request_success_total{finished_reason=length}": 3,
        "mnemojax_prompt_tokens_total": 3 * got.usage.prompt_tokens,
        "mnemojax_generation_tokens_total": got.usage.completion_tokens}


def test_one_beam_without_eos_is_greedy(client):
    """One beam with ignore_eos keeps the most likely token at every step: the greedy completion, its text and its
    log-probs (top 4, more than the 2 candidates a step of one beam takes)."""
    kw = dict(model="tiny", prompt=BEAM_PROMPTS[1], max_tokens=8, temperature=0, logprobs=4)
    greedy = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0]
    beam = client.completions.create(**kw, extra_body={"ignore_eos": True, "use_beam_search": True}).choices[0]
    assert (beam.text, beam.finish_reason) == (greedy.text, "length")
    assert beam.logprobs.tokens == greedy.logprobs.tokens
    assert beam.logprobs.text_offset == greedy.logprobs.text_offset
    np.testing.assert_allclose(beam.logprobs.token_logprobs, greedy.logprobs.token_logprobs, rtol=0, atol=1e-6)
    for b, g in zip(beam.logprobs.top_logprobs, greedy.logprobs.top_logprobs):
        assert list(b) == list(g)
        np.testing.assert_allclose(list(b.values()), list(g.values()), rtol=0, atol=1e-6)


def test_beam_search_chat_is_the_librarys_on_the_templated_prompt(client, offline, url):
    """Chat's use_beam_search searches from the messages through the chat template; the reply messages are the
    library's sequences of those token ids, with their log-probs."""
    messages = [{"role": "user", "content": "Hello there"}]
    ids = httpx.post(f"{url}/tokenize", json={"model": "tiny", "messages": messages}).json()["tokens"]
    want = _beam_choices(offline, [ids], BeamSearchParams(beam_width=2, max_tokens=5))
    got = client.chat.completions.create(model="tiny", messages=messages, n=2, max_tokens=5, temperature=0,
                                         logprobs=True, top_logprobs=1, extra_body={"use_beam_search": True})
    assert [(c.message.role, c.message.content, c.finish_reason) for c in got.choices] == [
        ("assistant", w[0], w[2]) for w in want]
    for c, w in zip(got.choices, want):
        np.testing.assert_allclose([t.logprob for t in c.logprobs.content], w[4], rtol=0, atol=1e-6)
        assert all(len(t.top_logprobs) == 1 for t in c.logprobs.content)
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), sum(len(w[1]) for w in want))


@pytest.mark.parametrize("extra, param", [
    ({"stream": True}, "stream"), ({"seed": 3}, "seed"), ({"stop": ["a"]}, "stop"), ({"top_p": 0.5}, "top_p"),
    ({"echo": True}, "echo"), ({"min_tokens": 2}, "min_tokens"), ({"n": 11}, "n"),
    ({"use_beam_search": False, "length_penalty": 0.5}, "length_penalty"),
])
def test_beam_search_refuses_what_it_does_not_honour(client, extra, param):
    """What vLLM's beam search ignores (streaming, sampling fields, stop strings, echo) is a 400 naming the field
    with use_beam_search, and so is length_penalty without it; their neutral values pass."""
    body = {"model": "tiny", "prompt": "ab", "max_tokens": 2, "temperature": 0, "use_beam_search": True, **extra}
    stream = body.pop("stream", False)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**{k: body.pop(k) for k in ("model", "prompt", "max_tokens", "temperature")},
                                  stream=stream, extra_body=body)
    assert e.value.body["param"] == param
    got = client.completions.create(model="tiny", prompt="ab", max_tokens=2, n=2, top_p=1.0, seed=None,
                                    temperature=0, extra_body={"use_beam_search": True, "length_penalty": 1.0,
                                                               "stop": [], "ignore_eos": True})
    assert len(got.choices) == 2 and got.usage.completion_tokens == 4


@pytest.mark.slow  # ~5 s: 30 slowed steps; the whole-request beam tests above stay in the default suite
def test_a_beam_search_holds_its_places_in_the_queue(llm, monkeypatch):
    """A search of n beams holds n places of max_queue from admission to its end (its steps run up to n requests,
    which wait in the engine's queue): with max_queue = n, another request is a 429 while it runs, and runs after;
    no place is left held."""
    step = llm.engine.step

    def slow_step():  # the search's 30 steps take over a second
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(llm.engine, "step", slow_step)
    s = ThreadServer(build_app(llm, served_model_name="tiny", max_queue=3))
    state = s.app.state.server
    between_steps = []  # (places held, engine requests waiting) each time a step's outputs are taken in
    advance = BeamSearch.advance

    def watched(search, outputs):
        between_steps.append((state.num_admitted, llm.num_waiting))
        return advance(search, outputs)

    monkeypatch.setattr(BeamSearch, "advance", watched)
    try:
        search: list = []
        body = {"model": "tiny", "prompt": "queue", "max_tokens": 30, "n": 3, "temperature": 0, "ignore_eos": True,
                "use_beam_search": True}
        t = threading.Thread(target=lambda: search.append(httpx.post(f"{s.url}/v1/completions", json=body,
                                                                     timeout=120)))
        t.start()
        wait_for(lambda: state.num_searches == 1, what="the search running")
        plain = {"model": "tiny", "prompt": "a", "max_tokens": 2}
        refused = [httpx.post(f"{s.url}/v1/completions", json=plain, timeout=60) for _ in range(3)]
        assert state.num_searches == 1  # all three came while it ran
        assert [r.status_code for r in refused] == [429] * 3 and "max_queue" in refused[0].json()["error"]["message"]
        t.join(120)
        assert search[0].status_code == 200 and len(search[0].json()["choices"]) == 3
        assert between_steps == [(3, 0)] * 30  # every place is the search's again between its steps
        assert httpx.post(f"{s.url}/v1/completions", json=plain, timeout=60).status_code == 200
        assert state.num_admitted == 0 and state.num_searches == 0
    finally:
        s.stop()


def test_truncate_prompt_tokens_counts_only_the_tokens_kept(client, offline, url):
    """vLLM's truncate_prompt_tokens: completions and chat run the prompt's last k tokens, as the library does, and
    count them in the usage; the room a request without max_tokens gets is what the truncated prompt leaves; a bad
    k is a 400 naming the field."""
    ids = [256, 72, 105, 33, 10, 40, 50, 60, 70]
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    ref = offline.generate([ids[-4:]], greedy)[0].outputs[0]
    got = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True, "truncate_prompt_tokens": 4})
    assert got.choices[0].text == ref.text and got.usage.prompt_tokens == 4
    messages = [{"role": "user", "content": "hello there, a long enough message"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0)
    assert whole.usage.prompt_tokens > 6
    cut = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0,
                                         extra_body={"truncate_prompt_tokens": 6})
    assert cut.usage.prompt_tokens == 6
    # max_tokens left out: the rest of max_model_len (128) after the 6 tokens kept
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": None,
                                                  "truncate_prompt_tokens": 6, "ignore_eos": True}, timeout=60)
    usage = r.json()["usage"]
    assert r.status_code == 200 and (usage["prompt_tokens"], usage["completion_tokens"]) == (6, 122)
    for endpoint, body in (("completions", {"prompt": ids}), ("chat/completions", {"messages": messages})):
        for k, message in ((0, "got 0"), (129, "(129) is greater than max_model_len (128)"), ("3", "int")):
            r = httpx.post(f"{url}/v1/{endpoint}", json={"model": "tiny", "max_tokens": 2, "truncate_prompt_tokens": k,
                                                         **body}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", (endpoint, k)
            assert message in r.json()["error"]["message"], (endpoint, k, r.json())


def test_allowed_token_ids_reach_the_engine(client, offline, url):
    """vLLM's allowed_token_ids: the same tokens as the library with the same list (greedy and seeded), only those
    tokens; an empty list, an id outside the vocabulary or more ids than the rows' bias slots are a 400 naming it."""
    ids = [256, 72, 105, 33, 10, 40]
    allowed = [72, 105, 33, 10]
    for kw in (dict(temperature=0), dict(temperature=1.4, seed=5)):
        ref = offline.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True, allowed_token_ids=allowed,
                                                     **kw))[0].outputs[0]
        got = client.completions.create(model="tiny", prompt=ids, max_tokens=8, **kw,
                                        extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
        assert got.choices[0].text == ref.text and set(ref.token_ids) <= set(allowed)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, extra_body={"allowed_token_ids": [72, 105]})
    assert set(chat.choices[0].message.content) <= {"H", "i"}
    for value, message in (([], "must not be empty"), ([72, 10**6], "(the vocabulary)"),
                           (list(range(17)), "more than max_logit_bias (16")):
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 2,
                                                      "allowed_token_ids": value}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", value
        assert message in r.json()["error"]["message"], (value, r.json())


def test_bad_words_reach_the_engine(client, offline, url):
    """vLLM's bad_words: the same tokens as the library with the same words (greedy and seeded), without the banned
    sequence (the tiny model's tokens are bytes: "WW" is two); a word of only spaces, a string for the list, or more
    bans than the rows' slots are a 400 naming the field."""
    ids = [256, 71, 105]  # the tiny model's greedy output starts with "WWWWW"
    plain = offline.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0]
    assert plain.text.startswith("WW")
    for kw in (dict(temperature=0), dict(temperature=1.4, seed=5)):
        ref = offline.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True, bad_words=["WW"],
                                                     **kw))[0].outputs[0]
        got = client.completions.create(model="tiny", prompt=ids, max_tokens=8, **kw,
                                        extra_body={"ignore_eos": True, "bad_words": ["WW"]})
        assert got.choices[0].text == ref.text and "WW" not in ref.text
        if kw["temperature"] == 0:
            assert ref.text[0] == "W"  # the ban starts at the second token
    for value, message in (([" "], "must not be empty or only spaces"), ("ab", "valid list"), (None, "valid list"),
                           (["\ud800"], "surrogate"),
                           ([chr(65 + i) for i in range(17)], "more than max_logit_bias (16")):
        body = json.dumps({"model": "tiny", "prompt": ids, "max_tokens": 2, "bad_words": value})  # \ud800 escaped
        r = httpx.post(f"{url}/v1/completions", content=body, headers={"content-type": "application/json"},
                       timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] in ("bad_words", "bad_words.0"), value
        assert message in r.json()["error"]["message"], (value, r.json())


def test_chat_logprob_bytes_are_the_tokens_bytes(client):
    """A chat logprob's `bytes` are the token's own bytes (a token that is a piece of a UTF-8 character included,
    shown as `bytes:\\xNN`), so that joined they are the content's bytes."""
    got = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello there"}],
                                         max_tokens=6, temperature=0, extra_body={"ignore_eos": True},
                                         logprobs=True, top_logprobs=2)
    content = got.choices[0].logprobs.content
    pieces = [t for t in content if t.token.startswith("bytes:")]
    assert pieces, "the tiny model's output has no byte that is not UTF-8 alone: the check below is weaker"
    assert all(t.bytes == [int(t.token[len("bytes:\\x"):], 16)] for t in pieces)
    assert bytes(b for t in content for b in t.bytes).decode("utf-8", "replace") == got.choices[0].message.content
    tops = [top for t in content for top in t.top_logprobs]
    assert all(top.bytes == list(top.token.encode()) for top in tops if not top.token.startswith("bytes:"))
    assert all(top.bytes == [int(top.token[len("bytes:\\x"):], 16)] for top in tops if top.token.startswith("bytes:"))


def test_text_offset_is_each_tokens_start_in_text(client):
    """Completion logprobs' text_offset indexes into `text`: a token that continues a UTF-8 character starts where
    that character does, and a byte that is no character is one U+FFFD (not the 10 characters of its token string
    `bytes:\\xNN`). The prompt "é€x" echoed: BOS (skipped, width 0), é = c3 a9, € = e2 82 ac, x."""
    tok = ByteTokenizer()
    got = client.completions.create(model="tiny", prompt="é€x", echo=True, max_tokens=12, temperature=0,
                                    logprobs=0, extra_body={"ignore_eos": True}).choices[0]
    text, tokens, offsets = got.text, got.logprobs.tokens, got.logprobs.text_offset
    assert tokens[:7] == ["<|begin_of_text|>", "bytes:\\xc3", "bytes:\\xa9", "bytes:\\xe2", "bytes:\\x82",
                          "bytes:\\xac", "x"]
    assert offsets[:7] == [0, 0, 0, 1, 1, 1, 2] and text.startswith("é€x")
    # the generated tokens (the tiny model's output is mostly bytes that are not UTF-8): each starts where the text
    # of the tokens before it ends, or one character earlier when it continues that text's last character
    generated = [int(t[len("bytes:\\x"):], 16) if t.startswith("bytes:\\x") else tok.encode(t, False)[0]
                 for t in tokens[7:]]
    assert any(t.startswith("bytes:") for t in tokens[7:])
    for i, o in enumerate(offsets[7:]):
        before = "é€x" + tok.decode(generated[:i])
        assert o in (len(before), len(before) - 1) and text[:o] == before[:o], (i, tokens[7 + i], o, before)
    assert offsets == sorted(offsets) and offsets[-1] < len(text)


def test_malformed_json_invalid_utf8_wrong_types_and_oversized_bodies(url):
    post = f"{url}/v1/completions"
    headers = {"Content-Type": "application/json"}
    r = httpx.post(post, content=b'{"prompt": "a", ', headers=headers)
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = httpx.post(post, content=b'{"prompt": "\xff\xfe"}', headers=headers)
    assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"]
    r = httpx.post(post, json={"prompt": {"a": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("prompt")
    r = httpx.post(post, json={"max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    big = json.dumps({"prompt": "x" * MAX_BYTES}).encode()
    r = httpx.post(post, content=big, headers=headers)
    assert r.status_code == 413 and str(MAX_BYTES) in r.json()["error"]["message"]

    def chunked():  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    r = httpx.post(post, content=chunked(), headers=headers)
    assert r.status_code == 413
    assert httpx.get(f"{url}/v1/nowhere").status_code == 404
    # and the server still serves
    r = httpx.post(post, json={"prompt": "ok", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_api_key(llm):
    s = ThreadServer(build_app(llm, served_model_name="tiny", api_key="s3cret"))
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{s.url}/v1", api_key="wrong", max_retries=0).models.list()
        assert httpx.post(f"{s.url}/v1/completions", json={"prompt": "a"}).status_code == 401
        ok = openai.OpenAI(base_url=f"{s.url}/v1", api_key="s3cret", max_retries=0)
        assert ok.completions.create(model="tiny", prompt="a", max_tokens=2).usage.completion_tokens == 2
        assert httpx.get(f"{s.url}/health").status_code == 200  # health, ping, version and metrics stay open
        assert httpx.get(f"{s.url}/ping").status_code == httpx.get(f"{s.url}/version").status_code == 200
        assert httpx.get(f"{s.url}/metrics").status_code == 200
    finally:
        s.stop()


def test_more_choices_than_the_queue_holds_is_400_and_others_go_on(llm):
    """A request the queue can never hold is a 400 naming n, not a 429 (retrying cannot help); a queue that is
    full right now is the 429 (tests/serving/test_server_hardening.py)."""
    s = ThreadServer(build_app(llm, served_model_name="tiny", max_queue=1))
    try:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="at most 1") as e:
            c.completions.create(model="tiny", prompt="a", max_tokens=2, n=2)
        assert e.value.body["param"] == "n"
        assert c.completions.create(model="tiny", prompt="a", max_tokens=2).usage.completion_tokens == 2
    finally:
        s.stop()


# ---------------------------------------------------------------- disconnects, load
def _aborted(url) -> float:
    return metrics(url).get("mnemojax_request_success_total{finished_reason=abort}", 0.0)


def test_client_disconnects_abort_and_free_pages(url, llm, monkeypatch):
    # Each step made 10 ms longer, so a request of 100 tokens takes over a second: on this 2-core VM the tiny model's
    # whole n = 8 request took ~0.21 s, close enough to the client's 0.1 s timeout plus the disconnect's detection
    # that some choices ran to their length first (a failure that depended on the machine's speed).
    step = llm.engine.step

    def slow_step():
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(llm.engine, "step", slow_step)
    idle = metrics(url)["mnemojax_kv_pages_used"]
    assert idle == 0
    aborted = _aborted(url)
    body = {"model": "tiny", "prompt": "disconnect me", "max_tokens": 100, "ignore_eos": True, "stream": True}
    for _ in range(3):  # drop mid-stream
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            events = (ln for ln in r.iter_lines() if ln)
            assert all(next(events).startswith("data: {") for _ in range(3))  # then the client goes away
    # drop a non-streaming request while it runs (8 choices x 100 tokens take over a second)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json={**body, "stream": False, "n": 8}, timeout=0.1)
    wait_for(lambda: _aborted(url) >= aborted + 3 + 8, what="11 aborted requests")
    wait_for(lambda: metrics(url)["mnemojax_kv_pages_used"] == idle, what="pages back to idle")
    assert llm.stats().running == 0 and llm.num_active == 0


def test_a_beam_search_whose_client_leaves_is_aborted(url, served, llm, monkeypatch):
    """A client that leaves a beam search ends it: the step running then is aborted, nothing runs on, and every
    page is free again."""
    # The engine's third step waits until the client has gone and the search has ended, and is then skipped: the
    # aborts queued meanwhile find that step's requests unfinished. (A timed version failed once in CI: a step's
    # requests can finish in the engine before their outputs reach the search, and then there is nothing to abort.)
    step, calls = llm.engine.step, itertools.count()
    reached, gone = threading.Event(), threading.Event()

    def step_until_the_client_leaves():
        if next(calls) == 2:
            reached.set()
            assert gone.wait(60)
            return []
        return step()

    monkeypatch.setattr(llm.engine, "step", step_until_the_client_leaves)
    state = served.app.state.server
    idle, aborted = metrics(url)["mnemojax_kv_pages_used"], _aborted(url)
    body = json.dumps({"model": "tiny", "prompt": "disconnect me", "max_tokens": 100, "ignore_eos": True, "n": 4,
                       "use_beam_search": True}).encode()
    where = urllib.parse.urlsplit(url)
    try:
        with socket.create_connection((where.hostname, where.port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            assert reached.wait(60)  # mid-search; then the client goes away
        wait_for(lambda: state.num_searches == 0, what="the search ended")
    finally:
        gone.set()
    wait_for(lambda: _aborted(url) > aborted, what="an aborted step")
    wait_for(lambda: metrics(url)["mnemojax_kv_pages_used"] == idle, what="pages back to idle")
    assert llm.stats().running == 0 and llm.num_active == 0
    assert state.num_admitted == 0  # no place in the queue left held
    assert next(calls) == 3  # nothing ran on


@pytest.mark.slow  # ~15 s on 2 cores; tests/engine/test_async_llm.py streams concurrently by default
def test_64_concurrent_streaming_clients(url, llm, caplog):
    caplog.set_level(logging.INFO)
    prompts = _prompts(64 * 3, seed=1)
    rng = np.random.default_rng(2)
    max_tokens = [int(rng.integers(2, 24)) for _ in prompts]
    statuses = []

    async def one(http, i, stream):
        body = {"model": "tiny", "prompt": prompts[i], "max_tokens": max_tokens[i], "temperature": 0.7, "seed": i,
                "ignore_eos": True, "stream": stream}
        if not stream:
            r = await http.post(f"{url}/v1/completions", json=body)
            statuses.append(r.status_code)
            return r.json()["choices"][0]["text"]
        text, done = "", False
        async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            statuses.append(r.status_code)
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    text += json.loads(line[6:])["choices"][0]["text"]
        assert done
        return text

    async def client(http, c, stream):
        return [await one(http, i, stream) for i in range(c * 3, c * 3 + 3)]

    most_waiting = 0

    async def watch_queue():
        nonlocal most_waiting
        while True:
            most_waiting = max(most_waiting, llm.stats().waiting)
            await asyncio.sleep(0.01)

    async def main(stream):
        limits = httpx.Limits(max_connections=128)
        watcher = asyncio.ensure_future(watch_queue())
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            per_client = await asyncio.gather(*(client(http, c, stream) for c in range(64)))
        watcher.cancel()
        return [t for texts in per_client for t in texts]

    streamed = asyncio.run(main(True))
    assert statuses == [200] * len(prompts)
    whole = asyncio.run(main(False))
    assert statuses == [200] * (2 * len(prompts))
    assert streamed == whole
    assert most_waiting > 8  # 63 KV pages hold a handful of these requests: the rest had to wait
    # waiting for pages is normal under load: not a log line per request per step at INFO
    waits = [r for r in caplog.records if r.levelno >= logging.INFO and "waits" in r.getMessage()]
    assert not waits, f"{len(waits)} INFO lines, first: {waits[0].getMessage()}"
    m = metrics(url)
    assert m["mnemojax_kv_pages_used"] == 0 and m["mnemojax_num_requests_running"] == 0
    assert llm.num_active == 0


# ---------------------------------------------------------------- fuzzing the OpenAPI schema
@pytest.mark.slow  # ~10 s on 2 cores: schemathesis' generated requests; the hand-written bad requests stay
def test_fuzzed_requests_never_get_a_5xx(url):
    """Random valid and invalid bodies for every operation of the served OpenAPI schema: any answer but a server
    error (5xx), and the fuzzer must reach both 200s and 400s (else it tested little).

    Hypothesis drives schemathesis's per-operation strategies directly (`APIOperation.as_strategy` with `@given`),
    not through schemathesis's pytest plugin, which breaks on new pytest releases (pytest 9.2 removed the
    `Function._nodeid` it reads); one test holds the whole check, so it does not depend on any other test.
    """
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models"}
    statuses: set[int] = set()
    for op in operations:
        # an operation with no body and no parameters (GET /health) has nothing to make invalid
        negatable = bool(op.body) or any(True for _ in op.iter_parameters())
        modes = [schemathesis.GenerationMode.POSITIVE] + [schemathesis.GenerationMode.NEGATIVE] * negatable
        for mode in modes:
            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
                      database=None)
            def check(case):
                response = case.call(timeout=120)
                statuses.add(response.status_code)
                assert response.status_code < 500, (case.method, case.path, case.body, response.text)

            check()
    assert 200 in statuses and 400 in statuses, statuses


def test_kv_memory_fraction_needs_a_device_that_reports_memory():
    from mnemojax.engine.llm_engine import EngineConfig, LLMEngine

    with pytest.raises(ValueError, match="not both"):
        EngineConfig(num_pages=10, kv_memory_fraction=0.5)
    with pytest.raises(ValueError, match=r"kv_memory_fraction must be in \(0, 1\]"):
        EngineConfig(kv_memory_fraction=1.5)
    with pytest.raises(ValueError, match="reports its memory"):  # the CPU does not
        LLMEngine(EngineConfig(kv_memory_fraction=0.5, max_model_len=64))


def _stream_error(url: str, body: dict) -> str:
    """A streamed completion that fails once started: 200, then an error event and [DONE]; the error's message."""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    return json.loads(lines[-2][6:])["error"]["message"]


def test_engine_failure_is_answered_not_hung():
    """If the engine itself fails, every caller gets an answer: a stream ends with an error event and [DONE],
    a whole response is a 500, so is the admin /reset_prefix_cache (it hung: its command waited for an engine
    thread that was gone), and /health says so."""
    broken = AsyncLLM("tiny", max_model_len=64, page_size=4, chunk_size=16, max_num_batched_tokens=32)
    calls = 0
    step = broken.engine.step

    def failing_step():
        nonlocal calls
        calls += 1
        if calls > 3:
            raise RuntimeError("device lost")
        return step()

    broken.engine.step = failing_step
    s = ThreadServer(build_app(broken, served_model_name="tiny"))
    try:
        message = _stream_error(s.url, {"prompt": "a", "max_tokens": 40, "ignore_eos": True, "stream": True})
        # the client learns that the engine stopped, not the exception's text (that goes to the server log)
        assert "engine thread has stopped" in message and "device lost" not in message
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=60)
        assert r.status_code == 500 and "engine thread has stopped" in r.json()["error"]["message"]
        assert "device lost" not in r.text
        r = httpx.post(f"{s.url}/reset_prefix_cache", timeout=10)
        assert r.status_code == 500 and "engine thread has stopped" in r.json()["error"]["message"]
        assert httpx.get(f"{s.url}/health").status_code == 503  # vLLM's: a probe takes the replica out
        assert httpx.get(f"{s.url}/ping").status_code == httpx.post(f"{s.url}/ping").status_code == 503
    finally:
        s.stop()


def test_a_request_whose_steps_fail_is_answered_and_the_server_serves_on(monkeypatch):
    """Steps that fail whenever they hold one prompt's chunk: after two failures that request ends (a stream with an
    error event naming it and [DONE], a whole response a 500 saying so, no exception text); /health stays 200,
    /metrics counts the failed steps, and the next request is served."""
    from mnemojax.engine.executor import Executor

    real = Executor.launch

    def launch(self, plan, *args, **kwargs):
        if any(ch.request.prompt_token_ids == [7, 7, 7] for ch in plan.chunks):
            raise RuntimeError("device lost")
        return real(self, plan, *args, **kwargs)

    monkeypatch.setattr(Executor, "launch", launch)
    served = AsyncLLM("tiny", max_model_len=64, page_size=4, chunk_size=16, max_num_batched_tokens=32)
    s = ThreadServer(build_app(served, served_model_name="tiny"))
    try:
        message = _stream_error(s.url, {"prompt": [7, 7, 7], "max_tokens": 4, "stream": True})
        assert "was running in 2 engine steps that failed" in message and "device lost" not in message
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": [7, 7, 7], "max_tokens": 2}, timeout=60)
        assert r.status_code == 500 and "engine steps that failed" in r.json()["error"]["message"]
        assert "device lost" not in r.text
        assert httpx.get(f"{s.url}/health").status_code == 200
        assert metrics(s.url)["mnemojax_num_step_failures_total"] == 4
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        s.stop()


def test_chat_template_kwargs_are_the_templates_variables(tmp_path, url):
    """vLLM's `chat_template_kwargs`: more variables for the chat template, in chat requests and /tokenize, the
    same ids as transformers' `apply_chat_template(..., **kwargs)`; the call's own arguments may not be set that
    way (a 400 naming the field); the built-in template reads none, so they change nothing there."""
    import transformers

    from tests.hf_utils import make_hf_checkpoint

    path = make_hf_checkpoint(tmp_path / "ckpt", weight_scale=8.0)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    tok.chat_template = "{% if note is defined %}[{{ note }}]{% endif %}" + tok.chat_template
    tok.save_pretrained(path)
    messages = [{"role": "user", "content": "Hello"}]
    want = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, note="be brief"),
                      add_special_tokens=False)
    assert want != tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                              add_special_tokens=False)
    served = AsyncLLM(path, max_model_len=128, page_size=4, max_num_batched_tokens=32)
    s = ThreadServer(build_app(served, served_model_name="llama"))
    try:
        body = {"messages": messages, "chat_template_kwargs": {"note": "be brief"}}
        assert httpx.post(f"{s.url}/tokenize", json=body).json()["tokens"] == want
        got = httpx.post(f"{s.url}/v1/chat/completions", json={**body, "max_tokens": 1}, timeout=60).json()
        assert got["usage"]["prompt_tokens"] == len(want)
        r = httpx.post(f"{s.url}/v1/chat/completions", json={**body, "chat_template_kwargs": {"tokenize": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
        r = httpx.post(f"{s.url}/tokenize", json={"prompt": "a", "chat_template_kwargs": {"note": "x"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    finally:
        s.stop()
        served.shutdown()
    plain = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()["tokens"]
    assert httpx.post(f"{url}/tokenize", json={"messages": messages,
                                              "chat_template_kwargs": {"note": "x"}}).json()["tokens"] == plain


def test_hugging_face_checkpoint_uses_its_tokenizer_chat_template(tmp_path):
    """A served HF directory applies its tokenizer's own (Jinja) chat template and detokenizes with it."""
    import transformers

    from tests.hf_utils import make_hf_checkpoint

    path = make_hf_checkpoint(tmp_path / "ckpt", weight_scale=8.0)
    kw = dict(max_model_len=128, page_size=4, chunk_size=16, max_num_batched_tokens=32)
    served = AsyncLLM(path, **kw)
    s = ThreadServer(build_app(served, served_model_name="llama"))
    try:
        messages = [{"role": "user", "content": "Hello, Jinja"}]
        tok = transformers.AutoTokenizer.from_pretrained(path)
        ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False)
        assert ids.count(tok.bos_token_id) == 1
        ref = LLM(path, **kw).generate([ids], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0)
        got = c.chat.completions.create(model="llama", messages=messages, max_tokens=8, temperature=0, logprobs=True)
        assert got.usage.prompt_tokens == len(ids)
        assert got.choices[0].message.content == ref.text
        # logprob `bytes`: a byte-level BPE token's own bytes (its symbols back through the byte table; this
        # tokenizer's ids 0..255 are the bytes), not the UTF-8 of its token string (0xc3 is "Ã" there)
        assert [t.bytes for t in got.choices[0].logprobs.content] == \
            [[i] if i < 256 else list(tok.decode([i], skip_special_tokens=False).encode()) for i in ref.token_ids]
    finally:
        s.stop()
        served.shutdown()
