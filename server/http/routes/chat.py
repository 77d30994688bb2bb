"""``POST /v1/chat/completions``: chat with the tokenizer's template, JSON or SSE; n choices."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from server.engine.protocol import ChatPrompt, Finished, TokenEvent
from server.http.errors import CLIENT_CLOSED, InvalidRequestError
from server.http.routes.call import ClientGone, GenerationCall, get_engine
from server.http.routes.fanout import Fanout, UsageTotal
from server.http.routes.logprobs import chat_entry
from server.http.routes.params import (
    check_choices,
    check_model,
    check_stream_options,
    for_choice,
    new_id,
    resolve_params,
)
from server.http.routes.sse import SSE_HEADERS, sse_stream
from server.http.schemas import ChatCompletionRequest
from server.http.schemas.refusals import refuse_unbuilt, refuse_unsupported

router = APIRouter()


def _chat_prompt(body: ChatCompletionRequest) -> ChatPrompt:
    messages = []
    for i, message in enumerate(body.messages):
        try:
            text = message.text()
        except ValueError as exc:
            raise InvalidRequestError(f"messages[{i}].content: {exc}",
                                      param=f"messages.{i}.content") from None
        messages.append({"role": message.role, "content": text})
    return ChatPrompt(tuple(messages))


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    """Answer a conversation n times (``stream: true`` for Server-Sent Events)."""
    engine = get_engine(request)
    check_model(body.model, engine)
    refuse_unbuilt(body)
    refuse_unsupported(body)
    check_stream_options(body)
    settings = request.app.state.settings
    check_choices(body.n, 1, settings)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    params = resolve_params(body, settings, max_tokens, logprobs=body.logprobs,
                            top_logprobs=body.top_logprobs or 0)
    prompt, rid = _chat_prompt(body), new_id("chatcmpl")
    fanout = Fanout([GenerationCall(request, engine, prompt, for_choice(params, i),
                                    rid if body.n == 1 else f"{rid}-{i}")
                     for i in range(body.n)])
    try:
        await fanout.start()
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    base = {"id": rid, "created": int(time.time()), "model": engine.model_name}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(fanout, base, body.logprobs, include_usage),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        outs = await fanout.collect()
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    usage, choices = UsageTotal(), []
    for i, out in enumerate(outs):
        usage.add(0, out.finished.usage)
        logprobs = {"content": [chat_entry(r) for r in out.logprobs]} if body.logprobs else None
        choices.append({"index": i, "logprobs": logprobs,
                        "message": {"role": "assistant", "content": "".join(out.text_parts)},
                        "finish_reason": out.finished.reason.value})
    return JSONResponse({**base, "object": "chat.completion", "choices": choices,
                         "usage": usage.as_dict()})


def _stream(fanout: Fanout, base: dict[str, Any], want_logprobs: bool, include_usage: bool):
    base = {**base, "object": "chat.completion.chunk"}
    usage = UsageTotal()

    def delta(i: int, content: dict[str, Any], finish: str | None, logprobs: Any = None):
        return {**base, "choices": [{"index": i, "delta": content, "logprobs": logprobs,
                                     "finish_reason": finish}]}

    def on_token(i: int, event: TokenEvent) -> dict[str, Any]:
        logprobs = None
        if want_logprobs and event.logprob is not None:
            logprobs = {"content": [chat_entry(event.logprob)]}
        return delta(i, {"content": event.text}, None, logprobs)

    def on_finish(i: int, event: Finished) -> list[dict[str, Any]]:
        usage.add(0, event.usage)
        return [delta(i, {"content": event.text} if event.text else {}, event.reason.value)]

    def last() -> list[dict[str, Any]]:
        return [{**base, "choices": [], "usage": usage.as_dict()}] if include_usage else []

    first = [delta(i, {"role": "assistant", "content": ""}, None)
             for i in range(len(fanout.calls))]
    return sse_stream(fanout, on_token, on_finish, first, last)
