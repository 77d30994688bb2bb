"""Fixed-size block bookkeeping for KV-cache memory. Pure Python, no MLX.

The pool pre-creates every block up front and hands them out by owner id
(one owner per request). Freed blocks go back on a LIFO stack, so the block
a request just returned is the first one the next request gets.

Free stack of one stream (top = next block handed out)::

    bottom                                                     top
    [ fresh n-1 ... fresh 1, fresh 0 | recycled ... last freed ]
      ^-- never handed out (n_fresh) ^-- handed out before, then freed

Freed blocks are always pushed on top and allocations pop from the top, so
the never-allocated blocks stay a contiguous run at the bottom. That lets
``n_reused`` be counted in O(1) per call: of ``n`` popped blocks,
``min(n, len(stack) - n_fresh)`` are recycled.

Invariants (checked by the stateful tests):
    * every block id is on exactly one free stack xor owned by one owner;
    * ``stats.blocks_in_use() == n_allocations - n_frees == owned blocks``;
    * ``stats.n_blocks == free + in use`` and ids ever created ==
      ``n_blocks + n_retired``.
"""

from __future__ import annotations

import threading
from collections import deque

from veloxquant_mlx.exceptions import (
    BlockPoolExhaustedError,
    ForeignBlockError,
    OwnerAlreadyActiveError,
    PoolArgumentError,
    PoolArgumentTypeError,
)
from veloxquant_mlx.memory.records import (
    HISTORY_LEN,
    SHARED_STREAM,
    AllocationStats,
    Block,
    PoolConfig,
    check_count,
)

__all__ = ["AllocationStats", "Block", "BlockPoolAllocator", "PoolConfig"]


class BlockPoolAllocator:
    """Thread-safe allocator of fixed-size blocks, tracked per owner.

    One plain (non-reentrant) lock guards every method; nothing here calls
    out while holding it. Each call costs O(blocks it touches): counters are
    kept, never recounted, and owners index their blocks by id.
    """

    def __init__(self, config: PoolConfig | None = None) -> None:
        self.config = config if config is not None else PoolConfig()
        self._lock = threading.Lock()
        self._block_size = self.config.block_size
        self._blocks: dict[int, Block] = {}  # every live (not retired) block by id
        self._free: dict[str, list[Block]] = {}  # stream -> LIFO stack, top at the end
        self._n_fresh: dict[str, int] = {}  # stream -> never-allocated run at the bottom
        self._owned: dict[int, dict[int, Block]] = {}  # owner -> {block_id: block}, in order
        self._active: set[int] = set()
        self._next_id = 0
        self.stats = AllocationStats(n_blocks=self.config.n_blocks)
        self._history: deque[tuple[int, ...]] = deque(maxlen=HISTORY_LEN)
        streams = self.config.streams
        share, extra = divmod(self.config.n_blocks, len(streams))
        for i, stream in enumerate(streams):
            self._free[stream] = []
            self._n_fresh[stream] = 0
            self._add_fresh(stream, share + (1 if i < extra else 0))
        # Stream-name aliasing: with one shared stream "k", "v" and "kv" all mean it.
        self._stream_of = {s: s for s in streams}
        if not self.config.separate_kv:
            self._stream_of.update({"k": SHARED_STREAM, "v": SHARED_STREAM})

    # -- internal helpers (call with the lock held) -------------------------

    def _add_fresh(self, stream: str, count: int) -> None:
        """Create ``count`` new blocks at the bottom of ``stream``'s stack."""
        new = []
        for block_id in range(self._next_id, self._next_id + count):
            block = Block(block_id, stream)
            block._pool = self
            self._blocks[block_id] = block
            new.append(block)
        self._next_id += count
        new.reverse()  # lowest id nearest the top of the fresh run
        stack = self._free[stream]
        stack[:0] = new
        self._n_fresh[stream] += count

    def _record(self) -> None:
        s = self.stats
        self._history.append(
            (s.n_blocks, s.n_allocations, s.n_frees, s.n_reused, s.n_exhausted, s.n_grown,
             s.n_retired, s.peak_blocks_in_use, s.n_partial)
        )

    def _resolve(self, stream: str) -> str:
        try:
            return self._stream_of[stream]
        except (KeyError, TypeError):
            raise PoolArgumentError(
                f"unknown stream {stream!r}; this pool (separate_kv="
                f"{self.config.separate_kv}) accepts {sorted(self._stream_of)}"
            ) from None

    def _grow_or_raise(self, stream: str, needed: int) -> None:
        """Make ``needed`` blocks free on ``stream`` or raise (counting the miss)."""
        free = len(self._free[stream])
        gap = needed - free
        cap = self.config.max_blocks
        if self.config.grow_on_exhaustion and (cap is None or self.stats.n_blocks + gap <= cap):
            self._add_fresh(stream, gap)
            self.stats.n_blocks += gap
            self.stats.n_grown += gap
            return
        self.stats.n_exhausted += needed
        self._record()
        detail = ""
        if self.config.grow_on_exhaustion:
            detail = f"growing by {gap} would pass max_blocks={cap}"
        raise BlockPoolExhaustedError(stream, needed, free, detail)

    def _set_used(self, block: Block, value: int) -> None:
        """Back end of ``Block.n_used = value``: keep the partial count exact."""
        if isinstance(value, bool) or not isinstance(value, int):
            raise PoolArgumentTypeError(f"n_used must be an int, got {type(value).__name__}")
        if not 0 <= value <= self._block_size:
            raise PoolArgumentError(f"n_used must be in [0, {self._block_size}], got {value}")
        self._lock.acquire()
        try:
            if block.owner is not None:
                bs = self._block_size
                self.stats.n_partial += (value < bs) - (block._n_used < bs)
            block._n_used = value
        finally:
            self._lock.release()

    # -- allocation ---------------------------------------------------------

    def allocate(self, stream: str, n_tokens: int, owner: int, format: str = "fp16") -> list[Block]:
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
            The new blocks, lowest-cost (most recently freed) first.

        Raises:
            BlockPoolExhaustedError: Not enough free blocks and no room to grow.
            PoolArgumentError: ``n_tokens <= 0`` or an unknown stream.
            PoolArgumentTypeError: ``n_tokens``/``owner`` not an int,
                ``format`` not a str.
        """
        if type(n_tokens) is not int or n_tokens <= 0:
            check_count("n_tokens", n_tokens, 1)
        if type(owner) is not int:
            check_count("owner", owner, -(2**63))
        if type(format) is not str:
            raise PoolArgumentTypeError(f"format must be a str, got {type(format).__name__}")
        bs = self._block_size
        n = -(-n_tokens // bs)
        self._lock.acquire()
        try:
            stream = self._stream_of.get(stream) or self._resolve(stream)
            stack = self._free[stream]
            if n > len(stack):
                self._grow_or_raise(stream, n)
            split = len(stack) - n
            taken = stack[split:]
            del stack[split:]
            taken.reverse()  # top of the stack first
            stats = self.stats
            recycled = split + n - self._n_fresh[stream]  # recycled blocks on the stack
            if recycled >= n:
                stats.n_reused += n
            else:
                fresh = n - max(recycled, 0)
                self._n_fresh[stream] -= fresh
                stats.n_reused += n - fresh
                for block in taken[n - fresh:]:
                    block.ever_allocated = True
            for block in taken:
                block.owner = owner
                block.format = format
                block._n_used = bs
            rem = n_tokens - (n - 1) * bs
            if rem != bs:
                taken[-1]._n_used = rem
                stats.n_partial += 1
            owned = self._owned.get(owner)
            if owned is None:
                owned = self._owned[owner] = {}
            for block in taken:
                owned[block.block_id] = block
            self._active.add(owner)
            stats.n_allocations += n
            in_use = stats.n_allocations - stats.n_frees
            if in_use > stats.peak_blocks_in_use:
                stats.peak_blocks_in_use = in_use
            self._record()
            return taken
        finally:
            self._lock.release()

    # -- release ------------------------------------------------------------

    def _push_back(self, blocks: list[Block]) -> None:
        """Return owned blocks to their stacks; the caller fixes the owner index."""
        bs = self._block_size
        partial = 0
        free = self._free
        for block in reversed(blocks):  # so the next allocation gets them in order
            partial += block._n_used < bs
            block.owner = None
            block._n_used = 0
            free[block.stream].append(block)
        stats = self.stats
        stats.n_partial -= partial
        stats.n_frees += len(blocks)

    def free(self, blocks: list[Block]) -> None:
        """Return ``blocks`` to the pool. Freeing an already-free block is a no-op.

        Raises:
            ForeignBlockError: A block is not one of this pool's live blocks;
                nothing is freed in that case.
        """
        self._lock.acquire()
        try:
            live = self._blocks
            for block in blocks:
                if live.get(getattr(block, "block_id", None)) is not block:
                    raise ForeignBlockError(
                        f"{block!r} does not belong to this pool (or was retired by shrink); "
                        "free blocks only on the pool that allocated them"
                    )
            to_free = []
            for block in blocks:
                owner = block.owner
                if owner is None:
                    continue
                owned = self._owned.get(owner)
                if owned is None or owned.pop(block.block_id, None) is None:
                    continue  # listed twice in this call
                to_free.append(block)
                if not owned:
                    del self._owned[owner]
                    self._active.discard(owner)
            if to_free:
                self._push_back(to_free)
                self._record()
        finally:
            self._lock.release()

    def free_all(self, owner: int) -> None:
        """Return every block checked out to ``owner`` and retire the owner id."""
        self._lock.acquire()
        try:
            owned = self._owned.pop(owner, None)
            self._active.discard(owner)
            if owned:
                self._push_back(list(owned.values()))
                self._record()
        finally:
            self._lock.release()

    # -- owners -------------------------------------------------------------

    def register_owner(self, owner: int) -> None:
        """Claim ``owner`` explicitly, so that a colliding second claim raises.

        Raises:
            OwnerAlreadyActiveError: ``owner`` holds blocks or was registered
                and not yet released.
        """
        if type(owner) is not int:
            check_count("owner", owner, -(2**63))
        self._lock.acquire()
        try:
            if owner in self._active:
                raise OwnerAlreadyActiveError(owner)
            self._active.add(owner)
        finally:
            self._lock.release()

    def release_owner(self, owner: int) -> None:
        """Drop ``owner`` from the active set without freeing its blocks."""
        self._lock.acquire()
        try:
            self._active.discard(owner)
        finally:
            self._lock.release()

    def active_owners(self) -> list[int]:
        """Owners that are registered or hold blocks, sorted."""
        self._lock.acquire()
        try:
            return sorted(self._active.union(self._owned))
        finally:
            self._lock.release()

    def blocks_for(self, owner: int) -> list[Block]:
        """Blocks checked out to ``owner``, in allocation order."""
        self._lock.acquire()
        try:
            owned = self._owned.get(owner)
            return list(owned.values()) if owned else []
        finally:
            self._lock.release()

    def n_blocks_held(self, owner: int) -> int:
        """How many blocks ``owner`` holds, without copying them."""
        self._lock.acquire()
        try:
            owned = self._owned.get(owner)
            return len(owned) if owned else 0
        finally:
            self._lock.release()

    def blocks_held_by_owner(self) -> dict[int, int]:
        """Blocks held per owner, for operators' views."""
        self._lock.acquire()
        try:
            return {owner: len(owned) for owner, owned in self._owned.items()}
        finally:
            self._lock.release()

    # -- capacity -----------------------------------------------------------

    def n_free(self, stream: str = "k") -> int:
        """Free blocks on ``stream`` ("kv" on a split pool: both streams)."""
        self._lock.acquire()
        try:
            if stream == SHARED_STREAM and self.config.separate_kv:
                return sum(len(s) for s in self._free.values())
            return len(self._free[self._resolve(stream)])
        finally:
            self._lock.release()

    def shrink(self, stream: str, target_free: int) -> int:
        """Retire free blocks of ``stream`` until ``target_free`` stay free.

        Blocks in use are never touched. The coldest free blocks go first:
        never-allocated ones, then the least recently freed. On a split pool
        ``stream="kv"`` shrinks both streams, splitting ``target_free`` the
        way ``n_blocks`` is split.

        Returns:
            The number of blocks retired.

        Raises:
            PoolArgumentError: ``target_free < 0`` or an unknown stream.
        """
        check_count("target_free", target_free, 0)
        self._lock.acquire()
        try:
            if stream == SHARED_STREAM and self.config.separate_kv:
                half, extra = divmod(target_free, 2)
                targets = {"k": half + extra, "v": half}
            else:
                targets = {self._resolve(stream): target_free}
            retired = sum(self._retire(s, t) for s, t in targets.items())
            if retired:
                self.stats.n_blocks -= retired
                self.stats.n_retired += retired
            self._record()
            return retired
        finally:
            self._lock.release()

    def _retire(self, stream: str, target_free: int) -> int:
        stack = self._free[stream]
        count = max(0, len(stack) - target_free)
        for block in stack[:count]:
            del self._blocks[block.block_id]
            block._pool = None
        del stack[:count]
        self._n_fresh[stream] -= min(count, self._n_fresh[stream])
        return count

    # -- observability ------------------------------------------------------

    @property
    def history(self) -> deque[AllocationStats]:
        """Snapshots after each of the last 256 mutating calls, oldest first."""
        self._lock.acquire()
        try:
            rows = list(self._history)
        finally:
            self._lock.release()
        return deque((AllocationStats(*row) for row in rows), maxlen=HISTORY_LEN)

    def snapshot(self) -> AllocationStats:
        """A consistent copy of the live counters."""
        self._lock.acquire()
        try:
            return self.stats.snapshot()
        finally:
            self._lock.release()

    def __repr__(self) -> str:
        return f"BlockPoolAllocator({self.config!r}, {self.stats!r})"
