"""Typed errors raised by the library.

Every error derives from :class:`VeloxQuantError`, so callers (the server
above all) can map the whole family to a response in one place. Messages say
what happened and what to do about it.
"""

from __future__ import annotations


class VeloxQuantError(Exception):
    """Base class of every error the library raises on purpose."""


class BlockPoolExhaustedError(VeloxQuantError):
    """An allocation needed more free blocks than the pool could provide.

    Attributes:
        stream: The stream that ran out ("k", "v" or "kv").
        requested: Blocks the allocation needed.
        free: Blocks that were free in that stream at the time.
    """

    def __init__(self, stream: str, requested: int, free: int, detail: str = "") -> None:
        self.stream = stream
        self.requested = requested
        self.free = free
        message = (
            f"block pool exhausted on stream {stream!r}: {requested} block(s) requested, "
            f"{free} free"
        )
        if detail:
            message += f" ({detail})"
        message += (
            "; raise PoolConfig.n_blocks (or max_blocks with grow_on_exhaustion=True), "
            "or free finished requests' blocks first"
        )
        super().__init__(message)


class OwnerAlreadyActiveError(VeloxQuantError):
    """register_owner() was called for an owner id that is still active.

    Attributes:
        owner: The colliding owner id.
    """

    def __init__(self, owner: int) -> None:
        self.owner = owner
        super().__init__(
            f"owner {owner!r} is already active on this pool; give every concurrent request "
            "its own owner id, or call free_all()/release_owner() for the old one first"
        )


class ForeignBlockError(VeloxQuantError, ValueError):
    """A block handed to free() does not belong to this pool (or was retired)."""


class PoolArgumentError(VeloxQuantError, ValueError):
    """An argument to the block pool has a wrong value (e.g. ``n_tokens <= 0``)."""


class PoolArgumentTypeError(VeloxQuantError, TypeError):
    """An argument to the block pool has a wrong type (e.g. a bool token count)."""


class KVFormatError(VeloxQuantError, ValueError):
    """A KV storage format is unknown or cannot hold this model's keys and values."""


class CacheReleasedError(VeloxQuantError, ValueError):
    """A pool-accounted cache was used after ``release()`` gave its blocks back."""
