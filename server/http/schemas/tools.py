"""Chat ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked into one plan.

OpenAI's shapes are loose JSON (``tools: [{"type": "function", "function":
{"name", "description", "parameters"}}]``, ``tool_choice`` a string or an
object); this module checks them once and gives the route a :class:`ToolPlan`:

- ``mode``: ``"none"`` (no tools offered, plain text), ``"auto"`` (tools in
  the prompt, the model decides, calls parsed from its text), ``"required"``
  or ``"named"`` (the output *is* one call, held to the functions' parameter
  schemas by constrained decoding, so its arguments always parse).
- :meth:`ToolPlan.call_schema`: the JSON Schema of one call in the forced modes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from server.http.errors import InvalidRequestError
from server.protocol import ConstraintError
from server.schema_depth import check_depth

# OpenAI's rule for function names.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# A function declared without parameters takes none (OpenAI's reading): its arguments are {}.
# An open object would let a forced call's arguments run on with made-up keys.
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {},
                                     "additionalProperties": False}


@dataclass(frozen=True, slots=True)
class Function:
    """One callable function as offered to the model."""

    name: str
    description: str
    parameters: dict[str, Any]

    def as_tool(self) -> dict[str, Any]:
        """The OpenAI tool object (what chat templates with tool support take)."""
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a chat request asks of tools (see the module docstring)."""

    functions: tuple[Function, ...]
    mode: str  # "none" | "auto" | "required" | "named"
    forced: str | None  # the function's name in "named" mode
    parallel: bool
    allowed: tuple[str, ...] | None = None  # tool_choice allowed_tools: the only ones offered
    # The syntax the model writes calls in (server.http.routes.tool_formats.SYNTAXES).
    call_format: str = "hermes"

    @property
    def offered(self) -> tuple[Function, ...]:
        """Functions shown to the model: none in "none" mode, only the forced one when named."""
        if self.mode == "none":
            return ()
        if self.mode == "named":
            return tuple(f for f in self.functions if f.name == self.forced)
        if self.allowed is not None:
            return tuple(f for f in self.functions if f.name in self.allowed)
        return self.functions

    @property
    def forced_call(self) -> bool:
        """True when the output must be a tool call (constrained decoding)."""
        return self.mode in ("required", "named")

    def call_schema(self) -> dict[str, Any]:
        """JSON Schema of one call ``{"name": ..., "arguments": {...}}`` to an offered function.

        One call, even when ``parallel`` allows more: the client asked for at
        least one, and a forced array invites a small model to repeat items
        until ``max_tokens`` cuts the JSON (which would then not parse).
        """
        options, defs = [], {}
        for i, f in enumerate(self.offered):
            arguments, own_defs = _rooted_refs(f.parameters, f"tool{i}")
            defs.update(own_defs)
            options.append({"type": "object",
                            "properties": {"name": {"const": f.name}, "arguments": arguments},
                            "required": ["name", "arguments"], "additionalProperties": False})
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return {**schema, "$defs": defs} if defs else schema


NO_TOOLS = ToolPlan((), "none", None, True)


def _rooted_refs(parameters: dict[str, Any], key: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``parameters`` to nest in a call's schema, and the definitions to put at its root.

    A schema's local ``$ref`` (``#/$defs/Address``, what pydantic writes for nested
    models, enums and recursion) points from the schema's own root; nested under
    ``arguments`` it would point at nothing. So its ``$defs`` (and ``definitions``) move to
    the call schema's root under names prefixed with ``key`` (one function's ``Address``
    is not another's), and every local ``$ref`` is rewritten to match: one to the
    parameters' own root (``#``, ``#/properties/...``) reaches a copy of them kept there.
    """
    if '"$ref"' not in json.dumps(parameters):
        return parameters, {}
    own = {**parameters.get("definitions", {}), **parameters.get("$defs", {})}
    body = {k: v for k, v in parameters.items() if k not in ("$defs", "definitions")}
    to_root = False

    def target(ref: str) -> str:
        nonlocal to_root
        for prefix in ("#/$defs/", "#/definitions/"):
            if ref.startswith(prefix):
                return f"#/$defs/{key}_{ref[len(prefix):]}"
        if ref == "#" or ref.startswith("#/"):
            to_root = True
            return f"#/$defs/{key}{ref[1:]}"
        return ref  # not local: left for the grammar compiler to judge

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: target(v) if k == "$ref" and isinstance(v, str) else rewrite(v)
                    for k, v in node.items()}
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    body = rewrite(body)
    defs = {f"{key}_{name}": rewrite(schema) for name, schema in own.items()}
    if to_root:
        defs[key] = body
    return body, defs


def _function(i: int, tool: Any) -> Function:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidRequestError(f"{where}.type must be \"function\" (the only tool type "
                                  "this server runs)", param=where)
    spec = tool.get("function")
    if not isinstance(spec, dict):
        raise InvalidRequestError(f"{where}.function must be an object with a name",
                                  param=where)
    name = spec.get("name")
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise InvalidRequestError(f"{where}.function.name must be 1-64 letters, digits, "
                                  f"'_' or '-'; got {json.dumps(name)[:80]}",
                                  param=f"{where}.function.name")
    description = spec.get("description") or ""
    parameters = spec.get("parameters")
    if parameters is None:  # left out, or null as SDKs send it for a function without any
        parameters = _EMPTY_PARAMETERS
    if not isinstance(description, str):
        raise InvalidRequestError(f"{where}.function.description must be a string",
                                  param=f"{where}.function.description")
    if not isinstance(parameters, dict):
        raise InvalidRequestError(f"{where}.function.parameters must be a JSON Schema object",
                                  param=f"{where}.function.parameters")
    _check_depth(parameters, f"{where}.function.parameters")
    if parameters.get("type", "object") != "object":
        # A call's arguments are a JSON object (OpenAI's rule too); a forced call with other
        # arguments would be generated, then not recognised as a call.
        raise InvalidRequestError(f"{where}.function.parameters must describe an object "
                                  f"(\"type\": \"object\"), not {parameters['type']!r}",
                                  param=f"{where}.function.parameters")
    return Function(name, description, parameters)


def _check_depth(parameters: dict[str, Any], param: str) -> None:
    """Refuse ``parameters`` nested too deep to walk (rendered, rewritten and compiled later)."""
    try:
        check_depth(parameters, param)
    except ConstraintError as exc:
        raise InvalidRequestError(exc.message, param=exc.param) from None


def _allowed(spec: Any, names: set[str]) -> tuple[str, tuple[str, ...]]:
    """``(mode, names)`` of ``tool_choice`` ``{"type": "allowed_tools", "allowed_tools":
    {"mode": "auto" | "required", "tools": [{"type": "function", "function": {"name"}}]}}``."""
    where = "tool_choice.allowed_tools"
    mode = spec.get("mode") if isinstance(spec, dict) else None
    tools = spec.get("tools") if isinstance(spec, dict) else None
    if mode not in ("auto", "required") or not isinstance(tools, list) or not tools:
        raise InvalidRequestError(f"{where} must be {{\"mode\": \"auto\" or \"required\", "
                                  "\"tools\": [{\"type\": \"function\", \"function\": "
                                  "{\"name\": ...}}, ...]}", param=where)
    chosen = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or name not in names:
            named = f" (it names {json.dumps(name)[:80]})" if isinstance(name, str) else ""
            raise InvalidRequestError(f"{where}.tools[{i}] must be a function of tools"
                                      f"{named}", param=f"{where}.tools[{i}]")
        chosen.append(name)
    return mode, tuple(chosen)


def _choice(choice: Any, names: set[str]) -> tuple[str, str | None]:
    """``(mode, forced name)`` from ``tool_choice`` (None: "auto" with tools, else "none")."""
    if choice is None:
        return ("auto" if names else "none"), None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequestError(f"tool_choice {choice!r} is unknown; use \"none\", "
                                      "\"auto\", \"required\" or {\"type\": \"function\", "
                                      "\"function\": {\"name\": ...}}", param="tool_choice")
        if choice != "none" and not names:
            raise InvalidRequestError(f"tool_choice {choice!r} needs tools", param="tool_choice")
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or \
            not isinstance(name, str):
        raise InvalidRequestError("tool_choice as an object must be {\"type\": \"function\", "
                                  "\"function\": {\"name\": ...}}", param="tool_choice")
    if name not in names:
        raise InvalidRequestError(f"tool_choice names function {name!r}, which is not in tools",
                                  param="tool_choice")
    return "named", name


def tool_plan(tools: list[Any] | None, tool_choice: Any,
              parallel_tool_calls: bool | None, call_format: str = "hermes") -> ToolPlan:
    """Check the request's tool fields and say what the route must do.

    ``call_format`` is the syntax the served model writes calls in; the plan carries
    it to the parsers.

    Raises:
        InvalidRequestError: A malformed tool (``parameters`` nested deeper than
            ``MAX_SCHEMA_DEPTH`` among them), a duplicate function name, or a
            ``tool_choice`` that is unknown, names no offered function, or asks
            for calls with no tools.
    """
    functions = tuple(_function(i, tool) for i, tool in enumerate(tools or ()))
    names = {f.name for f in functions}
    if len(names) != len(functions):
        raise InvalidRequestError("tools has two functions of the same name", param="tools")
    parallel = parallel_tool_calls is not False
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "allowed_tools":
        mode, allowed = _allowed(tool_choice.get("allowed_tools"), names)
        return ToolPlan(functions, mode, None, parallel, allowed, call_format)
    mode, forced = _choice(tool_choice, names)
    return ToolPlan(functions, mode, forced, parallel, call_format=call_format)
