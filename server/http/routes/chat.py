"""``POST /v1/chat/completions``: chat with the tokenizer's template, JSON or SSE; n choices."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from server.http.errors import CLIENT_CLOSED, InvalidRequestError
from server.http.routes.call import ClientGone, GenerationCall, get_engine
from server.http.routes.conversation import messages_fit
from server.http.routes.fanout import Fanout, UsageTotal, choice_group, shared_prefill
from server.http.routes.logprobs import chat_entry
from server.http.routes.params import (
    cache_namespace,
    check_choices,
    check_model,
    check_stream_options,
    for_choice,
    new_id,
    resolve_params,
)
from server.http.routes.reasoning import Thinking, thinking_of
from server.http.routes.sse import SSE_HEADERS, TEXT_MARK, FrameTemplate, sse_stream
from server.http.routes.structured import output_constraint
from server.http.routes.tool_calls import ToolStream, parse_calls, whole_calls
from server.http.routes.tool_formats import served_format
from server.http.schemas import ChatCompletionRequest, ChatMessage
from server.http.schemas.refusals import refuse_unsupported
from server.http.schemas.template_kwargs import TemplateKwargs
from server.http.schemas.tools import ToolPlan, tool_plan
from server.http.unknown_fields import unknown_fields_of
from server.protocol import (
    TOOL_CALL_CLOSE,
    ChatPrompt,
    ChoiceGroup,
    Finished,
    SamplingParams,
    TokenEvent,
)

router = APIRouter()


# Conversations longer than this are built on a worker thread: past it, checking every
# message would pause the event loop (and every stream it serves) for tens of milliseconds.
BUILD_OFF_LOOP = 256


async def built_prompt(messages: list[ChatMessage], tools: ToolPlan,
                       template_kwargs: TemplateKwargs = ()) -> ChatPrompt:
    """:func:`chat_prompt`, on a worker thread for a long conversation."""
    if len(messages) <= BUILD_OFF_LOOP:
        return chat_prompt(messages, tools, template_kwargs)
    return await asyncio.to_thread(chat_prompt, messages, tools, template_kwargs)


def chat_prompt(messages: list[ChatMessage], tools: ToolPlan,
                template_kwargs: TemplateKwargs = ()) -> ChatPrompt:
    """The conversation as the engine renders it, with the tools ``tools`` offers and the
    template's extra variables.

    Raises:
        InvalidRequestError: A message's content cannot be rendered (non-text parts).
    """
    rendered = []
    for i, message in enumerate(messages):
        try:
            rendered.append(message.rendered())
        except ValueError as exc:
            raise InvalidRequestError(f"messages[{i}].content: {exc}",
                                      param=f"messages[{i}].content") from None
        require_unicode(rendered[-1], f"messages[{i}]")
    offered = tuple(f.as_tool() for f in tools.offered)
    for i, tool in enumerate(offered):
        require_unicode(tool, f"tools[{i}]")
    require_unicode(dict(template_kwargs), "chat_template_kwargs")
    return ChatPrompt(tuple(rendered), offered, template_kwargs=template_kwargs)


def require_unicode(value: Any, where: str, code: str = "invalid_prompt") -> None:
    """Refuse a lone UTF-16 surrogate (``"\\ud800"`` is valid JSON) anywhere in ``value``
    (strings, nested in objects and arrays): before the tokenizer does, in its own words
    ("TextEncodeInput must be Union[...]"), or before a response echoing it fails to encode.

    Raises:
        InvalidRequestError: ``value`` holds one; ``where`` names the field, ``code`` is
            the error's code (``invalid_prompt`` for what the model reads).
    """
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{where} is not valid Unicode: a lone surrogate (U+{ord(text[exc.start]):04X}); "
            "send whole surrogate pairs", param=where, code=code) from None


async def with_grammar(params: SamplingParams, body: ChatCompletionRequest, engine: Any,
                        tools: ToolPlan) -> SamplingParams:
    """Add the output's grammar, and with ``parallel_tool_calls: false`` stop after one call."""
    constraint = await output_constraint(engine, body.response_format, tools)
    stop = params.stop
    if tools.mode == "auto" and not tools.parallel:
        stop += (TOOL_CALL_CLOSE,)
    return dataclasses.replace(params, constraint=constraint, stop=stop)


def _finish(tools: ToolPlan, finish: str, whole: bool = True) -> str:
    """The finish reason of an answer with calls: ``tool_calls``, but ``stop`` for a call the
    request named in ``tool_choice``, as OpenAI's API answers (streamed or not); ``length``
    when ``max_tokens`` cut the answer (a later call may have been lost), and ``stop`` when
    a stop string cut a forced call (``whole`` false): its arguments are unfinished."""
    if finish == "length" or not whole:
        return finish
    return "stop" if tools.mode == "named" else "tool_calls"


def _message(text: str, finish: str, tools: ToolPlan,
             thinking: Thinking | None = None) -> tuple[dict[str, Any], str]:
    """The assistant message of one choice and its finish reason (see :func:`_finish`);
    with ``thinking``, the reasoning apart in ``reasoning_content`` (calls are read from the
    answer alone)."""
    reasoning, text = thinking.split(text) if thinking is not None else ("", text)
    content, calls = parse_calls(text, tools) if tools.mode != "none" else (text, [])
    message = {"role": "assistant", "content": content}
    if thinking is not None:
        message["reasoning_content"] = reasoning or None
    if not calls:
        return message, finish
    whole = not tools.forced_call or bool(whole_calls(text, tools))
    return {**message, "tool_calls": calls}, _finish(tools, finish, whole)


@router.post("/v1/chat/completions", dependencies=[
    Depends(messages_fit),
    Depends(unknown_fields_of(ChatCompletionRequest, "/v1/chat/completions"))])
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    """Answer a conversation n times (``stream: true`` for Server-Sent Events)."""
    engine = get_engine(request)
    check_model(body.model, engine)
    refuse_unsupported(body)
    body.check_logprobs()
    check_stream_options(body)
    settings = request.app.state.settings
    check_choices(body.n, 1, settings)
    tools = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls,
                      served_format(engine, settings.server.tool_call_parser))
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    params = resolve_params(body, settings, getattr(body, field), logprobs=body.logprobs,
                            top_logprobs=body.top_logprobs or 0, max_tokens_field=field)
    prompt = await built_prompt(body.messages, tools, body.template_kwargs())
    rid = new_id("chatcmpl", request)
    params = await with_grammar(params, body, engine, tools)
    thinking = thinking_of(engine, settings, prompt, constrained=params.constraint is not None)
    salt, group = cache_namespace(request, body.cache_salt), ChoiceGroup()
    fanout = Fanout(choice_group(group, [
        GenerationCall(request, engine, prompt, for_choice(params, i),
                       rid if body.n == 1 else f"{rid}-{i}", cache_salt=salt, choices=group)
        for i in range(body.n)]), shared_prefill(body.n, settings))
    try:
        await fanout.start()
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    base = {"id": rid, "created": int(time.time()), "model": engine.model_name}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(fanout, base, body.logprobs, include_usage, tools,
                                         thinking),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        outs = await fanout.collect()
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    usage, choices = UsageTotal(), []
    for i, out in enumerate(outs):
        usage.add(0, out.finished.usage)
        logprobs = {"content": [chat_entry(r) for r in out.logprobs]} if body.logprobs else None
        message, finish = _message("".join(out.text_parts), out.finished.reason.value, tools,
                                   thinking)
        choices.append({"index": i, "logprobs": logprobs, "message": message,
                        "finish_reason": finish})
    return JSONResponse({**base, "object": "chat.completion", "choices": choices,
                         "usage": usage.as_dict()})


def _stream(fanout: Fanout, base: dict[str, Any], want_logprobs: bool, include_usage: bool,
            tools: ToolPlan, thinking: Thinking | None = None):
    """SSE chunks; with tools, text that may be a call is held and sent as ``tool_calls``;
    with ``thinking``, the reasoning goes as ``reasoning_content`` deltas."""
    chunks = _ChatChunks(len(fanout.calls), base, want_logprobs, tools, thinking)

    def last() -> list[dict[str, Any]]:
        return [{**chunks.base, "choices": [], "usage": chunks.usage.as_dict()}] \
            if include_usage else []

    # A forced call's answer has no text: its content is null from the first chunk, as in
    # OpenAI's streams (an empty string would make the SDK's stream helper report "").
    opening = {"role": "assistant", "content": None if tools.forced_call else ""}
    first = [chunks.delta(i, opening, None) for i in range(len(fanout.calls))]
    return sse_stream(fanout, chunks.on_token, chunks.on_finish, first, last)


class _ChatChunks:
    """The chunks of a streamed chat answer, choice by choice (see :func:`_stream`)."""

    def __init__(self, n: int, base: dict[str, Any], want_logprobs: bool, tools: ToolPlan,
                 thinking: Thinking | None) -> None:
        self.base = {**base, "object": "chat.completion.chunk"}
        self.want_logprobs, self.tools = want_logprobs, tools
        self.usage = UsageTotal()
        self.held = [ToolStream(tools) if tools.mode != "none" else None for _ in range(n)]
        self.splits = [thinking.splitter() if thinking is not None else None for _ in range(n)]
        self.templates = [FrameTemplate(self.delta(i, {"content": TEXT_MARK}, None))
                          for i in range(n)]
        self.thought_templates = [
            FrameTemplate(self.delta(i, {"reasoning_content": TEXT_MARK}, None))
            for i in range(n)] if thinking is not None else []
        # Log-probability entries of text held back (a possible tool call): they go out
        # with it.
        self.pending: list[list[dict[str, Any]]] = [[] for _ in range(n)]

    def delta(self, i: int, content: dict[str, Any], finish: str | None,
              logprobs: Any = None) -> dict[str, Any]:
        return {**self.base, "choices": [{"index": i, "delta": content, "logprobs": logprobs,
                                          "finish_reason": finish}]}

    def _take_pending(self, i: int) -> list[dict[str, Any]]:
        entries, self.pending[i] = self.pending[i], []
        return entries

    def on_token(self, i: int, event: TokenEvent) -> dict[str, Any] | bytes | None:
        held, split = self.held[i], self.splits[i]
        if self.want_logprobs:
            self.pending[i] += [chat_entry(r) for r in event.logprobs]
        thought, text = ("", event.text) if split is None else split.feed(event.text)
        text = text if held is None else held.feed(text)
        # (a forced call is never split: its grammar leaves the model no room to think)
        if held is not None and (piece := held.call_delta()) is not None:
            return self.delta(i, {"tool_calls": [piece]}, None)  # a forced call, as written
        if thought:
            return self._thought_chunk(i, thought, text)
        if not text and (held is not None or not self.pending[i]):
            return None  # nothing to send yet (held back: it may be part of a tool call)
        if self.pending[i]:
            return self.delta(i, {"content": text}, None, {"content": self._take_pending(i)})
        return self.templates[i].frame(text)

    def _thought_chunk(self, i: int, thought: str, text: str) -> dict[str, Any] | bytes:
        """A reasoning delta; with the answer's first text when the block closed in it."""
        if not text and not self.pending[i]:
            return self.thought_templates[i].frame(thought)
        entries = self._take_pending(i)
        piece = {"reasoning_content": thought, **({"content": text} if text else {})}
        return self.delta(i, piece, None, {"content": entries} if entries else None)

    def on_finish(self, i: int, event: Finished) -> list[dict[str, Any]]:
        self.usage.add(0, event.usage)
        split = self.splits[i]
        thought, tail = ("", event.text) if split is None else split.finish(event.text)
        return ([self.delta(i, {"reasoning_content": thought}, None)] if thought else []) + \
            self._closing(i, tail, event.reason.value)

    def _closing(self, i: int, tail: str, reason: str) -> list[dict[str, Any]]:
        """The answer's last chunks: text held back, whole calls, the finish reason."""
        stream, delta = self.held[i], self.delta
        if stream is None:
            return [delta(i, {"content": tail} if tail else {}, reason)]
        now = stream.feed(tail)
        if stream.call is not None:  # a forced call already streaming: its last piece
            piece, whole = stream.finish_call()
            entries = self._take_pending(i)
            chunks = [delta(i, {"tool_calls": [piece]}, None)] if piece else []
            if entries:
                chunks.insert(0, delta(i, {}, None, {"content": entries}))
            return chunks + [delta(i, {}, _finish(self.tools, reason, whole))]
        rest, calls = stream.finish()
        rest = now + rest
        entries = self._take_pending(i)
        logprobs = {"content": entries} if entries else None
        chunks = [delta(i, {"content": rest}, None, logprobs)] if rest or entries else []
        chunks += [delta(i, {"tool_calls": [{"index": k, **call}]}, None)
                   for k, call in enumerate(calls)]
        finish = _finish(self.tools, reason) if calls else reason
        return chunks + [delta(i, {}, finish)]
