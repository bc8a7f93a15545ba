"""`AsyncLLM`: the engine in a background thread, streaming outputs to asyncio callers (for the server).

The engine is not thread-safe, so only its thread touches it: callers send commands (add, abort) through a
thread-safe queue and receive `RequestOutput`s on their own event loop. The thread steps while there is work and
otherwise blocks on the command queue (no busy-waiting). After every step it publishes a snapshot of its counters
(`stats()`), which the server's metrics read without touching the engine.

A caller that reads slowly (or not at all) never makes outputs pile up: what it has not taken yet is one output,
to which newer DELTA outputs are added and which a newer CUMULATIVE output replaces.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from mnemojax.engine.llm_engine import EngineConfig, LLMEngine, with_our_names
from mnemojax.scheduling.outputs import RequestOutput
from mnemojax.scheduling.sampling_params import RequestOutputKind, SamplingParams, truncate_prompt

logger = logging.getLogger(__name__)

_ADD, _ABORT, _ABORT_ALL, _STOP, _RESET_CACHE = "add", "abort", "abort_all", "stop", "reset_prefix_cache"


class EngineStepError(RuntimeError):
    """A request was running in `failures` steps that failed (each failure is logged; the last is chained as
    `__cause__`), so it was ended; the engine serves on."""

    def __init__(self, request_id: str, failures: int):
        super().__init__(f"request {request_id!r} was running in {failures} engine steps that failed, so it was "
                         f"ended; the engine serves on (the server log has the failures)")
        self.request_id, self.failures = request_id, failures


class EngineDeadError(RuntimeError):
    """The engine thread has stopped, failed (its failure is logged, and chained as `__cause__`) or shut down; no
    request can run."""

    def __init__(self):
        super().__init__("the engine thread has stopped")


def _put_all(items: list[tuple[_Stream, Any]]) -> None:
    """On a caller's loop: each item into its stream."""
    for stream, item in items:
        stream.put(item)


def _settle(done: asyncio.Future, result=None, error: BaseException | None = None) -> None:
    """From the engine thread: `done`'s result (or `error`), on its loop, unless it is already done (cancelled)."""
    def settle():
        if not done.done():
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)

    try:
        done.get_loop().call_soon_threadsafe(settle)
    except RuntimeError:  # the caller's loop has closed: nobody is waiting
        pass


class _Stream:
    """One request's outputs on their way to its caller: the output not taken yet (later ones merged into it), and
    an event saying there is one. Touched only on the caller's event loop."""

    def __init__(self, delta: bool):
        self.delta = delta
        self.pending: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if self.delta and isinstance(self.pending, RequestOutput) and isinstance(item, RequestOutput):
            self.pending.add(item)
        else:
            self.pending = item  # a newer cumulative output holds all an older one did; a failure ends the stream
        self.ready.set()

    async def get(self) -> RequestOutput | BaseException:
        await self.ready.wait()
        self.ready.clear()
        item, self.pending = self.pending, None
        return item


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's counters, published by its thread after each step."""

    running: int = 0  # requests admitted (holding KV pages)
    waiting: int = 0  # requests queued for admission (or preempted)
    kv_pages_used: int = 0  # over all KVP ranks, the reserved dummy pages excluded
    kv_pages_total: int = 0
    preemptions: int = 0  # since start
    prefix_cache_queries: int = 0  # tokens of admitted requests that looked up the prefix cache, since start
    prefix_cache_hits: int = 0  # of those, tokens found cached
    step_time_prediction_error: float | None = None  # median |predicted / measured - 1| of recent steps
    step_failures: int = 0  # steps that failed and were recovered from, since start


class EngineClient(Protocol):
    """What the HTTP server needs of an engine (vLLM's `EngineClient` shape): `AsyncLLM` is one, and the server's
    tests also run against a mock whose outputs are computed by hand (`tests/mock_engine.py`)."""

    tokenizer: Any  # encode / decode / apply_chat_template, or None (token-id prompts only)
    model: str  # the model it runs (a preset name or a checkpoint path)
    max_model_len: int
    max_request_tokens: int  # the most tokens (prompt + output) one request can hold: max_model_len or the KV pages
    default_sampling: dict  # SamplingParams fields the model's generation_config.json sets for requests that don't
    eos_token_id: int | None  # the EOS a beam of the server's `use_beam_search` ends at (`LLMEngine.eos_token_id`)
    is_alive: bool
    num_waiting: int  # callers' requests with no output yet
    num_active: int  # requests whose callers are still listening

    def validate(self, prompt: str | Sequence[int], params: SamplingParams, priority: int = 0) -> list[int]: ...

    def generate(self, prompt: str | Sequence[int] | None, params: SamplingParams | None = None,
                 request_id: str | None = None, *, prompt_token_ids: list[int] | None = None,
                 priority: int = 0) -> AsyncIterator[RequestOutput]: ...

    def stats(self) -> EngineStats: ...

    def add_finished_listener(self, fn: Callable[[RequestOutput], None]) -> None: ...

    def abort_all(self) -> None: ...

    async def reset_prefix_cache(self) -> int: ...


class AsyncLLM:
    """`LLMEngine` behind an asyncio interface (an `EngineClient`).

    `idle_tick`, when given, is called by the engine thread about every `idle_tick_s` seconds while it has no
    work (multi-host serving uses it to keep the other processes' collectives alive).

    A step that fails (an exception) does not stop the engine: `LLMEngine` has preempted every running request by
    recompute (exact), so they go on and their callers see nothing but the delay. A request that was running in
    `step_failures_per_request` failed steps is ended with `EngineStepError` (it may be what makes them fail). A
    failure the engine did not recover from stops it, and every caller gets `EngineDeadError`: one in the recovery
    (a lost device fails its check there), one that is not an `Exception`, any in multi-host serving (the followers
    cannot recover), and the `max_failed_steps_in_a_row`-th failure with no step succeeding since the first (an
    engine that fails whatever it runs: /health then says so, rather than answer every request with a 500).
    """

    def __init__(self, model: str = "tiny", *, engine: LLMEngine | None = None,
                 idle_tick: Callable[[], None] | None = None, idle_tick_s: float = 1.0,
                 step_failures_per_request: int = 2, max_failed_steps_in_a_row: int = 10, **kwargs):
        for name, value in (("step_failures_per_request", step_failures_per_request),
                            ("max_failed_steps_in_a_row", max_failed_steps_in_a_row)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if engine is None:
            engine = LLMEngine(EngineConfig(model=model, **with_our_names(kwargs)))
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        # set (under the lock) when the engine thread ends: a command queued after that would wait for ever, so
        # callers check it under the same lock before queuing, and the thread fails what was queued before it
        self._closed = False
        self._lock = threading.Lock()
        self._in_hand = None  # the command the engine thread is handling (failed with the rest if the engine fails)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, _Stream]] = {}
        self._parents: dict[str, list[str]] = {}  # a running request with n > 1: its sequences' request ids
        # what the engine thread has for each callers' loop since its last `_deliver` (engine thread only)
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, Any]]] = {}
        self._ids = itertools.count()
        self._error: BaseException | None = None
        self._idle_tick, self._idle_tick_s = idle_tick, idle_tick_s
        self._failures_per_request, self._max_in_a_row = step_failures_per_request, max_failed_steps_in_a_row
        self._failures: dict[str, int] = {}  # failed steps each unfinished request was running in (engine thread)
        self._step_failures = self._failures_in_a_row = 0
        self._stats = EngineStats()
        self._publish()
        self.num_waiting = 0  # callers' requests with no output yet (touched by the callers' loop only)
        self._finished_listeners: list[Callable[[RequestOutput], None]] = []
        self._thread = threading.Thread(target=self._run, name="mnemojax-engine", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- callers' side
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model(self) -> str:
        return self.engine.config.model

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def default_sampling(self) -> dict:
        return self.engine.default_sampling

    @property
    def eos_token_id(self) -> int | None:
        """`LLMEngine.eos_token_id`."""
        return self.engine.eos_token_id

    @property
    def max_request_tokens(self) -> int:
        """`LLMEngine.max_request_tokens`."""
        return self.engine.max_request_tokens

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    @property
    def num_active(self) -> int:
        """Requests whose callers are still listening."""
        return len(self._streams)

    def add_finished_listener(self, fn: Callable[[RequestOutput], None]) -> None:
        """Calls `fn(output)` (from the engine thread) with the final output of every request, aborted ones
        included, whether or not its caller is still listening. For metrics."""
        self._finished_listeners.append(fn)

    def stats(self) -> EngineStats:
        return self._stats

    def validate(self, prompt: str | Sequence[int], params: SamplingParams, priority: int = 0) -> list[int]:
        """The prompt's token ids (as `params.truncate_prompt_tokens` leaves them); raises ValueError (naming the
        field and the limit) if the request (with its `priority`, `LLMEngine.check_priority`) is bad.

        Safe from any thread: tokenizing and the checks read only the engine's fixed configuration (and a regex's
        token guide, which the engine builds and caches behind a lock).
        """
        ids = truncate_prompt(self.engine.tokenize(prompt), params.truncate_prompt_tokens, self.engine.max_model_len)
        if params.n != 1:  # `generate` runs one request per sequence
            params.validate()
            params = dataclasses.replace(params, n=1)
        self.engine.validate(ids, params, priority)
        return ids

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                       request_id: str | None = None, *, prompt_token_ids: list[int] | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yields the request's output each time it makes progress; the last one has `finished` set. `priority`
        (vLLM's): lower runs first under scheduler_policy "priority"; 0 under any other.

        Bad input raises ValueError (naming the field and the limit) before anything is yielded; a failed or shut
        down engine raises `EngineDeadError`. If the caller stops iterating (a client went away), the request is
        aborted and its pages are freed. Outputs the caller has not taken yet are merged into one (see the module
        doc). `params.n` > 1: `_sequences`.
        """
        self._check_running()
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._streams or rid in self._parents:
            raise ValueError(f"request_id {rid!r} is already in use")
        if params is not None and params.n != 1:
            async for out in self._sequences(prompt, params, rid, prompt_token_ids, priority):
                yield out
            return
        # None: the engine's defaults for this prompt (`LLMEngine.default_sampling_params`), CUMULATIVE outputs
        stream = _Stream(params is not None and params.output_kind is RequestOutputKind.DELTA)
        self._streams[rid] = (asyncio.get_running_loop(), stream)
        try:
            self._queue((_ADD, rid, prompt, params, prompt_token_ids, priority))
        except EngineDeadError:
            self._streams.pop(rid, None)
            raise
        finished, waiting = False, True
        self.num_waiting += 1
        try:
            while True:
                item = await stream.get()
                if waiting:
                    waiting = False
                    self.num_waiting -= 1
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if waiting:
                self.num_waiting -= 1
            self._streams.pop(rid, None)
            if not finished:
                self._commands.put((_ABORT, rid))

    async def _sequences(self, prompt, params: SamplingParams, rid: str, prompt_token_ids: list[int] | None,
                         priority: int) -> AsyncIterator[RequestOutput]:
        """vLLM's `n` on one call: n requests (`<rid>-<j>`, sequence j drawing with seed + j when seeded, so
        sequence 0 is the request with n = 1) whose outputs come as one request's, `rid`: CUMULATIVE ones hold the
        latest output of every sequence that has one (`outputs[k].index` its sequence), DELTA ones what one
        sequence added (`outputs` that one; the prompt in the first output only, as for n = 1), FINAL_ONLY one
        output when all have ended; `finished` once all have. The request id, metrics and cached tokens are those
        of the sequence the output comes from (CUMULATIVE: the first). Each sequence has at most one output waiting
        here (its own stream merges the rest); the first failure of any ends them all, as leaving early does."""
        kids = params.sequences()
        self._parents[rid] = [f"{rid}-{j}" for j in range(params.n)]
        arrived: asyncio.Queue = asyncio.Queue()

        async def pump(j: int) -> None:
            try:
                async for out in self.generate(prompt, kids[j], f"{rid}-{j}", prompt_token_ids=prompt_token_ids,
                                               priority=priority):
                    taken = asyncio.Event()
                    arrived.put_nowait((j, out, taken))
                    await taken.wait()
            except Exception as e:  # noqa: BLE001 - handed to the caller
                arrived.put_nowait((j, e, None))

        tasks = [asyncio.ensure_future(pump(j)) for j in range(params.n)]
        latest: list[RequestOutput | None] = [None] * params.n
        kind = params.output_kind
        prompt_sent = False  # DELTA: the prompt (ids, log-probs) comes in the request's first output only
        try:
            while not all(out is not None and out.finished for out in latest):
                j, out, taken = await arrived.get()
                if isinstance(out, BaseException):
                    raise out
                latest[j] = out
                done = all(o is not None and o.finished for o in latest)
                if kind is RequestOutputKind.DELTA:
                    if prompt_sent:  # (each sequence's own first output holds it)
                        out = dataclasses.replace(out, prompt=None, prompt_token_ids=[], prompt_logprobs=None
                                                  if out.prompt_logprobs is None else [])
                    prompt_sent = True
                    yield dataclasses.replace(out, request_id=rid, finished=done,
                                              outputs=[dataclasses.replace(out.outputs[0], index=j)])
                elif kind is RequestOutputKind.CUMULATIVE or done:
                    first = next(o for o in latest if o is not None)
                    yield dataclasses.replace(first, request_id=rid, finished=done, outputs=[
                        dataclasses.replace(o.outputs[0], index=k) for k, o in enumerate(latest) if o is not None])
                taken.set()
        finally:
            self._parents.pop(rid, None)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def abort(self, request_id: str) -> None:
        """Aborts the request (with `n` > 1, each of its sequences); its caller gets its final output."""
        for rid in self._parents.get(request_id, [request_id]):
            self._commands.put((_ABORT, rid))

    def abort_all(self) -> None:
        """Aborts every unfinished request; each caller gets its final output (finish_reason "abort")."""
        self._commands.put((_ABORT_ALL,))

    async def reset_prefix_cache(self) -> int:
        """Forgets every cached KV page (on the engine thread, between steps); returns how many were cached. Raises
        `EngineDeadError` if the engine has stopped (or stops before it gets to the reset)."""
        done = asyncio.get_running_loop().create_future()
        self._queue((_RESET_CACHE, done))
        return await done

    def shutdown(self) -> None:
        """Stops the engine thread after the command in hand (in-flight requests are aborted)."""
        if self._thread.is_alive():
            self._commands.put((_STOP,))
            self._thread.join()
        self.engine.save_predictor_profile()  # the last calibration (with save_predictor_profile set)

    def _dead(self) -> EngineDeadError:
        err = EngineDeadError()
        err.__cause__ = self._error
        return err

    def _check_running(self) -> None:
        """Raises `EngineDeadError` if the engine thread has failed or ended (shut down)."""
        if self._error is not None or self._closed or not self._thread.is_alive():
            raise self._dead()

    def _queue(self, cmd) -> None:
        """Queues a command that someone waits on; raises `EngineDeadError` if no engine thread will ever take it."""
        with self._lock:
            self._check_running()
            self._commands.put(cmd)

    # ---------------------------------------------------------------- the engine thread
    def _send(self, rid: str, item) -> None:
        """Queues `item` for `rid`'s caller (if it still listens) until the next `_deliver`."""
        entry = self._streams.get(rid)
        if entry is not None:
            loop, stream = entry
            self._outbox.setdefault(loop, []).append((stream, item))

    def _deliver(self) -> None:
        """Hands each callers' loop the items queued for it since the last delivery, in order, in one thread-safe
        call: a call per item cost the engine thread ~6 us on a CPU (a lock and a write to the loop's wake-up
        pipe), 1.4 ms a step with 256 requests streaming, and woke the loop once per item."""
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the caller's loop has closed: nobody is listening
                pass

    def _publish(self) -> None:
        e = self.engine
        self._stats = EngineStats(running=len(e.scheduler.running), waiting=len(e.scheduler.waiting),
                                  kv_pages_used=e.kv.num_used, kv_pages_total=e.kv.num_usable,
                                  preemptions=e.scheduler.num_preemptions, prefix_cache_queries=e.kv.prefix_queries,
                                  prefix_cache_hits=e.kv.prefix_hits,
                                  step_time_prediction_error=e.prediction_error(),
                                  step_failures=self._step_failures)

    def _finish(self, rid: str, last: RequestOutput | BaseException) -> None:
        """Forgets a finished request; sends its last output (a delta, for DELTA requests; or the error that ended
        it) to its caller, and its whole output to the finished listeners."""
        whole = self.engine.pop_finished(rid)
        self._failures.pop(rid, None)
        self._send(rid, last)
        for fn in self._finished_listeners:
            fn(whole)

    def _step_failed(self, error: Exception) -> None:
        """After a failed step (from which `LLMEngine` recovered by preempting everyone running): ends each request
        that has now run in `step_failures_per_request` failed steps with `EngineStepError`. Re-raises `error` (so
        the engine stops) when the engine did not recover (multi-host serving, a failure in the recovery), or at
        the `max_failed_steps_in_a_row`-th failure in a row."""
        e = self.engine
        self._failures_in_a_row += 1
        if e.last_failure_preempted is None or self._failures_in_a_row >= self._max_in_a_row:
            raise error
        self._step_failures += 1
        logger.error("a step failed (%d in a row); its running requests are computed again", self._failures_in_a_row,
                     exc_info=error)
        for rid in e.last_failure_preempted:
            n = self._failures[rid] = self._failures.get(rid, 0) + 1
            if n >= self._failures_per_request and rid in e.requests:
                e.abort(rid, "error")  # vLLM's finish reason for a request its engine failed
                failed = EngineStepError(rid, n)
                failed.__cause__ = error
                self._finish(rid, failed)  # the caller gets the error; the finished listeners its final output

    def _abort(self, rid: str) -> None:
        e = self.engine
        req = e.requests.get(rid)
        if req is not None:
            e.abort(rid)
            self._finish(rid, e.output(req))

    def _handle(self, cmd) -> bool:
        e = self.engine
        if cmd[0] in (_STOP, _ABORT_ALL):
            for rid in [r for r, req in e.requests.items() if not req.is_finished]:
                self._abort(rid)
            return cmd[0] != _STOP
        if cmd[0] == _ADD:
            _, rid, prompt, params, prompt_ids, priority = cmd
            try:
                e.add_request(prompt, params, request_id=rid, prompt_token_ids=prompt_ids, priority=priority)
            except ValueError as err:
                self._send(rid, err)
        elif cmd[0] == _ABORT:
            self._abort(cmd[1])
        elif cmd[0] == _RESET_CACHE:
            _settle(cmd[1], e.reset_prefix_cache())
        return True

    def _fail_pending(self) -> None:
        """The engine thread is ending: no command queued now will be taken, so each caller waiting on one (the one
        in hand included, if the engine failed while handling it) gets `EngineDeadError`."""
        with self._lock:
            self._closed = True
        pending = [] if self._in_hand is None else [self._in_hand]
        while True:
            try:
                pending.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for cmd in pending:
            if cmd[0] == _ADD:
                self._send(cmd[1], self._dead())
            elif cmd[0] == _RESET_CACHE:
                _settle(cmd[1], error=self._dead())

    def _next_command(self):
        if self.engine.has_unfinished():
            return self._commands.get_nowait()
        if self._idle_tick is None:
            return self._commands.get()
        while True:
            try:
                return self._commands.get(timeout=self._idle_tick_s)
            except queue.Empty:
                self._idle_tick()

    def _run(self) -> None:
        e = self.engine
        try:
            while True:
                try:
                    cmd = self._in_hand = self._next_command()
                    if not self._handle(cmd):
                        return
                    self._in_hand = None
                    self._publish()  # before the outputs: a caller never sees stats older than them
                    self._deliver()
                    continue  # take every pending command before the next step
                except queue.Empty:
                    pass
                try:
                    outputs = e.step()
                except Exception as err:  # noqa: BLE001 - recovered from, or re-raised to stop the engine
                    self._step_failed(err)
                    outputs = []
                else:
                    self._failures_in_a_row = 0
                for out in outputs:
                    if out.request_id not in e.requests:
                        continue  # aborted (and answered) while its chunk was in flight
                    if out.finished:
                        self._finish(out.request_id, out)
                    else:
                        self._send(out.request_id, out)
                self._publish()
                self._deliver()
        except BaseException as err:  # the engine failed: tell every caller rather than leave them waiting
            logger.exception("the engine failed; every request in flight gets an error")
            self._error = err
            for rid in list(self._streams):
                self._send(rid, self._dead())
        finally:
            self._fail_pending()
            try:
                self._publish()
            finally:
                self._deliver()  # what is queued (the final outputs of a stop's aborts, the errors of a failure)
