"""``chat_template_kwargs`` (vLLM's field): extra variables for the chat template.

Templates read switches of their own: Qwen3's ``enable_thinking``,
gpt-oss's ``reasoning_effort``, a system prompt's date, ... A request's object
is passed to the tokenizer's ``apply_chat_template`` as keyword arguments, and
so are the top-level ``enable_thinking`` (Cherry Studio sends it there) and
OpenAI's ``reasoning_effort``; the object's own keys win over those. A
template that reads none of them renders as without.

A key naming one of ``apply_chat_template``'s own arguments (``tokenize``,
``add_generation_prompt``, ``tools``, ...) would change how the server builds
the prompt rather than what the template reads: a 400 naming it.
"""

from __future__ import annotations

from typing import Any

from server.http.errors import InvalidRequestError

# apply_chat_template's own arguments (transformers), and the names the template gets them as.
RESERVED = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template",
    "add_generation_prompt", "continue_final_message", "tokenize", "sanitize_control_tokens",
    "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})

TemplateKwargs = tuple[tuple[str, Any], ...]


def checked_template_kwargs(given: dict[str, Any] | None, **top_level: Any) -> TemplateKwargs:
    """The template's extra variables: the ``top_level`` fields that are set, then ``given``.

    Raises:
        InvalidRequestError: A key of ``given`` is one of ``apply_chat_template``'s own
            arguments (``param`` is ``chat_template_kwargs.<key>``).
    """
    for key in given or {}:
        if key in RESERVED:
            raise InvalidRequestError(
                f"chat_template_kwargs.{key} is an argument of apply_chat_template itself, "
                "which the server sets; chat_template_kwargs holds the template's own "
                "variables", param=f"chat_template_kwargs.{key}")
    merged = {key: value for key, value in top_level.items() if value is not None}
    merged.update(given or {})
    return tuple(merged.items())
