"""Request fields this server cannot honour: a 400 naming the field, never silence.

A field the server accepts must have its effect; one it cannot honour is
refused with ``param`` set to it, so a client learns at once instead of
getting output that quietly ignores what it asked for: OpenAI platform
features that a text-only, self-hosted model has no way to honour (audio,
moderation, verbosity, web search), the completions ``suffix``
(insertion), and the deprecated ``functions`` / ``function_call`` (their
replacement, ``tools`` / ``tool_choice``, is served).

A field left out, ``null``, or at the value that asks for nothing passes.
"""

from __future__ import annotations

from typing import Any

from server.http.errors import InvalidRequestError


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
    if getattr(body, "verbosity", None) is not None:
        raise _unsupported("verbosity", "the served model has no verbosity control")
    if getattr(body, "web_search_options", None) is not None:
        raise _unsupported("web_search_options", "this server has no web search")
    if getattr(body, "functions", None):
        raise _unsupported("functions", "it is deprecated; send the same functions as tools")
    if getattr(body, "function_call", None) not in (None, "none"):
        raise _unsupported("function_call", "it is deprecated; use tool_choice with tools")
    if getattr(body, "suffix", None):
        raise _unsupported("suffix", "insertion (text after the completion) needs a "
                           "fill-in-the-middle model")
