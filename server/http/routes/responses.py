"""``POST /v1/responses``: OpenAI's Responses API, JSON or its typed stream of events.

The request becomes a chat request (:func:`server.http.schemas.responses.chat_request`)
and runs as one: same prompt rendering, sampling, grammar and tool-call parsing.
Only the answer's shape differs. It is a ``response`` object whose ``output`` is
a list of items: the assistant ``message`` (one ``output_text`` part), then one
``function_call`` item per call. A stream is Server-Sent Events with an ``event:``
line each, numbered by ``sequence_number``::

    response.created, response.in_progress
    response.output_item.added (message), response.content_part.added,
    response.output_text.delta ..., response.output_text.done,
    response.content_part.done, response.output_item.done
    per call: response.output_item.added, response.function_call_arguments.delta / .done,
              response.output_item.done
    (a forced call streams its item and argument deltas as they are written; calls
    the model chose to make are parsed from its text, so they come whole at the end)
    response.completed  (response.incomplete when max_output_tokens ran out)

A failure after the first event is sent as ``response.failed``. Nothing is stored:
every response is answered while its request is open, and ``store`` is taken as
a hint (see the schema module).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from server.http.errors import CLIENT_CLOSED, APIError
from server.http.routes.call import ClientGone, GenerationCall, get_engine
from server.http.routes.chat import (
    BUILD_OFF_LOOP,
    built_prompt,
    require_unicode,
    with_grammar,
)
from server.http.routes.conversation import input_fits
from server.http.routes.fanout import Fanout
from server.http.routes.logprobs import chat_entry
from server.http.routes.params import cache_namespace, check_model, new_id, resolve_params
from server.http.routes.sse import SSE_HEADERS, sse
from server.http.routes.tool_calls import ToolStream, parse_calls
from server.http.routes.tool_formats import served_format
from server.http.routes.truncation import fewest_to_drop, trimmed_to_fit, without_oldest
from server.http.schemas.chat import ChatCompletionRequest, ChatMessage
from server.http.schemas.responses import (
    ResponsesRequest,
    chat_request,
    in_responses_terms,
    refuse_unsupported,
)
from server.http.schemas.tools import ToolPlan, tool_plan
from server.http.unknown_fields import unknown_fields_of
from server.protocol import (
    Finished,
    FinishReason,
    SamplingParams,
    TokenEvent,
    Usage,
)

router = APIRouter()


@router.post("/v1/responses", dependencies=[
    Depends(input_fits), Depends(unknown_fields_of(ResponsesRequest, "/v1/responses"))])
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    """Answer ``input`` once (``stream: true`` for the typed events)."""
    engine = get_engine(request)
    check_model(body.model, engine)
    refuse_unsupported(body)
    _refuse_unencodable_echoes(body)
    chat = await _as_chat(body)
    rid = new_id("resp", request, sep="_")  # OpenAI writes these ids with an underscore
    try:
        tools = tool_plan(chat.tools, chat.tool_choice, chat.parallel_tool_calls,
                          served_format(engine, request.app.state.settings.server.tool_call_parser))
        params = resolve_params(chat, request.app.state.settings, chat.max_completion_tokens,
                                logprobs=chat.logprobs, top_logprobs=chat.top_logprobs or 0,
                                max_tokens_field="max_output_tokens")
        truncate = body.truncation == "auto"  # (else input_fits refused what cannot fit)
        messages = await asyncio.to_thread(trimmed_to_fit, engine, chat.messages) \
            if truncate else chat.messages
        params = await with_grammar(params, chat, engine, tools)
        fanout = await _admitted(request, engine, messages, tools, params, rid,
                                 truncate=truncate,
                                 salt=cache_namespace(request, body.cache_salt))
    except APIError as exc:  # a check shared with chat names chat's fields
        raise in_responses_terms(exc) from None
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    shape = ResponseShape(rid, engine.model_name, body, tools, params.temperature, params.top_p)
    if body.stream:
        return StreamingResponse(_events(fanout, shape, tools, chat.logprobs),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        (out,) = await fanout.collect()
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    text = "".join(out.text_parts)
    content, calls = parse_calls(text, tools) if tools.mode != "none" else (text, [])
    entries = [chat_entry(r) for r in out.logprobs] if chat.logprobs and not calls else []
    return JSONResponse(shape.response(shape.items(content, calls, entries), out.finished))


# Fields the response object echoes as sent that the model never reads: a lone surrogate in
# one is found by no prompt check, and the answer would fail to encode after generating.
_ECHOED = ("metadata", "user", "prompt_cache_key", "safety_identifier", "tool_choice", "text")


def _refuse_unencodable_echoes(body: ResponsesRequest) -> None:
    """400 naming the first echoed field that holds a lone UTF-16 surrogate (valid JSON,
    not encodable as UTF-8), before anything is generated.

    ``tools`` are echoed too and also rendered into the prompt: refused as chat refuses them.
    """
    for field in _ECHOED:
        require_unicode(getattr(body, field), field, code="invalid_value")
    for i, tool in enumerate(body.tools or ()):
        require_unicode(tool, f"tools[{i}]")


async def _as_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """:func:`chat_request`, on a worker thread for a long input: validating every item
    would pause the event loop (and every stream it serves) for tenths of a second."""
    if isinstance(body.input, list) and len(body.input) > BUILD_OFF_LOOP:
        return await asyncio.to_thread(chat_request, body)
    return chat_request(body)


async def _admitted(request: Request, engine: Any, messages: list[ChatMessage],
                    tools: ToolPlan, params: SamplingParams, rid: str, *,
                    truncate: bool, salt: str | None) -> Fanout:
    """The request's generation, started; with ``truncate`` (``truncation: "auto"``), the
    oldest input items go while the rest leaves the context no room
    (:mod:`server.http.routes.truncation`: the first refusal finds how many must go by a
    search over rendered token counts, later ones drop one more at a time).

    System and developer messages (``instructions`` among them) and the last item stay;
    a tool result whose call went is dropped with it (templates expect the pair).
    """
    searched = False
    while True:
        prompt = await built_prompt(messages, tools)
        fanout = Fanout([GenerationCall(request, engine, prompt, params, rid, cache_salt=salt)])
        try:
            await fanout.start()
            return fanout
        except APIError as exc:
            if not truncate or exc.code != "context_length_exceeded":
                raise
            limit = request.app.state.settings.limits.max_prompt_tokens
            shorter = without_oldest(messages) if searched else \
                await fewest_to_drop(engine, messages, prompt, params, limit)
            if shorter is None:
                raise
            messages, searched = shorter, True


class ResponseShape:
    """The ``response`` object of one request, and its output items."""

    def __init__(self, rid: str, model: str, body: ResponsesRequest, tools: ToolPlan,
                 temperature: float, top_p: float) -> None:
        self.message_id = f"msg_{secrets.token_hex(12)}"
        self.base = {
            "id": rid, "object": "response", "created_at": int(time.time()), "model": model,
            "status": "in_progress", "output": [], "error": None, "incomplete_details": None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": temperature, "top_p": top_p, "top_logprobs": body.top_logprobs or 0,
            "parallel_tool_calls": tools.parallel,
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": body.tools or [], "text": {"format": (body.text or {}).get("format")
                                                or {"type": "text"}},
            "store": False, "metadata": body.metadata or {},
            "truncation": body.truncation or "disabled", "user": body.user,
            "prompt_cache_key": body.prompt_cache_key,
            "safety_identifier": body.safety_identifier,
            "service_tier": "default", "completed_at": None,
            "previous_response_id": None, "usage": None}

    def message(self, text: str, status: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
        """The assistant message item holding ``text``."""
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
        return {"type": "message", "id": self.message_id, "status": status,
                "role": "assistant", "content": [part] if status != "in_progress" else []}

    @staticmethod
    def call_item(call: dict[str, Any]) -> dict[str, Any]:
        """A ``function_call`` item for a call parsed from the text (chat's shape); a forced
        call that ``max_output_tokens`` cut short (its arguments do not parse) is incomplete."""
        function = call["function"]
        try:
            json.loads(function["arguments"])
            status = "completed"
        except ValueError:
            status = "incomplete"
        return {"type": "function_call", "id": ResponseShape.call_id(call),
                "call_id": call["id"], "name": function["name"],
                "arguments": function["arguments"], "status": status}

    @staticmethod
    def call_id(call: dict[str, Any]) -> str:
        """The ``function_call`` item's id, made from the call's own."""
        return f"fc_{call['id'].removeprefix('call_')}"

    def items(self, content: str | None, calls: list[dict[str, Any]],
              logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Output items: the message (unless the answer is only calls), then the calls."""
        items = [self.message(content or "", "completed", logprobs)] if content or not calls \
            else []
        return items + [self.call_item(call) for call in calls]

    def response(self, output: list[dict[str, Any]], finished: Finished) -> dict[str, Any]:
        """The finished response: ``incomplete`` when it ran out of ``max_output_tokens``
        (calls parsed before the cut included: a later one may have been lost)."""
        cut = finished.reason is FinishReason.LENGTH
        for item in output:
            if cut and item["type"] == "message":
                item["status"] = "incomplete"
        return {**self.base, "status": "incomplete" if cut else "completed", "output": output,
                "completed_at": None if cut else int(time.time()),
                "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
                "usage": _usage(finished.usage)}

    def failed(self, exc: APIError) -> dict[str, Any]:
        """The response of a generation that failed after the stream began."""
        code = "rate_limit_exceeded" if exc.status == 429 else "server_error"
        return {**self.base, "status": "failed", "error": {"code": code,
                                                           "message": exc.message}}


def _usage(usage: Usage) -> dict[str, Any]:
    # cache_write_tokens: the openai client's type requires an integer; prompts published to
    # the prefix cache are not counted per request here, so it stays 0.
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "kv_blocks": usage.kv_blocks}


class _Events:
    """Numbered SSE events of one response (``event:`` line, JSON ``data:``)."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        frame = b"event: " + kind.encode() + b"\n" + sse(
            {"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1
        return frame


async def _events(fanout: Fanout, shape: ResponseShape, tools: ToolPlan,
                  want_logprobs: bool) -> AsyncIterator[bytes]:
    """The stream of a response; see the module docstring for the order of events."""
    stream = _ResponseEvents(shape, tools)
    event = stream.event
    yield event("response.created", response=shape.base)
    yield event("response.in_progress", response=shape.base)
    try:
        async for _, item in fanout.events():
            if isinstance(item, TokenEvent):
                if want_logprobs:
                    stream.pending += [chat_entry(r) for r in item.logprobs]
                if frames := stream.on_text(item.text):
                    yield b"".join(frames)
                continue
            yield b"".join(stream.finished(item))
    except ClientGone:
        return  # nobody is listening; the request is already cancelled
    except APIError as exc:
        yield event("response.failed", response=shape.failed(exc))


class _ResponseEvents:
    """The events of one streamed response's output, in the order the module docstring
    gives: the message item's text (or a forced call's arguments) as it comes, then
    every item's closing events."""

    def __init__(self, shape: ResponseShape, tools: ToolPlan) -> None:
        self.shape, self.event = shape, _Events()
        self.held = ToolStream(tools) if tools.mode != "none" else None
        self.sent: list[str] = []  # message text streamed so far
        self.logprobs: list[dict[str, Any]] = []  # of the text streamed so far
        self.pending: list[dict[str, Any]] = []  # of tokens whose text is held back
        self.where = {"item_id": shape.message_id, "output_index": 0, "content_index": 0}

    def opened(self) -> list[bytes]:
        """The message item's opening events, the first time text is to be sent."""
        if self.sent:
            return []
        return [self.event("response.output_item.added", output_index=0,
                           item=self.shape.message("", "in_progress", [])),
                self.event("response.content_part.added", **self.where,
                           part={"type": "output_text", "text": "", "annotations": [],
                                 "logprobs": []})]

    def call_pieces(self) -> list[bytes]:
        """A forced call's events for what the model has written of it so far."""
        held = self.held
        piece = held.call_delta() if held is not None else None
        if piece is None:
            return []
        frames = []
        if "id" in piece:  # the name is known: the call's item opens
            item = self.shape.call_item(held.streamed_call())
            frames.append(self.event("response.output_item.added", output_index=0,
                                     item={**item, "status": "in_progress"}))
        more = piece.get("function", {}).get("arguments")
        if more:
            frames.append(self.event("response.function_call_arguments.delta",
                                     item_id=self.shape.call_id(held.call), output_index=0,
                                     delta=more))
        return frames

    def delta(self, text: str) -> list[bytes]:
        frames = self.opened()
        entries, self.pending = self.pending, []
        self.logprobs.extend(entries)
        self.sent.append(text)
        return frames + [self.event("response.output_text.delta", **self.where, delta=text,
                                    logprobs=entries)]

    def on_text(self, text: str) -> list[bytes]:
        """A token's events: its text, or a forced call's new arguments (often none)."""
        text = text if self.held is None else self.held.feed(text)
        return self.delta(text) if text else self.call_pieces()

    def finished(self, finished: Finished) -> list[bytes]:
        """The last text, then every output item's closing events and the response's."""
        held = self.held
        streaming_call = held is not None and held.call is not None
        last = None
        if streaming_call:  # its item is open: its last arguments, then it closes
            held.feed(finished.text)
            last, _ = held.finish_call()
            rest, calls = "", [held.streamed_call()]
        else:
            rest, calls = (finished.text, []) if held is None \
                else _finish(held, finished.text)
        frames = self.delta(rest) if rest else []
        text = "".join(self.sent)
        done = self.shape.response(
            self.shape.items(text, calls, self.logprobs if not calls else []), finished)
        for index, out in enumerate(done["output"]):
            if out["type"] == "message":
                frames += self._message_done(out, text)
            else:
                tail = (last or {}).get("function", {}).get("arguments") if streaming_call \
                    else None
                frames += self._call_done(index, out, streaming_call, tail)
            frames.append(self.event("response.output_item.done", output_index=index,
                                     item=out))
        kind = "response.incomplete" if done["status"] == "incomplete" \
            else "response.completed"
        return frames + [self.event(kind, response=done)]

    def _message_done(self, out: dict[str, Any], text: str) -> list[bytes]:
        part = out["content"][0]
        return self.opened() + [
            self.event("response.output_text.done", **self.where, text=text,
                       logprobs=part["logprobs"]),
            self.event("response.content_part.done", **self.where, part=part)]

    def _call_done(self, index: int, out: dict[str, Any], streamed: bool,
                   tail: str | None) -> list[bytes]:
        """A call item's closing events; one not streamed yet is sent whole first."""
        at = {"item_id": out["id"], "output_index": index}
        if streamed:
            frames = [self.event("response.function_call_arguments.delta", **at,
                                 delta=tail)] if tail else []
        else:
            frames = [self.event("response.output_item.added", output_index=index,
                                 item={**out, "arguments": "", "status": "in_progress"}),
                      self.event("response.function_call_arguments.delta", **at,
                                 delta=out["arguments"])]
        return frames + [self.event("response.function_call_arguments.done", **at,
                                    arguments=out["arguments"], name=out["name"])]


def _finish(held: ToolStream, tail: str) -> tuple[str, list[dict[str, Any]]]:
    """The held text's end: content still to send and the calls."""
    now = held.feed(tail)
    rest, calls = held.finish()
    return now + rest, calls
