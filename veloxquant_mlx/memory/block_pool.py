"""Fixed-size block bookkeeping for KV-cache memory, per owner. Pure Python, no MLX.

The pool pre-creates every block up front and hands them out by owner id
(one owner per request). Freed blocks go back on a LIFO stack, so the block
a request just returned is the first one the next request gets: the stacks,
growth, shrinking and capacity are :class:`~veloxquant_mlx.memory.free_stacks.
FreeStacks`, which :class:`BlockPoolAllocator` extends with the owners.

Invariants (checked by the stateful tests):
    * every block id is on exactly one free stack xor owned by one owner xor
      held by the pool's prefix cache (``prefix_cache.py``);
    * ``stats.blocks_in_use() == n_allocations - n_frees == owned + cached blocks``;
    * ``stats.n_blocks == free + in use`` and ids ever created ==
      ``n_blocks + n_retired``.
"""

from __future__ import annotations

from collections.abc import Iterable

from veloxquant_mlx.exceptions import (
    OwnerAlreadyActiveError,
    PoolArgumentError,
    PoolArgumentTypeError,
)
from veloxquant_mlx.memory.free_stacks import FreeStacks
from veloxquant_mlx.memory.pool_config import PoolConfig, check_count
from veloxquant_mlx.memory.prefix_cache import PrefixCache
from veloxquant_mlx.memory.records import (
    CACHED,
    AllocationStats,
    Block,
)

__all__ = ["AllocationStats", "Block", "BlockPoolAllocator", "PoolConfig"]


def _as_count(n_tokens: object) -> int:
    """``n_tokens`` as a plain int, or the typed error (kept off the hot path).

    An int subclass (an ``IntEnum`` member, say) is an int, as PoolConfig
    accepts it; it is converted so the pool only ever stores plain ints.
    """
    return int(check_count("n_tokens", n_tokens, 1))


def _as_owner(owner: object) -> int:
    """``owner`` as a plain int, or the typed error (see :func:`_as_count`).

    The lowest int64 is the prefix cache's mark (:data:`CACHED`), never an owner.
    """
    return int(check_count("owner", owner, CACHED + 1))


class BlockPoolAllocator(FreeStacks):
    """Thread-safe allocator of fixed-size blocks, tracked per owner.

    One plain (non-reentrant) lock guards every method; nothing here calls
    out while holding it. Each call costs O(blocks it touches): counters are
    kept, never recounted, and owners index their blocks by id. The hot path
    (``allocate``/``free_all``) is written for CPython's per-operation costs:
    explicit acquire/release, counters in one list, no per-call objects
    beyond the returned list and one history tuple.
    """

    def __init__(self, config: PoolConfig | None = None) -> None:
        super().__init__(config)
        # owner -> {block_id: block} in allocation order; an entry per active owner
        self._owned: dict[int, dict[object, Block]] = {}
        self._released: set[int] = set()  # release_owner()'d owners still holding blocks
        # owner -> blocks it holds per stream (only owners holding some; kept, not recounted)
        self._per_stream: dict[int, dict[str, int]] = {}
        # Full blocks of finished prompts kept for reuse (hash, references, LRU):
        # allocation evicts its unreferenced ones before it grows or refuses.
        self.prefix_cache = PrefixCache(self)

    def _count(self, owner: int, stream: str, delta: int) -> None:
        """Add ``delta`` to the blocks ``owner`` holds on ``stream`` (zeros are dropped)."""
        counts = self._per_stream.get(owner)
        if counts is None:
            counts = self._per_stream[owner] = {}
        n = counts.get(stream, 0) + delta
        if n:
            counts[stream] = n
            return
        del counts[stream]
        if not counts:
            del self._per_stream[owner]

    # -- a block's filled slots ----------------------------------------------

    def _set_used(self, block: Block, value: int) -> None:
        """Back end of ``Block.n_used = value`` (the setter checked its type): keep the
        partial count exact."""
        if not 0 <= value <= self._block_size:
            raise PoolArgumentError(f"n_used must be in [0, {self._block_size}], got {value}")
        self._acquire()
        try:
            if block.owner is not None:
                bs = self._block_size
                self.stats.n_partial += (value < bs) - (block._n_used < bs)
            block._n_used = value
        finally:
            self._release()

    def set_used(self, blocks: list[Block], value: int) -> None:
        """``block.n_used = value`` for every block of ``blocks``, under one lock.

        A paged batch advances the last block of every layer's keys and values
        of a row each step: one call per row instead of one locked setter per block.
        """
        if isinstance(value, bool) or not isinstance(value, int):
            raise PoolArgumentTypeError(f"n_used must be an int, got {type(value).__name__}")
        bs = self._block_size
        if not 0 <= value <= bs:
            raise PoolArgumentError(f"n_used must be in [0, {bs}], got {value}")
        self._acquire()
        try:
            for block in blocks:
                if block.owner is not None:
                    self.stats.n_partial += (value < bs) - (block._n_used < bs)
                block._n_used = value
        finally:
            self._release()

    # -- allocation ---------------------------------------------------------

    def allocate(
        self, stream: object, n_tokens: object, owner: object, format: object = "fp16"
    ) -> list[Block]:
        """Check out enough blocks for ``n_tokens`` slots to ``owner``.

        All-or-nothing: on failure no block changes hands.

        Args:
            stream: "k" or "v" ("kv" on a pool with ``separate_kv=False``,
                where any of the three means the shared stream).
            n_tokens: Token slots needed; ``ceil(n_tokens / block_size)``
                blocks are handed out, full but for the remainder in the last.
            owner: Integer id (e.g. a request id) the blocks are checked out to.
            format: Compression-format tag recorded on each block.

        Returns:
            The new blocks, most recently freed first.

        Raises:
            BlockPoolExhaustedError: Not enough free blocks and no room to grow.
            PoolArgumentError: ``n_tokens <= 0`` or an unknown stream.
            PoolArgumentTypeError: ``n_tokens``/``owner`` not an int,
                ``format`` not a str.
        """
        # Arguments are typed ``object`` and narrowed here, so that a compiled
        # build reports bad input with our typed errors, not a generic one.
        if type(n_tokens) is not int or n_tokens <= 0:
            n_tokens = _as_count(n_tokens)
        if type(owner) is not int or owner == CACHED:
            owner = _as_owner(owner)
        if type(format) is not str:
            raise PoolArgumentTypeError(f"format must be a str, got {type(format).__name__}")
        if type(stream) is not str:
            raise self._stream_error(stream)
        bs = self._block_size
        self._acquire()
        try:
            st = self._pick_stream(stream)
            c = self.stats
            owned = self._owned.get(owner)
            fresh_owner = owned is None
            if owned is None:
                owned = {}  # published below, once the blocks are taken
            if n_tokens > bs:
                n = -(-n_tokens // bs)
                taken = self._take(st, n, owner, format, n_tokens - (n - 1) * bs, owned)
            else:
                taken = [self._take_one(st, owner, format, n_tokens, owned)]
                n = 1
            if fresh_owner:
                self._owned[owner] = owned
            self._count(owner, st.name, n)
            if self._released:
                self._released.discard(owner)  # growing again re-activates it
            self._count_allocations(c, n)
            return taken
        finally:
            self._release()

    # -- release ------------------------------------------------------------

    def _into_cache(self, owner: int, blocks: list[Block]) -> None:
        """Hand ``owner``'s ``blocks`` to the prefix cache (lock held); all or none.

        They stay in use (no counter moves) and leave ``owner``'s list.
        """
        owned = self._owned.get(owner, {})
        for block in blocks:
            self._live_block(block, "publish")
            if block.owner != owner or block._key not in owned:
                raise PoolArgumentError(
                    f"block {block.block_id} is held by {block.owner}, not {owner}; only a "
                    "request's own written blocks can be published")
        for block in blocks:
            if owned.pop(block._key, None) is not None:
                self._count(owner, block.stream, -1)
            block.owner = CACHED
        if not owned and owner in self._released:  # a retired owner's last block
            self._owned.pop(owner, None)
            self._released.discard(owner)

    def free(self, blocks: Iterable[object]) -> None:
        """Return ``blocks`` to the pool. Freeing an already-free block is a no-op.

        Raises:
            ForeignBlockError: A block is not one of this pool's live blocks;
                nothing is freed in that case.
            PoolArgumentTypeError: ``blocks`` is one block, or not a collection.
        """
        if isinstance(blocks, Block) or not hasattr(blocks, "__iter__"):
            raise PoolArgumentTypeError(
                f"free() takes a list of blocks, got {type(blocks).__name__}")
        self._acquire()
        try:
            checked = [self._live_block(block, "free") for block in blocks]
            to_free = []
            for block in checked:
                owner = block.owner
                if owner is None:
                    continue
                owned = self._owned.get(owner)
                if owned is None or owned.pop(block._key, None) is None:
                    continue  # already free, or listed twice in this call
                to_free.append(block)
                self._count(owner, block.stream, -1)
                if not owned:  # its last block: the owner is done
                    del self._owned[owner]
                    self._released.discard(owner)
            if to_free:
                self._push_back(to_free)
        finally:
            self._release()

    def free_all(self, owner: object) -> None:
        """Return every block checked out to ``owner`` and retire the owner id."""
        if type(owner) is not int or owner == CACHED:
            owner = _as_owner(owner)
        self._acquire()
        try:
            owned = self._owned.pop(owner, None)
            self._per_stream.pop(owner, None)
            if self._released:
                self._released.discard(owner)
            if owned:
                self._push_back(list(owned.values()))
        finally:
            self._release()

    def transfer(self, blocks: Iterable[object], owner: object) -> None:
        """Hand checked-out ``blocks`` over to ``owner``; nothing is freed or counted.

        Counters and history are unchanged (the blocks stay in use). An owner left
        holding nothing stays active (it is still running), as after
        :meth:`register_owner`.

        Raises:
            ForeignBlockError: A block is not one of this pool's live blocks.
            PoolArgumentError: A block is free, or the prefix cache's (only
                blocks checked out to an owner move).
            PoolArgumentTypeError: ``owner`` is not an int.
            Nothing moves when any of these is raised.
        """
        if type(owner) is not int or owner == CACHED:
            owner = _as_owner(owner)
        self._acquire()
        try:
            checked: list[Block] = []
            for item in blocks:
                block = self._live_block(item, "transfer")
                if block.owner is None:
                    raise PoolArgumentError(
                        f"block {block.block_id} is free; only checked-out blocks can be "
                        "transferred (allocate it first)"
                    )
                if block.owner == CACHED:
                    raise PoolArgumentError(
                        f"block {block.block_id} is held by the prefix cache; requests "
                        "reference cached blocks (prefix_cache.acquire), they never own them")
                checked.append(block)
            target = self._owned.get(owner)
            if target is None:
                target = self._owned[owner] = {}
            self._released.discard(owner)
            for block in checked:
                old = block.owner
                source = self._owned.get(old) if old is not None else None
                if old is not None and source is not None:
                    if source.pop(block._key, None) is not None:
                        self._count(old, block.stream, -1)
                    if not source and old in self._released:  # a retired owner's last block
                        del self._owned[old]
                        self._released.discard(old)
                block.owner = owner
                if block._key not in target:  # listed twice: moved once
                    target[block._key] = block
                    self._count(owner, block.stream, 1)
        finally:
            self._release()

    # -- owners -------------------------------------------------------------

    def register_owner(self, owner: object) -> None:
        """Claim ``owner`` explicitly, so that a colliding second claim raises.

        Raises:
            OwnerAlreadyActiveError: ``owner`` holds blocks or was registered
                and not yet released.
        """
        if type(owner) is not int or owner == CACHED:
            owner = _as_owner(owner)
        self._acquire()
        try:
            if owner in self._owned and owner not in self._released:
                raise OwnerAlreadyActiveError(owner)
            self._released.discard(owner)
            self._owned.setdefault(owner, {})
        finally:
            self._release()

    def release_owner(self, owner: object) -> None:
        """Drop ``owner`` from the active set without freeing its blocks."""
        if type(owner) is not int or owner == CACHED:
            owner = _as_owner(owner)
        self._acquire()
        try:
            owned = self._owned.get(owner)
            if owned:
                self._released.add(owner)  # blocks stay reachable for free_all
            elif owned is not None:
                del self._owned[owner]
        finally:
            self._release()

    def active_owners(self) -> list[int]:
        """Owners that are registered or hold blocks (and were not released), sorted."""
        self._acquire()
        try:
            return sorted(set(self._owned) - self._released)
        finally:
            self._release()

    def blocks_for(self, owner: object) -> list[Block]:
        """Blocks checked out to ``owner``, in allocation order."""
        if type(owner) is not int or owner == CACHED:
            owner = _as_owner(owner)
        self._acquire()
        try:
            owned = self._owned.get(owner)
            return list(owned.values()) if owned else []
        finally:
            self._release()

    def n_blocks_held(self, owner: object) -> int:
        """How many blocks ``owner`` holds, without copying them."""
        if type(owner) is not int or owner == CACHED:
            owner = _as_owner(owner)
        self._acquire()
        try:
            owned = self._owned.get(owner)
            return len(owned) if owned else 0
        finally:
            self._release()

    def n_blocks_held_per_stream(self, owner: object) -> dict[str, int]:
        """How many blocks ``owner`` holds on each stream it holds any of.

        What admission asks of every running request (blocks reserved less
        blocks held, per stream), so the counts are kept as blocks change hands
        (allocate, free, transfer), not recounted: O(streams), not O(blocks).
        """
        if type(owner) is not int or owner == CACHED:
            owner = _as_owner(owner)
        self._acquire()
        try:
            return dict(self._per_stream.get(owner, {}))
        finally:
            self._release()

    def blocks_held_by_owner(self) -> dict[int, int]:
        """Blocks held per owner (owners holding none are left out)."""
        self._acquire()
        try:
            return {owner: len(owned) for owner, owned in self._owned.items() if owned}
        finally:
            self._release()

    def __repr__(self) -> str:
        return f"BlockPoolAllocator({self.config!r}, {self.stats!r})"
