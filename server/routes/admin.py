"""Operator routes behind ``Authorization: Bearer $VELOXQUANT_ADMIN_TOKEN``.

No token configured -> 403 (the routes are off, never open); a missing or
wrong token -> 401. Tokens are compared in constant time. The optional API
key of the inference routes (``VELOXQUANT_API_KEY``) is checked here too.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from server.errors import AuthenticationError, InvalidRequestError, PermissionDeniedError

HISTORY_SHOWN = 16


def _bearer_matches(request: Request, token: str) -> bool:
    """Constant-time check of ``Authorization: Bearer <token>``."""
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(),
                                                              token.encode())


def require_api_key(request: Request) -> None:
    """Dependency of the inference routes: with ``VELOXQUANT_API_KEY`` set, demand it."""
    key = request.app.state.settings.api_key
    if key and not _bearer_matches(request, key):
        raise AuthenticationError("missing or wrong API key (Authorization: Bearer ...)")


def require_admin(request: Request) -> None:
    """Dependency: let the request through only with the configured admin token."""
    token = request.app.state.settings.admin_token
    if not token:
        raise PermissionDeniedError(
            "admin routes are disabled: set VELOXQUANT_ADMIN_TOKEN in the server's "
            "environment to enable them")
    if not _bearer_matches(request, token):
        raise AuthenticationError("missing or wrong admin token (Authorization: Bearer ...)")


router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])


class ShrinkRequest(BaseModel):
    """Retire free blocks of a stream down to ``target_free`` free ones."""

    model_config = ConfigDict(extra="forbid")
    stream: Literal["k", "v", "kv"]
    target_free: int = Field(..., ge=0)


def pool_view(request: Request) -> dict[str, Any]:
    """Live stats, config, recent history and blocks held per live owner."""
    engine = request.app.state.engine
    pool = engine.pool
    history = pool.history() if callable(pool.history) else pool.history
    live = engine.live_requests()
    held = pool.blocks_held_by_owner()
    config = pool.config
    return {
        "stats": pool.stats.snapshot().as_dict(),
        "config": {"block_size": config.block_size, "n_blocks": config.n_blocks,
                   "separate_kv": config.separate_kv,
                   "grow_on_exhaustion": config.grow_on_exhaustion,
                   "max_blocks": config.max_blocks},
        "free": {s: pool.n_free(s) for s in config.streams},
        "history": [snap.as_dict() for snap in list(history)[-HISTORY_SHOWN:]],
        "owners": [{"owner": owner, "request_id": live.get(owner), "blocks": n}
                   for owner, n in sorted(held.items())],
    }


@router.get("/pool")
async def admin_pool(request: Request) -> dict[str, Any]:
    """The pool as an operator sees it."""
    return pool_view(request)


@router.post("/shrink")
async def admin_shrink(body: ShrinkRequest, request: Request) -> dict[str, Any]:
    """Retire free blocks; blocks running requests hold or reserved are never touched."""
    engine = request.app.state.engine
    if not engine.is_ready:
        raise InvalidRequestError("the engine is not running yet", status=503)
    retired, floors = await asyncio.wrap_future(engine.shrink(body.stream, body.target_free))
    return {"retired": retired, "kept_free": floors,
            "stats": engine.pool.stats.snapshot().as_dict()}
