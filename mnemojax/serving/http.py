"""uvicorn for the server, with the connection timeouts it lacks.

uvicorn closes a connection idle after a response (`timeout_keep_alive`), but waits without end for a request's
head that never completes (a connection that sends nothing, half a request line, part of the headers), and for a
client that reads nothing of a response. `GuardedHTTPProtocol` adds both limits:
- the head of each request (request line and headers) must arrive within `header_timeout_s` of the connection
  opening or of its previous response; else the connection is closed;
- while the response cannot be written (the socket's buffers are full: the client reads nothing), it may wait
  `write_timeout_s`; then the connection is reset (the unsent data discarded, not left to the kernel), which the
  app sees as a disconnect (its requests are aborted and their KV pages freed).
The body's own deadline (`body_timeout_s`, HTTP 408) is the app's (`GuardMiddleware`): it answers in JSON.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import struct

from mnemojax.serving.config import ServerConfig

logger = logging.getLogger(__name__)


def guarded_protocol(header_timeout_s: float, write_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (httptools or h11, as uvicorn picks) with the two timeouts above."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class GuardedHTTPProtocol(AutoHTTPProtocol):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._head_timer: asyncio.TimerHandle | None = None
            self._write_timer: asyncio.TimerHandle | None = None
            app = self.app

            async def app_with_head(scope, receive, send):  # called once a request's head has arrived
                self._cancel_head_timer()
                return await app(scope, receive, send)

            self.app = app_with_head

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm_head_timer()

        def on_response_complete(self):
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_head_timer()

        def connection_lost(self, exc):
            self._cancel_head_timer()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None
            super().connection_lost(exc)

        def pause_writing(self):
            super().pause_writing()
            if self._write_timer is None:
                self._write_timer = self.loop.call_later(write_timeout_s, self._write_timed_out)

        def resume_writing(self):
            super().resume_writing()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _arm_head_timer(self):
            self._cancel_head_timer()
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timed_out)

        def _cancel_head_timer(self):
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self):
            self._head_timer = None
            if not self.transport.is_closing():
                logger.info("%s: no complete request head within %g s; closing the connection", _peer(self),
                            header_timeout_s)
                self.transport.close()

        def _write_timed_out(self):
            self._write_timer = None
            logger.warning("%s read nothing of its response for %g s; dropping the connection (its requests are "
                           "aborted)", _peer(self), write_timeout_s)
            sock = self.transport.get_extra_info("socket")
            if sock is not None:  # reset, not close: the kernel would keep the unsent data, waiting for the client
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.abort()

    return GuardedHTTPProtocol


def _peer(protocol) -> str:
    client = getattr(protocol, "client", None)
    return "%s:%d" % client if client else "a client"


def uvicorn_config(app, config: ServerConfig, **kwargs):
    """The `uvicorn.Config` serving `app` at `config.host:config.port` with the connection timeouts; `kwargs` go
    to uvicorn (log settings, say)."""
    import uvicorn

    return uvicorn.Config(app, host=config.host, port=config.port,
                          http=guarded_protocol(config.header_timeout_s, config.write_timeout_s), **kwargs)
