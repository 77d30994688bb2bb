"""Every error the server answers, in the OpenAI shape, mapped in one place.

``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`` is
the body of every non-2xx answer: our own :class:`APIError` subclasses,
FastAPI's request validation errors, Starlette's 404/405/413, invalid JSON,
and (as a last resort, logged as a bug) any unexpected exception.

This module alone decides what the engine's reasons mean to an HTTP client
(:func:`engine_error`, :func:`status_of`, :func:`end_status`) and when an
answer carries ``Retry-After`` (:func:`error_response`: every 429 and 503).
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.http.refusals import describe
from server.http.validation_messages import field_path, validation_message
from server.protocol import Failed, FinishReason
from server.refusal import Reason, Rejected
from server.settings import Settings
from veloxquant_mlx.exceptions import VeloxQuantError

log = logging.getLogger("veloxquant.server")
# Where server.http.app.RequestIds keeps the HTTP request's id (``request.state``).
REQUEST_ID_STATE = "request_id"


def quoted(value: str, limit: int = 80) -> str:
    """``value`` as a message quotes it: whole when short, else its start and its length
    (a client's megabyte model name is not sent back to it)."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


def fresh_request_id() -> str:
    """A new ``x-request-id``: 24 hex digits."""
    return secrets.token_hex(12)

# Not a registered status: what the request log and the request counter record
# for a request whose client left before its answer (nginx's convention).
CLIENT_CLOSED = 499


class APIError(Exception):
    """An error answered to the client with a status and an OpenAI-shaped body.

    Attributes:
        status: HTTP status code.
        message: What went wrong and how to fix it.
        type: OpenAI error type (``invalid_request_error``, ...).
        param: The request field at fault, if any.
        code: A short machine-readable code.
    """

    status = 400
    type = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status

    def body(self) -> dict[str, Any]:
        """The JSON body of this error."""
        return error_body(self.message, self.type, self.param, self.code)


class InvalidRequestError(APIError):
    """The request is malformed or asks for something impossible (400)."""

    code = "invalid_value"


def unrecognized(names: list[str]) -> InvalidRequestError:
    """OpenAI's 400 for request fields it does not know ("Unrecognized request argument
    supplied"), naming the first."""
    return InvalidRequestError(
        f"unrecognized request argument supplied: {', '.join(names)} (not a field of this "
        "endpoint in OpenAI's API or this server's; a misspelling, or another server's "
        "extension?)", param=names[0], code="unknown_parameter")


class RequestTooLargeError(APIError):
    """The request body is over ``limits.max_body_bytes`` (413)."""

    status = 413
    code = "request_too_large"


class AuthenticationError(APIError):
    """Missing or wrong bearer token (401)."""

    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class PermissionDeniedError(APIError):
    """The route is disabled because no token is configured (403)."""

    status = 403
    type = "permission_error"
    code = "admin_disabled"


class OverloadedError(APIError):
    """No capacity now: the waiting queue is full, the wait timed out, a per-client cap (429)."""

    status = 429
    type = "rate_limit_error"
    code = "server_overloaded"


class UnavailableError(APIError):
    """The model is not loaded, the engine is stopped, or the server drains (503)."""

    status = 503
    type = "server_error"
    code = "unavailable"


class ConflictError(APIError):
    """The operation would leave the server unable to serve valid requests (409)."""

    status = 409
    code = "conflict"


class GenerationError(APIError):
    """The model failed while generating this request (500, reported, not a crash)."""

    status = 500
    type = "server_error"
    code = "generation_failed"


# What each engine reason is to a client; the reason's value is the error code.
_ENGINE_ERRORS: dict[Reason, type[APIError]] = {
    Reason.EMPTY_PROMPT: InvalidRequestError,
    Reason.INVALID_PROMPT: InvalidRequestError,
    Reason.INVALID_VALUE: InvalidRequestError,
    Reason.TOO_LARGE: InvalidRequestError,
    Reason.QUEUE_FULL: OverloadedError,
    Reason.QUEUE_TIMEOUT: OverloadedError,
    Reason.SHUTTING_DOWN: UnavailableError,
    Reason.MODEL_ERROR: GenerationError,
}
# Statuses whose answer tells the client when to come back.
_RETRY_STATUSES = frozenset({OverloadedError.status, UnavailableError.status})


def engine_error(event: Rejected | Failed) -> APIError:
    """The error a client gets for a request the engine refused or failed."""
    cls = _ENGINE_ERRORS[event.reason]
    message = describe(event) if isinstance(event, Rejected) else event.message
    if event.reason is Reason.MODEL_ERROR:
        message = f"generation failed: {message}"
    return cls(message, param=getattr(event, "param", None), code=event.reason.value)


def status_of(reason: Reason) -> int:
    """The HTTP status a request refused or failed for ``reason`` is answered with."""
    if reason is Reason.CANCELLED_WAITING:
        return CLIENT_CLOSED
    return _ENGINE_ERRORS[reason].status


def end_status(finish: FinishReason, failure: Reason | None = None) -> int:
    """The HTTP status of a request that ran and ended with ``finish``."""
    if finish is FinishReason.CANCELLED:
        return CLIENT_CLOSED
    if finish is FinishReason.ERROR:
        return status_of(failure or Reason.MODEL_ERROR)
    return 200


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """Build the OpenAI error envelope."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(exc: APIError, settings: Settings) -> JSONResponse:
    """Render an :class:`APIError`; every 429 and 503 carries ``Retry-After``."""
    return _json(exc.body(), exc.status, settings)


def _json(body: dict[str, Any], status: int, settings: Settings,
          headers: dict[str, str] | None = None) -> JSONResponse:
    headers = dict(headers or {})
    if status in _RETRY_STATUSES:
        headers["Retry-After"] = str(settings.limits.retry_after_s)
    return JSONResponse(body, status_code=status, headers=headers or None)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None, str]:
    """The message, ``param`` and ``code`` of a body that failed validation."""
    errors = exc.errors()
    if not errors:
        return "invalid request body", None, "invalid_value"
    first = errors[0]
    if first.get("type") == "missing" and tuple(first.get("loc", ())) == ("body",):
        return ("request body is empty: send a JSON object with this endpoint's fields "
                "(see GET /docs)"), None, "invalid_value"
    if first.get("type") == "json_invalid":
        # The parser's reason and where (FastAPI puts the character offset in loc).
        reason = (first.get("ctx") or {}).get("error") or first.get("msg", "")
        at = [p for p in first.get("loc", ()) if isinstance(p, int)]
        where = f" at character {at[0]}" if at else ""
        return f"request body is not valid JSON: {reason}{where}", None, "invalid_value"
    unknown = [field_path(tuple(e["loc"])) for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:
        refusal = unrecognized(unknown)
        return refusal.message, refusal.param, refusal.code
    message, param = validation_message(errors)
    return message, param, "invalid_value"


_STATUS_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


# Codes of the errors Starlette raises itself (a body it cannot parse, an oversized one);
# other statuses keep the status as their code.
_HTTP_CODES = {400: "invalid_value", 413: "request_too_large"}


def _http_message(request: Request, status: int, detail: Any) -> str:
    if status == 400 and detail == "There was an error parsing the body":
        return "request body is not valid JSON (it must be UTF-8 encoded JSON)"
    if status == 404:
        return (f"no route {request.method} {request.url.path}; see GET /v1/models, "
                "POST /v1/completions, POST /v1/chat/completions, POST /v1/responses, "
                "POST /tokenize")
    if status == 405:
        return f"method {request.method} is not allowed on {request.url.path}"
    return str(detail)


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception family to the OpenAI error shape."""

    def settings_of(request: Request) -> Settings:
        return request.app.state.settings

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, settings_of(request))

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, code = _validation_message(exc)
        return JSONResponse(error_body(message, "invalid_request_error", param, code),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        body = error_body(_http_message(request, status, exc.detail),
                          _STATUS_TYPES.get(status, "invalid_request_error"), None,
                          _HTTP_CODES.get(status, str(status)))
        return _json(body, status, settings_of(request), getattr(exc, "headers", None))

    @app.exception_handler(VeloxQuantError)
    async def _library(_: Request, exc: VeloxQuantError) -> JSONResponse:
        # A library error that reached a route is a misuse we did not foresee:
        # report it plainly instead of a bare 500 page.
        log.error("library error reached a route: %s", exc)
        return JSONResponse(error_body(str(exc), "server_error", None, type(exc).__name__),
                            status_code=500)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette answers this one outside every middleware, RequestIds included: the
        # request's id is put on the answer and in the log line here.
        request_id = getattr(request.state, REQUEST_ID_STATE, None)
        log.exception("unhandled error (a bug) in request %s: %s", request_id, exc)
        return JSONResponse(
            error_body("internal server error; see the server log for x-request-id "
                       f"{request_id}", "server_error", None, "internal_error"),
            status_code=500, headers={"x-request-id": request_id} if request_id else None)
