"""``POST /v1/completions``: legacy text completion, JSON or SSE."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from server.engine.protocol import Finished, TokenEvent, TokenLogprob
from server.http.errors import CLIENT_CLOSED, InvalidRequestError
from server.http.routes.call import ClientGone, GenerationCall, get_engine
from server.http.routes.params import check_model, new_id, resolve_params
from server.http.routes.sse import SSE_HEADERS, sse_stream
from server.http.schemas import CompletionRequest

router = APIRouter()


def _prompt(body: CompletionRequest) -> str | list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise InvalidRequestError(
                f"{len(prompt)} prompts given; this server takes one prompt per request",
                param="prompt")
        prompt = prompt[0]
    if not prompt:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    return prompt


class _LegacyLogprobs:
    """Accumulates the legacy ``logprobs`` object (tokens, offsets, top alternatives)."""

    def __init__(self) -> None:
        self.offset = 0

    def chunk(self, records: list[TokenLogprob], texts: list[str]) -> dict[str, Any]:
        offsets = []
        for text in texts:
            offsets.append(self.offset)
            self.offset += len(text)
        return {
            "tokens": [r.token for r in records],
            "token_logprobs": [r.logprob for r in records],
            "top_logprobs": [{t.token: t.logprob for t in r.top} for r in records],
            "text_offset": offsets,
        }


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    """Complete a prompt (``stream: true`` for Server-Sent Events)."""
    engine = get_engine(request)
    check_model(body.model, engine)
    if body.echo:
        raise InvalidRequestError("echo is not supported", param="echo")
    if body.suffix:
        raise InvalidRequestError("suffix is not supported", param="suffix")
    settings = request.app.state.settings
    want_logprobs = body.logprobs is not None
    params = resolve_params(body, settings, body.max_tokens, logprobs=want_logprobs,
                            top_logprobs=body.logprobs or 0)
    call = GenerationCall(request, engine, _prompt(body), params, new_id("cmpl"))
    try:
        await call.start()
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    base = {"id": call.request.request_id, "object": "text_completion",
            "created": call.created, "model": engine.model_name}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(call, base, want_logprobs, include_usage),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        out = await call.collect()
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    choice: dict[str, Any] = {"index": 0, "text": "".join(out.text_parts), "logprobs": None,
                              "finish_reason": out.finished.reason.value}
    if want_logprobs:
        texts = [r.token for r in out.logprobs]
        choice["logprobs"] = _LegacyLogprobs().chunk(out.logprobs, texts)
    return JSONResponse({**base, "choices": [choice], "usage": out.finished.usage.as_dict()})


def _stream(call: GenerationCall, base: dict[str, Any], want_logprobs: bool,
            include_usage: bool):
    legacy = _LegacyLogprobs()

    def on_token(event: TokenEvent) -> dict[str, Any]:
        logprobs = None
        if want_logprobs and event.logprob is not None:
            logprobs = legacy.chunk([event.logprob], [event.logprob.token])
        return {**base, "choices": [{"index": 0, "text": event.text, "logprobs": logprobs,
                                     "finish_reason": None}]}

    def on_finish(event: Finished) -> list[dict[str, Any]]:
        chunks = [{**base, "choices": [{"index": 0, "text": event.text, "logprobs": None,
                                        "finish_reason": event.reason.value}]}]
        if include_usage:
            chunks.append({**base, "choices": [], "usage": event.usage.as_dict()})
        return chunks

    return sse_stream(call, on_token, on_finish)
