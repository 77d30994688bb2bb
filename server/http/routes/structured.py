"""The grammar a request's output must follow: ``response_format`` or a forced tool call.

The engine compiles it (``Engine.compile_constraint``) on a worker thread: the
first schema per model builds llguidance's token index (~0.4 s); later ones
take about a millisecond and are cached. Never on the event loop. A format or
schema the grammar library cannot enforce is a 400 naming the field, with the
library's reason.
"""

from __future__ import annotations

import asyncio
from typing import Any

from server.http.errors import InvalidRequestError
from server.http.schemas.tools import ToolPlan
from server.protocol import ConstraintError


async def output_constraint(engine: Any, response_format: dict[str, Any] | None,
                            tools: ToolPlan | None = None) -> Any:
    """The compiled constraint for a request, or None when its output is free text.

    A forced tool call (``tool_choice`` "required" or a named function) takes
    precedence: the answer is then the call, whatever ``response_format`` says.
    With tools the model may call, a JSON format holds the answer and leaves
    ``<tool_call>`` tagged calls open.

    Raises:
        InvalidRequestError: Unknown ``response_format`` type, a malformed
            ``json_schema``, or a schema (or tool ``parameters``) that cannot be
            compiled.
    """
    try:
        if tools is not None and tools.forced_call:
            return await asyncio.to_thread(engine.compile_constraint,
                                           schema=tools.call_schema(), name="tool_call",
                                           param="tools")
        if response_format is None or response_format.get("type") == "text":
            return None
        # Tools the model may call (auto): the format shapes the answer and leaves the
        # calls open, as OpenAI's does (openai-agents' tools with an output_type).
        calls = tools.call_schema() if tools is not None and tools.offered else None
        return await asyncio.to_thread(engine.compile_constraint, response_format,
                                       calls=calls)
    except ConstraintError as exc:
        raise InvalidRequestError(exc.message, param=exc.param, code="invalid_value") from None
