"""The OpenAI-compatible HTTP API (FastAPI), served by `python -m mnemojax.serve`.

Endpoints: POST /v1/completions (`completions.py`), POST /v1/chat/completions (`chat.py`), GET /v1/models,
GET /health, GET /metrics. Streaming responses are server-sent events (`data: {json}` lines) ending with
`data: [DONE]`.

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

The app talks to the engine only through `mnemojax.async_llm.EngineClient`, so it serves `AsyncLLM` or a mock.
"""
from __future__ import annotations

import hmac
import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from mnemojax.async_llm import EngineClient
from mnemojax.serving.base import APIError, ServerState, error_body
from mnemojax.serving.chat import ServingChat
from mnemojax.serving.completions import ServingCompletion
from mnemojax.serving.protocol import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger(__name__)


class GuardMiddleware:
    """Pure ASGI middleware in front of the app: draining -> 503, API key -> 401, body size -> 413, and invalid
    UTF-8 -> 400, all before any route runs."""

    def __init__(self, app, state: ServerState):
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


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def build_app(llm: EngineClient, *, served_model_name: str = "tiny", api_key: str | None = None,
              max_queue: int = 256, max_request_bytes: int = 1 << 22) -> FastAPI:
    """The FastAPI app serving `llm`. `app.state.server` holds the `ServerState` (draining flag, metrics)."""
    st = ServerState(llm, served_model_name, api_key, max_queue, max_request_bytes)
    app = FastAPI(title="mnemojax", version="0.1.0",
                  description="OpenAI-compatible API of mnemojax (exact long-context Llama-3 serving in JAX).")
    app.state.server = st
    llm.add_finished_listener(st.metrics.observe_finished)
    app.add_middleware(GuardMiddleware, state=st)
    serving_completion, serving_chat = ServingCompletion(st), ServingChat(st)

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
                                            "owned_by": "mnemojax", "root": llm.model,
                                            "max_model_len": llm.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await serving_completion.create(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await serving_chat.create(body, request)

    return app
