"""Tool-call syntaxes besides the server's own, read from a finished answer.

A model writes calls in the syntax its chat template teaches
(``Engine.tool_call_format`` names it; ``server.tool_call_parser`` may force one):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  (Hermes, Qwen, and the server's own convention): read in :mod:`tool_calls`.
- ``llama3_json``: the answer is ``{"name": ..., "parameters": {...}}``, maybe
  after ``<|python_tag|>``; several are separated by ``;`` or newlines.
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, or the
  newer ``[TOOL_CALLS]name[ARGS]{...}``, after any text.
- ``pythonic``: the answer is a Python list of calls, ``[get_weather(city="Paris")]``,
  read with :mod:`ast` as literals only: nothing in it is evaluated.

A parser returns None when the text holds no call in its syntax (or a malformed
one): the answer is then read as ``hermes``, because the server's grammars (a
forced call, a JSON format beside tools) write calls in that shape whatever the
model's own syntax is.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from server.protocol import TOOL_CALL_OPEN

PYTHON_TAG = "<|python_tag|>"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
MISTRAL_CALLS = "[TOOL_CALLS]"

Calls = tuple[str, list[dict[str, Any]]]  # the text outside the calls, and the calls

_DECODER = json.JSONDecoder()
# Between Llama 3 JSON calls: ";" (as its prompts ask), whitespace, a repeated tag.
_BETWEEN = re.compile(r"(?:\s|;|" + re.escape(PYTHON_TAG) + r")*")
# The newer Mistral call: name, an optional call id, then the arguments' JSON.
_MISTRAL_NAMED = re.compile(r"\s*([A-Za-z0-9_-]{1,64})(?:\[CALL_ID\][A-Za-z0-9]*)?\[ARGS\]\s*")
# Errors of reading text the model wrote: malformed, or nested deeper than the parser goes.
_UNREADABLE = (ValueError, TypeError, SyntaxError, RecursionError, MemoryError)


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    """An OpenAI tool call object with a fresh id (``arguments`` as JSON text)."""
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def call_from(obj: Any, names: set[str]) -> dict[str, Any] | None:
    """An OpenAI tool call from a parsed candidate, or None when it is not one.

    A call names an offered function and has object arguments, under
    ``"arguments"`` or ``"parameters"`` (Llama 3's word), as an object or as JSON text.
    """
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except _UNREADABLE:
            return None
    if not isinstance(args, dict):
        return None
    return tool_call(obj["name"], json.dumps(args))


def _all_calls(objects: list[Any], names: set[str]) -> list[dict[str, Any]] | None:
    """The calls when every object is one (and there is at least one), else None."""
    calls = [call_from(obj, names) for obj in objects]
    return calls if calls and all(calls) else None


def llama3_json(text: str, names: set[str]) -> Calls | None:
    """Llama 3.x calls: the whole answer is JSON calls, maybe after ``<|python_tag|>``."""
    body = text.strip()
    if not body.startswith((PYTHON_TAG, "{")):
        return None
    objects, at = [], _BETWEEN.match(body).end()
    while at < len(body):
        try:
            obj, at = _DECODER.raw_decode(body, at)
        except _UNREADABLE:
            return None
        objects.append(obj)
        at = _BETWEEN.match(body, at).end()
    calls = _all_calls(objects, names)
    return ("", calls) if calls else None


def mistral(text: str, names: set[str]) -> Calls | None:
    """Mistral calls: each ``[TOOL_CALLS]`` opens a JSON list of calls (or one named call)."""
    head, *parts = text.split(MISTRAL_CALLS)
    if not parts:
        return None
    kept, calls = [head], []
    for part in parts:
        found = _mistral_part(part, names)
        if found is None:
            return None
        calls += found[0]
        kept.append(found[1])
    return "".join(kept), calls


def _mistral_part(part: str, names: set[str]) -> tuple[list[dict[str, Any]], str] | None:
    """The calls one ``[TOOL_CALLS]`` opens, and the text after them."""
    named = _MISTRAL_NAMED.match(part)
    start = named.end() if named else len(part) - len(part.lstrip())
    try:
        value, end = _DECODER.raw_decode(part, start)
    except _UNREADABLE:
        return None
    if named:
        objects = [{"name": named.group(1), "arguments": value}]
    else:
        objects = value if isinstance(value, list) else [value]
    calls = _all_calls(objects, names)
    return (calls, part[end:]) if calls else None


def pythonic(text: str, names: set[str]) -> Calls | None:
    """Pythonic calls: the whole answer is ``[f(a=1, b="x"), g()]`` (literal arguments)."""
    body = text.strip().removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip()
    if not (body.startswith("[") and body.endswith("]")):
        return None
    try:
        tree = ast.parse(body, mode="eval").body
    except _UNREADABLE:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = [_python_call(node, names) for node in tree.elts]
    return ("", calls) if all(calls) else None


def _python_call(node: ast.AST, names: set[str]) -> dict[str, Any] | None:
    """One ``name(key=literal, ...)`` as a call, or None (positional arguments have no names)."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    if node.func.id not in names or any(kw.arg is None for kw in node.keywords):
        return None
    try:
        # literal_eval reads constants and containers only: no name, call or attribute runs.
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        return tool_call(node.func.id, json.dumps(args, allow_nan=False))
    except _UNREADABLE:  # not a literal, or a value JSON cannot hold (a set, NaN)
        return None


@dataclass(frozen=True, slots=True)
class Syntax:
    """How one format's calls are found in an answer.

    ``parse`` reads a finished answer (None: the server's ``hermes`` reading alone);
    a stream holds text back from any of ``markers`` (calls open anywhere) and, when
    the answer starts with one of ``openers``, all of it (calls that only open an answer).
    """

    parse: Callable[[str, set[str]], Calls | None] | None
    markers: tuple[str, ...]
    openers: tuple[str, ...]


# Every format keeps the server's ``<tool_call>`` tag and bare JSON: its grammars write them.
SYNTAXES = {
    "hermes": Syntax(None, (TOOL_CALL_OPEN,), ("{", "[")),
    "llama3_json": Syntax(llama3_json, (TOOL_CALL_OPEN,), ("{", "[", PYTHON_TAG)),
    "mistral": Syntax(mistral, (TOOL_CALL_OPEN, MISTRAL_CALLS), ("{", "[")),
    "pythonic": Syntax(pythonic, (TOOL_CALL_OPEN,), ("{", "[", PYTHON_START)),
}


def served_format(engine: Any, setting: str) -> str:
    """The format calls are read in: ``setting`` unless "auto", else the template's."""
    if setting != "auto":
        return setting
    return getattr(engine, "tool_call_format", "hermes")
