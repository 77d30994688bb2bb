"""Operator routes behind ``Authorization: Bearer $VELOXQUANT_ADMIN_TOKEN`` (see auth.py)."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from server.http.auth import require_admin
from server.http.errors import ConflictError, UnavailableError
from server.metrics_collectors import request_blocks_in_use
from server.protocol import ShrinkRefused

HISTORY_SHOWN = 16
RANKS_TIMEOUT_S = 10.0  # longest wait for every rank's pool figures (/admin/pool)

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])


class ShrinkRequest(BaseModel):
    """Retire free blocks of a stream down to ``target_free`` free ones.

    ``force`` allows a shrink below one maximal request (``/health`` then
    reports ``degraded``). Strict types: ``"5"`` is not a count.
    """

    model_config = ConfigDict(extra="forbid", strict=True)
    stream: Literal["k", "v", "kv"]
    target_free: int = Field(..., ge=0)
    force: bool = False


def pool_view(request: Request) -> dict[str, Any]:
    """Live stats, config, recent history and blocks held per live owner."""
    engine = request.app.state.engine
    pool = engine.pool
    history = pool.history() if callable(pool.history) else pool.history
    live = engine.live_requests()
    held = pool.blocks_held_by_owner()  # requests only: cached blocks are "prefix_cache"'s
    config = pool.config
    return {
        "stats": _stats(pool),
        # n_blocks: the pool's size now (after shrinks and growth), not the start-up size.
        "config": {"block_size": config.block_size, "n_blocks": pool.stats.n_blocks,
                   "separate_kv": config.separate_kv,
                   "grow_on_exhaustion": config.grow_on_exhaustion,
                   "max_blocks": config.max_blocks},
        "free": {s: pool.n_free(s) for s in config.streams},
        "history": [snap.as_dict() for snap in list(history)[-HISTORY_SHOWN:]],
        "owners": [{"owner": owner, "request_id": live.get(owner), "blocks": n}
                   for owner, n in sorted(held.items())],
        "prefix_cache": _cache_view(engine),
        **kv_view(engine, request.app.state.metrics),
    }


def kv_view(engine: Any, metrics: Any) -> dict[str, int | str | None]:
    """KV format (name and block tag) and bytes: per block, in use (live), reserved (last
    engine step), workspace (fixed).

    None before the model is loaded (the arena is laid out for the model).
    """
    kv = getattr(engine, "kv", None)
    if kv is None:
        return dict.fromkeys(("kv_format", "kv_format_tag", "kv_bytes_per_block",
                              "kv_bytes_in_use", "kv_bytes_reserved", "kv_workspace_bytes"))
    sample = metrics.kv_bytes() if metrics is not None else {}
    return {"kv_format": kv.kv_format, "kv_format_tag": kv.format_tag,
            "kv_bytes_per_block": kv.bytes_per_block,
            "kv_bytes_in_use": request_blocks_in_use(engine.pool,
                                                     engine.pool.stats.blocks_in_use())
            * kv.bytes_per_block,
            "kv_bytes_reserved": sample.get("reserved", 0),
            "kv_workspace_bytes": kv.workspace_bytes}


@router.get("/pool")
async def admin_pool(request: Request) -> dict[str, Any]:
    """The pool as an operator sees it; with a model split over ranks, every rank's pool."""
    view = pool_view(request)
    ranks = getattr(request.app.state.engine, "rank_figures", None)
    figures = ranks() if ranks is not None else None
    if figures is not None:
        try:  # from the engine thread, which may be busy with a step or stopped for good
            rows = await asyncio.wait_for(asyncio.wrap_future(figures), RANKS_TIMEOUT_S)
        except Exception as exc:
            raise UnavailableError(f"the other ranks did not answer: {exc!r}") from exc
        view["ranks"] = [{"rank": rank, **row} for rank, row in enumerate(rows)]
    return view


@router.post("/shrink")
async def admin_shrink(body: ShrinkRequest, request: Request) -> dict[str, Any]:
    """Retire free blocks; blocks running requests hold or reserved are never touched.

    409 when the pool could no longer hold one maximal request, unless ``force``.
    ``kept_free`` is what each stream has free afterwards, counting cached blocks no
    request references (admission evicts them when it needs the room).
    """
    engine = request.app.state.engine
    if not engine.is_ready:
        raise UnavailableError("the engine is not running yet")
    try:
        retired, kept = await asyncio.wrap_future(
            engine.shrink(body.stream, body.target_free, body.force))
    except ShrinkRefused as exc:
        raise ConflictError(str(exc), param="target_free", code="shrink_refused") from None
    return {"retired": retired, "kept_free": kept, "degraded": engine.degraded,
            "stats": _stats(engine.pool)}


@router.post("/cache/reset")
async def admin_cache_reset(request: Request) -> dict[str, Any]:
    """Drop every cached prefix block no running request references.

    ``evicted``: pool blocks freed (0 with prefix caching off).
    """
    engine = request.app.state.engine
    if not engine.is_ready:
        raise UnavailableError("the engine is not running yet")
    evicted = await asyncio.wrap_future(engine.reset_prefix_cache())
    return {"evicted": evicted, "prefix_cache": _cache_view(engine)}


def _stats(pool: Any) -> dict[str, Any]:
    """The pool's stats (``blocks_in_use == n_allocations - n_frees``, cached prefix blocks
    included) and ``request_blocks_in_use``, the requests' share (as /metrics)."""
    stats = pool.stats.snapshot().as_dict()
    stats["request_blocks_in_use"] = request_blocks_in_use(pool, stats["blocks_in_use"])
    return stats


def _cache_view(engine: Any) -> dict[str, Any]:
    """Prefix caching figures; ``enabled`` false (and zeros) when it is off."""
    cache = getattr(engine, "prefix_cache", None)
    if cache is None:
        return {"enabled": False, "cached_blocks": 0, "evictable_blocks": 0}
    return {"enabled": True, **cache.view()}
