"""``POST /v1/responses`` request model, and its translation into a chat request.

OpenAI's Responses API carries the same generation as chat in other shapes:
``input`` (a string, or items: messages with text parts, earlier
``function_call`` items and their ``function_call_output``), ``instructions``
(a system message first), ``max_output_tokens``, tools as ``{"type":
"function", "name", "parameters"}`` and ``text.format`` for structured output.
:func:`chat_request` rewrites a request into the
:class:`~server.http.schemas.chat.ChatCompletionRequest` the chat route runs,
so both endpoints share one prompt, sampling, grammar and tool-call path.

This server keeps no state between requests: a response is not stored
(``store`` is accepted as the hint it is), so what needs a stored one
(``previous_response_id``, ``conversation``, ``background``, item references)
is refused with 400 naming the field, as are inputs a text model cannot read
(images, files) and tools it cannot run (web search, file search, ...).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, ValidationError

from server.http.errors import APIError, InvalidRequestError
from server.http.schemas.chat import ChatCompletionRequest, ChatMessage
from server.http.schemas.common import STRICT_BODY, OpenAIModel

_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
# Text parts of a message: the input's own, and an earlier answer's when a client replays it.
_TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS = "message.output_text.logprobs"  # the ``include`` entry asking for them
# ``include`` entries for output kinds this server never produces: asking is harmless.
_NOTHING_TO_INCLUDE = {"reasoning.encrypted_content", "file_search_call.results",
                       "web_search_call.results", "web_search_call.action.sources",
                       "code_interpreter_call.outputs", "computer_call_output.output.image_url",
                       "message.input_image.image_url"}


class ResponsesRequest(OpenAIModel):
    """The Responses API fields this server honours, or refuses when set.

    Field ranges are chat's; ``text`` holds ``format`` (``text``,
    ``json_object`` or ``json_schema`` with ``name`` and ``schema``).
    """

    model_config = STRICT_BODY

    model: str | None = Field(default=None, description="Model id; see GET /v1/models.")
    input: str | list[dict[str, Any]] = Field(..., description="Text, or input items.")
    instructions: str | None = Field(default=None, description="A system message put first.")
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    # No effect on a self-hosted, stateless server by definition (storage, metadata, cache
    # and billing hints, as on chat).
    store: bool | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1)
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    # "auto": input items that leave no room in the context are dropped from the start.
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # Refused unless left out: they need stored responses or model features this lacks.
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    prompt: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    moderation: dict[str, Any] | None = None
    context_management: list[Any] | None = None
    image: dict[str, Any] | None = None
    access_programs: dict[str, Any] | None = None
    background_options: dict[str, Any] | None = None

    @property
    def logprobs(self) -> bool:
        """Whether the output text carries log-probabilities (asked by ``include`` or
        ``top_logprobs``)."""
        return LOGPROBS in (self.include or ()) or bool(self.top_logprobs)


def _unsupported(param: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param} is not supported: {why}; leave it out (or null)",
                               param=param, code="unsupported_parameter")


_STATELESS = "this server does not store responses; send the whole conversation as input"
_OPEN_ONLY = "responses are answered while the request is open"
# Fields refused when set (not null; ``background`` also passes as false), and why.
_REFUSED = (
    ("previous_response_id", _STATELESS),
    ("conversation", _STATELESS),
    ("background", _OPEN_ONLY),
    ("background_options", _OPEN_ONLY),
    ("prompt", "there are no stored prompt templates here"),
    ("reasoning", "the served model has no reasoning mode"),
    ("max_tool_calls", "use parallel_tool_calls: false for one call"),
    ("moderation", "this server runs no moderation model"),
    ("context_management", "this server keeps no context between requests; send what the "
                           "model should see"),
    ("image", "this server generates text only"),
    ("access_programs", "there are no access programs here"),
)


def refuse_unsupported(body: ResponsesRequest) -> None:
    """400 naming the first field set that this server cannot honour."""
    for field, why in _REFUSED:
        value = getattr(body, field)
        if value is not None and value is not False:
            raise _unsupported(field, why)
    for i, entry in enumerate(body.include or ()):
        if entry != LOGPROBS and entry not in _NOTHING_TO_INCLUDE:
            raise _unsupported(f"include[{i}]", f"{entry!r} is nothing this server outputs")
    if (body.text or {}).get("verbosity") is not None:
        raise _unsupported("text.verbosity", "the served model has no verbosity control")
    if body.stream_options is not None and not body.stream:
        raise InvalidRequestError("stream_options is only allowed with stream: true",
                                  param="stream_options")


def _text(content: Any, param: str) -> str:
    """A message's text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{param} must be a string or a list of text parts",
                                  param=param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])  # an earlier answer's refusal, replayed: its words
            continue
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise InvalidRequestError(
                f"{param}[{j}] must be a text part ({', '.join(_TEXT_PARTS)} with \"text\"); "
                "the served model reads text only", param=f"{param}[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def _field(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{param}.{key} must be a string", param=f"{param}.{key}")
    return value


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages (earlier calls as assistant ``tool_calls``)."""
    out: list[dict[str, Any]] = []
    if body.instructions is not None:
        out.append({"role": "system", "content": body.instructions})
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) \
        else body.input
    if not items:
        raise InvalidRequestError("input is empty", param="input")
    for i, item in enumerate(items):
        param = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _MESSAGE_ROLES:
                raise InvalidRequestError(f"{param}.role must be one of "
                                          f"{', '.join(_MESSAGE_ROLES)}", param=f"{param}.role")
            out.append({"role": role, "content": _text(item.get("content"),
                                                       f"{param}.content")})
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", param), "type": "function",
                    "function": {"name": _field(item, "name", param),
                                 "arguments": _field(item, "arguments", param)}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # one turn, several calls
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _field(item, "call_id", param),
                        "content": _text(item.get("output"), f"{param}.output")})
        else:
            raise InvalidRequestError(
                f"{param}.type {kind!r} is not supported; input items are messages, "
                "function_call and function_call_output (this server stores no items to "
                "reference)", param=f"{param}.type")
    return out


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools in chat's shape; any other tool type is refused."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise _unsupported(f"tools[{i}]", f"tool type {kind!r} does not run here; only "
                                              "function tools do")
        function = {k: tool[k] for k in ("name", "description", "parameters")
                    if tool.get(k) is not None}  # null: not given (SDKs send it)
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        # Responses: {"type": "allowed_tools", "mode", "tools": [{"type", "name"}]}.
        tools = choice.get("tools")
        tools = [{"type": t.get("type"), "function": {"name": t.get("name")}}
                 if isinstance(t, dict) else t for t in tools] if isinstance(tools, list) \
            else tools
        return {"type": "allowed_tools",
                "allowed_tools": {"mode": choice.get("mode"), "tools": tools}}
    return choice  # strings, and other shapes for the tool plan to refuse by name


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise InvalidRequestError("text.format must be an object such as {\"type\": \"text\"}",
                                  param="text.format")
    if fmt is None or fmt.get("type") != "json_schema":
        return fmt
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that generates this response.

    Raises:
        InvalidRequestError: An input item or tool this server cannot take, named
            by its place in the request.
    """
    messages = []
    for i, message in enumerate(_messages(body)):
        try:
            messages.append(ChatMessage.model_validate(message))
        except ValidationError as exc:
            first = exc.errors()[0]
            raise InvalidRequestError(f"input message {i}: {first['msg']}",
                                      param="input") from None
    return ChatCompletionRequest.model_construct(
        model=body.model, messages=messages, max_completion_tokens=body.max_output_tokens,
        max_tokens=None, temperature=body.temperature, top_p=body.top_p, top_k=None,
        min_p=None, seed=None, stop=None, n=1, presence_penalty=None, frequency_penalty=None,
        repetition_penalty=None, logit_bias=None, stream=body.stream, stream_options=None,
        user=body.user, response_format=_response_format(body.text), logprobs=body.logprobs,
        top_logprobs=body.top_logprobs, tools=_tools(body.tools),
        tool_choice=_tool_choice(body.tool_choice), parallel_tool_calls=body.parallel_tool_calls)


# Chat's names for the fields a shared check may name in an error, and the Responses names.
RESPONSES_PARAMS = {"max_tokens": "max_output_tokens", "response_format": "text.format",
                    "messages": "input"}


def in_responses_terms(exc: APIError) -> APIError:
    """``exc`` (from a check shared with chat) naming the Responses fields, not chat's.

    ``tools[0].function.name`` becomes ``tools[0].name``; ``max_tokens``,
    ``response_format`` and ``messages`` their Responses names (the first two in the
    message too).
    """
    param = exc.param
    if param is not None:
        head, dot, rest = param.partition(".")
        if head.startswith("tools[") and rest.startswith("function"):
            rest = rest.removeprefix("function").lstrip(".")
            exc.param = head + ("." + rest if rest else "")
        elif head.startswith("messages"):
            # The chat messages are instructions and input items, not one to one.
            exc.param = "input"
        else:
            exc.param = RESPONSES_PARAMS.get(head, head) + dot + rest
    message = re.sub(r"(tools\[\d+\])\.function\.", r"\1.", exc.message)
    message = message.replace('{"type": "function", "function": {"name": ...}}',
                              '{"type": "function", "name": ...}')
    message = re.sub(r"\bresponse_format\.json_schema\.(\w+)", r"text.format.\1", message)
    message = re.sub(r"\bresponse_format\b", "text.format", message)
    message = re.sub(r"\bshorten the messages\b", "shorten the input", message)
    # Chat's message index counts the instructions too: not an input item's index.
    message = re.sub(r"\bmessages\[\d+\]", "the input or instructions", message)
    exc.message = message
    return exc
