"""One generation request seen from its route: submit, wait for admission, read events.

Routes never block the event loop: they submit to the engine and await the
request's channel, which the request's :class:`ClientWatch` wakes when the
client leaves; a wait that hears nothing for ``ENGINE_CHECK_S`` checks that
the engine still runs. Any way a route exits early (client gone, error,
cancellation) cancels the engine request, and the engine frees its blocks at
its next step.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from server.channel import EventChannel
from server.http.client_watch import client_watch
from server.http.errors import UnavailableError, engine_error
from server.protocol import (
    Admitted,
    Failed,
    Finished,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from server.refusal import Rejected

# How long a waiting route hears nothing before it checks that the engine still runs
# (its client leaving wakes it at once). Only a safety net: an engine that stops on
# purpose tells every request itself. Each stream's wait timer fires this often while
# the stream waits (server/deadline.py); at 0.1 s and 64 streams on the CPU that would
# be about a timer callback per streamed token.
ENGINE_CHECK_S = 1.0


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


def get_engine(request: Request) -> Any:
    """The app's engine, or 503 when the model is not loaded yet."""
    engine = request.app.state.engine
    if not engine.is_ready:
        raise UnavailableError(getattr(engine, "crash", None)
                               or "the model is not loaded yet (or failed to load); "
                                  "see GET /health")
    if stalled := getattr(engine, "stalled", None):  # it would wait on a hung engine
        raise UnavailableError(stalled)
    return engine


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
        prompt_param: How an error about the prompt names it (``prompt[2]`` in a batch).
        options: The request's ``score``, ``cache_salt`` and ``choices``
            (:class:`~server.protocol.GenerationRequest`).
    """

    def __init__(self, http_request: Request, engine: Any, prompt: Any,
                 params: SamplingParams, request_id: str, prompt_param: str = "prompt",
                 **options: Any) -> None:
        self.http_request = http_request
        self.engine = engine
        self.prompt_param = prompt_param
        # options: GenerationRequest's score, cache_salt and choices
        self.request = GenerationRequest(request_id, prompt, params, EventChannel(),
                                         **options)
        self.created = int(time.time())
        self.admitted: Admitted | None = None
        self._ahead: list[Any] = []  # events read early by prefilled(), delivered first
        self.watch = client_watch(http_request.scope)

    async def _next(self) -> Any:
        """The next event, unless the client left or the engine stopped.

        The client is checked before every event, not only when the channel is
        quiet: a request streaming tokens back-to-back must notice it left too.
        """
        if self._ahead:
            return self._ahead.pop(0)
        channel = self.request.channel
        while True:
            if self.watch.gone:
                raise ClientGone()
            event = channel.get_nowait()
            if event is None:
                event = await channel.wait(ENGINE_CHECK_S)
            if event is not None:
                return event
            if not self.watch.gone and not self.engine.is_ready:
                raise UnavailableError("the generation engine stopped")

    def _error(self, event: Rejected | Failed) -> Exception:
        error = engine_error(event)
        if error.param == "prompt" and self.prompt_param != "prompt":  # which one of a batch
            error.param = self.prompt_param
            error.message = f"{self.prompt_param}: {error.message}"
        return error

    @property
    def ready(self) -> bool:
        """Whether the next event is here already (reading it would not wait)."""
        return bool(self._ahead) or self.request.channel.ready

    async def start(self) -> Admitted:
        """Submit and wait for admission; cancel the request on any early exit.

        Raises:
            APIError: The engine refused the request.
            ClientGone: The client left while waiting.
        """
        # FastAPI read the body before the route ran: receive now only says "gone".
        self.watch.listen(self.http_request.receive)
        self.watch.on_gone(self.request.channel.wake)
        self.engine.submit(self.request)
        try:
            event = await self._next()
        except BaseException:
            self.request.cancel()
            raise
        if isinstance(event, (Rejected, Failed)):
            raise self._error(event)
        self.admitted = event
        return event

    async def prefilled(self) -> None:
        """Wait until the prompt is prefilled: its first event (kept for :meth:`events`).

        After this, the prompt's full blocks are in the prefix cache (the
        engine publishes them when prefill ends), so choices submitted now
        reuse them. Cancels the request on any early exit.
        """
        try:
            self._ahead.append(await self._next())
        except BaseException:
            self.request.cancel()
            raise

    async def events(self) -> AsyncIterator[TokenEvent | Finished]:
        """Token events, then the final :class:`Finished`; cancels on early exit.

        Raises:
            APIError: The request failed (model error, engine stopping).
        """
        try:
            while True:
                event = await self._next()
                if isinstance(event, Failed):
                    raise self._error(event)
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
            out.text_parts.append(event.text)
            if isinstance(event, Finished):
                out.finished = event
            else:
                out.logprobs += event.logprobs
        return out
