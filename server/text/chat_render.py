"""Chat messages (and offered tools) to prompt ids through the model's chat template.

Templates written for tool use (Qwen2.5, Llama 3.1, Hermes, ...) mention
``tools``; they get the tools and the conversation's tool calls as they
expect them (``arguments`` as an object). Any other template (SmolLM2's,
plain ChatML) gets the server's own convention, as plain text:

- a system block that lists each function as JSON and asks for calls as
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (merged into
  the conversation's own system message when it has one);
- an assistant message's earlier calls written in that same form;
- a ``tool`` message as a ``user`` message wrapped in
  ``<tool_response>...</tool_response>`` (a template may refuse roles it
  does not know).

The HTTP side parses calls in either the tagged form or the bare JSON form
that native templates ask for (``server.http.routes.tool_calls``), and in the
syntax a native template teaches (:func:`tool_call_format`).
"""

from __future__ import annotations

import json
from typing import Any

from server.protocol import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ChatPrompt,
)

_TOOLS_INTRO = (
    "You can call functions to help answer. Each function is described below as JSON, "
    "with a JSON Schema of its arguments:\n")
_TOOLS_HOWTO = (
    "\nTo call a function, answer with a JSON object inside tags, one call per tag:\n"
    f"{TOOL_CALL_OPEN}{{\"name\": \"<function name>\", \"arguments\": {{<arguments>}}}}"
    f"{TOOL_CALL_CLOSE}\nIf no function is needed, answer normally.")


# Marks of each tool-call syntax in chat templates, tried in this order: a template may
# hold several (Llama 3.2's pythonic variants keep Llama 3's "ipython" role).
_FORMAT_MARKS = (
    ("mistral", ("[TOOL_CALLS]",)),
    ("hermes", (TOOL_CALL_OPEN,)),
    ("pythonic", ("[func_name1(", "python list of the function calls")),
    ("llama3_json", ("<|python_tag|>", "ipython", "dictionary of argument name")),
)


def tool_call_format(tokenizer: Any) -> str:
    """The syntax the chat template teaches for tool calls (``server.http.routes.tool_formats``).

    A template that does not render tools gets the server's own ``<tool_call>``
    convention, so its model answers in ``hermes``; so does one whose syntax is
    none of the known ones.
    """
    if not template_takes_tools(tokenizer):
        return "hermes"
    template = tokenizer.chat_template
    return next((name for name, marks in _FORMAT_MARKS
                 if any(mark in template for mark in marks)), "hermes")


def template_takes_tools(tokenizer: Any) -> bool:
    """True when the tokenizer's chat template renders a ``tools`` list itself."""
    return _template_knows(tokenizer, "tools")


def _template_knows(tokenizer: Any, word: str) -> bool:
    """Whether the chat template mentions ``word`` (a role, ``tools``)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and word in template


def render_ids(tokenizer: Any, prompt: ChatPrompt) -> list[int]:
    """The prompt ids of a chat, generation prompt included; the prompt's template
    variables go to the template as keyword arguments.

    A ``developer`` message is OpenAI's newer name for a ``system`` one, and is
    rendered as one unless the template knows the role: most templates would
    write it as a turn of an unknown speaker (SmolLM2's then also adds its own
    default system prompt).

    Raises:
        Exception: Whatever the template raises (the caller turns it into a 400).
    """
    chat = prompt.messages if _template_knows(tokenizer, "developer") else [
        {**m, "role": "system"} if m["role"] == "developer" else m for m in prompt.messages]
    if template_takes_tools(tokenizer):
        messages = [_native(m) for m in chat]
        extra = {"tools": list(prompt.tools)} if prompt.tools else {}
    else:
        messages = _with_tools_block([_as_text(m) for m in chat], prompt.tools)
        extra = {}
    ids = list(tokenizer.apply_chat_template(messages,
                                             add_generation_prompt=prompt.generation_prompt,
                                             tokenize=True, **dict(prompt.template_kwargs),
                                             **extra))
    bos = bos_on_encode(tokenizer)
    if bos is not None and ids[:1] != [bos]:
        ids.insert(0, bos)  # a template without {{ bos_token }}: as llama.cpp adds it
    return ids


def bos_on_encode(tokenizer: Any) -> int | None:
    """The BOS id the tokenizer puts in front of every text it encodes, else None.

    A chat template renders text that is then encoded without special tokens,
    so a vocabulary that wants BOS first (``add_bos_token``: Llama 2, Mistral,
    TinyLlama GGUFs) gets none when the template does not write
    ``{{ bos_token }}``, and chats would differ from completions of the same
    text. llama.cpp adds it to the rendered chat; so do we, once.
    """
    cached = getattr(tokenizer, "_veloxquant_bos", False)
    if cached is not False:
        return cached
    bos = getattr(tokenizer, "bos_token_id", None)
    found = bos if bos is not None and tokenizer.encode("a")[:1] == [bos] else None
    try:
        tokenizer._veloxquant_bos = found
    except AttributeError:  # a tokenizer that takes no attributes: ask again next time
        pass
    return found


def _arguments(call: dict[str, Any]) -> Any:
    """A call's arguments as an object when they are JSON text (what templates expect)."""
    args = call.get("function", {}).get("arguments", "{}")
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


def _native(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    return {**message, "tool_calls": [
        {**call, "function": {"name": call["function"]["name"], "arguments": _arguments(call)}}
        for call in calls]}


def _as_text(message: dict[str, Any]) -> dict[str, str]:
    """The message in roles and plain text any template renders."""
    role, content = message["role"], message.get("content") or ""
    if role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    calls = message.get("tool_calls") or ()
    written = [TOOL_CALL_OPEN + json.dumps({"name": c["function"]["name"],
                                            "arguments": _arguments(c)}) + TOOL_CALL_CLOSE
               for c in calls]
    return {"role": role, "content": "\n".join([content, *written] if content else written)}


def tools_block(tools: tuple[dict[str, Any], ...]) -> str:
    """The system text that offers ``tools`` to a model whose template has no tool support."""
    listed = "\n".join(json.dumps(tool["function"]) for tool in tools)
    return _TOOLS_INTRO + listed + _TOOLS_HOWTO


def _with_tools_block(messages: list[dict[str, str]],
                      tools: tuple[dict[str, Any], ...]) -> list[dict[str, str]]:
    if not tools:
        return messages
    block = tools_block(tools)
    # (a developer message is still one here only where the template knows the role)
    if messages and messages[0]["role"] in ("system", "developer"):
        first = messages[0]
        return [{"role": first["role"], "content": f"{first['content']}\n\n{block}"},
                *messages[1:]]
    return [{"role": "system", "content": block}, *messages]
