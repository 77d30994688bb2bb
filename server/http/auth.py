"""Bearer-token checks as FastAPI security dependencies.

- :func:`require_api_key`: the inference routes, when ``VELOXQUANT_API_KEY`` is set.
- :func:`require_admin`: the ``/admin`` routes. No ``VELOXQUANT_ADMIN_TOKEN``
  configured -> 403 (the routes are off, never open); a missing or wrong
  token -> 401.
- :func:`require_metrics_key`: ``GET /metrics``, when
  ``server.metrics_require_key`` is on and an API key is set.

``HTTPBearer(auto_error=False)`` parses the header (and documents the scheme
in the OpenAPI schema); the answers stay ours, in the OpenAI error shape.
Tokens are compared in constant time, as bytes: the header's bytes as sent
(Starlette decodes headers as Latin-1) against the token's ASCII (settings
refuse non-ASCII tokens at start-up).

FastAPI parses a JSON body before it runs dependencies, so a request with
bad JSON and no key would learn 400 before 401. :func:`early_refusal` runs
the same checks on the raw headers in the ASGI guards, before any route or
body parsing; the dependencies stay as the routes' documented security.

The dependencies are ``async def`` although they never await: FastAPI runs a
plain ``def`` dependency on its thread pool, a thread hop (and at times a new
thread) for every request.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from server.http.errors import APIError, AuthenticationError, PermissionDeniedError
from server.settings import Settings

_bearer = HTTPBearer(auto_error=False, description="Authorization: Bearer <token>")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


# Paths behind the API key (besides the routes that declare require_api_key): the docs.
DOC_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")
# Keyed routes outside /v1 (server/http/routes/tokens.py, vLLM's paths).
TOKEN_PATHS = ("/tokenize", "/detokenize")


def _token_matches(presented: str, token: str) -> bool:
    return hmac.compare_digest(presented.strip().encode("latin-1", "replace"),
                               token.encode())


def _matches(credentials: HTTPAuthorizationCredentials | None, token: str) -> bool:
    return credentials is not None and _token_matches(credentials.credentials, token)


def _header_matches(authorization: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header value carries ``Bearer <token>``."""
    scheme, _, presented = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and _token_matches(presented, token)


def early_refusal(settings: Settings, path: str, authorization: str | None) -> APIError | None:
    """The auth error a request to ``path`` gets before anything reads its body, if any.

    Mirrors the dependencies below: ``/admin/*`` wants the admin token,
    ``/v1/*``, the token routes and the docs the API key (when set), ``/metrics`` the key
    with ``server.metrics_require_key``.
    """
    if path == "/admin" or path.startswith("/admin/"):
        if not settings.admin_token:
            return PermissionDeniedError(_ADMIN_OFF)
        if not _header_matches(authorization, settings.admin_token):
            return AuthenticationError(_ADMIN_WRONG)
        return None
    key = settings.api_key
    if not key or _header_matches(authorization, key):
        return None
    if path.startswith("/v1/") or path in DOC_PATHS or path in TOKEN_PATHS:
        return AuthenticationError(_KEY_WRONG)
    if path == "/metrics" and settings.server.metrics_require_key:
        return AuthenticationError(_METRICS_WRONG)
    return None


_KEY_WRONG = "missing or wrong API key (Authorization: Bearer ...)"
_ADMIN_OFF = ("admin routes are disabled: set VELOXQUANT_ADMIN_TOKEN in the server's "
              "environment to enable them")
_ADMIN_WRONG = "missing or wrong admin token (Authorization: Bearer ...)"
_METRICS_WRONG = ("missing or wrong API key for /metrics (Authorization: Bearer ...); "
                  "server.metrics_require_key is on")


async def require_api_key(request: Request, credentials: Credentials) -> None:
    """With ``VELOXQUANT_API_KEY`` set, demand it."""
    key = request.app.state.settings.api_key
    if key and not _matches(credentials, key):
        raise AuthenticationError(_KEY_WRONG)


async def require_admin(request: Request, credentials: Credentials) -> None:
    """Let the request through only with the configured admin token."""
    token = request.app.state.settings.admin_token
    if not token:
        raise PermissionDeniedError(_ADMIN_OFF)
    if not _matches(credentials, token):
        raise AuthenticationError(_ADMIN_WRONG)


async def require_metrics_key(request: Request, credentials: Credentials) -> None:
    """With ``server.metrics_require_key`` and an API key set, demand the key."""
    settings = request.app.state.settings
    if settings.server.metrics_require_key and settings.api_key \
            and not _matches(credentials, settings.api_key):
        raise AuthenticationError(_METRICS_WRONG)
