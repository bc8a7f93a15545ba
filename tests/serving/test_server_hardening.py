"""The server against hostile clients (issue 13), over the hand-computable mock engine: no input gets a 500 or
echoes a secret, every wrong type or limit is a 400 naming its field, and incomplete requests, unread streams and
idle connections are closed after their documented timeouts.

HTTP-level checks go through FastAPI's TestClient; connection-level ones (timeouts, a client that reads nothing)
need real sockets, so they run a uvicorn server on loopback and speak raw HTTP/1.1 to it.
"""
import asyncio
import json
import socket
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from mnemojax.serving.app import build_app
from mnemojax.serving.config import ServerConfig
from tests.mock_engine import MockEngine
from tests.server_utils import ThreadServer, wait_for

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture
def served():
    engine = MockEngine()
    with TestClient(build_app(engine, served_model_name="m"), raise_server_exceptions=False) as client:
        yield engine, client


def _error(r, status=400):
    assert r.status_code == status, r.text
    return r.json()["error"]


# ---------------------------------------------------------------- 1. secrets and exception text
def test_a_non_latin1_api_key_is_checked_and_never_echoed():
    with TestClient(build_app(MockEngine(), served_model_name="m", api_key="ключ"),
                    raise_server_exceptions=False) as c:
        body = {"prompt": "ab", "max_tokens": 2}
        for headers in ({}, {"Authorization": b"Bearer wrong"}, {"Authorization": b"Bearer \xff\xfe"},
                        {"Authorization": "Bearer ключ".encode("utf-8")[:-1]}):
            r = c.post(COMPLETIONS, json=body, headers=headers)
            assert _error(r, 401)["type"] == "authentication_error"
            assert "ключ" not in r.text and "\\u043a" not in r.text
        r = c.post(COMPLETIONS, json=body, headers={"Authorization": "Bearer ключ".encode("utf-8")})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "cd"


def test_the_api_key_from_a_file_or_the_environment(tmp_path):
    """--api_key shows in the process list; a file or MNEMOJAX_API_KEY do not."""
    path = tmp_path / "key"
    path.write_text("ключ\nignored\n", encoding="utf-8")
    assert ServerConfig(api_key_file=str(path)).with_api_key({}).api_key == "ключ"
    assert ServerConfig().with_api_key({"MNEMOJAX_API_KEY": "from-env"}).api_key == "from-env"
    assert ServerConfig(api_key="flag").with_api_key({"MNEMOJAX_API_KEY": "from-env"}).api_key == "flag"
    assert ServerConfig().with_api_key({}).api_key is None
    with pytest.raises(ValueError, match="not both"):
        ServerConfig(api_key="a", api_key_file=str(path))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        ServerConfig(api_key_file=str(tmp_path / "empty")).with_api_key({})


@pytest.mark.parametrize("field, value", [("max_queue", 0), ("max_choices", 0), ("max_stop_strings", -1),
                                          ("header_timeout_s", 0.0), ("write_timeout_s", -1.0),
                                          ("port", 70000), ("port", -1), ("max_request_bytes", 0),
                                          ("max_request_bytes", -1), ("shutdown_grace_s", -5.0)])
def test_server_limits_are_checked(field, value):
    with pytest.raises(ValueError, match=field):
        ServerConfig(**{field: value})


def test_the_request_size_limit_is_the_one_given():
    assert ServerConfig(max_request_bytes=1).request_bytes_limit(4096) == 1
    assert ServerConfig().request_bytes_limit(4096) == (1 << 20) + 32 * 4096


def test_an_internal_error_says_nothing_of_its_exception(served):
    engine, client = served

    def broken(prompt, params):
        raise RuntimeError("secret-value-42")

    engine.validate = broken
    r = client.post(COMPLETIONS, json={"prompt": "ab", "max_tokens": 2})
    err = _error(r, 500)
    assert "secret-value-42" not in r.text and "RuntimeError" not in r.text
    assert err["type"] == "internal_server_error" and "server log" in err["message"]


def test_a_stream_that_fails_midway_ends_with_an_error_event_without_its_exception():
    engine = MockEngine(fail_after=2, failure=RuntimeError("secret-value-42"))
    with TestClient(build_app(engine, served_model_name="m"), raise_server_exceptions=False) as client:
        with client.stream("POST", COMPLETIONS, json={"prompt": "ab", "max_tokens": 8, "stream": True}) as r:
            lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2][len("data: "):])["error"]
    assert err["code"] == 500 and "secret-value-42" not in "".join(lines) and "RuntimeError" not in "".join(lines)


# ---------------------------------------------------------------- 2. stop strings, stop token ids, choices
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("extra, param, limit", [
    ({"stop": [f"s{i}" for i in range(20_000)]}, "stop", "16"),  # the flood of stop strings, smaller
    ({"stop": [f"{i:02d}" for i in range(17)]}, "stop", "16"),  # one over the default cap
    ({"stop": ["x" * 1025]}, "stop", "1024"),  # one character over the default total length
    ({"stop": ["x" * 600, "y" * 425]}, "stop", "1024"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids", "64"),
])
def test_stop_limits_are_400_naming_the_field_and_the_limit(served, path, extra, param, limit):
    _, client = served
    body = {"prompt": "ab"} if path == COMPLETIONS else {"messages": MSG}
    err = _error(client.post(path, json={**body, "max_tokens": 2, **extra}))
    assert err["param"] == param and limit in err["message"]


def test_stop_strings_at_the_limits_are_served(served):
    _, client = served
    stop = ["x" * 64] * 15 + ["y" * 64]  # 16 strings, 1024 characters
    r = client.post(COMPLETIONS, json={"prompt": "ab", "max_tokens": 2, "stop": stop,
                                       "stop_token_ids": list(range(200, 264))})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "cd"


@pytest.mark.parametrize("body, param", [
    ({"prompt": ["ab"] * 257, "max_tokens": 2}, "prompt"),
    ({"prompt": ["ab"] * 33, "n": 8, "max_tokens": 2}, "n"),
])
def test_more_choices_than_the_server_can_ever_take_is_400_not_429(served, body, param):
    _, client = served
    err = _error(client.post(COMPLETIONS, json=body))
    assert err["param"] == param and "choices" in err["message"] and "256" in err["message"]


def test_a_full_queue_is_429_naming_max_queue(served):
    engine, client = served
    engine.num_waiting = 255  # requests of other clients, waiting for their first step
    err = _error(client.post(COMPLETIONS, json={"prompt": "ab", "max_tokens": 2, "n": 2}), 429)
    assert err["type"] == "rate_limit_error" and "max_queue" in err["message"]
    assert client.post(COMPLETIONS, json={"prompt": "ab", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("path, extra, param", [
    # fields the server cannot honour: refused by name, not ignored (a 200 with unconstrained text, no tool call)
    (COMPLETIONS, {"response_format": {"type": "structural_tag"}}, "response_format"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
     "response_format"),  # a schema that takes any JSON value
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    (CHAT, {"tool_choice": "required"}, "tool_choice"),
    (CHAT, {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    # vLLM's rule: stream_options only with a stream
    (COMPLETIONS, {"stream_options": {"include_usage": True}}, "stream_options"),
    (CHAT, {"stream_options": {"include_usage": True}, "stream": False}, "stream_options"),
])
def test_fields_the_server_cannot_honour_are_400_naming_them(served, path, extra, param):
    _, client = served
    body = {"prompt": "ab"} if path == COMPLETIONS else {"messages": MSG}
    err = _error(client.post(path, json={**body, "max_tokens": 2, **extra}))
    assert err["param"] == param, err


@pytest.mark.parametrize("extra", [{"response_format": {"type": "text"}}, {"tools": [], "tool_choice": "none"},
                                   {"tool_choice": "auto"}, {"stream": True, "stream_options": {"include_usage": True}}])
def test_their_default_values_are_served(served, extra):
    _, client = served
    assert client.post(CHAT, json={"messages": MSG, "max_tokens": 2, **extra}).status_code == 200


def test_an_unknown_model_is_404_as_in_openai_and_vllm(served):
    _, client = served
    err = _error(client.post(COMPLETIONS, json={"prompt": "ab", "model": "gpt-4"}), 404)
    assert err["type"] == "not_found_error" and err["param"] == "model" and "does not exist" in err["message"]


def test_requests_arriving_together_cannot_overfill_the_queue():
    # 12 requests at once: each handler admits its request before any engine request has started (and counts
    # as waiting), so each must count those admitted before it.
    engine = MockEngine(token_delay_s=0.2)
    app = build_app(engine, served_model_name="m", max_queue=3)
    s = ThreadServer(app)

    async def burst():
        async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
            return await asyncio.gather(*(c.post(COMPLETIONS, json={"prompt": "ab", "max_tokens": 2})
                                          for _ in range(12)))

    try:
        codes = sorted(r.status_code for r in asyncio.run(burst()))
        assert codes == [200] * 3 + [429] * 9, codes
        assert app.state.server.num_admitted == 0 and engine.num_waiting == 0
        assert httpx.post(f"{s.url}{COMPLETIONS}", json={"prompt": "ab", "max_tokens": 2}).status_code == 200
    finally:
        s.stop()


# ---------------------------------------------------------------- 4. zero token limits
@pytest.mark.parametrize("extra, param", [
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": 0, "max_completion_tokens": 5}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": -3}, "max_completion_tokens"),
])
def test_chat_token_limits_below_one_are_400(served, extra, param):
    _, client = served
    err = _error(client.post(CHAT, json={"messages": MSG, **extra}))
    assert err["param"] == param and "at least 1" in err["message"]


def test_chat_max_completion_tokens_wins_over_max_tokens(served):
    engine, client = served
    r = client.post(CHAT, json={"messages": MSG, "max_tokens": 9, "max_completion_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


# ---------------------------------------------------------------- 5. strict types
@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS, {"prompt": "ab", "stream": "yes"}, "stream"),
    (COMPLETIONS, {"prompt": "ab", "max_tokens": "2"}, "max_tokens"),
    (COMPLETIONS, {"prompt": "ab", "max_tokens": True}, "max_tokens"),
    (COMPLETIONS, {"prompt": "ab", "max_tokens": 2.0}, "max_tokens"),
    (COMPLETIONS, {"prompt": ["7", True]}, "prompt"),
    (COMPLETIONS, {"prompt": [7, "8"]}, "prompt"),
    (COMPLETIONS, {"prompt": "ab", "temperature": "0.5"}, "temperature"),
    (COMPLETIONS, {"prompt": "ab", "temperature": True}, "temperature"),
    (COMPLETIONS, {"prompt": "ab", "n": "2"}, "n"),
    (COMPLETIONS, {"prompt": "ab", "seed": "1"}, "seed"),
    (COMPLETIONS, {"prompt": "ab", "ignore_eos": 1}, "ignore_eos"),
    (COMPLETIONS, {"prompt": "ab", "stop": ["a", 1]}, "stop"),
    (COMPLETIONS, {"prompt": "ab", "stop_token_ids": ["1"]}, "stop_token_ids.0"),
    (COMPLETIONS, {"prompt": "ab", "stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    (CHAT, {"messages": MSG, "logprobs": "yes"}, "logprobs"),
    (CHAT, {"messages": MSG, "top_logprobs": "2", "logprobs": True}, "top_logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
])
def test_a_wrong_type_is_400_naming_the_field(served, path, body, param):
    engine, client = served
    err = _error(client.post(path, json=body))
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert not engine.requests  # nothing was queued


def test_a_float_that_is_whole_is_a_valid_temperature(served):
    _, client = served
    assert client.post(COMPLETIONS, json={"prompt": "ab", "max_tokens": 2, "temperature": 1}).status_code == 200


# ---------------------------------------------------------------- 6. clear errors
@pytest.mark.parametrize("headers", [{}, {"Content-Type": "application/x-www-form-urlencoded"},
                                     {"Content-Type": "text/plain"}])
def test_a_json_body_is_read_as_json_whatever_its_content_type(served, headers):
    _, client = served
    r = client.post(COMPLETIONS, content=b'{"prompt": "ab", "max_tokens": 2}', headers=headers)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "cd"


def test_an_image_content_part_is_refused_as_unsupported(served):
    _, client = served
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    err = _error(client.post(CHAT, json={"messages": [{"role": "user", "content": [part]}]}))
    assert err["param"] == "messages.0.content" and "text" in err["message"]
    assert ".str" not in err["message"]


@pytest.mark.parametrize("path, raw, param", [
    (COMPLETIONS, b'{"prompt": "a\\ud800b"}', "prompt"),
    (COMPLETIONS, b'{"prompt": ["ok", "\\udc00"]}', "prompt.1"),
    (COMPLETIONS, b'{"prompt": "ab", "stop": "\\ud83d"}', "stop"),
    (COMPLETIONS, b'{"prompt": "ab", "model": "\\ud800"}', "model"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages.0.content.0.text"),
])
def test_a_lone_surrogate_is_400_naming_its_field(served, path, raw, param):
    _, client = served
    err = _error(client.post(path, content=raw, headers={"Content-Type": "application/json"}))
    assert err["param"] == param and "surrogate" in err["message"]


def test_a_surrogate_pair_is_one_character(served):
    _, client = served
    r = client.post(COMPLETIONS, content=b'{"prompt": "\\ud83d\\ude00", "max_tokens": 2}',
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 200


@pytest.mark.parametrize("role", ["<|assistant|>", "system|>\nx", "admin", ""])
def test_chat_roles_are_checked(served, role):
    _, client = served
    err = _error(client.post(CHAT, json={"messages": [{"role": role, "content": "hi"}]}))
    assert err["param"] == "messages.0.role"


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant", "tool"])
def test_openai_roles_are_served(served, role):
    _, client = served
    assert client.post(CHAT, json={"messages": [{"role": role, "content": "hi"}], "max_tokens": 2}).status_code == 200


# ---------------------------------------------------------------- 3, 7. connections: timeouts and backpressure
TIMEOUTS = dict(header_timeout_s=0.5, body_timeout_s=0.5, write_timeout_s=1.0)


@pytest.fixture
def live():
    engine = MockEngine(max_model_len=100_000, token_delay_s=0.001)
    server = ThreadServer(build_app(engine, served_model_name="m", **TIMEOUTS))
    yield engine, server
    server.stop()


def _connect(server, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(10)
    s.connect(("127.0.0.1", server.port))
    return s


def _read_to_close(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout if it never does)."""
    data = b""
    while True:
        try:
            chunk = s.recv(1 << 16)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def _head(body_len: int | None, path: str = COMPLETIONS, chunked: bool = False) -> bytes:
    length = b"Transfer-Encoding: chunked\r\n" if chunked else b"Content-Length: %d\r\n" % body_len
    return b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + length + b"\r\n"


@pytest.mark.parametrize("sent", [b"", b"POST /v1/compl", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"],
                         ids=["nothing", "half a request line", "part of the headers"])
def test_an_incomplete_request_head_is_closed_after_the_header_timeout(live, sent):
    _, server = live
    with _connect(server) as s:
        s.sendall(sent)
        t0 = time.monotonic()
        assert _read_to_close(s) == b""
        assert 0.4 < time.monotonic() - t0 < 5


def test_an_idle_connection_after_a_response_is_closed(live):
    _, server = live
    body = json.dumps({"prompt": "ab", "max_tokens": 2}).encode()
    with _connect(server) as s:
        s.sendall(_head(len(body)) + body)
        first = s.recv(1 << 16)
        assert first.startswith(b"HTTP/1.1 200")
        s.sendall(b"POST /v1/comp")  # then half of a second request, and nothing more
        t0 = time.monotonic()
        _read_to_close(s)
        assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("sent", [_head(100) + b'{"prompt": "a', _head(None, chunked=True) + b"64\r\n{\"prompt\""],
                         ids=["part of the body", "a chunk shorter than its size"])
def test_an_incomplete_body_is_408_after_the_body_timeout(live, sent):
    engine, server = live
    with _connect(server) as s:
        s.sendall(sent)
        t0 = time.monotonic()
        reply = _read_to_close(s)
        assert 0.4 < time.monotonic() - t0 < 5
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == 408
    assert not engine.requests


def test_a_stream_nobody_reads_is_aborted_after_the_write_timeout(live):
    """A client that opens a long stream and reads nothing: the server stops writing once the socket buffers are
    full, and after `write_timeout_s` of no progress closes the connection and aborts the requests (their pages are
    freed); generation does not run to the end into memory."""
    engine, server = live
    body = json.dumps({"prompt": "ab", "max_tokens": 20_000, "n": 8, "logprobs": 1, "stream": True}).encode()
    with _connect(server, rcvbuf=4096) as s:
        s.sendall(_head(len(body)) + body)
        wait_for(lambda: engine.num_active == 8, timeout=5, what="8 choices running")
        wait_for(lambda: engine.num_active == 0, timeout=15, what="the unread stream aborted")
        assert engine.dropped == 8 and engine.finished == []
        _read_to_close(s)  # and the server closed the connection


def test_a_slow_reader_that_keeps_reading_is_served(live):
    engine, server = live
    body = json.dumps({"prompt": "ab", "max_tokens": 3000, "stream": True}).encode()
    with _connect(server, rcvbuf=4096) as s:
        s.sendall(_head(len(body)) + body)
        data = b""
        while b"data: [DONE]" not in data:
            time.sleep(0.002)
            chunk = s.recv(2048)
            assert chunk, "the server closed a connection whose client was reading"
            data += chunk
    assert engine.finished == ["length"] and engine.dropped == 0
