"""Plumbing shared by the generation routes: params, admission, event loops, SSE.

Routes never block the event loop: they submit to the engine and await the
request's channel, polling for client disconnects while they wait. Any way a
route exits early (client gone, error, cancellation) cancels the engine
request, and the engine frees its blocks at its next step.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from server.errors import (
    APIError,
    GenerationError,
    InvalidRequestError,
    OverloadedError,
    UnavailableError,
)
from server.generation import (
    Admitted,
    EventChannel,
    Failed,
    Finished,
    GenerationRequest,
    Rejected,
    SamplingParams,
    TokenEvent,
)
from server.schemas.common import SamplingFields
from server.settings import Settings

# How often a waiting route checks whether its client is still there.
DISCONNECT_POLL_S = 0.1


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


def new_id(prefix: str) -> str:
    """A fresh request id such as ``cmpl-3f2a...``."""
    return f"{prefix}-{secrets.token_hex(12)}"


def get_engine(request: Request) -> Any:
    """The app's engine, or 503 when the model is not loaded yet."""
    engine = request.app.state.engine
    if not engine.is_ready:
        raise UnavailableError("the model is not loaded yet (or failed to load); see GET /health",
                               headers=_retry_after(request.app.state.settings))
    return engine


def _retry_after(settings: Settings) -> dict[str, str]:
    return {"Retry-After": str(settings.limits.retry_after_s)}


def check_model(requested: str | None, engine: Any) -> None:
    """404 when the client names a model this server does not serve."""
    if requested and requested not in (engine.model_name, "default"):
        raise APIError(
            f"model {requested!r} is not served here; this server serves "
            f"{engine.model_name!r} (see GET /v1/models)",
            param="model", code="model_not_found", status=404,
        )


def resolve_params(
    body: SamplingFields,
    settings: Settings,
    max_tokens: int | None,
    *,
    logprobs: bool = False,
    top_logprobs: int = 0,
) -> SamplingParams:
    """Apply server defaults and limits to the request's sampling fields.

    Raises:
        InvalidRequestError: n > 1, too many/long stop strings, max_tokens over
            the cap, or a bad logit_bias key.
    """
    limits, defaults = settings.limits, settings.sampling
    if body.n != 1:
        raise InvalidRequestError(f"n={body.n} is not supported: this server returns one "
                                  "choice per request; send n separate requests", param="n")
    stops = body.stop_list()
    if len(stops) > limits.max_stop_sequences:
        raise InvalidRequestError(f"{len(stops)} stop sequences given, at most "
                                  f"{limits.max_stop_sequences} allowed", param="stop")
    if any(len(s) > limits.max_stop_length or not s for s in stops):
        raise InvalidRequestError(f"each stop sequence must have 1..{limits.max_stop_length} "
                                  "characters", param="stop")
    max_tokens = limits.default_max_tokens if max_tokens is None else max_tokens
    if max_tokens > limits.max_tokens_cap:
        raise InvalidRequestError(f"max_tokens={max_tokens} is over this server's cap of "
                                  f"{limits.max_tokens_cap} (limits.max_tokens_cap)",
                                  param="max_tokens")
    bias = []
    for key, value in (body.logit_bias or {}).items():
        if not key.lstrip("-").isdigit():
            raise InvalidRequestError(f"logit_bias key {key!r} is not a token id",
                                      param="logit_bias")
        bias.append((int(key), float(value)))

    def pick(value, default):
        return default if value is None else value

    top_k = pick(body.top_k, defaults.top_k)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=pick(body.temperature, defaults.temperature),
        top_p=pick(body.top_p, defaults.top_p),
        top_k=max(top_k, 0),
        min_p=pick(body.min_p, defaults.min_p),
        seed=body.seed,
        stop=tuple(stops),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        presence_penalty=body.presence_penalty or None,
        frequency_penalty=body.frequency_penalty or None,
        repetition_penalty=body.repetition_penalty,
        logit_bias=tuple(bias),
    )


@dataclass(slots=True)
class Outcome:
    """Everything a non-streaming answer needs."""

    text_parts: list[str] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finished: Finished | None = None


class GenerationCall:
    """One submitted request seen from its route: admission, then events.

    Args:
        http_request: The incoming HTTP request (for disconnect polling).
        engine: The engine to submit to.
        prompt: Prompt text, ids or chat prompt.
        params: Resolved sampling parameters.
        request_id: The id returned to the client.
    """

    def __init__(self, http_request: Request, engine: Any, prompt: Any,
                 params: SamplingParams, request_id: str) -> None:
        self.http_request = http_request
        self.engine = engine
        self.settings: Settings = http_request.app.state.settings
        self.request = GenerationRequest(request_id, prompt, params, EventChannel())
        self.created = int(time.time())
        self.admitted: Admitted | None = None
        self._checked_at = time.monotonic()

    async def _next(self) -> Any:
        """The next event; checks the client and the engine at least every poll period.

        The check runs on elapsed time, not only when the channel is quiet:
        a request streaming tokens back-to-back must notice its client left too.
        """
        channel = self.request.channel
        now = time.monotonic()
        if now - self._checked_at >= DISCONNECT_POLL_S:
            self._checked_at = now
            await self._check_alive()
        event = channel.get_nowait()
        while event is None:
            try:
                event = await asyncio.wait_for(channel.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                self._checked_at = time.monotonic()
                await self._check_alive()
        return event

    async def _check_alive(self) -> None:
        if await self.http_request.is_disconnected():
            raise ClientGone()
        if not self.engine.is_ready:
            raise UnavailableError("the generation engine stopped",
                                   headers=_retry_after(self.settings))

    async def start(self) -> Admitted:
        """Submit and wait for admission; cancel the request on any early exit.

        Raises:
            APIError: The engine refused the request (400/429/503).
            ClientGone: The client left while waiting.
        """
        self.engine.submit(self.request)
        try:
            event = await self._next()
        except BaseException:
            self.request.cancel()
            raise
        if isinstance(event, Rejected):
            raise _rejection_error(event, self.settings)
        if isinstance(event, Failed):
            raise _failure_error(event)
        self.admitted = event
        return event

    async def events(self) -> AsyncIterator[TokenEvent | Finished]:
        """Token events, then the final :class:`Finished`; cancels on early exit.

        Raises:
            GenerationError: The model failed for this request.
        """
        try:
            while True:
                event = await self._next()
                if isinstance(event, Failed):
                    raise _failure_error(event)
                yield event
                if isinstance(event, Finished):
                    return
        finally:
            # Normal end: a no-op (the engine already dropped the request).
            self.request.cancel()

    async def collect(self) -> Outcome:
        """Run to the end and gather the output (non-streaming answers)."""
        out = Outcome()
        async for event in self.events():
            if isinstance(event, Finished):
                out.text_parts.append(event.text)
                out.finished = event
            else:
                out.text_parts.append(event.text)
                if event.logprob is not None:
                    out.logprobs.append(event.logprob)
        return out


def _rejection_error(event: Rejected, settings: Settings) -> APIError:
    headers = {}
    if event.retry_after is not None or event.status in (429, 503):
        headers["Retry-After"] = str(event.retry_after or settings.limits.retry_after_s)
    if event.status == 429:
        return OverloadedError(event.message, code=event.code, headers=headers)
    if event.status == 503:
        return UnavailableError(event.message, code=event.code, headers=headers)
    return InvalidRequestError(event.message, param=event.param, code=event.code,
                               status=event.status)


def _failure_error(event: Failed) -> APIError:
    if event.status == 503:
        return UnavailableError(event.message)
    return GenerationError(f"generation failed: {event.message}")


def sse(payload: dict[str, Any]) -> bytes:
    """One Server-Sent Events frame."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def sse_stream(
    call: GenerationCall,
    on_token: Callable[[TokenEvent], dict[str, Any] | None],
    on_finish: Callable[[Finished], list[dict[str, Any]]],
    first: dict[str, Any] | None = None,
) -> AsyncIterator[bytes]:
    """Turn a call's events into SSE frames; errors become an ``error`` frame.

    Args:
        call: An admitted call.
        on_token: Builds the chunk for a token event (None to skip it).
        on_finish: Builds the closing chunks (finish reason, optional usage).
        first: A chunk to send before any token (the chat role delta).
    """
    if first is not None:
        yield sse(first)
    try:
        async for event in call.events():
            if isinstance(event, Finished):
                for chunk in on_finish(event):
                    yield sse(chunk)
            else:
                chunk = on_token(event)
                if chunk is not None:
                    yield sse(chunk)
    except ClientGone:
        return  # nobody is listening; events() already cancelled the request
    except APIError as exc:
        yield sse(exc.body())
    yield SSE_DONE
