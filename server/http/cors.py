"""CORS for browser clients, off unless ``server.cors_allow_origins`` lists origins.

A loopback server should not answer drive-by pages, so by default no CORS
header is ever sent (a browser then keeps every answer from a page on
another origin). With origins configured, Starlette's ``CORSMiddleware``
answers preflights and marks answers for those origins; its refusal of a
preflight (origin, method or header not allowed) is rendered in the OpenAI
error shape like every other 4xx of this server.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response

from server.http.errors import error_body
from server.settings import Settings


class OpenAICORSMiddleware(CORSMiddleware):
    """Starlette's CORS middleware whose preflight refusals are OpenAI-shaped JSON."""

    def preflight_response(self, request_headers: Headers) -> Response:
        """The preflight answer; a 400 keeps its CORS headers and gets a JSON error body."""
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        headers = {k: v for k, v in response.headers.items()
                   if k not in ("content-length", "content-type")}
        message = (f"{bytes(response.body).decode()} for this server (server.cors_allow_origins "
                   "and the methods GET, POST)")
        return JSONResponse(error_body(message, "invalid_request_error", None, "cors_refused"),
                            status_code=400, headers=headers)


def add_cors(app: FastAPI, settings: Settings) -> None:
    """Answer browsers from ``server.cors_allow_origins`` (none by default: no CORS at all).

    Add it last, so it is outermost: a preflight (``OPTIONS``, never with
    credentials) is answered before the guards ask for the API key, and the
    guards' own refusals (401, 413, 429, 503) still carry the CORS headers a
    page needs to read them. Bearer tokens, not cookies, authenticate, so
    credentials stay off; every request header is allowed (the openai JS
    client sends its own ``x-stainless-*`` headers) and ``Retry-After`` is
    readable by the page.
    """
    origins = settings.server.cors_allow_origins
    if not origins:
        return
    app.add_middleware(OpenAICORSMiddleware, allow_origins=list(origins),
                       allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"],
                       expose_headers=["Retry-After", "x-request-id"], allow_credentials=False,
                       max_age=600)
