"""Connection limits uvicorn lacks: a header deadline and a cap on open connections.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``), but a
connection that sends half a request line and then nothing is kept forever,
and nothing bounds how many are open: 2,000 such sockets exhaust the file
limit and ``accept`` fails for everyone (slowloris). Its ``limit_concurrency``
answers 503 only once a request's headers are complete, so it does not help.

:func:`guarded_protocol` returns uvicorn's h11 protocol with two additions,
both at the connection level (before any HTTP parsing or ASGI work)::

    connection_made: open connections > server.max_connections
                        -> a fixed 503 (OpenAI error shape, Retry-After) and close
                     else arm the header timer
    data arrives while no request is being read (their state IDLE): arm the timer
    request headers complete (h11 leaves IDLE): cancel the timer
    timer fires while still IDLE: close (it never finished its headers within
                     server.header_timeout_s)

An idle keep-alive connection is closed by uvicorn's own keep-alive timer
(``server.keep_alive_timeout_s``). Slow request bodies and slow readers are
handled elsewhere (``limits.max_body_bytes``; the stall guard in guards.py).
"""

from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.http.errors import error_body
from server.settings import Settings

log = logging.getLogger("veloxquant.server")


def _busy_response(retry_after_s: int, max_connections: int) -> bytes:
    body = json.dumps(error_body(
        f"too many open connections (server.max_connections={max_connections}); retry "
        "later", "server_error", None, "too_many_connections")).encode()
    head = ("HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"retry-after: {retry_after_s}\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n")
    return head.encode() + body


class _GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a connection cap (class attributes)."""

    header_timeout_s: float = 10.0
    max_connections: int = 1000
    busy_response: bytes = b""
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.write(self.busy_response)
            transport.close()
            return
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:
            if self._header_timer is None:  # the first bytes of a (next) request
                self._arm_header_timer()
        else:
            self._cancel_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(settings: Settings) -> type[H11Protocol]:
    """The protocol class to give uvicorn (``http=``), configured from ``[server]``."""
    server = settings.server
    return type("GuardedH11Protocol", (_GuardedH11Protocol,), {
        "header_timeout_s": server.header_timeout_s,
        "max_connections": server.max_connections,
        "busy_response": _busy_response(settings.limits.retry_after_s, server.max_connections),
    })
