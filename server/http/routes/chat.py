"""``POST /v1/chat/completions``: chat with the tokenizer's template, JSON or SSE."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from server.engine.protocol import ChatPrompt, Finished, TokenEvent, TokenLogprob
from server.http.errors import CLIENT_CLOSED, InvalidRequestError
from server.http.routes.call import ClientGone, GenerationCall, get_engine
from server.http.routes.params import check_model, new_id, resolve_params
from server.http.routes.sse import SSE_HEADERS, sse_stream
from server.http.schemas import ChatCompletionRequest

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


def _logprob_entry(record: TokenLogprob) -> dict[str, Any]:
    return {
        "token": record.token,
        "logprob": record.logprob,
        "bytes": list(record.token.encode()),
        "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode())}
                         for t in record.top],
    }


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    """Answer a conversation (``stream: true`` for Server-Sent Events)."""
    engine = get_engine(request)
    check_model(body.model, engine)
    settings = request.app.state.settings
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    params = resolve_params(body, settings, max_tokens, logprobs=body.logprobs,
                            top_logprobs=body.top_logprobs or 0)
    call = GenerationCall(request, engine, _chat_prompt(body), params, new_id("chatcmpl"))
    try:
        await call.start()
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    base = {"id": call.request.request_id, "created": call.created, "model": engine.model_name}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(call, base, body.logprobs, include_usage),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        out = await call.collect()
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    logprobs = None
    if body.logprobs:
        logprobs = {"content": [_logprob_entry(r) for r in out.logprobs]}
    choice = {"index": 0, "message": {"role": "assistant", "content": "".join(out.text_parts)},
              "logprobs": logprobs, "finish_reason": out.finished.reason.value}
    return JSONResponse({**base, "object": "chat.completion", "choices": [choice],
                         "usage": out.finished.usage.as_dict()})


def _stream(call: GenerationCall, base: dict[str, Any], want_logprobs: bool,
            include_usage: bool):
    base = {**base, "object": "chat.completion.chunk"}

    def delta(content: dict[str, Any], finish: str | None, logprobs: Any = None):
        return {**base, "choices": [{"index": 0, "delta": content, "logprobs": logprobs,
                                     "finish_reason": finish}]}

    def on_token(event: TokenEvent) -> dict[str, Any]:
        logprobs = None
        if want_logprobs and event.logprob is not None:
            logprobs = {"content": [_logprob_entry(event.logprob)]}
        return delta({"content": event.text}, None, logprobs)

    def on_finish(event: Finished) -> list[dict[str, Any]]:
        chunks = [delta({"content": event.text} if event.text else {}, event.reason.value)]
        if include_usage:
            chunks.append({**base, "choices": [], "usage": event.usage.as_dict()})
        return chunks

    return sse_stream(call, on_token, on_finish,
                      first=delta({"role": "assistant", "content": ""}, None))
