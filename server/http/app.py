"""``create_app(settings, engine=None)``: the FastAPI application.

The engine (real, or a fake in route tests) lives on ``app.state.engine``;
the app starts it on start-up and stops it on shutdown. Nothing here touches
MLX: that is the engine thread's job.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from fastapi import Depends, FastAPI
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.http import request_log
from server.http.auth import require_api_key
from server.http.cors import add_cors
from server.http.errors import (
    CLIENT_CLOSED,
    REQUEST_ID_STATE,
    fresh_request_id,
    install_error_handlers,
)
from server.http.guards import DrainState, Guards
from server.http.routes import admin, chat, completions, embeddings, responses, system, tokens
from server.http.unknown_fields import UnknownFields
from server.metrics import ServerMetrics, VllmNames
from server.metrics_collectors import EngineCollector, PoolCollector
from server.settings import Settings


class RequestIds:
    """Pure ASGI middleware giving every HTTP request an id, sent back as ``x-request-id``.

    OpenAI sends the header on every answer and its SDK shows it (``_request_id``, an
    error's ``request_id``); a client that got an error can quote it. A generation's own
    id is built from it (``chatcmpl-<id>``, ``resp_<id>``:
    :func:`server.http.routes.params.new_id`), so the id finds its ``request_end`` log line.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = fresh_request_id()
        scope.setdefault("state", {})[REQUEST_ID_STATE] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", ()), (b"x-request-id", request_id.encode())]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


class RequestCounter:
    """Pure ASGI middleware counting requests by route template and status.

    (A ``BaseHTTPMiddleware`` would wrap streaming bodies and get in the way
    of disconnect detection, so this stays at the ASGI level.)
    """

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, routes: list[Any]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes  # the app's routes, to label answers given before routing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = CLIENT_CLOSED  # nothing sent: the client left first
        finished = left = False  # the body's last part went out; the client left before

        async def counting_send(message: Message) -> None:
            nonlocal status, finished
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                finished = True
            await send(message)

        async def watching_receive() -> Message:
            nonlocal left
            message = await receive()
            left = left or (message["type"] == "http.disconnect" and not finished)
            return message

        try:
            await self.app(scope, watching_receive, counting_send)
        except Exception:
            status = 500
            raise
        finally:
            # A stream the client cut after its 200 went out counts as 499, as the
            # request log has it: the answer never reached its end.
            if left and status < 500:
                status = CLIENT_CLOSED
            self.metrics.request_done(self._route_path(scope), status)

    def _route_path(self, scope: Scope) -> str:
        """The template of the route a request went to, or would have gone to.

        Routing sets ``scope["route"]``; answers given before routing (the
        guards' auth, size, cap and drain refusals) have none, so the routes are
        matched here: a 401 on ``/v1/completions`` counts under that route. Only
        paths no route knows are ``unmatched`` (which keeps the label set bounded).
        """
        route = scope.get("route")
        if route is None:
            matches = [(r.matches(scope)[0], r) for r in self.routes]
            route = next((r for m, r in matches if m == Match.FULL), None) or next(
                (r for m, r in matches if m == Match.PARTIAL), None)
        return getattr(route, "path", None) or "unmatched"


def create_app(settings: Settings, engine: Any = None) -> FastAPI:
    """Build the app around an engine.

    Args:
        settings: The validated settings.
        engine: An engine; ``None`` builds the real one (the model loads on
            its thread when the app starts).

    Returns:
        The FastAPI app, with ``state.settings``, ``state.engine`` and
        ``state.metrics`` set.
    """
    if engine is None:
        from server.engine.engine import Engine  # imports MLX: only when serving for real

        engine = Engine(settings, ServerMetrics())
    metrics = _engine_metrics(settings, engine)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        # Accept traffic only once the model is loaded; a load failure stops start-up.
        if not await asyncio.to_thread(engine.wait_ready):
            engine.stop()
            raise RuntimeError(f"model failed to load: {getattr(engine, 'load_error', '?')}")
        try:
            yield
        finally:
            engine.stop()

    # redirect_slashes off: a 307 to "/v1/completions" would echo the client's Host header
    # back as the redirect target. The docs are off with server.docs = false, and behind
    # the API key when one is set (server.http.auth.early_refusal).
    docs = settings.server.docs
    app = FastAPI(title="VeloxQuant-MLX", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible MLX inference on one shared KV block pool.",
                  redirect_slashes=False, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None,
                  openapi_url="/openapi.json" if docs else None)
    app.state.settings = settings
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.unknown_fields = UnknownFields(settings.server.unknown_fields, metrics)
    app.state.started_at = int(time.time())
    install_error_handlers(app)
    routes = _include_routers(app)
    # SIGTERM drain, per-client cap, body size and stalled streams (server/http/guards.py);
    # added first so RequestCounter, outside it, counts what the guards answer too.
    app.state.drain = DrainState()
    app.add_middleware(Guards, settings=settings, drain=app.state.drain)
    app.add_middleware(RequestCounter, metrics=metrics, routes=routes)
    add_cors(app, settings)
    app.add_middleware(RequestIds)  # outermost: every answer carries the id
    return app


def _engine_metrics(settings: Settings, engine: Any) -> ServerMetrics:
    """The engine's metrics (a fresh set for a test double without), with the pool's,
    the engine's and (``metrics.vllm_names``) vLLM's families registered."""
    metrics: ServerMetrics = getattr(engine, "metrics", None) or ServerMetrics()
    metrics.registry.register(PoolCollector(lambda: engine.pool))  # sized at model load
    metrics.label_model(lambda: engine.model_name)  # known once the model loads
    gauges = EngineCollector(engine, metrics)
    metrics.registry.register(gauges)
    if settings.metrics.vllm_names:
        metrics.registry.register(VllmNames(metrics, gauges.load_gauges))
    metrics.listeners.append(request_log.RequestLog())
    return metrics


def _include_routers(app: FastAPI) -> list[Route]:
    """Add every route; returns the plain routes that requests are matched against."""
    # /health stays open, /metrics too unless server.metrics_require_key; the inference
    # routes need the API key when one is set.
    guarded = [Depends(require_api_key)]
    routers = [(completions.router, guarded), (chat.router, guarded),
               (responses.router, guarded), (tokens.router, guarded),
               (embeddings.router, guarded),
               (system.models_router, guarded), (system.router, []), (admin.router, [])]
    for router, dependencies in routers:
        app.include_router(router, dependencies=dependencies)
    # Plain routes to match paths against (FastAPI keeps included routers as lazy wrappers).
    routes = [r for r in app.routes if isinstance(r, Route)]
    return routes + [r for router, _ in routers for r in router.routes]

