"""The OpenAI-compatible HTTP API (FastAPI), served by `python -m mnemojax.serve`.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics.
Streaming responses are server-sent events (`data: {json}` lines) ending with `data: [DONE]`.

Errors use OpenAI's body, `{"error": {"message", "type", "param", "code"}}`:
- 400 bad input (the message names the field and the limit): malformed JSON, invalid UTF-8, a wrong type, an
  empty prompt, prompt + max_tokens beyond max_model_len, temperature / top_p / top_k / max_tokens / n out of
  range, an unknown model name;
- 401 a missing or wrong API key (only when the server has one; /health and /metrics stay open);
- 413 a body larger than the limit;
- 429 the queue of requests waiting for their first step is full;
- 503 the server is shutting down.
A bad request is answered alone: nothing is queued for it and the engine keeps serving everyone else.

A client that goes away (mid-stream or while waiting for a whole response) has its requests aborted at the
engine's next step, which frees their KV pages.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mnemojax.async_llm import AsyncLLM
from mnemojax.metrics import ServerMetrics
from mnemojax.outputs import RequestOutput
from mnemojax.protocol import ChatCompletionRequest, CompletionRequest
from mnemojax.sampling_params import ParamError, SamplingParams
from models.tokenizer import ByteTokenizer

logger = logging.getLogger(__name__)

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                500: "internal_server_error", 503: "service_unavailable"}

class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "error"), "param": param,
                      "code": status}}


def _param_of(err: ValueError) -> str | None:
    """The request field a validation error names (`ParamError.param`), if any."""
    return getattr(err, "param", None)


class GuardMiddleware:
    """Pure ASGI middleware in front of the app: draining -> 503, API key -> 401, body size -> 413, and invalid
    UTF-8 -> 400, all before any route runs."""

    def __init__(self, app, state: "ServerState"):
        self.app, self.state = app, state

    async def _reply(self, send, status: int, message: str, param: str | None = None):
        self.state.metrics.observe_error(status)
        body = json.dumps(error_body(status, message, param)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            return await self.app(scope, receive, send)
        st = self.state
        if st.draining:
            return await self._reply(send, 503, "the server is shutting down and takes no new requests")
        headers = dict(scope["headers"])
        if st.api_key is not None:
            auth = headers.get(b"authorization", b"").decode("latin-1")
            given = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(given.encode("latin-1"), st.api_key.encode("latin-1")):
                return await self._reply(send, 401, "missing or wrong API key (Authorization: Bearer <key>)")
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        limit = st.max_request_bytes
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            declared = 0
        if declared > limit:
            return await self._reply(send, 413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return await self._reply(send, 413, f"request body exceeds the limit of {limit} bytes")
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            return await self._reply(send, 400, f"request body is not valid UTF-8 (byte {e.start}): {e.reason}",
                                     "body")
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


class ServerState:
    def __init__(self, llm: AsyncLLM, served_model_name: str, api_key: str | None, max_queue: int,
                 max_request_bytes: int):
        self.llm = llm
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.max_queue = max_queue
        self.max_request_bytes = max_request_bytes
        self.draining = False
        self.metrics = ServerMetrics(llm.stats, served_model_name)
        self.created = int(time.time())


def _stable_len(text: str, finished: bool, stop: list[str]) -> int:
    """How much of a running request's text can be streamed without ever being taken back: not a trailing
    incomplete UTF-8 character (U+FFFD until its last byte comes) nor the last len(stop) - 1 characters (a stop
    string that completes later is cut from the text)."""
    if finished:
        return len(text)
    n = len(text)
    while n and text[n - 1] == "\ufffd":
        n -= 1
    hold = max((len(s) for s in stop), default=1) - 1
    return max(0, min(n, len(text) - hold))


class _Choice:
    """One choice's progress: what has been sent so far."""

    def __init__(self, index: int, prompt_index: int, prompt_ids: list[int], params: SamplingParams):
        self.index, self.prompt_index, self.prompt_ids, self.params = index, prompt_index, prompt_ids, params
        self.sent_text = 0
        self.sent_tokens = 0
        self.output: RequestOutput | None = None


def build_app(llm: AsyncLLM, *, served_model_name: str = "tiny", api_key: str | None = None, max_queue: int = 256,
              max_request_bytes: int = 1 << 22) -> FastAPI:
    """The FastAPI app serving `llm`. `app.state.server` holds the `ServerState` (draining flag, metrics)."""
    if max_queue < 1:
        raise ValueError(f"max_queue must be at least 1, got {max_queue}")
    st = ServerState(llm, served_model_name, api_key, max_queue, max_request_bytes)
    app = FastAPI(title="mnemojax", version="0.1.0",
                  description="OpenAI-compatible API of mnemojax (exact long-context Llama-3 serving in JAX).")
    app.state.server = st
    llm.add_finished_listener(st.metrics.observe_finished)
    app.add_middleware(GuardMiddleware, state=st)
    engine = llm.engine
    tokenizer = engine.tokenizer

    # ------------------------------------------------------------ errors
    def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
        st.metrics.observe_error(status)
        return JSONResponse(error_body(status, message, param), status_code=status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        err = exc.errors()[0]
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return error_response(400, f"malformed JSON in the request body: {err.get('msg')}", "body")
        param = ".".join(loc) or "body"
        return error_response(400, f"{param}: {err.get('msg')} (got {_short(err.get('input'))})", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        logger.exception("internal error serving %s", request.url.path)
        return error_response(500, f"internal error: {exc!r}")

    # ------------------------------------------------------------ plain endpoints
    @app.get("/health")
    async def health():
        if not llm.is_alive:
            return error_response(500, "the engine has stopped")
        if st.draining:
            return error_response(503, "the server is shutting down")
        return {}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(st.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": st.created,
                                            "owned_by": "mnemojax", "root": engine.config.model,
                                            "max_model_len": engine.max_model_len}]}

    # ------------------------------------------------------------ generation
    def check_model(model: str | None) -> None:
        if model is not None and model != served_model_name:
            raise APIError(400, f"model {model!r} does not exist; this server serves {served_model_name!r}", "model")

    def admit(prompts: list, make_params, n: int) -> list[_Choice]:
        """Validates the request's sampling fields and every prompt before anything is queued; 400 or 429 on
        failure. `make_params()` gives the base SamplingParams; each prompt gets `n` choices."""
        try:
            params = n_params(make_params(), n)
        except ValueError as e:
            raise APIError(400, str(e), _param_of(e)) from None
        choices = []
        for pi, prompt in enumerate(prompts):
            try:
                if isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt):
                    raise ParamError("prompt", "prompt must be a string, a list of token ids, or a list of either")
                ids = llm.validate(prompt, params[0])
            except ValueError as e:
                raise APIError(400, str(e) if len(prompts) == 1 else f"prompt[{pi}]: {e}", _param_of(e)) from None
            first = len(choices)
            choices += [_Choice(first + j, pi, ids, p) for j, p in enumerate(params)]
        if llm.num_waiting + len(choices) > st.max_queue:
            raise APIError(429, f"too many requests waiting ({llm.num_waiting}, the limit is max_queue = "
                                f"{st.max_queue}); retry later")
        return choices

    def n_params(base: SamplingParams, n: int) -> list[SamplingParams]:
        """n choices: with a seed, choice j draws with seed + j (choice 0 equals the same request with n = 1)."""
        return [base if base.seed is None else dataclasses.replace(base, seed=base.seed + j) for j in range(n)]

    async def run(rid: str, choices: list[_Choice]) -> AsyncIterator[_Choice]:
        """Runs the choices concurrently; yields a choice each time it makes progress. Leaving early (the client
        went away) aborts every unfinished one."""
        q: asyncio.Queue = asyncio.Queue()

        async def pump(c: _Choice):
            try:
                async for out in llm.generate(None, c.params, f"{rid}-{c.index}", prompt_token_ids=c.prompt_ids):
                    q.put_nowait((c, out))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                q.put_nowait((c, e))
            else:
                q.put_nowait((c, None))

        tasks = [asyncio.create_task(pump(c)) for c in choices]
        try:
            remaining = len(tasks)
            while remaining:
                c, item = await q.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, ValueError):
                    raise APIError(400, str(item), _param_of(item))
                if isinstance(item, BaseException):
                    raise item
                c.output = item
                yield c
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def until_disconnect(request: Request, coro):
        """Awaits `coro`, cancelling it if the client disconnects first (a non-streaming request)."""
        task = asyncio.ensure_future(coro)

        async def watch():
            while True:
                msg = await request.receive()
                if msg["type"] == "http.disconnect":
                    return

        watcher = asyncio.ensure_future(watch())
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if task not in done:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return None
        return task.result()

    async def run_to_end(request: Request, rid: str, choices: list[_Choice]) -> bool:
        """Runs the choices of a non-streaming request to the end; False if the client went away first."""
        async def collect():
            async for _ in run(rid, choices):
                pass
            return True

        return await until_disconnect(request, collect()) is not None

    def token_text(tid: int) -> str:
        """A token as logprobs show it: its text; a token that is not whole UTF-8 by itself is written as its bytes,
        `bytes:\\xNN` (OpenAI's convention), so distinct tokens stay distinct keys."""
        if tokenizer is None:
            return f"token_id:{tid}"
        text = tokenizer.decode([tid], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text
        if isinstance(tokenizer, ByteTokenizer):
            return f"bytes:\\x{tid:02x}"
        return tokenizer.convert_ids_to_tokens(tid)

    def usage(choices: list[_Choice]) -> dict:
        prompts = {c.prompt_index: len(c.prompt_ids) for c in choices}  # each prompt counts once, whatever n
        completion = sum(len(c.output.outputs[0].token_ids) for c in choices if c.output is not None)
        return {"prompt_tokens": sum(prompts.values()), "completion_tokens": completion,
                "total_tokens": sum(prompts.values()) + completion}

    def take_new_tokens(c: _Choice):
        """The choice's tokens (and their logprob dicts) not yet sent, marked as sent."""
        co, start = c.output.outputs[0], c.sent_tokens
        c.sent_tokens = len(co.token_ids)
        return co.token_ids[start:], (co.logprobs or [])[start:]

    def text_delta(c: _Choice) -> str:
        co = c.output.outputs[0]
        stable = max(c.sent_text, _stable_len(co.text, co.finish_reason is not None, c.params.stop))
        delta = co.text[c.sent_text:stable]
        c.sent_text = stable
        return delta

    def completion_logprobs(c: _Choice, ids, lps, offset: int) -> dict | None:
        if c.params.logprobs is None:
            return None
        tokens = [token_text(t) for t in ids]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": [d[t] for t, d in zip(ids, lps)],
                "top_logprobs": [{token_text(k): v for k, v in d.items()} for d in lps], "text_offset": offsets}

    def chat_logprobs(c: _Choice, ids, lps, top: int) -> dict | None:
        if c.params.logprobs is None:
            return None

        def entry(t, lp):
            s = token_text(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8", "surrogatepass"))}

        return {"content": [{**entry(t, d[t]), "top_logprobs": [entry(k, v) for k, v in list(d.items())[:top]]}
                            for t, d in zip(ids, lps)]}

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def guarded(gen: AsyncIterator[str]) -> AsyncIterator[str]:
        """A failure after the stream has started cannot change the status code: it ends the stream with an
        OpenAI-style error event and [DONE] instead of cutting the connection."""
        try:
            async for event in gen:
                yield event
        except APIError as e:
            st.metrics.observe_error(e.status)
            yield sse(error_body(e.status, e.message, e.param))
            yield "data: [DONE]\n\n"
        except Exception as e:  # noqa: BLE001 - reported to the client, logged here
            logger.exception("stream failed")
            st.metrics.observe_error(500)
            yield sse(error_body(500, f"internal error: {e!r}"))
            yield "data: [DONE]\n\n"

    def stream(gen: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(guarded(gen), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ------------------------------------------------------------ /v1/completions
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        try:
            body.check()
            prompts = body.prompts()
        except ParamError as e:
            raise APIError(400, str(e), e.param) from None
        max_tokens = 16 if body.max_tokens is None else body.max_tokens

        choices = admit(prompts, lambda: body.sampling_params(max_tokens, body.logprobs), body.n)
        rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), served_model_name

        if body.stream:
            async def events():
                async for c in run(rid, choices):
                    co = c.output.outputs[0]
                    offset = c.sent_text
                    delta = text_delta(c)
                    ids, lps = take_new_tokens(c)
                    if not delta and not ids and co.finish_reason is None:
                        continue
                    yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                               "choices": [{"index": c.index, "text": delta,
                                            "logprobs": completion_logprobs(c, ids, lps, offset),
                                            "finish_reason": co.finish_reason, "stop_reason": co.stop_reason}]})
                if body.include_usage:
                    yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                               "choices": [], "usage": usage(choices)})
                yield "data: [DONE]\n\n"

            return stream(events())

        if not await run_to_end(request, rid, choices):
            return Response(status_code=499)  # the client is gone; nobody reads this
        out = []
        for c in choices:
            co = c.output.outputs[0]
            ids, lps = co.token_ids, co.logprobs or []
            out.append({"index": c.index, "text": co.text, "logprobs": completion_logprobs(c, ids, lps, 0),
                        "finish_reason": co.finish_reason, "stop_reason": co.stop_reason})
        return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": out,
                "usage": usage(choices)}

    # ------------------------------------------------------------ /v1/chat/completions
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        try:
            body.check()
        except ParamError as e:
            raise APIError(400, str(e), e.param) from None
        if tokenizer is None:
            raise APIError(400, f"model {served_model_name!r} has no tokenizer, so no chat template; use "
                                "/v1/completions with token ids", "messages")
        try:
            text = tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in body.messages],
                                                 add_generation_prompt=body.add_generation_prompt, tokenize=False)
            prompt_ids = list(tokenizer.encode(text, add_special_tokens=False))
        except Exception as e:  # noqa: BLE001 - a template error is the caller's messages
            raise APIError(400, f"messages: the chat template failed: {e}", "messages") from None
        top = body.top_logprobs or 0
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:
            max_tokens = max(engine.max_model_len - len(prompt_ids), 1)

        choices = admit([prompt_ids], lambda: body.sampling_params(max_tokens, top if body.logprobs else None),
                        body.n)
        rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), served_model_name

        def chunk(choices_):
            return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": choices_})

        if body.stream:
            async def events():
                for c in choices:
                    yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])
                async for c in run(rid, choices):
                    co = c.output.outputs[0]
                    delta = text_delta(c)
                    ids, lps = take_new_tokens(c)
                    if not delta and not ids and co.finish_reason is None:
                        continue
                    yield chunk([{"index": c.index, "delta": {"content": delta} if delta else {},
                                  "logprobs": chat_logprobs(c, ids, lps, top), "finish_reason": co.finish_reason,
                                  "stop_reason": co.stop_reason}])
                if body.include_usage:
                    yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                               "choices": [], "usage": usage(choices)})
                yield "data: [DONE]\n\n"

            return stream(events())

        if not await run_to_end(request, rid, choices):
            return Response(status_code=499)
        out = []
        for c in choices:
            co = c.output.outputs[0]
            out.append({"index": c.index, "message": {"role": "assistant", "content": co.text},
                        "logprobs": chat_logprobs(c, co.token_ids, co.logprobs or [], top),
                        "finish_reason": co.finish_reason, "stop_reason": co.stop_reason})
        return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": out,
                "usage": usage(choices)}

    return app


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
