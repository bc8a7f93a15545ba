"""scripts/bench_serving.py against a fake OpenAI-compatible streaming server (starlette + uvicorn in a thread).

The fake server streams `max_tokens` one-letter tokens with known delays and fails chosen requests, so the
benchmark's counts of requests, tokens and errors can be computed by hand, and its TTFT bounded below by the
server's first-token delay. The trace generators are checked statistically; the trace loader on a file written
by the simulator's own `save_trace`; prompts for exact token counts.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import glob
import json
import os
import socket
import threading
import time

import numpy as np
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from mnemojax.sim import simulator
from models.tokenizer import ByteTokenizer

from mnemojax.bench import serving as bench
from tests import REPO

MODEL = "fake-model"


@dataclasses.dataclass
class FakeServer:
    """Streams `max_tokens` tokens ("a" each), `tokens_per_chunk` per SSE chunk: the first chunk after
    `first_token_delay` s, then one every `chunk_delay` s; then a usage chunk (if the request asks for it and
    `usage`; prompt tokens counted as the byte tokenizer would) and `data: [DONE]`. The n-th request received
    (1-based) answers HTTP 500 when n % fail_every == 0, ends cleanly without [DONE] when n % drop_every == 0,
    and has its connection cut after the first chunk when n % cut_every == 0 (0: never)."""

    first_token_delay: float = 0.05
    chunk_delay: float = 0.01
    tokens_per_chunk: int = 1
    usage: bool = True
    fail_every: int = 0
    drop_every: int = 0
    cut_every: int = 0
    bodies: list = dataclasses.field(default_factory=list)
    headers: list = dataclasses.field(default_factory=list)
    in_flight: int = 0
    peak_in_flight: int = 0

    def app(self) -> Starlette:
        async def models(request):
            return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

        async def completions(request):
            body = await request.json()
            self.bodies.append(body)  # one event loop: no lock needed
            self.headers.append(dict(request.headers))
            n = len(self.bodies)
            if self.fail_every and n % self.fail_every == 0:
                return JSONResponse({"error": {"message": "injected"}}, status_code=500)
            return StreamingResponse(self._stream(n, body), media_type="text/event-stream")

        return Starlette(routes=[Route("/v1/models", models),
                                 Route("/v1/completions", completions, methods=["POST"])])

    async def _stream(self, n, body):
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.first_token_delay)
            sent = 0
            while sent < body["max_tokens"]:
                k = min(self.tokens_per_chunk, body["max_tokens"] - sent)
                sent += k
                yield "data: " + json.dumps({"id": f"cmpl-{n}", "object": "text_completion", "model": MODEL,
                                             "choices": [{"index": 0, "text": "a" * k, "finish_reason": None}]})
                yield "\n\n"
                if self.cut_every and n % self.cut_every == 0:
                    raise RuntimeError("injected: connection cut")  # uvicorn closes mid-body
                if sent < body["max_tokens"]:
                    await asyncio.sleep(self.chunk_delay)
            if self.usage and body.get("stream_options", {}).get("include_usage"):
                prompt = body["prompt"]  # counted as the tiny model's byte tokenizer would: BOS + bytes
                p = len(prompt) if isinstance(prompt, list) else 1 + len(prompt.encode())
                usage = {"prompt_tokens": p, "completion_tokens": sent, "total_tokens": p + sent}
                yield f"data: {json.dumps({'id': f'cmpl-{n}', 'choices': [], 'usage': usage})}\n\n"
            if not (self.drop_every and n % self.drop_every == 0):
                yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1


@contextlib.contextmanager
def serving(server: FakeServer):
    """Runs `server` on a free port in a thread; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(server.app(), log_level="critical", lifespan="off", log_config=None))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the fake server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        uv.should_exit = True
        thread.join(10)
        sock.close()


def _run(base_url, *args):
    return bench.main(["--base_url", base_url, *map(str, args)])


# ------------------------------------------------------------------------------------------------ end to end
def test_counts_latencies_and_outputs(tmp_path, capsys):
    server = FakeServer(first_token_delay=0.05, chunk_delay=0.01, tokens_per_chunk=2)
    out_json, plot = tmp_path / "out.json", tmp_path / "ttft.png"
    with serving(server) as url:
        report = _run(url, "--request_rate", "40,inf", "--num_requests", 12, "--output_len", 6,
                      "--short_prompt_len", 20, "--short_prompt_max", 64, "--long_fraction", 0.25,
                      "--long_prompt_len", 200, "--api_key", "secret", "--output_json", out_json, "--plot", plot)
    printed = capsys.readouterr().out

    assert [r["label"] for r in report["runs"]] == ["40 req/s", "inf req/s"]
    assert report["model"] == MODEL  # from GET /v1/models
    for run in report["runs"]:
        m, recs = run["metrics"], run["requests"]
        assert (m["all"]["requests"], m["all"]["completed"], m["all"]["errors"]) == (12, 12, 0)
        assert m["short"]["requests"] + m["long"]["requests"] == 12 and m["long"]["requests"] > 0
        assert m["all"]["output_tokens"] == 12 * 6 and m["all"]["prompt_token_mismatches"] == 0
        for r in recs:
            assert r["output_tokens"] == 6 and r["tokens_from_usage"]
            assert r["server_prompt_tokens"] == r["prompt_tokens"]
            assert len(r["chunk_times"]) == 3  # 6 tokens, 2 per chunk
            assert r["ttft"] >= server.first_token_delay
            assert r["e2e"] >= server.first_token_delay + 2 * server.chunk_delay
            assert r["kind"] == ("long" if r["prompt_tokens"] > 64 else "short")
        assert m["all"]["ttft_ms"]["p50"] >= 50 and m["all"]["e2e_ms"]["p99"] >= m["all"]["ttft_ms"]["p99"]
        assert m["all"]["tbt_ms"]["p50"] is not None
    # What the server received: 24 streaming requests with the benchmark's fields and the API key.
    assert len(server.bodies) == 24
    for body, headers in zip(server.bodies, server.headers):
        assert body["model"] == MODEL and body["stream"] is True and body["ignore_eos"] is True
        assert body["stream_options"] == {"include_usage": True} and body["temperature"] == 0.0
        assert body["max_tokens"] == 6 and isinstance(body["prompt"], str)
        assert headers["authorization"] == "Bearer secret"
    # Same lengths in both runs (one seed), different prompt texts (no prefix cache reuse across runs).
    first, second = server.bodies[:12], server.bodies[12:]
    assert sorted(len(b["prompt"]) for b in first) == sorted(len(b["prompt"]) for b in second)
    assert not {b["prompt"] for b in first} & {b["prompt"] for b in second}

    assert json.loads(out_json.read_text())["runs"][1]["metrics"] == report["runs"][1]["metrics"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = printed[printed.index("sTTFTp50") - 100:]
    assert "40 req/s" in table and "inf req/s" in table
    assert "command:" in printed and url in printed and f"model: {MODEL}" in printed


def test_errors_are_counted_by_kind():
    # 20 requests: 4 x HTTP 500 (n = 5, 10, 15, 20), 2 without [DONE] (7, 14), 2 cut mid-stream (9, 18).
    server = FakeServer(first_token_delay=0.02, chunk_delay=0.005, usage=False, fail_every=5, drop_every=7,
                        cut_every=9)
    with serving(server) as url:
        report = _run(url, "--request_rate", "inf", "--num_requests", 20, "--output_len", 4, "--long_fraction", 0,
                      "--short_prompt_len", 10, "--short_prompt_max", 32, "--no_ignore_eos", "--model", "given")
    m, recs = report["runs"][0]["metrics"], report["runs"][0]["requests"]
    assert m["all"]["error_kinds"] == {"HTTP 500": 4, "no [DONE]": 2, "RemoteProtocolError": 2}
    assert (m["all"]["completed"], m["all"]["errors"]) == (12, 8)
    # No usage from this server: tokens are counted as text chunks (one token each here).
    assert m["all"]["output_tokens"] == 12 * 4
    assert all(not r["tokens_from_usage"] for r in recs)
    assert all(r["ttft"] is None for r in recs if r["error"])
    assert all("ignore_eos" not in b and b["model"] == "given" for b in server.bodies)


def test_timeouts_and_an_unreachable_server():
    server = FakeServer(first_token_delay=2.0)
    with serving(server) as url:
        report = _run(url, "--request_rate", "inf", "--num_requests", 3, "--timeout", 0.2, "--output_len", 2)
    assert report["runs"][0]["metrics"]["all"]["error_kinds"] == {"timeout": 3}
    with pytest.raises(SystemExit, match="pass --model"):  # the port is closed once the server has stopped
        _run(url, "--request_rate", "inf", "--num_requests", 1)


def test_max_concurrency_and_token_id_prompts():
    server = FakeServer(first_token_delay=0.03, chunk_delay=0.0)
    with serving(server) as url:
        report = _run(url, "--request_rate", "inf", "--num_requests", 6, "--max_concurrency", 2, "--output_len", 3,
                      "--long_fraction", 0, "--short_prompt_len", 9, "--short_prompt_sigma", 0, "--token_ids")
    assert server.peak_in_flight == 2
    recs = report["runs"][0]["requests"]
    assert sum(r["queued_s"] > 0.02 for r in recs) >= 4  # four of them waited for a slot
    for b in server.bodies:  # BOS then 8 byte tokens
        assert b["prompt"][0] == ByteTokenizer.bos_token_id and len(b["prompt"]) == 9
        assert all(0 <= i < 256 for i in b["prompt"][1:])


def test_replays_the_simulators_trace_file(tmp_path):
    trace = simulator.synthetic_trace(30.0, 0.4, seed=1)  # ~12 ShareGPT4-like requests within 0.4 s
    path = tmp_path / "trace.jsonl"
    simulator.save_trace(trace, str(path))
    server = FakeServer(first_token_delay=0.0, chunk_delay=0.0, tokens_per_chunk=256)
    with serving(server) as url:
        report = _run(url, "--trace", path)
    recs = report["runs"][0]["requests"]
    assert len(recs) == len(trace) > 3 and report["runs"][0]["metrics"]["all"]["errors"] == 0
    t0 = trace[0].arrival_time
    for r, t in zip(recs, trace):
        assert (r["prompt_tokens"], r["max_tokens"], r["output_tokens"]) == (t.prompt_tokens, t.output_tokens,
                                                                            t.output_tokens)
        assert r["scheduled_s"] == pytest.approx(t.arrival_time - t0)
        assert r["sent_s"] >= r["scheduled_s"]
    assert sorted(len(b["prompt"]) + 1 for b in server.bodies) == sorted(t.prompt_tokens for t in trace)
    with pytest.raises(SystemExit):  # a trace has its own arrival times
        bench.parse_args(["--trace", str(path), "--request_rate", "2"])


# ------------------------------------------------------------------------------------------------ traces
@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_arrival_rate_and_burstiness(burstiness):
    # Gamma gaps with shape k and mean 1/rate have squared coefficient of variation 1/k. Over n = 20,000 gaps the
    # relative standard error of the mean gap is cv / sqrt(n) <= 1.42 / 141 = 1.0% (k = 0.5), and that of the
    # sample cv is about sqrt((kurtosis - 1) / n) / 2 <= sqrt(14 / 20000) / 2 = 1.3% (excess kurtosis 6/k = 12):
    # tolerances of 5% and 7% are 5 standard errors, so only a wrong rate or shape fails.
    n, rate = 20_000, 8.0
    t = bench.arrival_times(n, rate, burstiness, seed=3)
    assert t[0] == 0.0 and np.all(np.diff(t) >= 0)
    gaps = np.diff(t)
    assert (n - 1) / t[-1] == pytest.approx(rate, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.07)
    # Another rate of the same seed scales the same pattern; inf sends everything at once.
    np.testing.assert_allclose(bench.arrival_times(n, 2 * rate, burstiness, seed=3), t / 2)
    assert not bench.arrival_times(5, float("inf")).any()


def test_synthetic_lengths():
    mix = bench.LengthMix(short_prompt_len=100, short_prompt_sigma=0.9, short_prompt_max=400, long_fraction=0.2,
                          long_prompt_len=1000, output_len=50, output_sigma=0.5, output_max=120)
    trace = bench.synthetic_trace(20_000, 5.0, mix=mix, seed=0)
    prompts = np.array([r.prompt_tokens for r in trace])
    outputs = np.array([r.output_tokens for r in trace])
    long = prompts == 1000
    # Binomial(20000, 0.2): standard error 0.0028; 0.015 is 5 of them.
    assert long.mean() == pytest.approx(0.2, abs=0.015)
    assert prompts[~long].max() <= 400 and outputs.max() <= 120 and outputs.min() >= 1
    # The truncated lognormal's median is below the untruncated one (100) by a little: P(X > 400) = 6%.
    assert 85 <= np.median(prompts[~long]) <= 100
    again = bench.synthetic_trace(20_000, 0.5, burstiness=0.3, mix=mix, seed=0)
    assert [(r.prompt_tokens, r.output_tokens) for r in again] == list(zip(prompts, outputs))
    with pytest.raises(ValueError, match="exceed short_prompt_max"):
        bench.LengthMix(long_prompt_len=300, short_prompt_max=300)


# ------------------------------------------------------------------------------------------------ prompts
def _trained_bpe():
    """A byte-level BPE tokenizer with 4,000 tokens of merges (trained on this repository's code in ~0.1 s):
    random tokens merge at their seams when decoded and encoded again, as with Llama-3's tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    root = REPO
    tok.train(sorted(glob.glob(os.path.join(root, "mnemojax", "*.py"))),
              trainers.BpeTrainer(vocab_size=4000, special_tokens=["<s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>")


def test_prompts_have_exact_token_counts():
    from tests.hf_utils import make_hf_tokenizer

    rng = np.random.default_rng(0)
    lengths = [*range(1, 40), 500, 5000]
    for tok in (ByteTokenizer(), make_hf_tokenizer(), _trained_bpe()):
        builder = bench.PromptBuilder(tok)
        for n in lengths:
            text, count = builder.build(n, rng)
            assert count == len(tok.encode(text, add_special_tokens=True)) == max(n, len(builder.prefix))
        ids, count = bench.PromptBuilder(tok, token_ids=True).build(50, rng)
        assert count == len(ids) == 50 and ids[:len(builder.prefix)] == builder.prefix
    text, _ = bench.PromptBuilder(ByteTokenizer()).build(100, rng)
    assert len(text) == 99 and set(text) <= set("abcdefghijklmnopqrstuvwxyz ")
