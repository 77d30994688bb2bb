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

Each frame is one token's chunk, as OpenAI's clients expect; several frames
may share one write when the event loop fell behind (``MAX_FRAMES_PER_SEND``),
which SSE allows and clients parse alike.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from json.encoder import encode_basestring_ascii
from typing import Any

from server.http.errors import APIError
from server.http.routes.call import ClientGone
from server.http.routes.fanout import Fanout
from server.protocol import (
    Finished,
    TokenEvent,
)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DONE = b"data: [DONE]\n\n"
# Frames sent in one body message at most. A frame goes out as soon as it is
# built unless the stream's next event is already waiting (the event loop fell
# behind the engine): then frames are joined, and one send (the ASGI
# middleware chain, HTTP framing, a socket write) carries several tokens.
# Bounded so that a stream far behind still sends regularly.
MAX_FRAMES_PER_SEND = 16


# Built once: json.dumps with separators builds an encoder per call, and a stream
# encodes one chunk per token.
_encode = json.JSONEncoder(separators=(",", ":")).encode


def sse(payload: dict[str, Any]) -> bytes:
    """One Server-Sent Events frame."""
    return b"data: " + _encode(payload).encode() + b"\n\n"


# Stands for the varying string while a FrameTemplate encodes its chunk: private-use
# characters, which no id, model name or role of ours contains.
TEXT_MARK = "\ue000veloxquant-text\ue000"
_MARK_JSON = encode_basestring_ascii(TEXT_MARK).encode()


class FrameTemplate:
    """The SSE frames of one chunk shape in which only one string differs per frame.

    A streamed token's chunk is the same dict every time (id, model, choice
    index, ``null`` fields) but for its text. Encoding that dict per token costs
    about a tenth of the event loop's CPU at 64 streams; here it is encoded
    once, with :data:`TEXT_MARK` in place of the text, and each frame is the
    encoded text spliced in: the same bytes :func:`sse` gives (checked by the
    tests), with the text escaped as the encoder escapes it.

    Args:
        chunk: The chunk, holding :data:`TEXT_MARK` exactly once as a string value.

    Raises:
        ValueError: ``chunk`` holds the mark zero or several times.
    """

    __slots__ = ("_head", "_tail")

    def __init__(self, chunk: dict[str, Any]) -> None:
        head, *tails = sse(chunk).split(_MARK_JSON)
        if len(tails) != 1:
            raise ValueError(f"the chunk must hold TEXT_MARK once, not {len(tails)} times")
        self._head, self._tail = head, tails[0]

    def frame(self, text: str) -> bytes:
        """The frame of the chunk with ``text`` in place of the mark."""
        return self._head + encode_basestring_ascii(text).encode() + self._tail


async def sse_stream(
    fanout: Fanout,
    on_token: Callable[[int, TokenEvent], dict[str, Any] | bytes | None],
    on_finish: Callable[[int, Finished], list[dict[str, Any]]],
    first: list[dict[str, Any]] | None = None,
    last: Callable[[], list[dict[str, Any]]] | None = None,
) -> AsyncIterator[bytes]:
    """Turn the choices' events into SSE frames; errors become an ``error`` frame.

    Args:
        fanout: The admitted calls (one per choice; none for an echo-only answer).
        on_token: Builds the chunk for choice j's token event, or its frame ready
            encoded (:class:`FrameTemplate`); None to skip it.
        on_finish: Builds choice j's closing chunks (finish reason).
        first: Chunks to send before any token (chat role deltas, echoed prompts).
        last: Builds the chunks sent once every choice finished (the usage chunk).
    """
    for chunk in first or ():
        yield sse(chunk)
    frames: list[bytes] = []  # built, not yet sent (see MAX_FRAMES_PER_SEND)
    try:
        async for j, event in fanout.events():
            if isinstance(event, Finished):
                frames += [sse(chunk) for chunk in on_finish(j, event)]
            else:
                chunk = on_token(j, event)
                if chunk is not None:
                    frames.append(chunk if isinstance(chunk, bytes) else sse(chunk))
            if frames and (len(frames) >= MAX_FRAMES_PER_SEND or not fanout.ready):
                yield b"".join(frames)
                frames = []
    except ClientGone:
        return  # nobody is listening; every request of the fanout is already cancelled
    except APIError as exc:
        frames.append(sse(exc.body()))
    else:
        frames += [sse(chunk) for chunk in (last() if last is not None else ())]
    frames.append(SSE_DONE)
    yield b"".join(frames)
