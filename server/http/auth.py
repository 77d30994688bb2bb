"""Bearer-token checks as FastAPI security dependencies.

- :func:`require_api_key`: the inference routes, when ``VELOXQUANT_API_KEY`` is set.
- :func:`require_admin`: the ``/admin`` routes. No ``VELOXQUANT_ADMIN_TOKEN``
  configured -> 403 (the routes are off, never open); a missing or wrong
  token -> 401.
- :func:`require_metrics_key`: ``GET /metrics``, when
  ``server.metrics_require_key`` is on and an API key is set.

``HTTPBearer(auto_error=False)`` parses the header (and documents the scheme
in the OpenAPI schema); the answers stay ours, in the OpenAI error shape.
Tokens are compared in constant time.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from server.http.errors import AuthenticationError, PermissionDeniedError

_bearer = HTTPBearer(auto_error=False, description="Authorization: Bearer <token>")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _matches(credentials: HTTPAuthorizationCredentials | None, token: str) -> bool:
    return credentials is not None and hmac.compare_digest(
        credentials.credentials.strip().encode(), token.encode())


def require_api_key(request: Request, credentials: Credentials) -> None:
    """With ``VELOXQUANT_API_KEY`` set, demand it."""
    key = request.app.state.settings.api_key
    if key and not _matches(credentials, key):
        raise AuthenticationError("missing or wrong API key (Authorization: Bearer ...)")


def require_admin(request: Request, credentials: Credentials) -> None:
    """Let the request through only with the configured admin token."""
    token = request.app.state.settings.admin_token
    if not token:
        raise PermissionDeniedError(
            "admin routes are disabled: set VELOXQUANT_ADMIN_TOKEN in the server's "
            "environment to enable them")
    if not _matches(credentials, token):
        raise AuthenticationError("missing or wrong admin token (Authorization: Bearer ...)")


def require_metrics_key(request: Request, credentials: Credentials) -> None:
    """With ``server.metrics_require_key`` and an API key set, demand the key."""
    settings = request.app.state.settings
    if settings.server.metrics_require_key and settings.api_key \
            and not _matches(credentials, settings.api_key):
        raise AuthenticationError(
            "missing or wrong API key for /metrics (Authorization: Bearer ...); "
            "server.metrics_require_key is on")
