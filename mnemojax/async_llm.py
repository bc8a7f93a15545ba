"""`AsyncLLM`: the engine in a background thread, streaming outputs to asyncio callers (for the server).

The engine is not thread-safe, so only its thread touches it: callers send commands (add, abort) through a
thread-safe queue and receive `RequestOutput`s on their own asyncio queue. The thread steps while there is
work and otherwise blocks on the command queue (no busy-waiting).
"""
from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import AsyncIterator, Sequence

from mnemojax.engine import EngineConfig, LLMEngine
from mnemojax.outputs import RequestOutput
from mnemojax.sampling_params import SamplingParams

_ADD, _ABORT, _STOP = "add", "abort", "stop"


class AsyncLLM:
    def __init__(self, model: str = "tiny", **kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mnemojax-engine", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- callers' side
    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yields the request's output each time it makes progress; the last one has `finished` set.

        Bad input raises ValueError (naming the field and the limit) before anything is yielded. If the
        caller stops iterating (a client went away), the request is aborted and its pages are freed.
        """
        if self._error is not None:
            raise RuntimeError("the engine thread has stopped") from self._error
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (asyncio.get_running_loop(), q)
        self._commands.put((_ADD, rid, prompt, params or SamplingParams()))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self._commands.put((_ABORT, rid))

    def abort(self, request_id: str) -> None:
        self._commands.put((_ABORT, request_id))

    def shutdown(self) -> None:
        """Stops the engine thread after the command in hand (in-flight requests are aborted)."""
        self._commands.put((_STOP,))
        self._thread.join()

    # ---------------------------------------------------------------- the engine thread
    def _send(self, rid: str, item) -> None:
        stream = self._streams.get(rid)
        if stream is not None:
            loop, q = stream
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _handle(self, cmd) -> bool:
        e = self.engine
        if cmd[0] == _STOP:
            for rid in [r for r, req in e.requests.items() if not req.is_finished]:
                e.abort(rid)
                self._send(rid, e.pop_finished(rid))
            return False
        if cmd[0] == _ADD:
            _, rid, prompt, params = cmd
            try:
                e.add_request(prompt, params, request_id=rid)
            except ValueError as err:
                self._send(rid, err)
        elif cmd[0] == _ABORT:
            rid = cmd[1]
            req = e.requests.get(rid)
            if req is not None:
                e.abort(rid)
                self._send(rid, e.pop_finished(rid))
        return True

    def _run(self) -> None:
        e = self.engine
        try:
            while True:
                try:
                    cmd = self._commands.get(block=not e.has_unfinished())
                    if not self._handle(cmd):
                        return
                    continue  # take every pending command before the next step
                except queue.Empty:
                    pass
                for out in e.step():
                    if out.request_id not in e.requests:
                        continue  # aborted (and answered) while its chunk was in flight
                    if out.finished:
                        out = e.pop_finished(out.request_id)
                    self._send(out.request_id, out)
        except BaseException as err:  # the engine failed: tell every caller rather than leave them waiting
            self._error = err
            for rid in list(self._streams):
                self._send(rid, RuntimeError(f"engine failed: {err!r}"))
            raise
