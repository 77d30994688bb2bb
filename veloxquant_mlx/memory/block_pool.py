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
    * every block id is on exactly one free stack xor owned by one owner xor
      held by the pool's prefix cache (``prefix_cache.py``);
    * ``stats.blocks_in_use() == n_allocations - n_frees == owned + cached blocks``;
    * ``stats.n_blocks == free + in use`` and ids ever created ==
      ``n_blocks + n_retired``.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Iterable

from veloxquant_mlx.exceptions import (
    BlockPoolExhaustedError,
    ForeignBlockError,
    OwnerAlreadyActiveError,
    PoolArgumentError,
    PoolArgumentTypeError,
)
from veloxquant_mlx.memory.pool_config import HISTORY_LEN, SHARED_STREAM, PoolConfig, check_count
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


def _blocks_memory_holds() -> int:
    """Most blocks this machine's RAM could hold (0: RAM size unknown, no limit).

    Counted at 100 bytes a block, below what a block and its index entries
    really take (about 200), so growth is refused only when it cannot succeed.
    """
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return 0
    return max(ram, 0) // 100


_BLOCKS_MEMORY_HOLDS = _blocks_memory_holds()


class _Stream:
    """Free stack of one stream, the length of its never-allocated bottom run, and
    how many live blocks (free or not) the stream has."""

    __slots__ = ("name", "stack", "n_fresh", "n_blocks")

    def __init__(self, name: str) -> None:
        self.name = name
        self.stack: list[Block] = []  # top (next handed out) at the end
        self.n_fresh = 0
        self.n_blocks = 0


class BlockPoolAllocator:
    """Thread-safe allocator of fixed-size blocks, tracked per owner.

    One plain (non-reentrant) lock guards every method; nothing here calls
    out while holding it. Each call costs O(blocks it touches): counters are
    kept, never recounted, and owners index their blocks by id. The hot path
    (``allocate``/``free_all``) is written for CPython's per-operation costs:
    explicit acquire/release, counters in one list, no per-call objects
    beyond the returned list and one history tuple.
    """

    def __init__(self, config: PoolConfig | None = None) -> None:
        if config is not None and not isinstance(config, PoolConfig):
            raise PoolArgumentTypeError(
                f"config must be a PoolConfig, got {type(config).__name__}")
        self.config = config if config is not None else PoolConfig()
        self._lock = threading.Lock()
        # Bound once: calling a stored method skips a method look-up per call.
        self._acquire = self._lock.acquire
        self._release = self._lock.release
        self._block_size = self.config.block_size
        self._blocks: dict[int, Block] = {}  # every live (not retired) block by id
        self._streams: dict[str, _Stream] = {}
        # owner -> {block_id: block} in allocation order; an entry per active owner
        self._owned: dict[int, dict[object, Block]] = {}
        self._released: set[int] = set()  # release_owner()'d owners still holding blocks
        # owner -> blocks it holds per stream (only owners holding some; kept, not recounted)
        self._per_stream: dict[int, dict[str, int]] = {}
        self._next_id = 0
        self.stats = AllocationStats(n_blocks=self.config.n_blocks)
        # History: a ring of preallocated stats records, one written per
        # mutating call by copying the counters in (no allocation per call).
        self._ring = [AllocationStats(0) for _ in range(HISTORY_LEN)]
        self._ring_pos = 0  # total mutating calls recorded so far
        names = self.config.streams
        share, extra = divmod(self.config.n_blocks, len(names))
        for i, name in enumerate(names):
            self._streams[name] = _Stream(name)
            self._add_fresh(self._streams[name], share + (1 if i < extra else 0))
        # With one shared stream, "k", "v" and "kv" all name it.
        self._stream_of = dict(self._streams)
        if not self.config.separate_kv:
            shared = self._streams[SHARED_STREAM]
            self._stream_of.update({"k": shared, "v": shared})
        self._k_stream = self._stream_of["k"]
        self._v_stream = self._stream_of["v"]
        self._kv_stream = self._stream_of.get(SHARED_STREAM)  # None on a split pool
        self.prefix_cache: PrefixCache | None = None
        # Full blocks of finished prompts kept for reuse (hash, references, LRU):
        # allocation evicts its unreferenced ones before it grows or refuses.
        self.prefix_cache = PrefixCache(self)

    # -- internal helpers (call with the lock held) -------------------------

    def _add_fresh(self, stream: _Stream, count: int) -> None:
        """Create ``count`` new blocks at the bottom of ``stream``'s stack, or none.

        All-or-nothing: if memory runs out part way, the blocks made so far are
        dropped again (none stays in ``_blocks`` unreachable from a stack).
        """
        new: list[Block] = []
        try:
            for block_id in range(self._next_id + count - 1, self._next_id - 1, -1):
                block = Block(block_id, stream.name)
                block._pool = self
                block._home = stream.stack
                self._blocks[block_id] = block
                new.append(block)  # highest id first: the lowest ends nearest the top
            stream.stack[:0] = new
        except BaseException:
            for block in new:
                del self._blocks[block.block_id]
            raise
        self._next_id += count
        stream.n_fresh += count
        stream.n_blocks += count

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

    def _record(self, c: AllocationStats) -> None:
        pos = self._ring_pos
        self._ring[pos % HISTORY_LEN].copy_from(c)
        self._ring_pos = pos + 1

    def _stream(self, name: object) -> _Stream:
        st = self._stream_of.get(name) if isinstance(name, str) else None
        if st is None:
            raise self._stream_error(name)
        return st

    def _stream_error(self, name: object) -> PoolArgumentError:
        return PoolArgumentError(
            f"unknown stream {name!r}; this pool (separate_kv="
            f"{self.config.separate_kv}) accepts {sorted(self._stream_of)}"
        )

    def _grow_or_raise(self, stream: _Stream, needed: int) -> None:
        """Make ``needed`` blocks free on ``stream`` or raise (counting the miss)."""
        c = self.stats
        cache = self.prefix_cache
        if cache is not None and cache.evictable(stream.name):  # cached blocks go first
            self._evicted(cache.take_lru({stream.name: needed - len(stream.stack)}))
        free = len(stream.stack)
        gap = needed - free
        if gap <= 0:
            return
        detail = self._grow(stream, gap) if self.config.grow_on_exhaustion else ""
        if detail is None:
            return
        c.n_exhausted += 1  # failed allocate() calls, not blocks (the seed page's definition)
        self._record(c)
        raise BlockPoolExhaustedError(stream.name, needed, free, detail)

    def _grow(self, stream: _Stream, gap: int) -> str | None:
        """Add ``gap`` blocks to ``stream``: None once done, else why not (nothing added)."""
        c = self.stats
        cap = self.config.max_blocks
        if cap is not None and c.n_blocks + gap > cap:
            return f"growing by {gap} would pass max_blocks={cap}"
        # Checked up front: making blocks one by one until memory runs out
        # would take minutes (max_blocks=None means unbounded, not infinite).
        if 0 < _BLOCKS_MEMORY_HOLDS < c.n_blocks + gap:
            return (f"growing by {gap} blocks needs more memory than this machine has; "
                    "ask for fewer tokens or set max_blocks")
        try:
            self._add_fresh(stream, gap)
        except MemoryError:
            return f"ran out of memory growing by {gap} blocks"
        c.n_blocks += gap
        c.n_grown += gap
        return None

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

    def _pick_stream(self, stream: str) -> _Stream:
        """The stream named ``stream`` (plain compares beat a dict look-up here)."""
        if stream == "k":
            return self._k_stream
        if stream == "v":
            return self._v_stream
        if stream == "kv" and self._kv_stream is not None:
            return self._kv_stream
        return self._stream(stream)

    def _count_allocations(self, c: AllocationStats, n: int) -> None:
        """Count ``n`` blocks handed out, the peak in use, and record the stats."""
        in_use = c.n_allocations + n - c.n_frees
        c.n_allocations += n
        if in_use > c.peak_blocks_in_use:
            c.peak_blocks_in_use = in_use
        self._record(c)

    def _take_one(
        self, st: _Stream, owner: int, format: str, n_used: int, owned: dict[object, Block]
    ) -> Block:
        """Pop one block off ``st`` into ``owned``: the usual growth step, no slicing."""
        stack = st.stack
        if not stack:
            self._grow_or_raise(st, 1)
        block = stack.pop()
        c = self.stats
        if block.ever_allocated:
            c.n_reused += 1
        else:
            block.ever_allocated = True
            st.n_fresh -= 1
        block.owner = owner
        block.checkouts += 1
        block.format = format
        block._n_used = n_used
        if n_used != self._block_size:
            c.n_partial += 1
        owned[block._key] = block
        return block

    def _take(
        self, st: _Stream, n: int, owner: int, format: str, last_used: int,
        owned: dict[object, Block],
    ) -> list[Block]:
        """Pop ``n`` blocks (n >= 2) off ``st`` into ``owned``; the last holds ``last_used``."""
        stack = st.stack
        if n > len(stack):
            self._grow_or_raise(st, n)
        split = len(stack) - n
        taken = stack[split:]
        del stack[split:]
        taken.reverse()  # top of the stack first
        c = self.stats
        recycled = split + n - st.n_fresh  # recycled blocks that were on the stack
        if recycled >= n:
            c.n_reused += n
        else:
            fresh = n - max(recycled, 0)
            st.n_fresh -= fresh
            c.n_reused += n - fresh
            for block in taken[n - fresh:]:
                block.ever_allocated = True
        bs = self._block_size
        for block in taken:
            block.owner = owner
            block.checkouts += 1
            block.format = format
            block._n_used = bs
            owned[block._key] = block
        if last_used != bs:
            taken[-1]._n_used = last_used
            c.n_partial += 1
        return taken

    # -- release ------------------------------------------------------------

    def _push_back(self, blocks: list[Block]) -> None:
        """Return owned blocks to their stacks; the caller fixes the owner index."""
        bs = self._block_size
        partial = 0
        for block in reversed(blocks):  # so the next allocation gets them in order
            partial += block._n_used < bs
            block.owner = None
            block._n_used = 0
            block._home.append(block)
        c = self.stats
        c.n_partial -= partial
        c.n_frees += len(blocks)
        self._record(c)

    def _evicted(self, blocks: list[Block]) -> int:
        """Free blocks the prefix cache let go (lock held); returns how many."""
        if blocks:
            self._push_back(blocks)
        return len(blocks)

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

    def _live_block(self, block: object, verb: str) -> Block:
        """``block`` if it is one of this pool's live blocks; else ForeignBlockError."""
        if not isinstance(block, Block) or self._blocks.get(block.block_id) is not block:
            raise ForeignBlockError(
                f"{block!r} does not belong to this pool (or was retired by shrink); "
                f"{verb} blocks only on the pool that allocated them"
            )
        return block

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

    # -- capacity -----------------------------------------------------------

    def n_free(self, stream: object = "k") -> int:
        """Free blocks on ``stream`` ("kv" on a split pool: both streams)."""
        self._acquire()
        try:
            if stream == SHARED_STREAM and self.config.separate_kv:
                return sum(len(s.stack) for s in self._streams.values())
            return len(self._stream(stream).stack)
        finally:
            self._release()

    def n_blocks_on(self, stream: object = "k") -> int:
        """Live blocks of ``stream``, free or in use ("kv" on a split pool: both)."""
        self._acquire()
        try:
            if stream == SHARED_STREAM and self.config.separate_kv:
                return sum(s.n_blocks for s in self._streams.values())
            return self._stream(stream).n_blocks
        finally:
            self._release()

    def n_available(self, stream: object = "k") -> int:
        """Blocks an allocation on ``stream`` can take now: free ones, and cached ones no
        request references (allocation evicts those first, least recently used)."""
        cache = self.prefix_cache
        names = (list(self._streams) if stream == SHARED_STREAM and self.config.separate_kv
                 else [self._stream(stream).name])
        evictable = sum(cache.evictable(n) for n in names) if cache is not None else 0
        return self.n_free(stream) + evictable

    def shrink(self, stream: object, target_free: object) -> int:
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
        target = check_count("target_free", target_free, 0)
        self._acquire()
        try:
            if stream == SHARED_STREAM and self.config.separate_kv:
                half, extra = divmod(target, 2)
                targets = {self._streams["k"]: half + extra, self._streams["v"]: half}
            else:
                targets = {self._stream(stream): target}
            retired = sum(self._retire(st, t) for st, t in targets.items())
            c = self.stats
            c.n_blocks -= retired
            c.n_retired += retired
            self._record(c)
            return retired
        finally:
            self._release()

    def _retire(self, st: _Stream, target_free: int) -> int:
        stack = st.stack
        count = max(0, len(stack) - target_free)
        for block in stack[:count]:
            del self._blocks[block.block_id]
            block._pool = None
        del stack[:count]
        st.n_fresh -= min(count, st.n_fresh)
        st.n_blocks -= count
        return count

    # -- observability ------------------------------------------------------

    @property
    def history(self) -> deque[AllocationStats]:
        """Snapshots after each of the last 256 mutating calls, oldest first."""
        self._acquire()
        try:
            pos = self._ring_pos
            start = max(0, pos - HISTORY_LEN)
            rows = [self._ring[i % HISTORY_LEN].snapshot() for i in range(start, pos)]
        finally:
            self._release()
        return deque(rows, maxlen=HISTORY_LEN)

    def snapshot(self) -> AllocationStats:
        """A consistent copy of the live counters."""
        self._acquire()
        try:
            return self.stats.snapshot()
        finally:
            self._release()

    def __repr__(self) -> str:
        return f"BlockPoolAllocator({self.config!r}, {self.stats!r})"
