"""Request fields this server does not honour (yet): a 400 naming the field, never silence.

A field the server accepts must have its effect; one it cannot honour is
refused with ``param`` set to it, so a client learns at once instead of
getting output that quietly ignores what it asked for. Two groups:

- :func:`refuse_unbuilt`: structured outputs and tool calling. Constrained
  decoding will implement them; each check here is the one place to replace
  with the real handling (and ``UNBUILT`` the list to shrink).
- :func:`refuse_unsupported`: OpenAI platform features that a text-only,
  self-hosted model has no way to honour (audio, moderation, reasoning
  effort, web search) and the completions ``suffix`` (insertion).

A field left out, ``null``, or at the value that asks for nothing (``"text"``
format, no tools, ``tool_choice: "none"``) passes.
"""

from __future__ import annotations

from typing import Any

from server.http.errors import InvalidRequestError

# Fields refused until constrained decoding lands (issue 15): keep in step with the checks.
UNBUILT = ("response_format", "tools", "tool_choice", "parallel_tool_calls", "functions",
           "function_call")
_FORMAT_TYPES = ("text", "json_object", "json_schema")


def _not_yet(param: str, what: str) -> InvalidRequestError:
    return InvalidRequestError(f"{what} is not available on this server yet; leave {param} "
                               "out (or null) for plain text generation", param=param,
                               code="unsupported_value")


def refuse_unbuilt(body: Any) -> None:
    """400 for structured-output and tool-calling fields set to anything but their default.

    Args:
        body: A completions or chat request (fields read with ``getattr``, so
            chat-only fields are skipped for completions).

    Raises:
        InvalidRequestError: Naming the first such field.
    """
    fmt = getattr(body, "response_format", None)
    if fmt is not None:
        kind = fmt.get("type")
        if kind not in _FORMAT_TYPES:
            raise InvalidRequestError(
                f"response_format type {kind!r} is unknown; use one of "
                f"{', '.join(_FORMAT_TYPES)}", param="response_format", code="invalid_value")
        if kind != "text":
            raise _not_yet("response_format", f"response_format {kind!r} (structured output)")
    if getattr(body, "tools", None):
        raise _not_yet("tools", "tool calling (tools)")
    if getattr(body, "tool_choice", None) not in (None, "none"):
        raise _not_yet("tool_choice", "tool calling (tool_choice other than \"none\")")
    if getattr(body, "parallel_tool_calls", None) is False:
        raise _not_yet("parallel_tool_calls", "tool calling (parallel_tool_calls)")
    if getattr(body, "functions", None):
        raise _not_yet("functions", "function calling (functions)")
    if getattr(body, "function_call", None) not in (None, "none"):
        raise _not_yet("function_call", "function calling (function_call other than \"none\")")


def _unsupported(param: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param} is not supported: {why}; leave it out (or null)",
                               param=param, code="unsupported_parameter")


def refuse_unsupported(body: Any) -> None:
    """400 for fields no self-hosted text model can honour, when set.

    Raises:
        InvalidRequestError: Naming the first such field.
    """
    if getattr(body, "audio", None) is not None:
        raise _unsupported("audio", "this server generates text only")
    if "audio" in (getattr(body, "modalities", None) or ()):
        raise _unsupported("modalities", "this server generates text only (use [\"text\"])")
    if getattr(body, "moderation", None) is not None:
        raise _unsupported("moderation", "this server runs no moderation model")
    if getattr(body, "reasoning_effort", None) is not None:
        raise _unsupported("reasoning_effort", "the served model has no reasoning mode")
    if getattr(body, "verbosity", None) is not None:
        raise _unsupported("verbosity", "the served model has no verbosity control")
    if getattr(body, "web_search_options", None) is not None:
        raise _unsupported("web_search_options", "this server has no web search")
    if getattr(body, "suffix", None):
        raise _unsupported("suffix", "insertion (text after the completion) needs a "
                           "fill-in-the-middle model")
