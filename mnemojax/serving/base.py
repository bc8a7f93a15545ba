"""What the completions and chat endpoints share (vLLM's `OpenAIServing` shape): the server's state, OpenAI
error bodies, admission (every prompt and field validated before anything is queued), running a request's
choices, streaming them as server-sent events, usage, and logprob token strings.

An endpoint subclasses `OpenAIServing` and says only how its chunks and its whole response look.

Requests ask the engine for DELTA outputs. A stream takes each choice's output before the next is asked for, so
what a slow client has not read waits in the engine client, merged into one output per choice (`AsyncLLM`); a
whole response adds each choice's outputs up as they come. Either way memory grows with the output, never with a
queue of per-step outputs.
"""
from __future__ import annotations

import asyncio
import codecs
import dataclasses
import json
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Sequence

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from mnemojax.engine.async_llm import EngineClient, EngineDeadError, EngineStepError
from mnemojax.engine.beam_search import BeamSearch, BeamSearchSequence
from mnemojax.engine.detokenizer import Detokenizer
from mnemojax.scheduling.outputs import CompletionOutput, RequestOutput
from mnemojax.scheduling.sampling_params import BeamSearchParams, ParamError, RequestOutputKind, SamplingParams
from mnemojax.serving.config import ServerConfig
from mnemojax.serving.metrics import ServerMetrics
from models.tokenizer import ByteTokenizer, is_byte_level, special_ids, token_bytes_fn

logger = logging.getLogger(__name__)

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
                429: "rate_limit_error", 500: "internal_server_error", 503: "service_unavailable"}
DONE = "data: [DONE]\n\n"
INTERNAL_ERROR = "internal error; the server log has the details"
"""A 500's whole message: an exception's text may hold anything (paths, keys), so it goes to the log only."""
ENGINE_STOPPED = "the engine thread has stopped; the server log has the details"


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's error body. The message may quote a client's input, so what UTF-8 cannot encode (a lone surrogate)
    is written as an escape rather than failing the response."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "error"), "param": param,
                      "code": status}}


def bad_request(err: ValueError, prefix: str = "") -> APIError:
    """A validation error as a 400 naming its field (`ParamError.param`, when it has one)."""
    return APIError(400, prefix + str(err), getattr(err, "param", None))


def _api_error(e: BaseException) -> BaseException:
    """A failure of the engine client as the client should see it: bad input is a 400 naming its field; a stopped
    engine a 500 that says so (its exception is in the log), as is a request ended because steps it ran in failed
    (the engine serves on); anything else stays itself (a 500 saying nothing)."""
    if isinstance(e, ValueError):
        return bad_request(e)
    if isinstance(e, EngineStepError):
        return APIError(500, str(e))
    if isinstance(e, EngineDeadError):
        return APIError(500, ENGINE_STOPPED)
    return e


def top_entries(d: dict[int, float], k: int, token: int) -> list[tuple[int, float]]:
    """The `k` most likely (token, log-prob) entries of an engine's log-prob dict (its top entries come first, in
    order), and `token`'s own after them if it is not among them."""
    top = list(d.items())[:k]
    return top if any(t == token for t, _ in top) else top + [(token, d[token])]


class TextOffsets:
    """Where each token's text starts in the text its tokens decode to, token by token, as the engine's
    `Detokenizer` makes that text (for byte-level tokenizers: the tokens' bytes decoded as UTF-8, what is not UTF-8
    as U+FFFD): the index of the character its first byte is in. A token that continues a character starts where
    that character does; a special token is its text, or nothing when the text skips it. Offsets never decrease.

    Other tokenizers (SentencePiece-style) make the text window by window after `context` (the prompt's ids, for
    generated tokens), as the `Detokenizer` does: a token starts where the text stood before its window."""

    def __init__(self, tokenizer, token_bytes, skip_special_tokens: bool, special: frozenset[int],
                 byte_level: bool, context: Sequence[int] = ()):
        self._tokenizer, self._token_bytes = tokenizer, token_bytes
        self._skip, self._special = skip_special_tokens, special
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.chars = 0  # characters made whole so far
        self._windows = None  # the text as a context-dependent tokenizer's windows make it
        if tokenizer is not None and not byte_level:
            self._windows = Detokenizer(tokenizer, SamplingParams(skip_special_tokens=skip_special_tokens), context)

    def add(self, tid: int) -> int:
        """Token `tid`'s start; then its text counts."""
        if self._tokenizer is None:
            return 0  # no tokenizer: no text
        if self._windows is not None:
            start = len(self._windows.text)
            self._windows.add([tid])
            return start
        if tid in self._special:
            if self._skip:
                return self.chars
            # it ends the bytes before it (U+FFFD if they are no whole character), then is its own text
            self.chars += len(self._utf8.decode(b"", final=True))
            self._utf8.reset()
            start = self.chars
            self.chars += len(self._tokenizer.decode([tid], skip_special_tokens=False))
            return start
        data = self._token_bytes(tid)
        pending = self._utf8.getstate()[0]  # the bytes of a character not whole yet
        start = self.chars
        if pending and data:
            try:  # does the token's first byte continue that character?
                codecs.getincrementaldecoder("utf-8")("strict").decode(pending + data[:1])
            except UnicodeDecodeError:  # no: that character is a U+FFFD, and the token starts after it
                start += 1
        self.chars += len(self._utf8.decode(data))
        return start


async def _all(coros):
    """The coroutines' results, run concurrently; the first failure (or a cancellation) cancels the others, and
    none is left running when this returns or raises."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class ServerState:
    """What every endpoint reads: the engine client, the server's config (limits, API key), its draining flag and
    metrics."""

    def __init__(self, llm: EngineClient, config: ServerConfig):
        self.llm = llm
        self.config = config
        self.served_model_name = config.served_model_name or llm.model
        self.api_key = None if config.api_key is None else config.api_key.encode("utf-8")
        self.max_request_bytes = config.request_bytes_limit(llm.max_model_len)
        self.chat_template = config.resolved_chat_template()  # None: the tokenizer's
        if self.chat_template is not None and (llm.tokenizer is None or isinstance(llm.tokenizer, ByteTokenizer)):
            raise ValueError(f"chat_template: model {llm.model!r} has "
                             f"{'no tokenizer' if llm.tokenizer is None else 'the built-in byte tokenizer'}, whose "
                             f"chat template cannot be replaced (that needs a Hugging Face tokenizer)")
        self.draining = False
        self._drain_started: asyncio.Future | None = None
        self.num_admitted = 0  # choices admitted whose engine request has not started yet (see `OpenAIServing.admit`)
        self.num_searches = 0  # beam searches running (`OpenAIServing.run_beams`): between steps no request runs
        self.aborting = False  # draining's grace is over: what is in flight is aborted, and no search takes a step
        self.metrics = ServerMetrics(llm.stats, self.served_model_name)
        self.created = int(time.time())

    def unreserve(self) -> None:
        self.num_admitted -= 1

    def start_draining(self) -> None:
        """New requests get 503 from now on, and so do requests whose body is still arriving. On the event loop."""
        self.draining = True
        if self._drain_started is not None and not self._drain_started.done():
            self._drain_started.set_result(None)

    def drain_started(self) -> asyncio.Future:
        """A future that is done once draining starts (a wait for a client ends there)."""
        if self._drain_started is None:
            self._drain_started = asyncio.get_running_loop().create_future()
            if self.draining:
                self._drain_started.set_result(None)
        return self._drain_started


@dataclasses.dataclass(eq=False)
class Choice:
    """One choice: its request, and what it has received from the engine and not yet given to the response."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    show_prompt_logprobs: int | None = None  # the request's `prompt_logprobs` (the engine may compute more)
    echo: bool = False  # completions: the prompt leads the text and the log-probs
    discard_output: bool = False  # echo with max_tokens 0: the engine generates 1 token, the response shows none
    role: str = "assistant"  # chat: the reply's role
    echoed: str = ""  # chat's `echo`: the text the reply starts with
    token_ids_as_text: bool = False  # vLLM's `return_tokens_as_token_ids`: logprobs write tokens as "token_id:<id>"
    return_token_ids: bool = False  # vLLM's `return_token_ids`: the response shows the prompt's and its token ids
    priority: int = 0  # vLLM's `priority`: its engine requests' (`LLMEngine.check_priority`)
    streamed: bool = False  # a stream's: its first chunk has gone out (echo's prompt, `return_token_ids`' ids)
    echo_chars: int = 0  # a stream's echo: the length of the prompt's text, which leads the choice's text
    pending: RequestOutput | None = None  # received, not taken: the DELTA outputs added up
    whole: CompletionOutput | None = None  # a beam search's output, not taken (`finish`)
    prompt_logprobs: list[dict[int, float] | None] = dataclasses.field(default_factory=list)  # received so far
    num_tokens: int = 0  # generated so far
    num_cached_tokens: int = 0  # prompt tokens the engine's prefix cache gave it
    taken_chars: int = 0  # characters of text taken so far
    done: bool = False  # its engine request has ended (finished, failed or aborted)
    emptied: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # set while nothing is pending
    unreserve: Callable[[], None] = lambda: None  # gives back its place in the queue (`OpenAIServing.admit`)
    offsets: TextOffsets | None = None  # a stream's text offsets of the tokens taken so far (completion logprobs)
    last_offset: int = 0  # a stream's last token's start in the text (never below the token before it's)
    held: list = dataclasses.field(default_factory=list)  # a stream's (token, log-probs, start) not shown yet

    def receive(self, out: RequestOutput) -> None:
        if out.prompt_logprobs:
            self.prompt_logprobs.extend(out.prompt_logprobs)
        if self.discard_output:
            co = out.outputs[0]
            reason = co.finish_reason if co.finish_reason in (None, "abort", "error") else "length"
            out = dataclasses.replace(out, outputs=[CompletionOutput(co.index, "", [], None, reason)])
        self.num_tokens += len(out.outputs[0].token_ids)
        self.num_cached_tokens = out.num_cached_tokens
        self.emptied.clear()
        if self.pending is None:
            self.pending = out
        else:
            self.pending.add(out)

    def finish(self, whole: CompletionOutput, num_cached_tokens: int) -> None:
        """Its whole output at once (a beam search's sequence, `OpenAIServing.run_beams`), for `take`."""
        self.whole, self.num_tokens, self.num_cached_tokens = whole, len(whole.token_ids), num_cached_tokens

    def take(self) -> CompletionOutput | None:
        """What arrived since the last take (text, tokens, log-probs, finish reason), or None if nothing did. The
        engine's text never shows what a later token could still change, so text taken is never taken back."""
        if self.whole is not None:
            co, self.whole = self.whole, None
            return co
        if self.pending is None:
            return None
        co, self.pending = self.pending.outputs[0], None
        self.emptied.set()
        self.taken_chars += len(co.text)
        return co


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
        tok = self.tokenizer
        self.token_bytes = None if tok is None else token_bytes_fn(tok)
        self.special_ids = frozenset() if tok is None else special_ids(tok)
        self.byte_level = tok is not None and is_byte_level(tok)

    def text_offsets(self, params: SamplingParams, context: Sequence[int] = ()) -> TextOffsets:
        """A fresh `TextOffsets` for text decoded as `params` asks (special tokens skipped or written), after the
        tokens `context` (a completion's prompt) for tokenizers whose text depends on it."""
        return TextOffsets(self.tokenizer, self.token_bytes, params.skip_special_tokens, self.special_ids,
                           self.byte_level, context)

    # ------------------------------------------------------------ admission
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.state.served_model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves "
                                f"{self.state.served_model_name!r}", "model")

    def check_limits(self, params: SamplingParams, num_prompts: int, n: int) -> None:
        """The server's own limits on one request (400 naming the field and the limit)."""
        cfg = self.state.config
        if len(params.stop) > cfg.max_stop_strings:
            raise APIError(400, f"stop: {len(params.stop)} stop strings; the limit is {cfg.max_stop_strings}", "stop")
        chars = sum(len(s) for s in params.stop)
        if chars > cfg.max_stop_chars:
            raise APIError(400, f"stop: the stop strings have {chars} characters in all; the limit is "
                                f"{cfg.max_stop_chars}", "stop")
        if len(params.stop_token_ids) > cfg.max_stop_token_ids:
            raise APIError(400, f"stop_token_ids: {len(params.stop_token_ids)} ids; the limit is "
                                f"{cfg.max_stop_token_ids}", "stop_token_ids")
        most = min(cfg.max_choices, cfg.max_queue)
        if num_prompts * n > most:
            raise APIError(400, f"{num_prompts} prompt(s) with n = {n} make {num_prompts * n} choices; this server "
                                f"takes at most {most} in one request", "n" if n > 1 else "prompt")

    def admit(self, prompts: list, base: SamplingParams, n: int, rest_of_context: bool = False,
              **choice_fields) -> list[Choice]:
        """Validates every prompt before anything is queued; 400 or 429 on failure. Each prompt gets `n` choices:
        with a seed, choice j draws with seed + j (choice 0 equals the same request with n = 1).
        `rest_of_context`: each prompt's `max_tokens` is the rest of what one request can hold. `choice_fields` go
        to every `Choice`."""
        self.check_limits(base, len(prompts), n)
        try:  # the seed of choice n - 1 must be below 2**63 (a 400 naming `seed`)
            params = dataclasses.replace(base, n=n, output_kind=RequestOutputKind.DELTA).sequences()
        except ParamError as e:
            raise bad_request(e) from None
        choices: list[Choice] = []
        for pi, prompt in enumerate(prompts):
            try:
                if isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt):
                    raise ParamError("prompt", "prompt must be a string, a list of token ids, or a list of either")
                mine = params
                if rest_of_context:
                    ids = self.llm.validate(prompt, dataclasses.replace(params[0], max_tokens=1, min_tokens=0),
                                            choice_fields.get("priority", 0))
                    room = max(self.llm.max_request_tokens - len(ids), 1)
                    room = min(room, self.llm.default_sampling.get("max_tokens", room))  # the model's cap
                    mine = [dataclasses.replace(p, max_tokens=room) for p in params]
                ids = self.llm.validate(prompt, mine[0], choice_fields.get("priority", 0))
            except ValueError as e:
                raise bad_request(e, "" if len(prompts) == 1 else f"prompt[{pi}]: ") from None
            first = len(choices)
            choices += [Choice(first + j, pi, ids, p, **choice_fields) for j, p in enumerate(mine)]
        # The queue counts the engine's waiting requests and the choices admitted whose engine request has not
        # started yet: other requests' handlers run between this admission and the start, and would pass it too.
        # Each choice holds its place until its engine request starts (`run`), or until it is dropped unstarted.
        state, max_queue = self.state, self.state.config.max_queue
        waiting = self.llm.num_waiting + state.num_admitted
        if waiting + len(choices) > max_queue:
            raise APIError(429, f"too many requests waiting ({waiting}, the limit is max_queue = {max_queue}); retry "
                                f"later")
        state.num_admitted += len(choices)
        for c in choices:
            c.unreserve = weakref.finalize(c, state.unreserve)
        return choices

    # ------------------------------------------------------------ running
    async def run(self, rid: str, choices: list[Choice], paced: bool = False) -> AsyncIterator[None]:
        """Runs the choices concurrently; yields each time some have received output (see `Choice.take`). `paced`:
        a choice asks for its next output only once the last was taken. Leaving early (the client went away)
        aborts every unfinished one."""
        progress = asyncio.Event()
        failures: list[BaseException] = []

        async def pump(c: Choice):
            try:
                # no await between: the engine counts the request waiting from the generator's first step on
                c.unreserve()
                async for out in self.llm.generate(None, c.params, f"{rid}-{c.index}", prompt_token_ids=c.prompt_ids,
                                                   priority=c.priority):
                    c.receive(out)
                    progress.set()
                    if paced:
                        await c.emptied.wait()
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                failures.append(e)
            finally:
                c.done = True
                progress.set()

        tasks = [asyncio.create_task(pump(c)) for c in choices]
        try:
            while True:
                await progress.wait()
                progress.clear()
                if failures:
                    raise _api_error(failures[0])
                ended = all(c.done for c in choices)  # nothing can arrive after this yield
                yield
                if ended:
                    return
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for c in choices:
                c.unreserve()  # a task cancelled before it started

    async def run_beams(self, rid: str, choices: list[Choice], beam: BeamSearchParams) -> None:
        """vLLM's `use_beam_search`: each prompt's search (`mnemojax.engine.beam_search.BeamSearch`), the prompts
        concurrently. A step sends the engine one request per live beam at once (the beam's tokens as the prompt,
        one token, the top 2 x beam_width log-probs, or the request's `logprobs` if more); with prefix caching the
        pages a beam's parent filled are not computed again. A prompt's choices (beam_width of them, in order)
        receive its best sequences, best first (`beam_output`). A step request that ends without a token (aborted)
        ends its prompt's search, each of its choices with that finish reason and nothing else.

        The queue: a prompt's choices hold its beam_width places from admission to the search's end (a step runs
        at most beam_width requests); a step's request takes one of them over while the engine counts it."""
        eos, state = self.llm.eos_token_id, self.state

        async def step(request_id: str, tokens: list[int], params: SamplingParams, priority: int):
            state.num_admitted -= 1  # no await between: the engine counts the request waiting from here on
            state.metrics.beam_steps.add(request_id)  # (not a request of its own in /metrics)
            try:
                last = None
                async for out in self.llm.generate(None, params, request_id, prompt_token_ids=tokens,
                                                   priority=priority):
                    last = out
                return last
            finally:
                state.num_admitted += 1  # the place is the search's again
                state.metrics.beam_steps.discard(request_id)

        async def search(group: list[Choice]) -> None:
            first, started = group[0], time.monotonic()
            params = dataclasses.replace(beam, max_tokens=first.params.max_tokens)  # the room `admit` gave it
            s = BeamSearch([first.prompt_ids], params, eos, first.params.logprobs or 0)
            head = None  # the first step's output: the prompt's cached tokens
            while not s.done:
                outs = [] if state.aborting else await _all(
                    step(f"{rid}-{first.prompt_index}-{s.steps}-{k}", b.tokens, s.step_params, first.priority)
                    for k, b in enumerate(s.live()))
                head = head or (outs[0] if outs else None)
                cut = next((o.outputs[0].finish_reason for o in outs if not o.outputs[0].token_ids), None)
                if cut is not None or not outs:
                    wholes = [CompletionOutput(0, "", [], None, cut or "abort") for _ in group]
                    break
                s.advance([o.outputs[0] for o in outs])
            else:
                wholes = [self.beam_output(c, seq, params, eos) for c, seq in zip(group, s.results()[0].sequences)]
            for c, whole in zip(group, wholes):
                c.finish(whole, 0 if head is None else head.num_cached_tokens)
            state.metrics.observe_search(len(first.prompt_ids), wholes, time.monotonic() - started)

        n = beam.beam_width
        self.state.num_searches += 1
        try:
            await _all(search(choices[i:i + n]) for i in range(0, len(choices), n))
        except Exception as e:  # noqa: BLE001 - as the client should see it
            raise _api_error(e) from None
        finally:
            self.state.num_searches -= 1
            for c in choices:
                c.done = True
                c.unreserve()  # the search's places in the queue

    def beam_output(self, c: Choice, seq: BeamSearchSequence, beam: BeamSearchParams,
                    eos: int | None) -> CompletionOutput:
        """A returned sequence as its choice's output (vLLM's): the generated tokens, a final EOS left out unless
        `include_stop_str_in_output` (finish reason "stop", the EOS its stop reason; else "length"); the text of
        the generated tokens without that EOS, made as the engine makes a request's text (the choice's
        `skip_special_tokens`); `logprobs` top entries per token from its step's log-probs."""
        gen, lps = seq.tokens[len(c.prompt_ids):], seq.logprobs
        stopped = not beam.ignore_eos and bool(gen) and gen[-1] == eos
        text = ""
        if self.tokenizer is not None:
            detok = Detokenizer(self.tokenizer, SamplingParams(skip_special_tokens=c.params.skip_special_tokens),
                                c.prompt_ids)
            for t in gen[:-1] if stopped else gen:  # a token at a time, as the engine's steps add them
                detok.add([t])
            detok.flush()
            text = detok.text
        if stopped and not beam.include_stop_str_in_output:
            gen, lps = gen[:-1], lps[:-1]
        top = None if c.params.logprobs is None else [dict(top_entries(d, c.params.logprobs, t))
                                                      for t, d in zip(gen, lps)]
        return CompletionOutput(0, text, gen, top, "stop" if stopped else "length", eos if stopped else None)

    async def run_to_end(self, request: Request, rid: str, choices: list[Choice],
                         beam: BeamSearchParams | None = None) -> bool:
        """Runs the choices of a non-streaming request to the end (`beam`: by beam search, `run_beams`); False if
        the client went away first (watched through `http.disconnect`), which aborts them."""
        async def collect():
            if beam is not None:
                return await self.run_beams(rid, choices, beam)
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
    async def respond(self, request: Request, stream: bool, include_usage: bool, choices: list[Choice],
                      continuous_usage: bool = False, beam: BeamSearchParams | None = None,
                      request_id: str | None = None):
        """The whole response, or a stream of chunks ending with [DONE] (`continuous_usage`: each chunk with its
        choice's usage so far, vLLM's `continuous_usage_stats`); `beam`: the choices are a beam search's (never
        streamed: the request's check refuses that). The response's id is "<prefix>-<id>" with vLLM's id: the
        `X-Request-Id` header's, else the body's `request_id`, else a fresh one; the engine's request ids are
        always fresh (two requests may give the same id)."""
        rid, created = f"{self.id_prefix}-{uuid.uuid4().hex}", int(time.time())
        given = request.headers.get("x-request-id") or request_id
        head = {"id": f"{self.id_prefix}-{given}" if given else rid, "created": created,
                "model": self.state.served_model_name}
        if stream:
            return StreamingResponse(self._guarded(self._events(rid, head, choices, include_usage, continuous_usage)),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        if not await self.run_to_end(request, rid, choices, beam):
            return Response(status_code=499)  # the client is gone; nobody reads this
        return {**head, "object": self.object_name, "choices": [self.whole_choice(c, c.take()) for c in choices],
                "usage": self.usage(choices), **self.response_fields(choices)}

    async def _events(self, rid: str, head: dict, choices: list[Choice], include_usage: bool,
                      continuous_usage: bool = False):
        def chunk(choices_, **extra):
            return sse({**head, "object": self.stream_object, "choices": choices_, **extra})

        def choice_chunk(c: Choice, data: dict, **extra):
            if not continuous_usage:
                return chunk([data], **extra)
            n = len(c.prompt_ids)  # vLLM's: the choice's prompt and the tokens it has streamed so far
            return chunk([data], usage={"prompt_tokens": n, "completion_tokens": c.num_tokens,
                                        "total_tokens": n + c.num_tokens}, **extra)

        preambles = [self.preamble(c) for c in choices]  # vLLM's order: every choice's first chunk, then the next
        for k in range(max(map(len, preambles), default=0)):
            for c, pre in zip(choices, preambles):
                if k < len(pre):
                    yield choice_chunk(c, pre[k], **(self.first_chunk_fields(c) if k == 0 else {}))
        async for _ in self.run(rid, choices, paced=True):
            for c in choices:
                offset = c.taken_chars
                co = c.take()
                if co is None or (not co.text and not co.token_ids and co.finish_reason is None):
                    continue
                yield choice_chunk(c, self.stream_choice(c, co, offset))
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
        except Exception:  # noqa: BLE001 - logged here; the client learns only that it failed
            logger.exception("stream failed")
            self.state.metrics.observe_error(500)
            yield sse(error_body(500, INTERNAL_ERROR))
            yield DONE

    def preamble(self, c: Choice) -> list[dict]:
        return []

    def first_chunk_fields(self, c: Choice) -> dict:
        """Fields beside the choices of a choice's first preamble chunk."""
        return {}

    def response_fields(self, choices: list[Choice]) -> dict:
        """Fields a whole response has besides id, created, model, object, choices and usage."""
        return {}

    def prompt_logprobs(self, c: Choice) -> list[dict | None] | None:
        """vLLM's `prompt_logprobs`: per prompt token (the first None) `{"<id>": {"logprob", "rank",
        "decoded_token"}}` for the top `show_prompt_logprobs` tokens and the prompt's own token. `rank` is 1 for the
        most likely; it is null for a prompt token outside the top tokens the engine computed."""
        if c.show_prompt_logprobs is None:
            return None
        out: list[dict | None] = [None]
        for t, d in zip(c.prompt_ids[1:], c.prompt_logprobs[1:]):
            ranks = {k: r for r, k in enumerate(list(d)[:c.params.prompt_logprobs], 1)}
            out.append({str(k): {"logprob": lp, "rank": ranks.get(k), "decoded_token": self.token_text(k)}
                        for k, lp in top_entries(d, c.show_prompt_logprobs, t)})
        return out

    def stream_choice(self, c: Choice, new: CompletionOutput, offset: int) -> dict:
        """A chunk's choice: `new` is what arrived since the previous chunk, `offset` where its text starts."""
        raise NotImplementedError

    def whole_choice(self, c: Choice, whole: CompletionOutput) -> dict:
        raise NotImplementedError

    @staticmethod
    def usage(choices: list[Choice]) -> dict:
        prompts = {c.prompt_index: len(c.prompt_ids) for c in choices}  # each prompt counts once, whatever n
        cached: dict[int, int] = {}  # and its cached tokens: the most any of its choices found
        for c in choices:
            cached[c.prompt_index] = max(cached.get(c.prompt_index, 0), c.num_cached_tokens)
        completion = sum(c.num_tokens for c in choices)
        return {"prompt_tokens": sum(prompts.values()), "completion_tokens": completion,
                "total_tokens": sum(prompts.values()) + completion,
                "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}

    def token_ids_as_text(self, body) -> bool:
        """vLLM's `return_tokens_as_token_ids`: the request's, else the server's flag."""
        asked = body.return_tokens_as_token_ids
        return self.state.config.return_tokens_as_token_ids if asked is None else asked

    def token_text(self, tid: int, as_id: bool = False) -> str:
        """A token as logprobs show it: its text; a token that is not whole UTF-8 by itself is written as its bytes,
        `bytes:\\xNN` (OpenAI's convention), so distinct tokens stay distinct keys. A SentencePiece-style token is
        its piece's text with its space (" hello", as in the output text; decoded alone it would lose it).
        `as_id` (vLLM's `return_tokens_as_token_ids`), or no tokenizer: "token_id:<id>"."""
        tok = self.tokenizer
        if tok is None or as_id:
            return f"token_id:{tid}"
        if self.byte_level:
            text = tok.decode([tid], skip_special_tokens=False)
        else:
            text = self.token_bytes(tid).decode("utf-8", errors="replace")
        if "\ufffd" not in text:
            return text
        if isinstance(tok, ByteTokenizer):
            return f"bytes:\\x{tid:02x}"
        return tok.convert_ids_to_tokens(tid)
