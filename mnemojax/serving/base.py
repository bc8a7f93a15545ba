"""What the completions and chat endpoints share (vLLM's `OpenAIServing` shape): the server's state, OpenAI
error bodies, admission (every prompt and field validated before anything is queued), running a request's
choices, streaming them as server-sent events, usage, and logprob token strings.

An endpoint subclasses `OpenAIServing` and says only how its chunks and its whole response look.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from mnemojax.async_llm import EngineClient
from mnemojax.outputs import RequestOutput
from mnemojax.sampling_params import ParamError, SamplingParams
from mnemojax.serving.metrics import ServerMetrics
from models.tokenizer import ByteTokenizer

logger = logging.getLogger(__name__)

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                500: "internal_server_error", 503: "service_unavailable"}
DONE = "data: [DONE]\n\n"


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "error"), "param": param,
                      "code": status}}


def bad_request(err: ValueError, prefix: str = "") -> APIError:
    """A validation error as a 400 naming its field (`ParamError.param`, when it has one)."""
    return APIError(400, prefix + str(err), getattr(err, "param", None))


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class ServerState:
    """What every endpoint reads: the engine client, the server's limits, its draining flag and metrics."""

    def __init__(self, llm: EngineClient, served_model_name: str, api_key: str | None, max_queue: int,
                 max_request_bytes: int):
        if max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {max_queue}")
        self.llm = llm
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.max_queue = max_queue
        self.max_request_bytes = max_request_bytes
        self.draining = False
        self.metrics = ServerMetrics(llm.stats, served_model_name)
        self.created = int(time.time())


@dataclasses.dataclass(eq=False)
class Choice:
    """One choice's progress: its request, and what has been sent of it so far."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    sent_text: int = 0
    sent_tokens: int = 0
    output: RequestOutput | None = None

    def take_new_tokens(self):
        """The tokens (and their logprob dicts) not yet sent, marked as sent."""
        co, start = self.output.outputs[0], self.sent_tokens
        self.sent_tokens = len(co.token_ids)
        return co.token_ids[start:], (co.logprobs or [])[start:]

    def take_new_text(self) -> str:
        """The text not yet sent, marked as sent. The engine's output text never shows what a later token could
        still change, so it only grows."""
        text = self.output.outputs[0].text
        delta = text[self.sent_text:]
        self.sent_text = len(text)
        return delta


class OpenAIServing:
    """One endpoint: a subclass gives `object_name`, `stream_object`, `stream_choice`, `whole_choice` and may add
    `preamble` chunks."""

    object_name = ""  # the "object" of a whole response
    stream_object = ""  # the "object" of a streamed chunk
    id_prefix = ""

    def __init__(self, state: ServerState):
        self.state = state
        self.llm = state.llm
        self.tokenizer = state.llm.tokenizer

    # ------------------------------------------------------------ admission
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.state.served_model_name:
            raise APIError(400, f"model {model!r} does not exist; this server serves "
                                f"{self.state.served_model_name!r}", "model")

    def admit(self, prompts: list, base: SamplingParams, n: int) -> list[Choice]:
        """Validates every prompt before anything is queued; 400 or 429 on failure. Each prompt gets `n` choices:
        with a seed, choice j draws with seed + j (choice 0 equals the same request with n = 1)."""
        params = [base if base.seed is None else dataclasses.replace(base, seed=base.seed + j) for j in range(n)]
        choices: list[Choice] = []
        for pi, prompt in enumerate(prompts):
            try:
                if isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt):
                    raise ParamError("prompt", "prompt must be a string, a list of token ids, or a list of either")
                ids = self.llm.validate(prompt, params[0])
            except ValueError as e:
                raise bad_request(e, "" if len(prompts) == 1 else f"prompt[{pi}]: ") from None
            first = len(choices)
            choices += [Choice(first + j, pi, ids, p) for j, p in enumerate(params)]
        st = self.state
        if self.llm.num_waiting + len(choices) > st.max_queue:
            raise APIError(429, f"too many requests waiting ({self.llm.num_waiting}, the limit is max_queue = "
                                f"{st.max_queue}); retry later")
        return choices

    # ------------------------------------------------------------ running
    async def run(self, rid: str, choices: list[Choice]) -> AsyncIterator[Choice]:
        """Runs the choices concurrently; yields a choice each time it makes progress. Leaving early (the client
        went away) aborts every unfinished one."""
        q: asyncio.Queue = asyncio.Queue()

        async def pump(c: Choice):
            try:
                async for out in self.llm.generate(None, c.params, f"{rid}-{c.index}", prompt_token_ids=c.prompt_ids):
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
                    raise bad_request(item)
                if isinstance(item, BaseException):
                    raise item
                c.output = item
                yield c
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def run_to_end(self, request: Request, rid: str, choices: list[Choice]) -> bool:
        """Runs the choices of a non-streaming request to the end; False if the client went away first (watched
        through `http.disconnect`), which aborts them."""
        async def collect():
            async for _ in self.run(rid, choices):
                pass

        task = asyncio.ensure_future(collect())

        async def watch():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.ensure_future(watch())
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if task not in done:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return False
        task.result()  # re-raises a failure
        return True

    # ------------------------------------------------------------ responses
    async def respond(self, request: Request, stream: bool, include_usage: bool, choices: list[Choice]):
        """The whole response, or a stream of chunks ending with [DONE]."""
        rid, created = f"{self.id_prefix}-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "created": created, "model": self.state.served_model_name}
        if stream:
            return StreamingResponse(self._guarded(self._events(rid, head, choices, include_usage)),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        if not await self.run_to_end(request, rid, choices):
            return Response(status_code=499)  # the client is gone; nobody reads this
        return {**head, "object": self.object_name, "choices": [self.whole_choice(c) for c in choices],
                "usage": self.usage(choices)}

    async def _events(self, rid: str, head: dict, choices: list[Choice], include_usage: bool):
        def chunk(choices_, **extra):
            return sse({**head, "object": self.stream_object, "choices": choices_, **extra})

        for c in choices:
            for pre in self.preamble(c):
                yield chunk([pre])
        async for c in self.run(rid, choices):
            co = c.output.outputs[0]
            offset = c.sent_text
            delta = c.take_new_text()
            ids, lps = c.take_new_tokens()
            if not delta and not ids and co.finish_reason is None:
                continue
            yield chunk([self.stream_choice(c, delta, ids, lps, offset)])
        if include_usage:
            yield chunk([], usage=self.usage(choices))
        yield DONE

    async def _guarded(self, gen: AsyncIterator[str]) -> AsyncIterator[str]:
        """A failure after the stream has started cannot change the status code: it ends the stream with an
        OpenAI-style error event and [DONE] instead of cutting the connection."""
        try:
            async for event in gen:
                yield event
        except APIError as e:
            self.state.metrics.observe_error(e.status)
            yield sse(error_body(e.status, e.message, e.param))
            yield DONE
        except Exception as e:  # noqa: BLE001 - reported to the client, logged here
            logger.exception("stream failed")
            self.state.metrics.observe_error(500)
            yield sse(error_body(500, f"internal error: {e!r}"))
            yield DONE

    def preamble(self, c: Choice) -> list[dict]:
        return []

    def stream_choice(self, c: Choice, delta: str, ids: list[int], lps: list[dict], offset: int) -> dict:
        raise NotImplementedError

    def whole_choice(self, c: Choice) -> dict:
        raise NotImplementedError

    @staticmethod
    def usage(choices: list[Choice]) -> dict:
        prompts = {c.prompt_index: len(c.prompt_ids) for c in choices}  # each prompt counts once, whatever n
        completion = sum(len(c.output.outputs[0].token_ids) for c in choices if c.output is not None)
        return {"prompt_tokens": sum(prompts.values()), "completion_tokens": completion,
                "total_tokens": sum(prompts.values()) + completion}

    def token_text(self, tid: int) -> str:
        """A token as logprobs show it: its text; a token that is not whole UTF-8 by itself is written as its bytes,
        `bytes:\\xNN` (OpenAI's convention), so distinct tokens stay distinct keys."""
        tok = self.tokenizer
        if tok is None:
            return f"token_id:{tid}"
        text = tok.decode([tid], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text
        if isinstance(tok, ByteTokenizer):
            return f"bytes:\\x{tid:02x}"
        return tok.convert_ids_to_tokens(tid)
