"""What a body that failed validation says: a message a client can act on, and its ``param``.

Pydantic reports each failed branch of a union under its type's tag
(``stop.str``, ``prompt.list[list[int]]``), list items as ``messages.0``, a
validator's own text after ``Value error,`` and a wrong kind of value in its
own words ("a valid dictionary or object to extract fields from"). Here the
tags go, paths are written as OpenAI writes them (``messages[0].content``),
a union's branches become one "must be a string or a list, got a number", and
the common shapes get plain words.
"""

from __future__ import annotations

import json
import re
from typing import Any

# A union branch's tag in an error location: a type (``str``, ``list[int]``,
# ``dict[str,any]``) or a validator wrapper (``function-after[...]``).
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list|dict)$|\[|^function-")

# Pydantic's wrong-type errors, in the words of JSON.
_EXPECTED = {
    "string_type": "a string", "int_type": "an integer", "float_type": "a number",
    "bool_type": "a boolean", "list_type": "a list", "dict_type": "an object",
    "model_type": "an object", "model_attributes_type": "an object",
    "int_from_float": "an integer", "none_required": "null",
}
_OBJECT_TYPES = ("dict_type", "model_type", "model_attributes_type")


def _json_kind(value: Any) -> str:
    """What a JSON value is, as a client would name it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "a list" if isinstance(value, list) else "an object"


def field_path(loc: tuple[Any, ...]) -> str:
    """``("body", "messages", 0, "content")`` as ``messages[0].content``; union tags dropped."""
    path = ""
    for part in loc:
        if part == "body" and not path:
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        elif not _UNION_TAG.search(str(part)):
            path += f".{part}" if path else str(part)
    return path


def _message(errors: list[dict[str, Any]]) -> str:
    """One field's errors (a union's branches give several) as one sentence."""
    first = errors[0]
    kinds = [_EXPECTED.get(e.get("type", "")) for e in errors]
    if all(kinds):
        wanted = " or ".join(dict.fromkeys(k for k in kinds if k))
        return f"must be {wanted}, got {_json_kind(first.get('input'))}"
    kind = first.get("type", "")
    if kind in _OBJECT_TYPES:
        return f"must be an object, got {_json_kind(first.get('input'))}"
    if kind == "literal_error":
        expected = (first.get("ctx") or {}).get("expected", "one of the allowed values")
        return f"must be {expected}, got {json.dumps(first.get('input'))[:80]}"
    if kind == "missing":
        return "required (null counts as not given)"
    if kind == "string_unicode":
        return ("is not valid Unicode (a lone surrogate such as \\ud800); send whole "
                "surrogate pairs")
    message = str(first.get("msg", "invalid"))
    return message.removeprefix("Value error, ")


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """The message and ``param`` of a body's validation errors (at most five fields)."""
    by_field: dict[str, list[dict[str, Any]]] = {}
    for error in errors:
        by_field.setdefault(field_path(tuple(error.get("loc", ()))), []).append(error)
    # A list sent where a union also takes a scalar: the scalar branch's "must be a
    # string" is beside the point when the list branch says which item is wrong.
    for path in [p for p in by_field if p and any(q.startswith(p + "[") for q in by_field)]:
        if all(e.get("type") in _EXPECTED and isinstance(e.get("input"), list)
               for e in by_field[path]):
            del by_field[path]
    parts = []
    for path, field_errors in list(by_field.items())[:5]:
        text = _message(field_errors)
        if not path and field_errors[0].get("type") in _OBJECT_TYPES:
            text = "request body must be a JSON object with this endpoint's fields"
        parts.append(f"{path}: {text}" if path else text)
    first = next(iter(by_field), "")
    return "; ".join(parts), first or None
