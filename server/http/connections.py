"""Connection limits uvicorn lacks: a header deadline, a cap on open connections.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``), but a
connection that sends half a request line and then nothing is kept forever,
and nothing bounds how many are open: 2,000 such sockets exhaust the file
limit and ``accept`` fails for everyone (slowloris). Its ``limit_concurrency``
answers 503 only once a request's headers are complete, so it does not help.

:func:`guarded_protocol` returns one of uvicorn's HTTP/1.1 protocols with two
additions, both at the connection level (before any ASGI work)::

    connection_made: open connections > server.max_connections
                        -> a fixed 503 (OpenAI error shape, Retry-After) and close
                     else arm the header timer
    data arrives while the request's headers are not complete: arm the timer
    request headers complete: cancel the timer
    timer fires while still waiting for headers: close (they did not come within
                     server.header_timeout_s)

Which protocol (``server.http_parser``): ``httptools`` (uvicorn's protocol on
the C parser) when it is installed, else ``h11`` (the pure-Python one);
``auto`` picks the first. It matters for streaming: every token is one
response-body send, and h11 frames it through a Python state machine, the
httptools protocol with one formatted write. An idle keep-alive connection is
closed by uvicorn's own keep-alive timer (``server.keep_alive_timeout_s``).
Slow request bodies and slow readers are handled elsewhere
(``limits.max_body_bytes``; the stall guard in guards.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.http.errors import error_body, fresh_request_id
from server.settings import Settings

try:
    import httptools  # noqa: F401  (uvicorn's protocol below needs it)
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # an optional speed-up: h11 serves everything without it
    HttpToolsProtocol = None

log = logging.getLogger("veloxquant.server")


# Filled with a fresh id per answer, as every other answer's x-request-id (server/http/app.py).
_ID_SLOT = "REQUEST-ID-SLOT-24-CHARS"


def _with_id(response: bytes) -> bytes:
    return response.replace(_ID_SLOT.encode(), fresh_request_id().encode(), 1)


def _busy_response(retry_after_s: int, max_connections: int) -> bytes:
    body = json.dumps(error_body(
        f"too many open connections (server.max_connections={max_connections}); retry "
        "later", "server_error", None, "too_many_connections")).encode()
    head = ("HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"retry-after: {retry_after_s}\r\nconnection: close\r\n"
            f"x-request-id: {_ID_SLOT}\r\n"
            f"content-length: {len(body)}\r\n\r\n")
    return head.encode() + body


class _Guard:
    """The two limits, for a uvicorn protocol whose ``_awaiting_headers()`` says when
    the current request's headers are not complete yet."""

    header_timeout_s: float = 10.0
    max_connections: int = 1000
    busy_response: bytes = b""
    _header_timer: asyncio.TimerHandle | None = None
    connections: set
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    def _admit(self, transport: asyncio.Transport) -> None:
        """Refuse a connection past the cap; else start its header deadline."""
        if len(self.connections) > self.max_connections:
            transport.write(_with_id(self.busy_response))
            transport.close()
            return
        self._arm_header_timer()

    def _track_headers(self) -> None:
        """After data arrived: the deadline runs exactly while headers are awaited."""
        if self._awaiting_headers():
            if self._header_timer is None:  # the first bytes of a (next) request
                self._arm_header_timer()
        else:
            self._cancel_header_timer()

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self._awaiting_headers() and not self.transport.is_closing():
            self.transport.close()


class _GuardedH11Protocol(_Guard, H11Protocol):
    """uvicorn's h11 protocol with the guard (class attributes)."""

    def _awaiting_headers(self) -> bool:
        return self.conn.their_state is h11.IDLE

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._admit(transport)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)


# Most bytes of request headers buffered before a 400: h11's own limit (its default
# max_incomplete_event_size), which the C parser does not have.
MAX_HEADER_BYTES = h11._connection.DEFAULT_MAX_INCOMPLETE_EVENT_SIZE

if HttpToolsProtocol is not None:
    class _GuardedHttpToolsProtocol(_Guard, HttpToolsProtocol):
        """uvicorn's httptools protocol with the guard and h11's header-size limit."""

        _in_headers = True  # from the connection (or a request's first byte) to its headers
        _header_bytes = 0  # received while the current headers were incomplete
        _began = False  # a request began in the data being parsed

        def _awaiting_headers(self) -> bool:
            return self._in_headers

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._admit(transport)

        def data_received(self, data: bytes) -> None:
            self._began = False
            super().data_received(data)
            if self.parser is None or self.transport.is_closing():  # a parse error's 400
                return
            self._track_headers()
            if self._in_headers:
                # A request that began in this data counts from the next data on: the
                # bound is the limit plus one read, never unbounded.
                self._header_bytes += 0 if self._began else len(data)
                if self._header_bytes > MAX_HEADER_BYTES:
                    self.send_400_response("Request headers too large.")

        def on_message_begin(self) -> None:
            self._in_headers, self._header_bytes, self._began = True, 0, True
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._in_headers = False
            self._cancel_header_timer()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)


def parser_name(settings: Settings) -> str:
    """The HTTP parser ``server.http_parser`` resolves to here (``h11`` or ``httptools``).

    Raises:
        RuntimeError: ``httptools`` was asked for and is not installed.
    """
    wanted = settings.server.http_parser
    if wanted == "h11" or (wanted == "auto" and HttpToolsProtocol is None):
        return "h11"
    if HttpToolsProtocol is None:
        raise RuntimeError("server.http_parser = \"httptools\" but httptools is not installed "
                           "(pip install httptools, or use \"auto\" or \"h11\")")
    return "httptools"


def guarded_protocol(settings: Settings) -> type[Any]:
    """The protocol class to give uvicorn (``http=``), configured from ``[server]``."""
    server = settings.server
    base = _GuardedH11Protocol if parser_name(settings) == "h11" else _GuardedHttpToolsProtocol
    return type(f"Guarded{base.__name__.removeprefix('_Guarded')}", (base,), {
        "header_timeout_s": server.header_timeout_s,
        "max_connections": server.max_connections,
        "busy_response": _busy_response(settings.limits.retry_after_s, server.max_connections),
    })
