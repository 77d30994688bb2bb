"""Owner leases: one request's claim on a pool, shared by all its layers' caches.

A lease makes ``release()`` safe to call from any layer, any number of times:
the first call frees the owner's blocks, later calls (even after the owner id
was reused by a new request, which gets a new lease) do nothing.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

from veloxquant_mlx.exceptions import VeloxQuantError
from veloxquant_mlx.memory.block_pool import Block, BlockPoolAllocator


class OwnerLease:
    """One request's claim on a pool, shared by all of its layers' caches."""

    __slots__ = ("pool", "owner", "released", "__weakref__")

    def __init__(self, pool: BlockPoolAllocator, owner: int) -> None:
        self.pool = pool
        self.owner = owner
        self.released = False


class LayerGroup:
    """The caches of one model's layers for one request, in layer order.

    A model call appends the same tokens to each layer in turn; when the pool
    runs out in layer ``i``, layers ``0..i-1`` already hold them.
    :meth:`undo_step` gives them back, so the caller can free room and run the
    same step again. A group, not the whole lease: a draft model's caches may
    share the request's owner id, and its layers' offsets say nothing about
    this model's step. Members are held weakly (caches hold the group).
    """

    __slots__ = ("members",)

    def __init__(self, caches: Sequence[Any]) -> None:
        self.members = [weakref.ref(cache) for cache in caches]

    def undo_step(self, failed: Any, start: int, n_tokens: int) -> None:
        """Trim the ``n_tokens`` appended from ``start`` off the members before ``failed``."""
        for ref in self.members:
            cache = ref()
            if cache is failed:
                return  # later layers have not run this step
            if cache is not None and cache.offset == start + n_tokens:
                cache.trim(n_tokens)


# id(pool) -> {owner: live lease}. Caches made for the same (pool, owner)
# while a lease is live share it; a released lease leaves the table, so a
# reused owner id starts a fresh lease that old caches cannot touch. Keyed by
# id, not weakly by the pool: the compiled allocator (setup.py) cannot be
# weakly referenced. The leases are held weakly: the table must not keep a
# pool alive whose caches were dropped without release() (held strongly, each
# such pool would stay in memory for good). A live lease holds its pool, so a lease found
# under an id belongs to that live pool; an emptied table (its pool's leases
# all gone) is dropped when the next lease is made.
_LEASES: dict[int, weakref.WeakValueDictionary[int, OwnerLease]] = {}
_LEASES_LOCK = threading.Lock()


def lease_for(pool: BlockPoolAllocator, owner: int) -> OwnerLease:
    """The live lease of ``(pool, owner)``, created if there is none."""
    with _LEASES_LOCK:
        table = _LEASES.get(id(pool))
        if table is None:
            for key in [key for key, leases in _LEASES.items() if not len(leases)]:
                del _LEASES[key]
            table = _LEASES[id(pool)] = weakref.WeakValueDictionary()
        lease = table.get(owner)
        if lease is None:
            lease = table[owner] = OwnerLease(pool, owner)
        return lease


def release_lease(lease: OwnerLease) -> bool:
    """Free the lease's blocks once. Returns False when it was already released."""
    with _LEASES_LOCK:
        if lease.released:
            return False
        lease.released = True
        table = _LEASES.get(id(lease.pool))
        if table is not None and table.get(lease.owner) is lease:
            del table[lease.owner]
    lease.pool.free_all(lease.owner)
    return True


def require_owned(blocks: Sequence[Block], owner: int, start: int = 0) -> None:
    """Raise unless ``blocks[start:]`` are all still checked out to ``owner``.

    ``pool.free_all(owner)`` called behind a cache's back returns its blocks,
    and the pool may already have handed them to another request: a cache
    checks the blocks it is about to change or free, so it never touches
    another owner's.

    Raises:
        VeloxQuantError: Naming the first block that changed hands.
    """
    for i in range(start, len(blocks)):
        block = blocks[i]
        if block.owner != owner:
            raise VeloxQuantError(
                f"block {block.block_id} of this cache no longer belongs to owner {owner} "
                f"(now {block.owner!r}): pool.free_all({owner}) was called while the cache "
                "was in use. Use cache.release() when a request ends, and build new caches "
                "for the next one"
            )
