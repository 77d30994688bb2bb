"""HTTP-level guards, one pure ASGI middleware: drain, per-client cap, body size, stalls.

Pure ASGI (not ``BaseHTTPMiddleware``) so streaming bodies pass through
untouched and the routes' client-disconnect detection keeps working.

- **Authentication first.** The bearer checks of :mod:`server.http.auth` run
  on the raw headers before the app, so an unauthenticated request learns
  401/403 whatever its body holds.
- **Body size.** A ``Content-Length`` over ``limits.max_body_bytes`` is
  answered 413 before the body is read, on any route; a chunked body that
  grows past it is cut off with 413 while being read. (Starlette's
  ``RequestBodyLimitMiddleware`` / FastAPI's ``max_body_size`` do the same
  but need releases newer than this project's ``fastapi>=0.110`` floor, and
  answer a plain-text 413 on routes that never read their body.)
- **Drain.** Once :class:`DrainState` is draining (SIGTERM, see
  :mod:`server.http.serve`), new requests get 503 with ``Retry-After`` and
  ``/health`` reports 503 so balancers stop routing; requests already in
  flight go on. ``DrainState.inflight`` counts them.
- **Per-client cap.** With ``limits.max_concurrent_per_client`` > 0, a client
  address (the TCP peer: behind a proxy, the proxy) with that many generation
  requests in flight gets 429 for the next one.
- **Stalled streams.** A response body ``send`` that cannot complete within
  ``limits.stream_stall_timeout_s`` (the client stopped reading and the
  socket buffers are full) marks the client gone: later sends are dropped,
  ``receive`` reports ``http.disconnect`` and the request's
  :class:`~server.http.client_watch.ClientWatch` wakes its routes, exactly
  as for a client that hung up; they cancel the request, whose blocks the
  engine frees at its next step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.http.auth import early_refusal
from server.http.client_watch import SCOPE_KEY, ClientWatch
from server.http.errors import (
    APIError,
    OverloadedError,
    RequestTooLargeError,
    UnavailableError,
    error_response,
)
from server.http.stall_timer import StallTimer
from server.settings import Settings

log = logging.getLogger("veloxquant.server")

# Routes that stay answerable while draining and do not count as in-flight work.
OPEN_PATHS = ("/health", "/metrics")
# Routes that start a generation (the per-client cap counts these).
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


@dataclass(slots=True)
class DrainState:
    """Shared between the middleware (counts requests) and the server (decides to exit).

    Only touched from the event loop thread, except :meth:`begin`, which the
    signal handler calls (plain attribute writes, safe under the GIL).
    """

    draining: bool = False
    deadline: float = 0.0
    inflight: int = 0

    def begin(self, grace_s: float) -> None:
        """Stop taking new work; in-flight requests get ``grace_s`` seconds."""
        if not self.draining:
            self.deadline = time.monotonic() + grace_s
            self.draining = True

    def done(self) -> bool:
        """Draining and nothing left in flight, or the grace period is over."""
        return self.draining and (self.inflight == 0 or time.monotonic() >= self.deadline)


def _header(scope: Scope, wanted: bytes) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == wanted:
            return value.decode("latin-1")
    return None


def _declare_json(scope: Scope) -> None:
    """Declare ``scope``'s body JSON, whatever (or whether) the client declared.

    Every POST body here is JSON. ``curl -d '{...}'`` without ``-H`` sends it
    as ``application/x-www-form-urlencoded``, and FastAPI then never parsed it
    ("Input should be a valid dictionary"); llama-server reads such bodies as
    JSON too. A body that is no JSON still gets the JSON parse error, a 400.
    """
    kind = (_header(scope, b"content-type") or "").split(";")[0].strip().lower()
    if kind != "application/json":
        headers = [(k, v) for k, v in scope.get("headers", ()) if k != b"content-type"]
        scope["headers"] = [*headers, (b"content-type", b"application/json")]


def _content_length(scope: Scope) -> int | None:
    value = _header(scope, b"content-length")
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


class Guards:
    """The middleware; see the module docstring.

    Args:
        app: The wrapped ASGI app.
        settings: Server settings (limits and the API key).
        drain: The drain state shared with the server runner.
    """

    def __init__(self, app: ASGIApp, settings: Settings, drain: DrainState) -> None:
        self.app = app
        self.settings = settings
        self.drain = drain
        self.max_body = settings.limits.max_body_bytes
        self.stall_s = settings.limits.stream_stall_timeout_s
        self.per_client = settings.limits.max_concurrent_per_client
        self.by_client: dict[str, int] = {}  # client address -> generations in flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        refusal = self._refusal(scope, path)
        if refusal is not None:
            await error_response(refusal, self.settings)(scope, receive, send)
            return
        if path in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if scope.get("method") == "POST":
            _declare_json(scope)
        client = None
        if self.per_client and path in GENERATION_PATHS:
            client = (scope.get("client") or ("?", 0))[0]
            self.by_client[client] = self.by_client.get(client, 0) + 1
        self.drain.inflight += 1
        watch = scope[SCOPE_KEY] = ClientWatch()
        try:
            await self._guarded(scope, receive, send, watch)
        finally:
            watch.close()
            self.drain.inflight -= 1
            if client is not None:
                left = self.by_client.pop(client) - 1
                if left:
                    self.by_client[client] = left

    def _refusal(self, scope: Scope, path: str) -> APIError | None:
        """The error to answer before the app runs, if any."""
        if self.drain.draining and path != "/metrics":
            return UnavailableError("the server is shutting down and takes no new requests; "
                                    "retry on another instance", code="shutting_down")
        # Authenticate before anything reads the body (FastAPI parses JSON before it
        # runs the routes' auth dependencies).
        denied = early_refusal(self.settings, path, _header(scope, b"authorization"))
        if denied is not None:
            return denied
        length = _content_length(scope)
        if length is not None and length > self.max_body:
            return self._too_large(length)
        encoding = _header(scope, b"content-encoding")
        if scope.get("method") == "POST" and encoding is not None \
                and encoding.strip().lower() not in ("", "identity"):
            # Read as JSON it would be "not valid JSON (must be UTF-8)"; say what is wrong.
            return APIError(f"Content-Encoding {encoding.strip()!r} is not supported: send "
                            "the body uncompressed", param=None,
                            code="unsupported_content_encoding", status=415)
        if self.per_client and path in GENERATION_PATHS:
            client = (scope.get("client") or ("?", 0))[0]
            if self.by_client.get(client, 0) >= self.per_client:
                return OverloadedError(
                    f"{self.per_client} requests from this client are already in flight "
                    "(limits.max_concurrent_per_client); wait for one to finish",
                    code="too_many_concurrent_requests")
        return None

    def _too_large(self, length: int | None) -> RequestTooLargeError:
        got = f"{length} bytes" if length is not None else "a larger body"
        return RequestTooLargeError(f"request body too large: {got}, at most "
                                    f"limits.max_body_bytes={self.max_body}; shorten the "
                                    "prompt or messages")

    async def _guarded(self, scope: Scope, receive: Receive, send: Send,
                       watch: ClientWatch) -> None:
        """Run the app with a counting ``receive`` and a stall-aware ``send``."""
        received = 0
        stalled = False
        max_body, stall_s = self.max_body, self.stall_s
        timer = StallTimer(stall_s)

        async def guarded_receive() -> Message:
            nonlocal received
            if stalled:  # what a reader of receive sees of a cut-off client
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_body:
                    # Rendered in the OpenAI shape by the app's HTTPException handler.
                    raise HTTPException(413, self._too_large(None).message)
            elif message["type"] == "http.disconnect":
                watch.mark_gone()
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal stalled
            if stalled:
                return  # the client is treated as gone: drop the rest of the answer
            if message["type"] != "http.response.body":
                await send(message)
                return
            if not await timer.send(send, message):
                stalled = True
                log.warning("client of %s read nothing for %.1fs "
                            "(limits.stream_stall_timeout_s): cutting its stream",
                            scope.get("path"), stall_s)
                watch.mark_gone()

        try:
            await self.app(scope, guarded_receive, guarded_send)
        finally:
            timer.close()
