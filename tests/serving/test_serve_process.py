"""`python -m mnemojax.serve` as users start it: SIGTERM drains and exits 0; two processes with 4 CPU devices
each (jax.distributed on localhost) serve the same tokens as one process with 8."""
import json
import signal
import socket
import tempfile
import threading
import time

import httpx
import numpy as np
import pytest

from tests.server_utils import ServeProcess, free_port, metrics, start_serve, wait_for, wait_healthy


def _stream_lines(url, body, lines, first_events: threading.Event):
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        for ln in r.iter_lines():
            if ln:
                lines.append(ln)
            if len(lines) >= 3:
                first_events.set()
    first_events.set()


@pytest.mark.slow  # ~20 s (the default suite's ten minutes, forty-seventh session)
def test_sigterm_stops_intake_answers_in_flight_and_exits_0():
    """SIGTERM: new requests are refused; a stream and a beam search in flight (their steps take turns with the
    stream's) outlive the grace and are answered, aborted; the process exits 0."""
    with ServeProcess(["--max-model-len", "4096", "--shutdown-grace-s", "0.5"]) as served:  # vLLM's spelling
        url, proc = served.url, served.proc
        lines, started = [], threading.Event()
        body = {"prompt": "a long answer", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        t = threading.Thread(target=_stream_lines, args=(url, body, lines, started))
        t.start()
        assert started.wait(60)
        beams: list = []
        searching = threading.Thread(target=_whole, args=(url, {"prompt": "beams", "max_tokens": 3000, "n": 2,
                                                                "ignore_eos": True, "use_beam_search": True}, beams))
        searching.start()
        wait_for(lambda: metrics(url)["mnemojax_num_requests_running"] >= 2, what="the search's steps running")
        proc.send_signal(signal.SIGTERM)
        # intake stops: a new request is refused (503 while draining, or no listener once closed)
        try:
            status = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30).status_code
        except httpx.ConnectError:
            status = None
        assert status in (503, None)
        t.join(60)
        searching.join(60)
        assert proc.wait(60) == 0
    output = served.output
    # the stream in flight got a final message (aborted: 4000 tokens do not fit in the 0.5 s grace) and [DONE]
    assert lines[-1] == "data: [DONE]", output[-3000:]
    final = json.loads(lines[-2][6:])["choices"][0]
    assert final["finish_reason"] == "abort"
    (status, ctype, text), = beams
    assert status == 200 and [c["finish_reason"] for c in json.loads(text)["choices"]] == ["abort"] * 2, text
    assert "draining" in output and "Traceback" not in output, output[-3000:]
    assert "objects of start-up out of the garbage collector's reach" in output  # no full-GC pauses while serving


def _whole(url, body, out: list):
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    out.append((r.status_code, r.headers.get("content-type"), r.text))


def test_a_second_signal_aborts_at_once_and_a_half_sent_body_gets_503():
    """SIGTERM with a long grace: a request whose body is still arriving is answered 503 (JSON) at once, and the
    streams in flight go on; a second signal (SIGINT, as a second Ctrl-C) ends the grace: every stream ends with a
    final chunk (finish_reason "abort") and [DONE], a whole response is still JSON, and the process exits 0."""
    with ServeProcess(["--max_model_len", "4096", "--shutdown_grace_s", "120"]) as served:
        url, proc = served.url, served.proc
        lines, started = [], threading.Event()
        body = {"prompt": "a long answer", "max_tokens": 4000, "ignore_eos": True}
        streaming = threading.Thread(target=_stream_lines, args=(url, {**body, "stream": True}, lines, started))
        whole: list = []
        waiting = threading.Thread(target=_whole, args=(url, body, whole))
        streaming.start()
        waiting.start()
        assert started.wait(60)
        half = socket.create_connection(("127.0.0.1", served.port), timeout=30)
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": \"a")
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        reply = b""
        while b"}}" not in reply:
            chunk = half.recv(4096)
            assert chunk, reply
            reply += chunk
        half.close()
        time.sleep(1.0)
        assert proc.poll() is None and streaming.is_alive()  # the grace goes on for the streams
        proc.send_signal(signal.SIGINT)
        streaming.join(60)
        waiting.join(60)
        assert proc.wait(60) == 0
    output = served.output
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503") and json.loads(payload)["error"]["code"] == 503, reply
    assert lines[-1] == "data: [DONE]", output[-3000:]
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "abort"
    (status, ctype, text), = whole
    assert status == 200 and ctype == "application/json", (status, ctype, text)
    assert json.loads(text)["choices"][0]["finish_reason"] == "abort"
    assert "Traceback" not in output, output[-3000:]


REQUESTS = [
    {"prompt": "The pipeline and KV ranks", "max_tokens": 12, "temperature": 0, "logprobs": 2},
    {"prompt": "seeded sampling", "max_tokens": 10, "temperature": 0.9, "seed": 4, "logprobs": 0},
    # 77 prompt tokens: with 64 tokens per KVP rank, its KV spans both ranks
    {"prompt": "x" * 50 + "long prompt spanning ranks", "max_tokens": 8, "temperature": 0, "logprobs": 1},
    # penalties: the token counts live on the device, and the leader sends each process their set-up
    {"prompt": "x" * 50 + "long prompt spanning ranks", "max_tokens": 8, "temperature": 0, "logprobs": 1,
     "repetition_penalty": 1.3, "frequency_penalty": 0.5},
    {"prompt": "penalized sampling", "max_tokens": 10, "temperature": 0.9, "seed": 4, "logprobs": 0,
     "presence_penalty": 1.0},
]
MESH = ["--kvp", "2", "--spp", "2", "--tp", "2", "--max_tokens_per_kvp_rank", "64", "--page_size", "4",
        "--max_model_len", "128", "--chunk_size", "16", "--max_num_batched_tokens", "32"]


def _results(url):
    out = []
    with httpx.Client(timeout=300) as c:
        for body in REQUESTS:
            r = c.post(f"{url}/v1/completions", json={"model": "tiny", **body})
            assert r.status_code == 200, r.text
            ch = r.json()["choices"][0]
            out.append((ch["text"], ch["logprobs"]["tokens"], ch["logprobs"]["token_logprobs"]))
        chat = c.post(f"{url}/v1/chat/completions", json={"model": "tiny", "max_tokens": 8, "temperature": 0,
                                                          "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200, chat.text
        out.append((chat.json()["choices"][0]["message"]["content"], [], []))
    return out


def _tail(log, chars: int | None = 3000) -> str:
    log.seek(0)
    text = log.read().decode(errors="replace")
    return text if chars is None else text[-chars:]


@pytest.mark.slow
def test_two_processes_serve_the_same_tokens_as_one():
    one_port, two_port, coord = free_port(), free_port(), free_port()
    with tempfile.TemporaryFile() as log1, tempfile.TemporaryFile() as log2:
        one = start_serve(["--port", str(one_port), *MESH], num_cpu_devices=8, log=log1)
        # precompile on (the command's default; the tests' environment turns it off): every process compiles its
        # shapes alone, the leader broadcasting nothing (it did, and the follower's collectives did not match)
        multi = [start_serve(["--port", str(two_port), *MESH, "--coordinator_address", f"localhost:{coord}",
                              "--num_processes", "2", "--process_id", str(i), "--precompile"], num_cpu_devices=4,
                             log=log2)
                 for i in range(2)]
        procs = [one, *multi]
        try:
            wait_healthy(f"http://127.0.0.1:{one_port}", procs)
            wait_healthy(f"http://127.0.0.1:{two_port}", procs)
            ref = _results(f"http://127.0.0.1:{one_port}")
            got = _results(f"http://127.0.0.1:{two_port}")
            for p in procs[:2]:  # process 0 of the pair stops its follower on the way out
                p.send_signal(signal.SIGTERM)
            codes = [p.wait(120) for p in procs]
        except Exception as e:
            raise AssertionError(f"one process's log:\n{_tail(log1)}\ntwo processes' log:\n{_tail(log2)}") from e
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            output = _tail(log2, None)
    assert codes == [0, 0, 0], output[-3000:]
    assert "process 1 of 2" in output and "in all" in output
    for (text, toks, lps), (rtext, rtoks, rlps) in zip(got, ref):
        assert text == rtext and toks == rtoks
        np.testing.assert_allclose(lps, rlps, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_processes_started_with_different_settings_exit_naming_them():
    """A follower started with another --seed served other numbers without a word (the leader's tokens, the
    follower's random weights); now every process compares its engine settings before building anything, and all
    exit 1 naming the field and each process's value."""
    coord = free_port()
    with tempfile.TemporaryFile() as log:
        procs = [start_serve(["--port", str(free_port()), "--coordinator_address", f"localhost:{coord}",
                              "--num_processes", "2", "--process_id", str(i), "--seed", str(i)], log=log)
                 for i in range(2)]
        try:
            codes = [p.wait(120) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        output = _tail(log, None)
    assert codes == [1, 1], output[-3000:]
    assert "different engine settings (seed: process 0 0, process 1 1)" in output, output[-3000:]
