"""A conversation that cannot fit is refused before its chat template runs.

:mod:`server.text.bounds` says what proves a conversation too long; this
module counts a request's messages the way it does and answers the routes that
render a chat template (chat completions, ``/v1/responses``, ``/tokenize``).

The refusal is a route dependency: FastAPI runs dependencies after parsing
the JSON body and before validating it into the request model, and validating
tens of thousands of messages takes a tenth of a second or more of the event
loop each. So the counts are taken from the parsed JSON as sent, with every
shape the model would refuse counted as nothing (counting less never refuses
what fits; validation then reports the shape).
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from server.http.errors import engine_error
from server.http.unknown_fields import json_body
from server.protocol import (
    ConversationBound,
    ConversationSize,
)

# Content parts whose ``text`` the model reads (chat's, and the Responses input's).
TEXT_PARTS = ("text", "input_text", "output_text")
NOTHING = ConversationSize(0, 0)


async def messages_fit(request: Request) -> None:
    """Dependency of the routes that render ``messages``: 400 when they cannot fit.

    Raises:
        APIError: 400 ``context_length_exceeded`` naming ``messages``.
    """
    body = await json_body(request)
    messages = body.get("messages") if isinstance(body, dict) else None
    _refuse(request, _messages_size(messages), "messages")


async def input_fits(request: Request) -> None:
    """Dependency of ``/v1/responses``: 400 when ``instructions`` and ``input`` cannot
    fit (with ``truncation: "auto"`` the route drops the oldest items instead:
    :mod:`server.http.routes.truncation`).

    Raises:
        APIError: 400 ``context_length_exceeded`` naming ``input``.
    """
    body = await json_body(request)
    if not isinstance(body, dict) or body.get("truncation") == "auto":
        return
    _refuse(request, _input_size(body.get("input"), body.get("instructions")), "input")


def _refuse(request: Request, size: ConversationSize, field: str) -> None:
    bound = served_bound(getattr(request.app.state, "engine", None))
    refusal = None if bound is None else bound.refusal(size, field)
    if refusal is not None:
        raise engine_error(refusal)


def served_bound(engine: Any) -> ConversationBound | None:
    """The served model's bound; None before it loads (the route answers 503 then)."""
    return getattr(engine, "conversation_bound", None)


def message_size(role: Any, content: Any) -> ConversationSize:
    """One message as the bound counts it."""
    return ConversationSize(1, _chars(role, content))


def _chars(role: Any, content: Any) -> int:
    """Characters of a message's text, less the whitespace around it (``| trim``); none
    for the assistant's (a template may drop earlier reasoning from those)."""
    if role == "assistant":
        return 0
    if isinstance(content, str):
        return len(content.strip())
    if not isinstance(content, list):
        return 0
    text = "".join(part["text"] for part in content
                   if isinstance(part, dict) and part.get("type") in TEXT_PARTS
                   and isinstance(part.get("text"), str))
    return len(text.strip())


def _messages_size(messages: Any) -> ConversationSize:
    """Chat's ``messages`` as sent (each an object with ``role`` and ``content``)."""
    if not isinstance(messages, list):
        return NOTHING
    sent = [m for m in messages if isinstance(m, dict)]
    return ConversationSize(len(sent), sum(_chars(m.get("role"), m.get("content"))
                                           for m in sent))


def _input_size(items: Any, instructions: Any) -> ConversationSize:
    """The Responses ``instructions`` (a system message) and ``input`` (a string: one
    user message; or items). A ``function_call`` item may join the assistant message
    before it, so it counts nothing; a ``function_call_output`` is a tool message."""
    size = message_size("system", instructions) if isinstance(instructions, str) else NOTHING
    if isinstance(items, str):
        return size + message_size("user", items)
    if not isinstance(items, list):
        return size
    messages, chars = size.messages, size.chars
    for item in items:
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            chars += _chars(item.get("role"), item.get("content"))
        elif kind == "function_call_output":
            chars += _chars("tool", item.get("output"))
        else:
            continue
        messages += 1
    return ConversationSize(messages, chars)
