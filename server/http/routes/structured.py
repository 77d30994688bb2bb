"""The grammar a request's output must follow: ``response_format`` or a forced tool call.

Compiling runs on a worker thread (the first schema per model builds
llguidance's token index, ~0.4 s; later ones take about a millisecond and
are cached), never on the event loop. A format or schema the grammar
library cannot enforce is a 400 naming the field, with the library's reason.
"""

from __future__ import annotations

import asyncio
from typing import Any

from server.engine.constraints import (
    Constraint,
    ConstraintError,
    compile_json_schema,
    compile_response_format,
)
from server.http.errors import InvalidRequestError
from server.http.schemas.tools import ToolPlan


async def output_constraint(engine: Any, response_format: dict[str, Any] | None,
                            tools: ToolPlan | None = None) -> Constraint | None:
    """The compiled constraint for a request, or None when its output is free text.

    A forced tool call (``tool_choice`` "required" or a named function) takes
    precedence: the answer is then the call, whatever ``response_format`` says.

    Raises:
        InvalidRequestError: Unknown ``response_format`` type, a malformed
            ``json_schema``, or a schema (or tool ``parameters``) that cannot be
            compiled.
    """
    if tools is not None and tools.forced_call:
        schema, name, param = tools.call_schema(), "tool_call", "tools"
    elif response_format is None or response_format.get("type") == "text":
        return None
    else:
        schema = name = param = None
    tokenizer = engine.loaded.tokenizer
    try:
        if schema is None:
            return await asyncio.to_thread(compile_response_format, response_format, tokenizer)
        return await asyncio.to_thread(compile_json_schema, schema, tokenizer, name=name,
                                       param=param)
    except ConstraintError as exc:
        raise InvalidRequestError(exc.message, param=exc.param, code="invalid_value") from None
