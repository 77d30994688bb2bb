"""How deep a client's JSON Schema may nest: checked before anything walks it recursively.

The schema rewrites and checks of structured outputs (server.text.schemas) and
of tool definitions recurse about three Python frames per level of objects and arrays;
Python's limit (1,000 frames) is reached near 330 levels, which a 12 KB body reaches.
The walk here is iterative, so any depth the JSON parser accepted is measured safely.
Dependency-free: the HTTP side checks tools' ``parameters`` with it too.
"""

from __future__ import annotations

from typing import Any

from server.protocol import ConstraintError

# Objects and arrays nested in a client's schema, at most. Generated schemas nest a few
# levels per model (pydantic puts nested models in $defs, reached by $ref): 64 lets a
# schema written out 30 objects deep through, and stays far from the recursion limit.
MAX_SCHEMA_DEPTH = 64


def nesting_depth(value: Any, stop_after: int) -> int:
    """How deep objects and arrays nest in ``value`` (a scalar: 0), walked without recursion.

    Stops past ``stop_after``: the walk goes no deeper than the limit it serves.
    """
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        deepest = max(deepest, depth)
        if deepest > stop_after:
            break
        stack.extend((child, depth + 1)
                     for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def check_depth(schema: Any, param: str, limit: int = MAX_SCHEMA_DEPTH) -> None:
    """Refuse a schema nested deeper than ``limit``.

    Raises:
        ConstraintError: It nests too deep; the message and ``param`` name the request field.
    """
    if nesting_depth(schema, limit) > limit:
        raise ConstraintError(
            f"{param}: the schema nests objects and arrays more than {limit} levels deep, "
            "the most this server compiles; flatten it (reuse parts with $defs and $ref)",
            param)
