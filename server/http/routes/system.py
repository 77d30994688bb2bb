"""``GET /health``, ``GET /v1/models`` (and ``/v1/models/{id}``) and ``GET /metrics``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import generate_latest

from server.http.auth import require_metrics_key
from server.http.errors import APIError, UnavailableError, error_response, quoted

router = APIRouter()
models_router = APIRouter()

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@router.get("/health")
# HEAD: some probes only ask that. Its own operation id: one route for both methods gave
# both GET's id, and FastAPI warned of the duplicate each time it built the OpenAPI schema.
@router.head("/health", operation_id="health_head")
async def health(request: Request) -> JSONResponse:
    """200 once the model is loaded and the engine thread is alive; 503 otherwise.

    ``status`` is ``degraded`` (still 200: smaller requests are served) with a
    ``reason`` while a shrink leaves the pool smaller than at start and unable to hold one
    maximal request.
    503 too while the model's calls keep failing (several in a row, none run since:
    :mod:`server.engine.run_output`), or while one engine step has run past
    ``limits.engine_stall_timeout_s``, so a supervisor restarts a broken device.
    """
    engine = request.app.state.engine
    failing = getattr(engine, "failing", None)
    if engine.is_ready and failing:
        return error_response(UnavailableError(f"model calls are failing: {failing}"),
                              request.app.state.settings)
    stalled = getattr(engine, "stalled", None)
    if engine.is_ready and stalled:
        return error_response(UnavailableError(stalled), request.app.state.settings)
    if engine.is_ready:
        running, waiting = engine.queue_depths()
        body = {"status": "ok", "model": engine.model_name, "running": running,
                "waiting": waiting}
        degraded = getattr(engine, "degraded", None)
        if degraded:
            body.update(status="degraded", reason=degraded)
        return JSONResponse(body)
    reason = getattr(engine, "load_error", None)
    message = (f"model failed to load: {reason}" if reason
               else getattr(engine, "crash", None) or "model loading or engine stopped")
    return error_response(UnavailableError(message), request.app.state.settings)


def _model_object(request: Request, name: str) -> dict[str, Any]:
    """The model's object under one of its served names."""
    engine = request.app.state.engine
    body = {"id": name, "object": "model",
            "created": request.app.state.started_at, "owned_by": "veloxquant"}
    context = getattr(engine, "context_length", None)
    if context is not None:  # vLLM's name for it, which clients already read
        body["max_model_len"] = context
    kv = getattr(engine, "kv", None)  # None until the model is loaded (or a fake engine)
    if kv is not None:
        # Extra fields are allowed in the OpenAI model object (llama-server sends "meta" too).
        body["meta"] = {"kv_format": kv.kv_format, "kv_format_tag": kv.format_tag,
                        "kv_bytes_per_block": kv.bytes_per_block}
    return body


@models_router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    """The served model under each of its names (the primary first), in the OpenAI list
    shape: clients pick an id from this list and send it back."""
    names = request.app.state.engine.served_names
    return JSONResponse({"object": "list", "data": [_model_object(request, n) for n in names]})


# ":path": a served name may hold a slash ("org/name"), which the openai client sends as is.
@models_router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> JSONResponse:
    """The served model's object under ``model_id``, one of its names
    (``client.models.retrieve``); 404 for any other id."""
    served = request.app.state.engine.served_names
    if not model_id:  # "/v1/models/": no redirects here, so say what was meant
        raise APIError("no model id after /v1/models/; GET /v1/models (no trailing slash) "
                       "lists the served model", param="model", code="model_not_found",
                       status=404)
    if model_id not in served:
        names = ", ".join(repr(name) for name in served)
        raise APIError(f"model {quoted(model_id)} is not served here; this server serves "
                       f"{names} (see GET /v1/models)", param="model",
                       code="model_not_found", status=404)
    return JSONResponse(_model_object(request, model_id))


@router.get("/metrics", dependencies=[Depends(require_metrics_key)])
async def metrics(request: Request) -> Response:
    """Pool counters and server metrics in the Prometheus text format."""
    return Response(generate_latest(request.app.state.metrics.registry),
                    media_type=PROMETHEUS_CONTENT_TYPE)
