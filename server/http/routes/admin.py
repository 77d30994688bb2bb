"""Operator routes behind ``Authorization: Bearer $VELOXQUANT_ADMIN_TOKEN`` (see auth.py)."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from server.http.auth import require_admin
from server.http.errors import UnavailableError

HISTORY_SHOWN = 16

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
        raise UnavailableError("the engine is not running yet")
    retired, floors = await asyncio.wrap_future(engine.shrink(body.stream, body.target_free))
    return {"retired": retired, "kept_free": floors,
            "stats": engine.pool.stats.snapshot().as_dict()}
