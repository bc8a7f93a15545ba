"""The HTTP server against a mock engine whose outputs are computed by hand (tests/mock_engine.py): the
response shapes of both endpoints, streamed and whole, without a model."""
import json

import pytest
from fastapi.testclient import TestClient

from mnemojax.serving.app import build_app
from tests.hf_utils import make_sp_tokenizer
from tests.mock_engine import MockEngine


@pytest.fixture
def served():
    engine = MockEngine()
    with TestClient(build_app(engine, served_model_name="m")) as client:
        yield engine, client


def _events(client, path, body):
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def test_completion_whole_and_streamed(served):
    engine, client = served
    body = {"model": "m", "prompt": "ab", "max_tokens": 3, "logprobs": 1}
    r = client.post("/v1/completions", json=body).json()
    # BOS, 'a', 'b' -> tokens b+1, b+2, b+3 = "cde", log-probs -0.1, -0.2, -0.3
    assert engine.requests[0][0] == [256, 97, 98]
    (c,) = r["choices"]
    assert (c["index"], c["text"], c["finish_reason"]) == (0, "cde", "length")
    assert c["logprobs"]["tokens"] == ["c", "d", "e"] and c["logprobs"]["text_offset"] == [0, 1, 2]
    assert c["logprobs"]["token_logprobs"] == [-0.1, -0.2, -0.3]
    assert c["logprobs"]["top_logprobs"][0] == {"c": -0.1, "d": -1.1}
    assert r["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                          "prompt_tokens_details": {"cached_tokens": 0}}
    assert r["object"] == "text_completion" and r["model"] == "m" and r["id"].startswith("cmpl-")

    events = _events(client, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    texts = [e["choices"][0]["text"] for e in events if e["choices"]]
    assert texts == ["c", "d", "e"]
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]] == [None, None, "length"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3


def test_stop_string_is_held_back_and_cut(served):
    _, client = served
    body = {"prompt": "ab", "max_tokens": 5, "stop": ["de"]}
    r = client.post("/v1/completions", json=body).json()["choices"][0]
    assert (r["text"], r["finish_reason"], r["stop_reason"]) == ("c", "stop", "de")
    events = _events(client, "/v1/completions", body)
    assert "".join(e["choices"][0]["text"] for e in events) == "c"  # "d" was held back, then cut


def test_n_choices_and_several_prompts(served):
    engine, client = served
    r = client.post("/v1/completions", json={"prompt": [[5], [7, 8]], "max_tokens": 2, "n": 2, "seed": 10}).json()
    assert [(c["index"], c["text"]) for c in r["choices"]] == [(0, "\x06\x07"), (1, "\x06\x07"), (2, "\t\n"),
                                                                (3, "\t\n")]
    assert [p.seed for _, p in engine.requests] == [10, 11, 10, 11]  # choice j draws with seed + j
    assert r["usage"]["prompt_tokens"] == 3  # each prompt counted once, whatever n


def _offsets(client, body):
    """The whole response's (text, tokens, text_offset), and the text_offset of its stream, which (checked here)
    never decreases nor points past the text streamed so far."""
    c = client.post("/v1/completions", json=body).json()["choices"][0]
    streamed, text = [], ""
    for e in _events(client, "/v1/completions", body):
        if e["choices"]:
            text += e["choices"][0]["text"]
            streamed += e["choices"][0]["logprobs"]["text_offset"]
            assert streamed == sorted(streamed) and all(o <= len(text) for o in streamed), (text, streamed)
    assert text == c["text"]
    return c["text"], c["logprobs"]["tokens"], c["logprobs"]["text_offset"], streamed


def test_text_offset_indexes_into_text_for_tokens_that_are_not_utf8_alone(served):
    """text_offset is where each token starts in `text`, not a sum of the lengths of the token strings (a byte that
    is no whole character is shown as `bytes:\\xNN`, 10 characters, and is one U+FFFD in the text)."""
    _, client = served
    # after "}" (0x7d): "~", DEL, then 0x80 and 0x81, each not UTF-8 and one U+FFFD in the text
    text, tokens, whole, streamed = _offsets(client, {"prompt": [0x7d], "max_tokens": 4, "logprobs": 0})
    assert text == "~\x7f\ufffd\ufffd"
    assert tokens == ["~", "\x7f", "bytes:\\x80", "bytes:\\x81"]
    assert whole == streamed == [0, 1, 2, 3]
    # after 0xbf: 0xc0 and 0xc1 (never UTF-8), then 0xc2 (the start of a character the output ends inside). The
    # stream holds the text back until a whole character follows (here: the end), and with it the entries of the
    # tokens that start past the text streamed so far (0xc1's): the stream's offsets are the whole response's.
    text, tokens, whole, streamed = _offsets(client, {"prompt": [0xbf], "max_tokens": 3, "logprobs": 0})
    assert text == "\ufffd" * 3 and whole == streamed == [0, 1, 2]
    # a stop string cut from the text leaves the tokens that made it at the text's end
    text, _, whole, streamed = _offsets(client, {"prompt": "ab", "max_tokens": 5, "stop": "de", "logprobs": 0})
    assert text == "c" and whole == streamed == [0, 1, 1]
    # "d" and "e" held back as the start of a stop string that "f" then breaks: they start where they are
    text, _, whole, streamed = _offsets(client, {"prompt": "ab", "max_tokens": 4, "stop": "dez", "logprobs": 0})
    assert text == "cdef" and whole == streamed == [0, 1, 2, 3]


def test_chat_default_max_tokens_is_what_the_kv_pages_hold():
    """Without max_tokens a chat request gets the rest of what a request can hold: max_model_len, or the KV pages'
    tokens when they hold fewer (the rest of max_model_len would always be a 400)."""
    engine = MockEngine(max_model_len=64, kv_tokens=40)
    with TestClient(build_app(engine, served_model_name="m")) as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        prompt = r.json()["usage"]["prompt_tokens"]
        assert prompt == 27 and engine.requests[0][1].max_tokens == 40 - prompt
        assert r.json()["usage"]["completion_tokens"] == 13
        # a conversation the KV pages cannot hold names the field the client sent
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 20}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert "KV pages" in r.json()["error"]["message"]


def test_completion_max_tokens_null_is_the_rest_of_the_context_per_prompt():
    """An explicit `max_tokens: null` is the rest of what each prompt's request can hold (vLLM's); absent, it is
    OpenAI's 16 (it was 16 both ways)."""
    engine = MockEngine(max_model_len=64)
    with TestClient(build_app(engine, served_model_name="m")) as client:
        r = client.post("/v1/completions", json={"prompt": ["ab", "abcdef"], "max_tokens": None})
        assert r.status_code == 200, r.text
        (ids1, p1), (ids2, p2) = engine.requests
        assert len(ids2) == len(ids1) + 4 and (p1.max_tokens, p2.max_tokens) == (64 - len(ids1), 64 - len(ids2))
        assert client.post("/v1/completions", json={"prompt": "ab"}).status_code == 200
        assert engine.requests[-1][1].max_tokens == 16


def test_chat_whole_and_streamed(served):
    _, client = served
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True, "top_logprobs": 1}
    r = client.post("/v1/chat/completions", json=body).json()
    (c,) = r["choices"]
    # the template ends with "<|assistant|>\n": tokens 11, 12, 13
    assert c["message"] == {"role": "assistant", "content": "\x0b\x0c\r"} and c["finish_reason"] == "length"
    assert [x["logprob"] for x in c["logprobs"]["content"]] == [-0.1, -0.2, -0.3]
    assert [len(x["top_logprobs"]) for x in c["logprobs"]["content"]] == [1, 1, 1]
    events = _events(client, "/v1/chat/completions", body)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:]) == "\x0b\x0c\r"
    assert all(e["object"] == "chat.completion.chunk" for e in events)


def test_models_and_a_bad_request(served):
    _, client = served
    (m,) = client.get("/v1/models").json()["data"]
    assert (m["id"], m["root"], m["max_model_len"]) == ("m", "mock", 64)
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 100})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_reset_prefix_cache_endpoint_is_behind_the_api_key():
    engine = MockEngine()
    with TestClient(build_app(engine, served_model_name="m", api_key="k")) as client:
        assert client.post("/reset_prefix_cache").status_code == 401
        r = client.post("/reset_prefix_cache", headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and r.json() == {"num_cached_pages_reset": 0}
        assert engine.num_cache_resets == 1
        assert client.get("/health").status_code == 200  # still open


def test_prediction_error_gauge_only_with_calibration():
    from mnemojax.engine.async_llm import EngineStats
    from mnemojax.serving.metrics import ServerMetrics

    text = ServerMetrics(lambda: EngineStats(step_time_prediction_error=0.07), "m").render().decode()
    assert "\nmnemojax_step_time_prediction_error 0.07\n" in text
    assert "mnemojax_step_time_prediction_error" not in ServerMetrics(EngineStats, "m").render().decode()


def test_sentencepiece_completion_continues_the_prompt_with_its_offsets():
    """A SentencePiece tokenizer (Llama-2's decoder drops the space that starts what it decodes): the completion's
    text keeps its words' spaces and its first one (it continues the prompt, as vLLM's does), echo joins prompt
    and completion with that space, and each token's text_offset is where its piece (U+2581 a space) starts, in
    the whole response and in the stream; log-prob token strings are those pieces."""
    tok = make_sp_tokenizer()
    pieces = ["\u2581hello", "\u2581world", ".", "\u2581a", "b", "\u2581\u2581", "\u00e9"]
    out = [tok.convert_tokens_to_ids(p) for p in pieces]
    engine = MockEngine(tokenizer=tok, tokens=lambda last, n: out[:n])
    words = [p.replace("\u2581", " ") for p in pieces]
    starts = [sum(len(w) for w in words[:i]) for i in range(len(words))]  # by hand: the pieces' lengths
    with TestClient(build_app(engine, served_model_name="m")) as client:
        a = tok.convert_tokens_to_ids("\u2581a")
        body = {"model": "m", "prompt": [a, a], "max_tokens": len(out), "logprobs": 0}
        text, tokens, offsets, streamed = _offsets(client, body)
        assert text == "".join(words) == " hello world. ab  é"
        assert offsets == streamed == starts
        assert tokens == words  # each with its space, as the text has it ("hello" when decoded alone)
        c = client.post("/v1/completions", json={**body, "echo": True}).json()["choices"][0]
        assert c["text"] == "a a hello world. ab  é"  # the prompt's first space is dropped, as HF decodes it
        assert c["logprobs"]["text_offset"] == [0, 1] + [len("a a") + s for s in starts]


def test_the_models_generation_defaults_fill_what_a_request_leaves_out():
    """vLLM's --generation-config auto: the model's defaults (here temperature 0.5, top_p 0.8, top_k 7 and
    max_new_tokens 3) for what a request leaves out, and max_new_tokens caps every request's max_tokens."""
    engine = MockEngine(default_sampling={"temperature": 0.5, "top_p": 0.8, "top_k": 7, "max_tokens": 3})
    with TestClient(build_app(engine, served_model_name="m")) as client:
        bodies = [("/v1/completions", {"prompt": "ab", "max_tokens": 10}),
                  ("/v1/completions", {"prompt": "ab", "temperature": 0, "top_p": 1.0, "top_k": -1}),
                  ("/v1/completions", {"prompt": "ab", "max_tokens": None}),
                  ("/v1/completions", {"prompt": "ab", "max_tokens": 2}),
                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]
        for path, body in bodies:
            assert client.post(path, json=body).status_code == 200
    got = [(p.temperature, p.top_p, p.top_k, p.max_tokens) for _, p in engine.requests]
    assert got == [(0.5, 0.8, 7, 3), (0.0, 1.0, -1, 3), (0.5, 0.8, 7, 3), (0.5, 0.8, 7, 2), (0.5, 0.8, 7, 3)]
