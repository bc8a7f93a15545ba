"""vLLM's chat and tokenizer request fields, against a mock engine (tests/mock_engine.py) whose prompt ids the
tests read back: `continue_final_message`, `add_special_tokens`, `echo` and the reply's role, `chat_template` (the
request's, only when trusted; the server's `--chat_template`), `documents`, content parts, completions'
`add_special_tokens: false` and `return_tokens_as_token_ids`. The expected prompt ids come from transformers'
own `apply_chat_template` on the byte tokenizer's Hugging Face twin (tests/hf_utils.py)."""
import json

import pytest
from fastapi.testclient import TestClient

from mnemojax.serving.app import build_app
from mnemojax.serving.config import ServerConfig
from models.tokenizer import BYTE_CHAT_TEMPLATE
from tests.hf_utils import make_hf_tokenizer
from tests.mock_engine import MockEngine

HF = make_hf_tokenizer()
TALK = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]
DOCS_TEMPLATE = "{% for d in documents %}[{{ d['title'] }}: {{ d['text'] }}]{% endfor %}" + BYTE_CHAT_TEMPLATE


def _serve(tokenizer=None, **config):
    engine = MockEngine(max_model_len=256, tokenizer=tokenizer)
    return engine, TestClient(build_app(engine, served_model_name="m", **config))


def _hf_ids(messages, special=False, **kw):
    """transformers' ids for `messages` through the HF twin's template (the reference)."""
    text = HF.apply_chat_template(messages, tokenize=False, **kw)
    return HF.encode(text, add_special_tokens=special)


def _chat(client, **body):
    r = client.post("/v1/chat/completions", json={"max_tokens": 3, **body})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("hf", [False, True], ids=["byte", "hf"])
def test_continue_final_message_leaves_the_last_message_open(hf):
    engine, client = _serve(HF if hf else None)
    with client:
        r = _chat(client, messages=TALK, add_generation_prompt=False, continue_final_message=True)
        want = _hf_ids(TALK, continue_final_message=True)
        assert engine.requests[-1][0] == want and bytes(want[-3:]) == b" is"
        # vLLM's role: the last message's when no generation prompt is added; "is" -> the mock's "tuv"
        assert r["choices"][0]["message"] == {"role": "assistant", "content": "tuv"}
        r = client.post("/v1/chat/completions", json={"messages": TALK, "continue_final_message": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
        # /tokenize takes it too, with messages only
        got = client.post("/tokenize", json={"messages": TALK, "add_generation_prompt": False,
                                             "continue_final_message": True}).json()["tokens"]
        assert got == want
        r = client.post("/tokenize", json={"prompt": "a", "add_generation_prompt": False,
                                           "continue_final_message": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_add_special_tokens_and_content_parts():
    engine, client = _serve(HF)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    as_text = [{"role": "user", "content": "a\nb"}]  # vLLM joins text parts with newlines
    with client:
        _chat(client, messages=msgs)
        assert engine.requests[-1][0] == _hf_ids(as_text, add_generation_prompt=True)
        _chat(client, messages=msgs, add_special_tokens=True)  # the tokenizer's BOS before the template's
        want = _hf_ids(as_text, special=True, add_generation_prompt=True)
        assert engine.requests[-1][0] == want and want[:2] == [HF.bos_token_id] * 2
        # /tokenize: by default special tokens for a prompt, none for messages (the template writes its own)
        assert client.post("/tokenize", json={"messages": msgs}).json()["tokens"] == \
            _hf_ids(as_text, add_generation_prompt=True)
        assert client.post("/tokenize", json={"messages": msgs, "add_special_tokens": True}).json()["tokens"] == want
        assert client.post("/tokenize", json={"prompt": "ab"}).json()["tokens"] == [HF.bos_token_id, 97, 98]
        # completions: a text prompt without BOS on request; token ids are taken as they are
        r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, "add_special_tokens": False,
                                                 "echo": True})
        assert engine.requests[-1][0] == [97, 98] and r.json()["choices"][0]["text"] == "abcd"
        client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "add_special_tokens": False})
        assert engine.requests[-1][0] == [5, 6]


def _streamed(client, body):
    with client.stream("POST", "/v1/chat/completions", json={**body, "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    return [json.loads(line[len("data: "):])["choices"][0]["delta"] for line in lines[:-1]]


def test_echo_starts_the_reply_with_the_last_message_of_its_role():
    _, client = _serve()
    with client:
        body = {"messages": TALK, "add_generation_prompt": False, "continue_final_message": True, "echo": True}
        assert _chat(client, **body)["choices"][0]["message"] == {"role": "assistant", "content": "The answer istuv"}
        deltas = _streamed(client, body)
        assert deltas[:2] == [{"role": "assistant", "content": ""}, {"content": "The answer is"}]
        assert "".join(d.get("content", "") for d in deltas) == "The answer istuv"
        # n = 2: vLLM's order, every choice's role chunk first, then every choice's echo
        usage = {"include_usage": True, "continuous_usage_stats": True}
        two = {**body, "max_tokens": 2, "n": 2, "stream": True, "stream_options": usage}
        with client.stream("POST", "/v1/chat/completions", json=two) as r:
            events = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line and "[DONE]" not in line]
        firsts = [(e["choices"][0]["index"], e["choices"][0]["delta"], e["usage"]["completion_tokens"])
                  for e in events[:4]]
        role, echo = {"role": "assistant", "content": ""}, {"content": "The answer is"}
        assert firsts == [(0, role, 0), (1, role, 0), (0, echo, 0), (1, echo, 0)]
        # the reply is the assistant's, the last message the user's: nothing to echo
        users = [{"role": "user", "content": "Hi"}]
        r = _chat(client, messages=users, echo=True)["choices"][0]["message"]
        assert r["role"] == "assistant" and not r["content"].startswith("Hi")
        deltas = _streamed(client, {"messages": users, "echo": True})
        assert "".join(d.get("content", "") for d in deltas) == r["content"] and deltas[1] != {"content": "Hi"}
        # without a generation prompt the reply takes the last message's role, so it echoes it
        r = _chat(client, messages=users, echo=True, add_generation_prompt=False)["choices"][0]["message"]
        assert r["role"] == "user" and r["content"].startswith("Hi")
    _, client = _serve(response_role="bot")  # vLLM's --response-role: the role a generation prompt's reply takes
    with client:
        assert _chat(client, messages=users)["choices"][0]["message"]["role"] == "bot"
        assert _streamed(client, {"messages": users})[0]["role"] == "bot"
        assert _chat(client, messages=users, add_generation_prompt=False)["choices"][0]["message"]["role"] == "user"
    with pytest.raises(ValueError, match="response_role must not be empty"):
        ServerConfig(response_role="")


def test_a_requests_chat_template_needs_the_servers_trust():
    template = "{% for m in messages %}{{ m['role'] }}={{ m['content'] }};{% endfor %}"
    msgs = [{"role": "user", "content": "Hi"}]
    _, client = _serve(HF)
    with client:
        r = client.post("/v1/chat/completions", json={"messages": msgs, "chat_template": template})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
        assert "--trust_request_chat_template" in r.json()["error"]["message"]
    engine, client = _serve(HF, trust_request_chat_template=True)
    with client:
        _chat(client, messages=msgs, chat_template=template)
        assert engine.requests[-1][0] == list(b"user=Hi;") == _hf_ids(msgs, chat_template=template)
        assert client.post("/tokenize", json={"messages": msgs, "chat_template": template}).json()["tokens"] == \
            list(b"user=Hi;")
        r = client.post("/v1/chat/completions", json={"messages": msgs, "chat_template": "{% if %}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    # the built-in byte tokenizer's template is fixed: a 400 naming the field, never ignored
    _, client = _serve(trust_request_chat_template=True)
    with client:
        r = client.post("/v1/chat/completions", json={"messages": msgs, "chat_template": template})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"


def test_the_servers_chat_template_and_documents(tmp_path):
    msgs = [{"role": "user", "content": "Q"}]
    docs = [{"title": "t1", "text": "x"}, {"title": "t2", "text": "y"}]
    path = tmp_path / "template.jinja"
    path.write_text(DOCS_TEMPLATE)
    for setting in (str(path), DOCS_TEMPLATE):  # a file, or the template itself
        engine, client = _serve(HF, chat_template=setting)
        with client:
            _chat(client, messages=msgs, documents=docs)
            want = _hf_ids(msgs, chat_template=DOCS_TEMPLATE, documents=docs, add_generation_prompt=True)
            assert engine.requests[-1][0] == want and bytes(want[:12]) == b"[t1: x][t2: "
            assert client.get("/tokenizer_info").json()["chat_template"] == DOCS_TEMPLATE
    with pytest.raises(ValueError, match="chat_template: 'no/such/file' is neither a file nor a Jinja template"):
        ServerConfig(chat_template="no/such/file").resolved_chat_template()
    with pytest.raises(ValueError, match="chat_template: .*byte tokenizer"):
        build_app(MockEngine(), chat_template=DOCS_TEMPLATE)
    _, client = _serve()
    with client:  # the built-in template, as Jinja
        assert client.get("/tokenizer_info").json()["chat_template"] == BYTE_CHAT_TEMPLATE


def test_return_tokens_as_token_ids():
    _, client = _serve(return_tokens_as_token_ids=True)
    with client:
        body = {"prompt": "ab", "max_tokens": 2, "logprobs": 1}
        lp = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
        # 'b' (98) -> tokens 99, 100, each with one more top entry (the mock's)
        assert lp["tokens"] == ["token_id:99", "token_id:100"]
        assert lp["top_logprobs"][0] == {"token_id:99": -0.1, "token_id:100": -1.1}
        lp = client.post("/v1/completions", json={**body, "return_tokens_as_token_ids": False}).json()
        assert lp["choices"][0]["logprobs"]["tokens"] == ["c", "d"]  # the request's choice wins
        r = _chat(client, messages=[{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=1)
        first = r["choices"][0]["logprobs"]["content"][0]  # "...\n" (10) -> 11
        assert (first["token"], first["bytes"]) == ("token_id:11", [11])  # bytes: the token's own
        assert [t["token"] for t in first["top_logprobs"]] == ["token_id:11"]
    _, client = _serve()
    with client:
        lp = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 1, "logprobs": 0,
                                                  "return_tokens_as_token_ids": True}).json()
        assert lp["choices"][0]["logprobs"]["tokens"] == ["token_id:99"]
