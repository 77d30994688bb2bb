"""Server-Sent Events framing of a generation: ``data: {json}`` frames, then ``data: [DONE]``.

Hand-framed on a plain ``StreamingResponse`` (three lines) rather than
through a library:

- sse-starlette patches uvicorn's ``Server.handle_exit`` process-wide and
  closes every stream once uvicorn starts to exit; the SIGTERM drain needs
  in-flight streams to run on through the grace period and then end with an
  error frame. Its own disconnect listener also reads ``receive()``, which
  the routes' disconnect poll and the stall guard rely on.
- FastAPI's own ``EventSourceResponse`` needs a release newer than this
  project's ``fastapi>=0.110`` floor.

A failure after the first byte cannot change the status any more: it is sent
as one ``{"error": ...}`` frame before ``[DONE]``. A client that left gets
nothing more (its request is already cancelled).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from server.engine.protocol import Finished, TokenEvent
from server.http.errors import APIError
from server.http.routes.call import ClientGone, GenerationCall

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    """One Server-Sent Events frame."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def sse_stream(
    call: GenerationCall,
    on_token: Callable[[TokenEvent], dict[str, Any] | None],
    on_finish: Callable[[Finished], list[dict[str, Any]]],
    first: dict[str, Any] | None = None,
) -> AsyncIterator[bytes]:
    """Turn a call's events into SSE frames; errors become an ``error`` frame.

    Args:
        call: An admitted call.
        on_token: Builds the chunk for a token event (None to skip it).
        on_finish: Builds the closing chunks (finish reason, optional usage).
        first: A chunk to send before any token (the chat role delta).
    """
    if first is not None:
        yield sse(first)
    try:
        async for event in call.events():
            if isinstance(event, Finished):
                for chunk in on_finish(event):
                    yield sse(chunk)
            else:
                chunk = on_token(event)
                if chunk is not None:
                    yield sse(chunk)
    except ClientGone:
        return  # nobody is listening; events() already cancelled the request
    except APIError as exc:
        yield sse(exc.body())
    yield SSE_DONE
