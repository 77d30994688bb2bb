"""Every error the server answers, in the OpenAI shape, mapped in one place.

``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`` is
the body of every non-2xx answer: our own :class:`APIError` subclasses,
FastAPI's request validation errors, Starlette's 404/405, invalid JSON, and
(as a last resort, logged as a bug) any unexpected exception.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from veloxquant_mlx.exceptions import VeloxQuantError

log = logging.getLogger("veloxquant.server")


class APIError(Exception):
    """An error answered to the client with a status and an OpenAI-shaped body.

    Attributes:
        status: HTTP status code.
        message: What went wrong and how to fix it.
        type: OpenAI error type (``invalid_request_error``, ...).
        param: The request field at fault, if any.
        code: A short machine-readable code.
        headers: Extra response headers (``Retry-After``).
    """

    status = 400
    type = "invalid_request_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body of this error."""
        return error_body(self.message, self.type, self.param, self.code)


class InvalidRequestError(APIError):
    """The request is malformed or asks for something impossible (400)."""


class RequestTooLargeError(InvalidRequestError):
    """Prompt plus max_tokens could never fit the pool or the limits (400)."""

    code = "context_length_exceeded"


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
    """No capacity now: the waiting queue is full or the wait timed out (429)."""

    status = 429
    type = "rate_limit_error"
    code = "server_overloaded"


class UnavailableError(APIError):
    """The model is not loaded or the engine is stopped (503)."""

    status = 503
    type = "server_error"
    code = "unavailable"


class GenerationError(APIError):
    """The model failed while generating this request (500, reported, not a crash)."""

    status = 500
    type = "server_error"
    code = "generation_failed"


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """Build the OpenAI error envelope."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(exc: APIError) -> JSONResponse:
    """Render an :class:`APIError` as a JSON response."""
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON: " + str(first.get("msg", "")), None
    parts = []
    for err in errors[:5]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts), param


_STATUS_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception family to the OpenAI error shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(
            error_body(message, "invalid_request_error", param, "invalid_value"), status_code=400
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        if status == 404:
            message = f"no route {request.method} {request.url.path}; see GET /v1/models, " \
                      "POST /v1/completions, POST /v1/chat/completions"
        elif status == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        body = error_body(message, _STATUS_TYPES.get(status, "invalid_request_error"),
                          None, str(status))
        return JSONResponse(body, status_code=status, headers=getattr(exc, "headers", None))

    @app.exception_handler(VeloxQuantError)
    async def _library(_: Request, exc: VeloxQuantError) -> JSONResponse:
        # A library error that reached a route is a misuse we did not foresee:
        # report it plainly instead of a bare 500 page.
        log.error("library error reached a route: %s", exc)
        return JSONResponse(error_body(str(exc), "server_error", None, type(exc).__name__),
                            status_code=500)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error (a bug): %s", exc)
        return JSONResponse(
            error_body("internal server error; see the server log", "server_error", None,
                       "internal_error"),
            status_code=500,
        )
