"""The OpenAI-compatible HTTP API (FastAPI), served by `python -m mnemojax.serve`.

Endpoints: POST /v1/completions (`completions.py`), POST /v1/chat/completions (`chat.py`), GET /v1/models,
vLLM's POST /tokenize, POST /detokenize and GET /tokenizer_info (`tokenization.py`), GET /health (and vLLM's GET/POST
/ping, the same answer), GET /version, GET /metrics, and the admin POST /reset_prefix_cache (forgets the engine's cached KV pages). Streaming responses are server-sent
events (`data: {json}` lines) ending with `data: [DONE]`.

Errors use OpenAI's body, `{"error": {"message", "type", "param", "code"}}`:
- 400 bad input (the message names the field and the limit): malformed JSON, invalid UTF-8 or a lone surrogate,
  a wrong type (types are strict), an empty prompt, prompt + max_tokens beyond max_model_len, a sampling field out
  of range, more stop strings, stop characters, stop token ids or choices than the server's limits, an unknown
  chat role, a field the server cannot honour (structured output, tools);
- 401 a missing or wrong API key (only when the server has one, for /v1, the tokenizer endpoints and admin paths;
  /health, /ping, /version and /metrics stay open);
- 404 an unknown model name (OpenAI's and vLLM's status);
- 408 the body did not arrive within the body timeout;
- 413 a body larger than the limit;
- 429 the queue of requests waiting for their first step is full;
- 500 only the server's own failure, whose text goes to the log, never to the client;
- 503 the server is shutting down; /health also when the engine has stopped.
A bad request is answered alone: nothing is queued for it and the engine keeps serving everyone else. The body is
read as JSON whatever its Content-Type says.

A client that goes away (mid-stream or while waiting for a whole response) has its requests aborted at the
engine's next step, which frees their KV pages; so does one that reads nothing for the write timeout
(`mnemojax.serving.http` holds the connection timeouts).

The app talks to the engine only through `mnemojax.engine.async_llm.EngineClient`, so it serves `AsyncLLM` or a mock.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import importlib.metadata
import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from mnemojax.engine.async_llm import EngineClient, EngineDeadError
from mnemojax.serving.base import ENGINE_STOPPED, INTERNAL_ERROR, APIError, ServerState, error_body
from mnemojax.serving.chat import ServingChat
from mnemojax.serving.completions import ServingCompletion
from mnemojax.serving.config import ServerConfig
from mnemojax.serving.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                       describe_validation_error)
from mnemojax.serving.tokenization import PATHS as TOKENIZER_PATHS, ServingTokenization

logger = logging.getLogger(__name__)


_DRAINING = "the server is shutting down and takes no new requests"
_JSON = (b"content-type", b"application/json")
ADMIN_PATHS = ("/reset_prefix_cache",)  # outside /v1 (vLLM's paths), behind the API key like /v1


class GuardMiddleware:
    """Pure ASGI middleware in front of the app: draining -> 503, API key -> 401, and a POST body read whole
    before any route runs: over the size limit -> 413, not all there within the body timeout -> 408, draining
    starts meanwhile -> 503, invalid UTF-8 -> 400. The body then reaches the app as JSON (whatever Content-Type
    the client sent)."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def _reply(self, send, status: int, message: str, param: str | None = None, close: bool = False):
        """An error response; `close` when the connection cannot serve another request (its body unread)."""
        self.state.metrics.observe_error(status)
        body = json.dumps(error_body(status, message, param)).encode()
        headers = [_JSON, (b"content-length", str(len(body)).encode())] + [(b"connection", b"close")] * close
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, authorization: bytes) -> bool:
        """`Authorization: Bearer <key>`, compared as bytes (a key need not be Latin-1) in constant time."""
        scheme, _, given = authorization.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(given, self.state.api_key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not (scope["path"].startswith("/v1") or scope["path"] in TOKENIZER_PATHS
                                           or scope["path"] in ADMIN_PATHS):
            return await self.app(scope, receive, send)
        st = self.state
        if st.draining:
            return await self._reply(send, 503, _DRAINING)
        headers = dict(scope["headers"])
        if st.api_key is not None and not self._authorized(headers.get(b"authorization", b"")):
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
        body = await self._read_body(receive, send)
        if body is None:
            return
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            return await self._reply(send, 400, f"request body is not valid UTF-8 (byte {e.start}): {e.reason}",
                                     "body")
        if st.draining:
            return await self._reply(send, 503, _DRAINING)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        scope = {**scope, "headers": [h for h in scope["headers"] if h[0] != b"content-type"] + [_JSON]}
        return await self.app(scope, replay, send)

    async def _read_body(self, receive, send) -> bytes | None:
        """The whole body; or None, after answering (413, 408, 503) or when the client went away."""
        st, limit = self.state, self.state.max_request_bytes
        loop = asyncio.get_running_loop()
        deadline = loop.time() + st.config.body_timeout_s
        draining = st.drain_started()
        chunks, size = [], 0
        while True:
            message = asyncio.ensure_future(receive())
            await asyncio.wait({message, draining}, timeout=max(0.0, deadline - loop.time()),
                               return_when=asyncio.FIRST_COMPLETED)
            if not message.done():
                message.cancel()
                if draining.done():
                    return await self._reply(send, 503, _DRAINING, close=True)
                return await self._reply(send, 408, f"the request body did not arrive within "
                                                    f"{st.config.body_timeout_s:g} s", "body", close=True)
            msg = message.result()
            if msg["type"] == "http.disconnect":
                return None
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return await self._reply(send, 413, f"request body exceeds the limit of {limit} bytes")
            if not msg.get("more_body", False):
                return b"".join(chunks)


def build_app(llm: EngineClient, config: ServerConfig | None = None, **overrides) -> FastAPI:
    """The FastAPI app serving `llm` under `config` (keyword arguments override its fields). `app.state.server`
    holds the `ServerState` (config, draining flag, metrics)."""
    st = ServerState(llm, dataclasses.replace(config or ServerConfig(), **overrides))
    app = FastAPI(title="mnemojax", version="0.1.0",
                  description="OpenAI-compatible API of mnemojax (exact long-context Llama-3 serving in JAX).")
    app.state.server = st
    llm.add_finished_listener(st.metrics.observe_finished)
    app.add_middleware(GuardMiddleware, state=st)
    serving_completion, serving_chat = ServingCompletion(st), ServingChat(st)
    serving_tokenization = ServingTokenization(st, serving_chat)

    def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
        st.metrics.observe_error(status)
        return JSONResponse(error_body(status, message, param), status_code=status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        param, message = describe_validation_error(exc.errors())
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        logger.error("internal error serving %s: %r (the server logs its traceback)", request.url.path, exc)
        return error_response(500, INTERNAL_ERROR)

    @app.get("/health")
    async def health():
        if not llm.is_alive:
            return error_response(503, "the engine has stopped")  # as vLLM's: probes take the replica out
        if st.draining:
            return error_response(503, "the server is shutting down")
        return {}

    for method in ("GET", "POST"):  # vLLM's /ping (SageMaker's probe): /health's answer; one route per method,
        app.add_api_route("/ping", health, methods=[method], name=f"ping_{method.lower()}")  # so one operation id each

    @app.get("/version")
    async def version():
        return {"version": importlib.metadata.version("mnemojax")}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(st.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """Admin (behind the API key): forgets every cached KV page; later requests compute their prompts again. A
        stopped engine is a 500 that says so (as for a completion)."""
        try:
            return {"num_cached_pages_reset": await llm.reset_prefix_cache()}
        except EngineDeadError:
            raise APIError(500, ENGINE_STOPPED) from None

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": st.served_model_name, "object": "model", "created": st.created,
                                            "owned_by": "mnemojax", "root": llm.model,
                                            "max_model_len": llm.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await serving_completion.create(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await serving_chat.create(body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return serving_tokenization.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return serving_tokenization.detokenize(body)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return serving_tokenization.tokenizer_info()

    return app
