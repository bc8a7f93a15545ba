"""Load generator: replays a trace against an OpenAI-compatible `/v1/completions` endpoint, streaming, and
reports TTFT, TBT and end-to-end latency.

    python scripts/bench_serving.py --request_rate 2,8 --num_requests 200 [--burstiness 1.0] \\
        [--long_fraction 0.1 --long_prompt_len 4096] [--base_url http://127.0.0.1:8000/v1] [--model NAME] \\
        [--max_concurrency N] [--output_json out.json] [--plot ttft_cdf.png]
    python scripts/bench_serving.py --trace trace.jsonl     # mnemojax.sim.simulator's JSONL (save_trace)

Traces. Synthetic: gamma inter-arrival times with shape `--burstiness` and mean 1 / `--request_rate`
(burstiness 1 is a Poisson process; below 1 burstier, above 1 more regular), the first request at t = 0; each
request is long with probability `--long_fraction` (`--long_prompt_len` tokens), else short (lognormal prompt
length with median `--short_prompt_len` and log-sd `--short_prompt_sigma`, redrawn above `--short_prompt_max`);
output lengths lognormal with median `--output_len`, log-sd `--output_sigma` (0: all equal, the default), at most
`--output_max`. Arrival gaps, lengths and prompt contents come from separate seeded streams, so the runs of a
comma-separated `--request_rate` list send the same requests with the arrival pattern scaled (only the prompt
texts differ between runs, so that a prefix cache cannot serve a later run from an earlier one). `--trace` replays
the simulator's JSONL file (`arrival_time`, `prompt_tokens`, `output_tokens`) with its own arrival times
(less the first one: the first request is sent at once).
A request is *long* when its prompt exceeds `--long_threshold` tokens (default: `--short_prompt_max`, or the
simulator's 8192 for a trace file).

Prompts. With the default `--tokenizer tiny` (the tiny model's byte tokenizer: 1 byte = 1 token, plus BOS) a
prompt of N tokens is N - 1 random lowercase letters and spaces. With `--tokenizer DIR` (a Hugging Face
tokenizer) a prompt is random non-special tokens decoded to text, re-encoded and adjusted until it encodes to
exactly N tokens with the tokenizer's special tokens (the rare prompt where that does not settle keeps its own
count, recorded). `--token_ids` sends the ids themselves (`prompt` as a list of ints; exact for any tokenizer).

Requests: `stream: true`, `stream_options.include_usage`, `max_tokens`, `temperature` (default 0) and
`ignore_eos: true` (a vLLM extension, so that every output has exactly `max_tokens` tokens; `--no_ignore_eos`
leaves it out). A request is sent at its arrival time, or, with `--max_concurrency`, once fewer than that many
are in flight (the wait is recorded as `queued_s`; latencies count from the send).

Measures (per request, from the send): TTFT = time to the first SSE chunk carrying a token (text, or an empty
text while the choice is still running: servers hold back partial UTF-8); TBT = the gaps between a request's
later token chunks, pooled over requests (a chunk may carry several tokens, so TBT is a gap
between chunks, not tokens); TPOT = (E2E - TTFT) / (output tokens - 1), per request; E2E = time to `data: [DONE]`.
Output tokens are `usage.completion_tokens` when the server sends usage, else the number of token chunks.
Errors, counted by kind: an HTTP status other than 200, an exception (its class, e.g. `ReadTimeout`,
`RemoteProtocolError`), a stream that ends without `data: [DONE]` ("no [DONE]"), an SSE `error` object, an
undecodable chunk, or a stream with no token chunk at all. Latency percentiles cover the successful requests;
throughputs are their requests and output tokens over the run's duration (first send to last completion).
The client is one Python asyncio process: at thousands of concurrent streams its own overhead shows in TBT.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import datetime
import json
import math
import os
import shlex
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np


from mnemojax.sim.reports import pyplot, save_figure  # noqa: E402
from mnemojax.sim.simulator import SHORT_MAX_TOKENS, TraceRequest, load_trace  # noqa: E402  (plain Python, no jax)
from models.tokenizer import ByteTokenizer, load_tokenizer  # noqa: E402

KINDS = ("all", "short", "long")
QUANTILES = (50, 90, 99)


# ------------------------------------------------------------------------------------------------ traces
@dataclasses.dataclass(frozen=True)
class LengthMix:
    """Prompt and output lengths of a synthetic trace."""

    short_prompt_len: int = 256
    """Median prompt tokens of a short request (lognormal)."""
    short_prompt_sigma: float = 0.9
    """Log-sd of short prompt lengths (ShareGPT4's is 0.93); 0: all equal."""
    short_prompt_max: int = 1024
    """Short prompt lengths above this are redrawn (a truncated lognormal, no spike at the cap)."""
    long_fraction: float = 0.1
    """Probability that a request is long."""
    long_prompt_len: int = 4096
    """Prompt tokens of a long request."""
    output_len: int = 128
    """Median output tokens (lognormal)."""
    output_sigma: float = 0.0
    """Log-sd of output lengths; 0: every request generates `output_len` tokens."""
    output_max: int = 1024
    """Output lengths above this are redrawn."""

    def __post_init__(self):
        for name in ("short_prompt_len", "short_prompt_max", "long_prompt_len", "output_len", "output_max"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.short_prompt_len > self.short_prompt_max or self.output_len > self.output_max:
            raise ValueError("the median lengths must not exceed their caps")
        if self.short_prompt_sigma < 0 or self.output_sigma < 0:
            raise ValueError("sigmas must be >= 0")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError(f"long_fraction must be in [0, 1], got {self.long_fraction}")
        if self.long_fraction > 0 and self.long_prompt_len <= self.short_prompt_max:
            raise ValueError(f"long_prompt_len ({self.long_prompt_len}) must exceed short_prompt_max "
                             f"({self.short_prompt_max}) so that long and short requests can be told apart")


def _capped_lognormal(rng: np.random.Generator, median: int, sigma: float, cap: int) -> int:
    while True:
        x = max(1, int(round(median * math.exp(sigma * rng.standard_normal()))))
        if x <= cap:
            return x


def arrival_times(num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Arrival seconds of `num_requests` requests, the first at 0: gamma gaps of shape `burstiness` and mean
    1 / `request_rate` (squared coefficient of variation 1 / burstiness); `request_rate` inf: all at 0.
    The gaps are drawn at rate 1 and divided by the rate, so rates of one seed share one pattern."""
    if not request_rate > 0:
        raise ValueError(f"request_rate must be positive (or inf), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    gaps = np.random.default_rng([seed, 0]).gamma(burstiness, 1.0 / burstiness, num_requests - 1) / request_rate
    return np.concatenate([[0.0], np.cumsum(gaps)])


def synthetic_trace(num_requests: int, request_rate: float, *, burstiness: float = 1.0,
                    mix: LengthMix = LengthMix(), seed: int = 0) -> list[TraceRequest]:
    """`num_requests` requests at `arrival_times(...)` with lengths from `mix`. Deterministic for a seed; the
    lengths do not depend on the rate or the burstiness."""
    rng = np.random.default_rng([seed, 1])
    out = []
    for t in arrival_times(num_requests, request_rate, burstiness, seed):
        if rng.random() < mix.long_fraction:
            prompt = mix.long_prompt_len
        else:
            prompt = _capped_lognormal(rng, mix.short_prompt_len, mix.short_prompt_sigma, mix.short_prompt_max)
        output = _capped_lognormal(rng, mix.output_len, mix.output_sigma, mix.output_max)
        out.append(TraceRequest(float(t), prompt, output))
    return out


# ------------------------------------------------------------------------------------------------ prompts
class PromptBuilder:
    """Prompts of an exact token count (special tokens included) for a tokenizer with `encode(text,
    add_special_tokens=...)`, `decode(ids)` and `all_special_ids` (this repository's `ByteTokenizer` or a
    Hugging Face one). `token_ids`: prompts are lists of ids instead of text."""

    MAX_ROUNDS = 10

    def __init__(self, tokenizer, token_ids: bool = False):
        self.tokenizer = tokenizer
        self.token_ids = token_ids
        self.prefix = list(tokenizer.encode("", add_special_tokens=True))  # what encode adds (Llama-3: BOS)
        if isinstance(tokenizer, ByteTokenizer):  # letters and spaces: every byte is one token and plain text
            allowed = [ord(c) for c in "abcdefghijklmnopqrstuvwxyz "]
        else:  # base-vocabulary tokens (no added ones, such as Llama-3's reserved) that are text on their own
            special = set(tokenizer.all_special_ids)
            ids = [i for i in range(tokenizer.vocab_size) if i not in special]
            again = tokenizer(tokenizer.batch_decode([[i] for i in ids]), add_special_tokens=False)["input_ids"]
            allowed = [i for i, a in zip(ids, again) if a == [i]]  # not a partial UTF-8 sequence, say
        if not allowed:
            raise ValueError("the tokenizer has no token that decodes to text and encodes back to itself")
        self.allowed = np.asarray(allowed)

    def build(self, num_tokens: int, rng: np.random.Generator) -> tuple[str | list[int], int]:
        """(prompt, its token count): `num_tokens` unless a text prompt's round trip did not settle."""
        body = max(0, num_tokens - len(self.prefix))
        ids = [int(i) for i in rng.choice(self.allowed, body)]
        if self.token_ids:
            return self.prefix + ids, len(self.prefix) + body
        tok = self.tokenizer
        for k in range(self.MAX_ROUNDS):
            text = tok.decode(ids)
            again = list(tok.encode(text, add_special_tokens=False))
            if len(again) == body:
                break
            # Decoding and encoding again merged or split tokens at seams of random tokens: keep the re-encoded
            # start and draw a new tail (one token longer each round, so that a merge cannot repeat forever).
            keep = max(0, min(len(again), body) - k)
            ids = again[:keep] + [int(i) for i in rng.choice(self.allowed, body - keep)]
        return text, len(tok.encode(text, add_special_tokens=True))


@dataclasses.dataclass(frozen=True)
class Planned:
    """A request ready to send."""

    index: int
    arrival_s: float
    """Scheduled send time, seconds from the run's start."""
    kind: str
    """"short" or "long"."""
    prompt: str | list[int]
    prompt_tokens: int
    max_tokens: int


def plan(trace: Sequence[TraceRequest], builder: PromptBuilder, long_threshold: int, seed: int,
         stream: int) -> list[Planned]:
    """The trace's requests with prompts, their contents drawn from the seed's `stream`-th content stream."""
    rng = np.random.default_rng([seed, 2, stream])
    out = []
    for i, r in enumerate(trace):
        prompt, n = builder.build(r.prompt_tokens, rng)
        out.append(Planned(i, r.arrival_time, "long" if r.prompt_tokens > long_threshold else "short", prompt, n,
                           r.output_tokens))
    return out


# ------------------------------------------------------------------------------------------------ client
@dataclasses.dataclass
class Record:
    """One request's outcome. Times in seconds: `*_s` from the run's start; ttft/e2e/chunk times from the send."""

    index: int
    kind: str
    prompt_tokens: int
    """Tokens of the prompt sent (by the client's tokenizer)."""
    max_tokens: int
    scheduled_s: float
    sent_s: float | None = None
    queued_s: float | None = None
    """sent - scheduled: the wait for a `--max_concurrency` slot (and the dispatcher's lag)."""
    ttft: float | None = None
    e2e: float | None = None
    chunk_times: list[float] = dataclasses.field(default_factory=list)
    """Arrival of each text-bearing chunk, from the send."""
    output_tokens: int = 0
    tokens_from_usage: bool = False
    """output_tokens is the server's usage.completion_tokens (else: the number of text-bearing chunks)."""
    server_prompt_tokens: int | None = None
    """usage.prompt_tokens, when the server sent it."""
    error: str | None = None
    """Error kind (None: success)."""
    error_detail: str | None = None


class StreamError(Exception):
    """A failed request; `kind` groups it in the report."""

    def __init__(self, kind: str, detail: str = ""):
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind
        self.detail = detail


async def stream_completion(client: httpx.AsyncClient, url: str, payload: dict[str, Any], rec: Record,
                            t0: float) -> None:
    """POSTs `payload` and reads its SSE stream into `rec` (chunk times from `t0`, a `time.perf_counter()`);
    raises `StreamError` for a failed request."""
    async with client.stream("POST", url, json=payload) as resp:
        if resp.status_code != 200:
            body = (await resp.aread()).decode("utf-8", "replace")
            raise StreamError(f"HTTP {resp.status_code}", body[:300])
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, SSE comments (":"), event/id fields
            data = line[5:].strip()
            if data == "[DONE]":
                rec.e2e = time.perf_counter() - t0
                break
            now = time.perf_counter()
            try:
                chunk = json.loads(data)
            except json.JSONDecodeError:
                raise StreamError("bad chunk", data[:300]) from None
            if not isinstance(chunk, dict):
                raise StreamError("bad chunk", data[:300])
            if chunk.get("error"):
                raise StreamError("stream error", json.dumps(chunk["error"])[:300])
            # A token-bearing chunk: text, or a choice still running with empty text (a server holds back text
            # that is not yet whole UTF-8 or may start a stop string, but the token was generated now).
            if any(c.get("text") or c.get("finish_reason") is None for c in chunk.get("choices") or ()):
                rec.chunk_times.append(now - t0)
            usage = chunk.get("usage")
            if usage:
                rec.server_prompt_tokens = usage.get("prompt_tokens")
                if usage.get("completion_tokens") is not None:
                    rec.output_tokens = int(usage["completion_tokens"])
                    rec.tokens_from_usage = True
        else:
            raise StreamError("no [DONE]", f"after {len(rec.chunk_times)} token chunks")
    if not rec.chunk_times:
        raise StreamError("no tokens", "the stream ended without a chunk carrying a token")
    if not rec.tokens_from_usage:
        rec.output_tokens = len(rec.chunk_times)


async def send(client: httpx.AsyncClient, url: str, payload: dict[str, Any], rec: Record, timeout: float,
               start: float) -> Record:
    """Sends one request now and fills `rec`; never raises (failures become `rec.error`)."""
    t0 = time.perf_counter()
    rec.sent_s = t0 - start
    rec.queued_s = rec.sent_s - rec.scheduled_s
    try:
        await asyncio.wait_for(stream_completion(client, url, payload, rec, t0), timeout)
    except StreamError as e:
        rec.error, rec.error_detail = e.kind, e.detail
    except (asyncio.TimeoutError, httpx.TimeoutException) as e:
        rec.error, rec.error_detail = "timeout", f"{type(e).__name__} after {timeout} s"
    except Exception as e:  # noqa: BLE001  (connection resets, protocol errors: every failure is counted)
        rec.error, rec.error_detail = type(e).__name__, str(e)[:300]
    if rec.error is None:
        rec.ttft = rec.chunk_times[0]
    else:
        rec.e2e = None
    return rec


@dataclasses.dataclass(frozen=True)
class ClientSettings:
    """How requests are sent."""

    base_url: str
    """The API root, e.g. http://127.0.0.1:8000/v1 (requests go to {base_url}/completions)."""
    model: str | None = None
    """Served model name; None: the first id of GET {base_url}/models."""
    api_key: str | None = None
    """Sent as `Authorization: Bearer ...`."""
    temperature: float = 0.0
    ignore_eos: bool = True
    """Send vLLM's `ignore_eos` so that every output has exactly max_tokens tokens."""
    extra_body: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Further fields of every request body."""
    max_concurrency: int | None = None
    """Requests in flight at most (None: no limit: every request is sent at its arrival time)."""
    timeout: float = 600.0
    """Seconds a request may take in all (and each connect / read / pool wait)."""

    def client(self) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.AsyncClient(
            headers=headers, timeout=httpx.Timeout(self.timeout),
            limits=httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency))

    def payload(self, model: str, r: Planned) -> dict[str, Any]:
        body = {"model": model, "prompt": r.prompt, "max_tokens": r.max_tokens, "temperature": self.temperature,
                "stream": True, "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True
        return {**body, **self.extra_body}


async def served_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id of GET {base_url}/models."""
    url = f"{base_url.rstrip('/')}/models"
    try:
        resp = await client.get(url)
        resp.raise_for_status()
        data = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError) as e:
        raise SystemExit(f"cannot list the served models (GET {url}: {type(e).__name__}: {e}); pass --model") from e
    if not data:
        raise SystemExit(f"GET {url} lists no model; pass --model")
    return data[0]["id"]


async def run_requests(client: httpx.AsyncClient, settings: ClientSettings, model: str,
                       requests: Sequence[Planned]) -> tuple[list[Record], float]:
    """Sends each request at its arrival time (subject to `max_concurrency`); returns the records (in the
    requests' order) and the duration: the run's start to the last request's end."""
    url = f"{settings.base_url.rstrip('/')}/completions"
    slots = asyncio.Semaphore(settings.max_concurrency) if settings.max_concurrency else None
    start = time.perf_counter()
    ends: list[float] = []

    async def one(r: Planned) -> Record:
        rec = Record(r.index, r.kind, r.prompt_tokens, r.max_tokens, r.arrival_s)
        async with slots if slots is not None else contextlib.nullcontext():
            await send(client, url, settings.payload(model, r), rec, settings.timeout, start)
        ends.append(time.perf_counter())
        return rec

    tasks = []
    for r in sorted(requests, key=lambda r: r.arrival_s):
        delay = start + r.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(r)))
    records = await asyncio.gather(*tasks)
    return sorted(records, key=lambda rec: rec.index), max(ends) - start


# ------------------------------------------------------------------------------------------------ metrics
def _pcts(xs: Sequence[float], scale: float = 1e3) -> dict[str, float | None]:
    a = np.asarray(xs, dtype=float)
    return {f"p{q}": float(np.percentile(a, q)) * scale if a.size else None for q in QUANTILES}


def summarize(records: Sequence[Record], duration_s: float) -> dict[str, Any]:
    """Per kind ("all", "short", "long"): counts, errors by kind, TTFT / TBT / TPOT / E2E percentiles (ms) of
    the successful requests, and request / output-token throughput over `duration_s`."""
    out: dict[str, Any] = {"duration_s": duration_s}
    for kind in KINDS:
        rs = [r for r in records if kind == "all" or r.kind == kind]
        ok = [r for r in rs if r.error is None]
        tbt = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
        tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
        tokens = sum(r.output_tokens for r in ok)
        out[kind] = {
            "requests": len(rs), "completed": len(ok), "errors": len(rs) - len(ok),
            "error_kinds": dict(collections.Counter(r.error for r in rs if r.error is not None).most_common()),
            "short_outputs": sum(r.output_tokens < r.max_tokens for r in ok),
            "prompt_token_mismatches": sum(r.server_prompt_tokens not in (None, r.prompt_tokens) for r in ok),
            "output_tokens": tokens,
            "ttft_ms": _pcts([r.ttft for r in ok]), "tbt_ms": _pcts(tbt), "tpot_ms": _pcts(tpot),
            "e2e_ms": _pcts([r.e2e for r in ok]),
            "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
            "output_throughput": tokens / duration_s if duration_s > 0 else 0.0,
        }
    return out


def _ms(x: float | None, width: int = 8) -> str:
    return f"{x:{width}.1f}" if x is not None else f"{'-':>{width}}"


def describe_run(label: str, m: dict[str, Any]) -> str:
    """Every number of one run: a row per kind, then the errors."""
    lines = [f"{'':6} {'req':>5} {'ok':>5} {'err':>4} | {'TTFT p50':>8} {'p90':>8} {'p99':>8} | {'TBT p50':>8} "
             f"{'p90':>8} {'p99':>8} | {'E2E p50':>8} {'p90':>8} {'p99':>8} | {'TPOT p50':>8} | {'req/s':>7} "
             f"{'tok/s':>8}   (latencies in ms)"]
    for kind in KINDS:
        k = m[kind]
        lat = " | ".join(" ".join(_ms(k[name][f"p{q}"]) for q in QUANTILES) for name in ("ttft_ms", "tbt_ms", "e2e_ms"))
        lines.append(f"{kind:6} {k['requests']:>5} {k['completed']:>5} {k['errors']:>4} | {lat} | "
                     f"{_ms(k['tpot_ms']['p50'])} | {k['request_throughput']:>7.2f} {k['output_throughput']:>8.1f}")
    a = m["all"]
    errs = ", ".join(f"{kind}: {n}" for kind, n in a["error_kinds"].items()) or "none"
    lines.append(f"errors: {errs}; duration {m['duration_s']:.2f} s; {a['output_tokens']} output tokens"
                 + (f"; {a['short_outputs']} successful requests got fewer tokens than max_tokens"
                    if a["short_outputs"] else "")
                 + (f"; the server counted other prompt lengths than the client for {a['prompt_token_mismatches']}"
                    if a["prompt_token_mismatches"] else ""))
    return f"== {label}\n" + "\n".join(lines)


def summary_table(runs: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """One row per run: errors, short and long TTFT p50/p99, TBT and E2E p50/p99 (ms), throughputs."""
    head = (f"{'run':<10} {'req':>5} {'err':>4} {'sTTFTp50':>8} {'sTTFTp99':>8} {'lTTFTp50':>8} {'lTTFTp99':>8} "
            f"{'TBTp50':>8} {'TBTp99':>8} {'E2Ep50':>8} {'E2Ep99':>8} {'req/s':>7} {'tok/s':>8}")
    rows = [head]
    for label, m in runs:
        a, s, lg = m["all"], m["short"], m["long"]
        rows.append(f"{label:<10} {a['requests']:>5} {a['errors']:>4} {_ms(s['ttft_ms']['p50'])} "
                    f"{_ms(s['ttft_ms']['p99'])} {_ms(lg['ttft_ms']['p50'])} {_ms(lg['ttft_ms']['p99'])} "
                    f"{_ms(a['tbt_ms']['p50'])} {_ms(a['tbt_ms']['p99'])} {_ms(a['e2e_ms']['p50'])} "
                    f"{_ms(a['e2e_ms']['p99'])} {a['request_throughput']:>7.2f} {a['output_throughput']:>8.1f}")
    return "\n".join(rows)


def plot_ttft_cdf(runs: Sequence[tuple[str, Sequence[Record]]], path: str) -> str:
    """TTFT CDFs of the successful requests: a colour per run, a line style per kind. Returns the path."""
    fig, ax = pyplot().subplots(figsize=(8, 4.5))
    styles = {"all": "-", "short": "--", "long": ":"}
    lo, hi = math.inf, 0.0
    for i, (label, records) in enumerate(runs):
        for kind in KINDS:
            xs = np.sort([r.ttft * 1e3 for r in records if r.error is None and (kind == "all" or r.kind == kind)])
            if xs.size:  # from 0 at the smallest TTFT, so that even one request draws a step
                ax.step(np.r_[xs[0], xs], np.r_[0.0, np.arange(1, xs.size + 1) / xs.size], where="post",
                        color=f"C{i}", linestyle=styles[kind], label=f"{label} {kind} (n={xs.size})")
                lo, hi = min(lo, xs[0]), max(hi, xs[-1])
    if hi > 20 * lo:  # long prompts' TTFTs are often orders of magnitude above short ones'
        ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    return save_figure(fig, path, [ax])


# ------------------------------------------------------------------------------------------------ main
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("endpoint")
    g.add_argument("--base_url", default="http://127.0.0.1:8000/v1", help="API root; requests go to /completions")
    g.add_argument("--model", default=None, help="served model name (default: the first id of GET /models)")
    g.add_argument("--api_key", default=None, help="sent as an Authorization: Bearer header")
    g.add_argument("--max_concurrency", type=int, default=None, help="requests in flight at most (default: any)")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--no_ignore_eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (outputs may then stop early at EOS)")
    g.add_argument("--extra_body", type=json.loads, default={}, help="JSON object merged into every request body")
    g = p.add_argument_group("trace")
    g.add_argument("--request_rate", default=None,
                   help="requests/s, or a comma-separated list run in turn (inf: all at once); not with --trace")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1: Poisson)")
    g.add_argument("--num_requests", type=int, default=None,
                   help="requests per run (default 200; with --trace: the first N of the file, default all)")
    g.add_argument("--trace", default=None, help="a JSONL trace of mnemojax.sim.simulator.save_trace")
    g.add_argument("--seed", type=int, default=0)
    m = LengthMix()
    g.add_argument("--short_prompt_len", type=int, default=m.short_prompt_len, help="median short prompt tokens")
    g.add_argument("--short_prompt_sigma", type=float, default=m.short_prompt_sigma,
                   help="log-sd of short prompt lengths (0: all equal)")
    g.add_argument("--short_prompt_max", type=int, default=m.short_prompt_max, help="short prompts are at most this")
    g.add_argument("--long_fraction", type=float, default=m.long_fraction, help="probability of a long request")
    g.add_argument("--long_prompt_len", type=int, default=m.long_prompt_len, help="long prompt tokens")
    g.add_argument("--output_len", type=int, default=m.output_len, help="median output tokens (max_tokens)")
    g.add_argument("--output_sigma", type=float, default=m.output_sigma, help="log-sd of output lengths (0: all equal)")
    g.add_argument("--output_max", type=int, default=m.output_max, help="output lengths are at most this")
    g.add_argument("--long_threshold", type=int, default=None,
                   help=f"prompts longer than this are long (default: --short_prompt_max; {SHORT_MAX_TOKENS} "
                        f"with --trace)")
    g.add_argument("--warmup", type=int, default=0,
                   help="send this many requests of the first run's trace one by one first, unmeasured")
    g = p.add_argument_group("prompts")
    g.add_argument("--tokenizer", default="tiny", help="'tiny' (byte tokenizer) or a Hugging Face tokenizer dir")
    g.add_argument("--token_ids", action="store_true", help="send prompts as lists of token ids")
    g = p.add_argument_group("output")
    g.add_argument("--output_json", default=None, help="write every number and per-request record here")
    g.add_argument("--plot", default=None, help="write a TTFT CDF plot (PNG) here")
    args = p.parse_args(argv)
    if args.trace is not None and args.request_rate is not None:
        p.error("--trace replays the file's arrival times; --request_rate is for synthetic traces")
    if args.trace is None and args.request_rate is None:
        p.error("give --request_rate (synthetic trace) or --trace")
    if args.num_requests is not None and args.num_requests < 1:
        p.error("--num_requests must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max_concurrency must be >= 1")
    return args


def _traces(args: argparse.Namespace) -> tuple[list[tuple[str, list[TraceRequest]]], int, str]:
    """[(label, trace)] of the runs, the long threshold, and a description."""
    if args.trace is not None:
        trace = load_trace(args.trace)[:args.num_requests]
        if not trace:
            raise SystemExit(f"{args.trace} holds no request")
        t0 = trace[0].arrival_time  # the first request is sent at once
        trace = [dataclasses.replace(r, arrival_time=r.arrival_time - t0) for r in trace]
        thr = args.long_threshold or SHORT_MAX_TOKENS
        return [("trace", trace)], thr, f"trace {args.trace}: {len(trace)} requests"
    mix = LengthMix(**{f.name: getattr(args, f.name) for f in dataclasses.fields(LengthMix)})
    n = args.num_requests or 200
    runs = []
    for rate in args.request_rate.split(","):
        runs.append((f"{rate.strip()} req/s", synthetic_trace(n, float(rate), burstiness=args.burstiness, mix=mix,
                                                   seed=args.seed)))
    desc = (f"synthetic: {n} requests per run, gamma arrivals (burstiness {args.burstiness}), {mix}")
    return runs, args.long_threshold or mix.short_prompt_max, desc


async def benchmark(settings: ClientSettings, runs: Sequence[tuple[str, list[Planned]]], warmup: Sequence[Planned],
                    log=print) -> tuple[str, list[tuple[str, list[Record], dict[str, Any]]]]:
    """Runs each labelled list of requests in turn; returns the model name and [(label, records, metrics)]."""
    async with settings.client() as client:
        model = settings.model or await served_model(client, settings.base_url)
        log(f"model: {model}")
        if warmup:
            recs, dur = await run_requests(client, dataclasses.replace(settings, max_concurrency=1), model,
                                           [dataclasses.replace(r, arrival_s=0.0) for r in warmup])
            errs = collections.Counter(r.error for r in recs if r.error)
            log(f"warm-up: {len(recs)} requests one by one in {dur:.2f} s, errors: {dict(errs) or 'none'}")
        out = []
        for label, requests in runs:
            records, duration = await run_requests(client, settings, model, requests)
            metrics = summarize(records, duration)
            log(describe_run(f"run {label}: {len(requests)} requests", metrics))
            out.append((label, records, metrics))
    return model, out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark; returns what --output_json writes."""
    args = parse_args(argv)
    words = [sys.executable, *(sys.argv if argv is None else [__file__, *argv])]
    command = " ".join(shlex.quote(str(w)) for w in words)
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    print(f"command: {command}\nendpoint: {args.base_url}\ndate: {date}")
    tokenizer = load_tokenizer(args.tokenizer)
    if tokenizer is None:
        raise SystemExit(f"{args.tokenizer} holds no tokenizer files")
    builder = PromptBuilder(tokenizer, token_ids=args.token_ids)
    traces, long_threshold, desc = _traces(args)
    print(f"{desc}; long prompts: > {long_threshold} tokens; tokenizer {args.tokenizer}"
          f"{' (token-id prompts)' if args.token_ids else ''}")
    t = time.perf_counter()
    runs = [(label, plan(trace, builder, long_threshold, args.seed, i)) for i, (label, trace) in enumerate(traces)]
    warmup = plan(traces[0][1][:args.warmup], builder, long_threshold, args.seed, len(runs)) if args.warmup else []
    print(f"prompts built in {time.perf_counter() - t:.2f} s")
    settings = ClientSettings(base_url=args.base_url, model=args.model, api_key=args.api_key,
                              temperature=args.temperature, ignore_eos=args.ignore_eos, extra_body=args.extra_body,
                              max_concurrency=args.max_concurrency, timeout=args.timeout)
    model, results = asyncio.run(benchmark(settings, runs, warmup))

    print("\nTTFT, TBT, E2E in ms (s = short, l = long prompts); throughput of successful requests")
    print(summary_table([(label, m) for label, _, m in results]))
    report = {"command": command, "endpoint": args.base_url, "model": model, "date": date, "trace": desc,
              "long_threshold": long_threshold, "settings": vars(args),
              "runs": [{"label": label, "metrics": m, "requests": [dataclasses.asdict(r) for r in recs]}
                       for label, recs, m in results]}
    if args.plot:
        print("plot:", plot_ttft_cdf([(label, recs) for label, recs, _ in results], args.plot))
    if args.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
        print("json:", args.output_json)
    return report
