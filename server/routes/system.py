"""``GET /health``, ``GET /v1/models`` and ``GET /metrics``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.errors import error_body
from server.metrics import render

router = APIRouter()
models_router = APIRouter()

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 once the model is loaded and the engine thread is alive; 503 otherwise."""
    engine = request.app.state.engine
    if engine.is_ready:
        running, waiting = engine.queue_depths()
        return JSONResponse({"status": "ok", "model": engine.model_name,
                             "running": running, "waiting": waiting})
    reason = getattr(engine, "load_error", None)
    message = f"model failed to load: {reason}" if reason else "model loading or engine stopped"
    retry = str(request.app.state.settings.limits.retry_after_s)
    return JSONResponse(error_body(message, "server_error", None, "unavailable"),
                        status_code=503, headers={"Retry-After": retry})


@models_router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    """The one served model, in the OpenAI list shape."""
    engine = request.app.state.engine
    data = []
    if engine.model_name:
        data.append({"id": engine.model_name, "object": "model",
                     "created": request.app.state.started_at, "owned_by": "veloxquant"})
    return JSONResponse({"object": "list", "data": data})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Pool counters and server metrics in the Prometheus text format."""
    state = request.app.state
    return Response(render(state.engine.pool, state.metrics),
                    media_type=PROMETHEUS_CONTENT_TYPE)
