"""``POST /v1/completions``: legacy text completion, JSON or SSE; batches, n, echo."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from server.http.errors import CLIENT_CLOSED, APIError, InvalidRequestError
from server.http.request_log import RequestLog
from server.http.routes.call import ClientGone, GenerationCall, get_engine
from server.http.routes.echo import echo_prompts
from server.http.routes.fanout import Fanout, UsageTotal, choice_group, shared_prefill
from server.http.routes.logprobs import LegacyLogprobs, merge_legacy
from server.http.routes.params import (
    cache_namespace,
    check_choices,
    check_model,
    check_stream_options,
    for_choice,
    new_id,
    resolve_params,
)
from server.http.routes.sse import SSE_HEADERS, TEXT_MARK, FrameTemplate, sse_stream
from server.http.routes.structured import output_constraint
from server.http.schemas import CompletionRequest
from server.http.schemas.refusals import refuse_unsupported
from server.http.unknown_fields import unknown_fields_of
from server.protocol import (
    ChoiceGroup,
    Finished,
    SamplingParams,
    TokenEvent,
)

router = APIRouter()


def _prompts(body: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts: one, or a batch (a list of strings or of token lists)."""
    prompt = body.prompt
    batch = prompt if isinstance(prompt, list) and prompt and \
        isinstance(prompt[0], (str, list)) else [prompt]
    for i, one in enumerate(batch):
        if not one:
            where = "prompt" if len(batch) == 1 else f"prompt[{i}]"
            raise InvalidRequestError(f"{where} must not be empty", param="prompt",
                                      code="empty_prompt")
    return batch


def _check(body: CompletionRequest, n_prompts: int, settings: Any) -> None:
    """The request-level rules beyond the schema's types and ranges."""
    refuse_unsupported(body)
    check_stream_options(body)
    if body.best_of is not None and body.best_of != body.n:
        raise InvalidRequestError(
            f"best_of={body.best_of} is not supported: this server returns every choice it "
            f"generates, so best_of must equal n ({body.n}) or be left out", param="best_of",
            code="unsupported_parameter")
    check_choices(body.n, n_prompts, settings)
    if body.max_tokens is not None and body.max_tokens < (0 if body.echo else 1):
        raise InvalidRequestError("max_tokens must be at least 1; 0 is allowed only with "
                                  "echo: true (to score the prompt)", param="max_tokens")


@router.post("/v1/completions",
             dependencies=[Depends(unknown_fields_of(CompletionRequest, "/v1/completions"))])
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    """Complete each prompt n times (``stream: true`` for Server-Sent Events)."""
    engine = get_engine(request)
    check_model(body.model, engine)
    settings = request.app.state.settings
    prompts = _prompts(body)
    _check(body, len(prompts), settings)
    params = resolve_params(body, settings, body.max_tokens,
                            logprobs=body.logprobs is not None, top_logprobs=body.logprobs or 0)
    constraint = await output_constraint(engine, body.response_format)
    params = dataclasses.replace(params, constraint=constraint)
    rid = new_id("cmpl", request)
    try:
        echoes = await _echoes(request, engine, prompts, body.logprobs, rid,
                               params.max_tokens == 0) if body.echo else None
        fanout = Fanout(_calls(request, engine, prompts, body.n, params, rid,
                               cache_namespace(request, body.cache_salt)),
                        shared_prefill(body.n, settings))
        await fanout.start()
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    answer = _Answer(body, echoes, {"id": rid, "object": "text_completion",
                                    "created": int(time.time()), "model": engine.model_name},
                     len(prompts) * body.n)
    if body.stream:
        return StreamingResponse(answer.stream(fanout), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    try:
        outs = await fanout.collect()
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(answer.json(outs))


async def _echoes(request: Request, engine: Any, prompts: list[str | list[int]],
                  top_n: int | None, rid: str, only: bool) -> list[Any]:
    """The echoed prompts (scored when ``top_n`` is not None).

    A scoring request writes its own request log line, as every engine request
    does; an echo that is only tokenized writes one here when no generation follows.

    Raises:
        APIError: A prompt was refused or scoring failed.
        ClientGone: The client left while the prompts were scored.
    """
    started = time.monotonic()
    log = only and top_n is None  # no engine request writes this request's line
    try:
        echoes = await echo_prompts(request, engine, prompts, top_n, rid)
    except ClientGone:
        if log:
            RequestLog.scored(rid, CLIENT_CLOSED, None, started)
        raise
    except APIError as exc:
        if log:
            RequestLog.scored(rid, exc.status, None, started, exc.code)
        raise
    if log:
        RequestLog.scored(rid, 200, sum(len(echo.ids) for echo in echoes), started)
    return echoes


def _calls(request: Request, engine: Any, prompts: list[str | list[int]], n: int,
           params: SamplingParams, rid: str, salt: str | None) -> list[GenerationCall]:
    """One call per choice (none with ``max_tokens: 0``): choice j = prompt p x n + i; the
    n choices of a prompt are one group (admitted together)."""
    if params.max_tokens == 0:
        return []
    total, calls = len(prompts) * n, []
    for p, prompt in enumerate(prompts):
        group = ChoiceGroup()
        calls += choice_group(group, [
            GenerationCall(request, engine, prompt, for_choice(params, i),
                           rid if total == 1 else f"{rid}-{p * n + i}",
                           "prompt" if len(prompts) == 1 else f"prompt[{p}]",
                           cache_salt=salt, choices=group) for i in range(n)])
    return calls


class _Answer:
    """Builds the JSON answer or the SSE chunks of one completions request.

    Args:
        body: The request.
        echoes: One :class:`~server.http.routes.echo.Echo` per prompt when ``echo``.
        base: ``id``, ``object``, ``created``, ``model`` of every chunk.
        total: Choices (prompts x n).
    """

    def __init__(self, body: CompletionRequest, echoes: list[Any] | None,
                 base: dict[str, Any], total: int) -> None:
        self.n = body.n
        self.echoes = echoes
        self.base = base
        self.total = total
        self.want_logprobs = body.logprobs is not None
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.legacy = [LegacyLogprobs() for _ in range(total)]
        self.usage = UsageTotal()

    def _echo(self, j: int) -> tuple[str, dict[str, Any] | None]:
        """Choice j's echoed prompt text and its legacy log-probabilities (or None)."""
        echo = self.echoes[j // self.n]
        logprobs = None
        if self.want_logprobs:
            logprobs = self.legacy[j].chunk(echo.logprobs, first=echo.tokens[0])
        return echo.text, logprobs

    def _choice(self, j: int, text: str, logprobs: Any, finish: str | None) -> dict[str, Any]:
        return {"index": j, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def json(self, outs: list[Any]) -> dict[str, Any]:
        """The non-streaming answer from every choice's outcome (none: echo only)."""
        choices = []
        for j in range(self.total):
            text, parts = "", []
            if self.echoes is not None:
                text, echoed = self._echo(j)
                parts += [echoed] if echoed else []
            finish = "length"
            if outs:
                out = outs[j]
                text += "".join(out.text_parts)
                finish = out.finished.reason.value
                self.usage.add(j // self.n, out.finished.usage)
                if self.want_logprobs:
                    parts.append(self.legacy[j].chunk(out.logprobs))
            else:
                self.usage.add_prompt(j // self.n, len(self.echoes[j // self.n].ids))
            logprobs = merge_legacy(parts) if self.want_logprobs else None
            choices.append(self._choice(j, text, logprobs, finish))
        return {**self.base, "choices": choices, "usage": self.usage.as_dict()}

    def stream(self, fanout: Fanout):
        """The SSE frames: echoed prompts first, then the choices' tokens interleaved."""
        first = []
        if self.echoes is not None:
            for j in range(self.total):
                first.append({**self.base, "choices": [self._choice(j, *self._echo(j), None)]})
                if not fanout.calls:  # max_tokens 0: the prompt is the whole answer
                    self.usage.add_prompt(j // self.n, len(self.echoes[j // self.n].ids))
                    first.append({**self.base,
                                  "choices": [self._choice(j, "", None, "length")]})

        templates = [FrameTemplate({**self.base, "choices": [self._choice(
            j, TEXT_MARK, None, None)]}) for j in range(len(fanout.calls))]

        def on_token(j: int, event: TokenEvent) -> dict[str, Any] | bytes:
            if self.want_logprobs and event.logprobs:
                logprobs = self.legacy[j].chunk(list(event.logprobs))
                return {**self.base, "choices": [self._choice(j, event.text, logprobs, None)]}
            return templates[j].frame(event.text)

        def on_finish(j: int, event: Finished) -> list[dict[str, Any]]:
            self.usage.add(j // self.n, event.usage)
            return [{**self.base, "choices": [self._choice(j, event.text, None,
                                                           event.reason.value)]}]

        def last() -> list[dict[str, Any]]:
            if not self.include_usage:
                return []
            return [{**self.base, "choices": [], "usage": self.usage.as_dict()}]

        return sse_stream(fanout, on_token, on_finish, first, last)
