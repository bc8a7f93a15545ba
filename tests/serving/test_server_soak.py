"""A bounded soak of `python -m mnemojax.serve` on loopback (issue 13): normal streaming clients run alone, then
twice beside every abusive pattern at once and alone again. The normal clients' time between tokens stays within 2x
of the slowest quiet run, every abuser gets its documented answer (never a 5xx), and after each round KV pages and
requests are back to zero and the server's memory does not keep growing (the server precompiles its shapes, and a
first abusive round warms it up: its memory stays).

The API key comes from the environment (MNEMOJAX_API_KEY, not Latin-1), so it is not in the process list.
Everything is a fixed count of requests against 127.0.0.1, so the test's length is bounded (about 30 s on an idle
2-core machine).
"""
import asyncio
import json
import select
import signal
import socket
import statistics
import time

import httpx
import pytest

from tests.server_utils import ServeProcess, metrics, wait_for

KEY = "ключ-soak"
AUTH = {"Authorization": f"Bearer {KEY}".encode()}
NORMAL_CLIENTS, NORMAL_REQUESTS, NORMAL_TOKENS = 4, 4, 48
FLAGS = ["--max_model_len", "2048", "--num_pages", "2048", "--write_timeout_s", "2", "--header_timeout_s", "1",
         "--body_timeout_s", "1", "--shutdown_grace_s", "1"]
# The clients drop a pooled connection idle for 0.5 s, before the server closes it at 1 s (--header_timeout_s):
# with httpx's default 5 s a POST could go out on a connection the server was closing that instant (httpx.ReadError
# in a CI run; a keep-alive race, not the server failing a request).
LIMITS = httpx.Limits(keepalive_expiry=0.5)


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def _normal_stream(http, url, i) -> list[float]:
    """One normal streamed completion, read as it comes; the gaps between its token chunks (the server sends a
    chunk for every step's new tokens, even when their text or log-prob entries are held back: the tiny model's
    random bytes are often no whole UTF-8 character)."""
    body = {"prompt": f"normal client {i}: tell a story", "max_tokens": NORMAL_TOKENS, "temperature": 0.7,
            "seed": i, "ignore_eos": True, "stream": True, "logprobs": 0}
    times, done = [], False
    async with http.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: ") and json.loads(line[6:])["choices"]:
                times.append(time.perf_counter())
    assert done and len(times) >= NORMAL_TOKENS // 2
    return [b - a for a, b in zip(times[1:], times[2:])]  # from the second token on (the first waits for prefill)


async def _normal_load(url) -> list[float]:
    async with httpx.AsyncClient(timeout=120, limits=LIMITS) as http:
        async def client(c):
            gaps = []
            for k in range(NORMAL_REQUESTS):
                gaps += await _normal_stream(http, url, c * NORMAL_REQUESTS + k)
            return gaps

        per_client = await asyncio.gather(*(client(c) for c in range(NORMAL_CLIENTS)))
    return [g for gaps in per_client for g in gaps]


async def _send_raw(port: int, data: bytes, rcvbuf: int | None = None) -> socket.socket:
    loop = asyncio.get_running_loop()
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.setblocking(False)
    await loop.sock_connect(s, ("127.0.0.1", port))
    if data:
        await loop.sock_sendall(s, data)
    return s


async def _closed_by_server(s: socket.socket, within: float) -> bytes:
    """What the server sent before it closed the connection (which it must do within `within` seconds)."""
    loop, data = asyncio.get_running_loop(), b""
    deadline = loop.time() + within
    try:
        while True:
            chunk = await asyncio.wait_for(loop.sock_recv(s, 1 << 16), deadline - loop.time())
            if not chunk:
                return data
            data += chunk
    except ConnectionResetError:
        return data
    finally:
        s.close()


async def _dropped_by_server(s: socket.socket, within: float) -> None:
    """Waits, reading nothing, until the server drops the connection (it must within `within` seconds)."""
    poll = select.poll()
    poll.register(s, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    deadline = time.monotonic() + within
    while not poll.poll(0):
        assert time.monotonic() < deadline, "the server kept a connection whose client reads nothing"
        await asyncio.sleep(0.1)
    s.close()


def _post_head(length: int, extra: bytes = b"") -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: "
            + AUTH["Authorization"] + b"\r\n" + extra + b"Content-Length: %d\r\n\r\n" % length)


async def _abusers(url: str, port: int) -> list[int]:
    """Every abusive pattern of issue 13 at once; returns the HTTP statuses they got."""
    statuses: list[int] = []
    async with httpx.AsyncClient(timeout=120, limits=LIMITS) as http:
        async def post(path, **kw):
            kw.setdefault("headers", AUTH)
            r = await http.post(f"{url}{path}", **kw)
            statuses.append(r.status_code)
            return r

        async def stop_floods():  # 20,000 stop strings, and stop strings at the limits with n = 8
            for _ in range(3):
                r = await post("/v1/completions", json={"prompt": "x", "max_tokens": 300, "n": 8,
                                                        "stop": [f"s{i}" for i in range(20_000)]})
                assert r.status_code == 400
            r = await post("/v1/completions", json={"prompt": "y", "max_tokens": 200, "n": 8, "ignore_eos": True,
                                                    "stop": ["\x00" * 63 + "z"] * 15 + ["q" * 64]})
            assert r.status_code == 200

        async def unread_streams():  # n = 8, 1800 tokens, 20 log-probs each, never read
            body = json.dumps({"prompt": "never read", "max_tokens": 1800, "n": 8, "logprobs": 20,
                               "ignore_eos": True, "stream": True}).encode()
            socks = [await _send_raw(port, _post_head(len(body)) + body, rcvbuf=4096) for _ in range(2)]
            for s in socks:
                await _dropped_by_server(s, within=30)

        async def slowloris():  # nothing; half a request line; headers and part of a body; a short chunk
            chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: " + AUTH["Authorization"]
                       + b"\r\nTransfer-Encoding: chunked\r\n\r\n64\r\n{\"prompt\"")
            for data in (b"", b"POST /v1/comp", _post_head(100) + b'{"prompt": "a', chunked):
                s = await _send_raw(port, data)
                reply = await _closed_by_server(s, within=5)
                if reply:
                    statuses.append(int(reply.split(b" ", 2)[1]))

        async def disconnects():  # streams dropped after their first chunks
            for i in range(10):
                body = {"prompt": f"drop {i}", "max_tokens": 500, "ignore_eos": True, "stream": True}
                async with http.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH) as r:
                    statuses.append(r.status_code)
                    lines = r.aiter_lines()
                    for _ in range(2):
                        await anext(lines)

        async def bad_requests():
            for _ in range(3):
                await post("/v1/completions", content=b'{"prompt": ', headers=AUTH)
                await post("/v1/completions", json={"prompt": ["7", True]})
                await post("/v1/completions", json={"prompt": "a", "stream": "yes"})
                await post("/v1/completions", content=b'{"prompt": "\\ud800"}', headers=AUTH)
                await post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}],
                                                         "max_completion_tokens": 0})
                await post("/v1/completions", json={"prompt": [f"p{i}" for i in range(300)], "max_tokens": 1})
                await post("/v1/completions", content=b"x" * (3 << 20), headers=AUTH)
                await post("/v1/completions", json={"prompt": "a"}, headers={})
                await post("/v1/completions", json={"prompt": "a"}, headers={"Authorization": b"Bearer \xff"})

        await asyncio.gather(stop_floods(), unread_streams(), slowloris(), disconnects(), bad_requests())
    return statuses


@pytest.mark.slow
def test_abusive_clients_do_not_slow_others_or_hold_memory():
    with ServeProcess(FLAGS, env={"MNEMOJAX_API_KEY": KEY, "MNEMOJAX_PRECOMPILE": "1"}) as served:
        url, port, proc = served.url, served.port, served.proc
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            assert KEY.encode() not in f.read()  # the key is not in the process list
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "a"}).status_code == 401

        async def abused():
            normal = asyncio.ensure_future(_normal_load(url))
            await asyncio.sleep(0.3)  # the abusers arrive while the normal clients stream
            statuses = await _abusers(url, port)
            return await normal, statuses

        asyncio.run(abused())  # warm-up: fills the allocator's pools and the server's caches
        _wait_idle(url)
        # Two measured rounds, each abused then quiet, after a first quiet run (the machine is shared: a quiet run
        # on each side of every abused one). RSS is read after the warm-up and after each round.
        quiet, loud, statuses, aborted, rss = [asyncio.run(_normal_load(url))], [], [], [], [_rss_mib(proc.pid)]
        for _ in range(2):
            before = _aborted(url)
            gaps, got = asyncio.run(abused())
            _wait_idle(url)
            loud.append(gaps)
            statuses += got
            aborted.append(_aborted(url) - before)
            quiet.append(asyncio.run(_normal_load(url)))
            time.sleep(1.0)
            rss.append(_rss_mib(proc.pid))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    output = served.output
    q, a = max(map(statistics.median, quiet)), max(map(statistics.median, loud))
    grew = [end - start for start, end in zip(rss, rss[1:])]
    rss_line = " -> ".join(f"{m:.0f}" for m in rss)
    print(f"TBT median quiet {q * 1e3:.2f} ms, with abusers {a * 1e3:.2f} ms; RSS {rss_line} MiB; "
          f"statuses {sorted(set(statuses))}")
    assert a <= 2 * q, (q, a)
    assert all(s < 500 for s in statuses), statuses
    assert {400, 401, 408, 413} <= set(statuses), sorted(set(statuses))
    assert min(aborted) >= 16 + 10, aborted  # the unread streams' choices and the dropped streams, each round
    # Memory held for good grows with every round; the allocator's keep levels off (this VM: +6-13 MiB a round, and
    # +22 MiB over 15 rounds from the first). Two unread streams alone held +242 MiB a round when per-step outputs
    # were queued copies. The server precompiles every shape at start, as served by default: with compiles left to
    # the first step that needs a shape (MNEMOJAX_PRECOMPILE=0, the suite's default) the first measured round grew
    # 34-47 MiB here and 64.0 MiB in one CI run under load, from the compiled batch shapes the warm-up had not met.
    assert max(grew) < 64 and min(grew) < 32, rss
    assert "Traceback" not in output, output[-3000:]


def _aborted(url) -> float:
    return metrics(url).get("mnemojax_request_success_total{finished_reason=abort}", 0.0)


def _wait_idle(url) -> None:
    def idle():
        m = metrics(url)
        return m["mnemojax_kv_pages_used"] == m["mnemojax_num_requests_running"] == \
            m["mnemojax_num_requests_waiting"] == 0

    wait_for(idle, timeout=30, what="KV pages and requests back to zero")
