"""The block pool's free stacks: blocks made, handed out, taken back, grown, retired.

:class:`FreeStacks` is the half of :class:`~veloxquant_mlx.memory.block_pool.
BlockPoolAllocator` that knows blocks and streams but not owners: each
stream's free stack, the pool's one lock, growth on exhaustion (evicting the
prefix cache's unreferenced blocks first), shrinking, the capacity queries and
the stats history. The allocator derives from it and adds the owner index.
Pure Python, no MLX; compiled with the allocator by mypyc where possible.

Free stack of one stream (top = next block handed out)::

    bottom                                                     top
    [ fresh n-1 ... fresh 1, fresh 0 | recycled ... last freed ]
      ^-- never handed out (n_fresh) ^-- handed out before, then freed

Freed blocks are always pushed on top and allocations pop from the top, so
the never-allocated blocks stay a contiguous run at the bottom. That lets
``n_reused`` be counted in O(1) per call: of ``n`` popped blocks,
``min(n, len(stack) - n_fresh)`` are recycled.
"""

from __future__ import annotations

import os
import threading
from collections import deque

from veloxquant_mlx.exceptions import (
    BlockPoolExhaustedError,
    ForeignBlockError,
    PoolArgumentError,
    PoolArgumentTypeError,
)
from veloxquant_mlx.memory.pool_config import HISTORY_LEN, SHARED_STREAM, PoolConfig, check_count
from veloxquant_mlx.memory.prefix_cache import PrefixCache
from veloxquant_mlx.memory.records import AllocationStats, Block


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


class StreamStack:
    """Free stack of one stream, the length of its never-allocated bottom run, and
    how many live blocks (free or not) the stream has."""

    __slots__ = ("name", "stack", "n_fresh", "n_blocks")

    def __init__(self, name: str) -> None:
        self.name = name
        self.stack: list[Block] = []  # top (next handed out) at the end
        self.n_fresh = 0
        self.n_blocks = 0


class FreeStacks:
    """Every live block of a pool, on its stream's free stack or handed out.

    One plain (non-reentrant) lock guards every public method; the private
    ones are called with it held. Nothing here calls out while holding it.
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
        self._streams: dict[str, StreamStack] = {}
        self._next_id = 0
        self.stats = AllocationStats(n_blocks=self.config.n_blocks)
        # History: a ring of preallocated stats records, one written per
        # mutating call by copying the counters in (no allocation per call).
        self._ring = [AllocationStats(0) for _ in range(HISTORY_LEN)]
        self._ring_pos = 0  # total mutating calls recorded so far
        names = self.config.streams
        share, extra = divmod(self.config.n_blocks, len(names))
        for i, name in enumerate(names):
            self._streams[name] = StreamStack(name)
            self._add_fresh(self._streams[name], share + (1 if i < extra else 0))
        # With one shared stream, "k", "v" and "kv" all name it.
        self._stream_of = dict(self._streams)
        if not self.config.separate_kv:
            shared = self._streams[SHARED_STREAM]
            self._stream_of.update({"k": shared, "v": shared})
        self._k_stream = self._stream_of["k"]
        self._v_stream = self._stream_of["v"]
        self._kv_stream = self._stream_of.get(SHARED_STREAM)  # None on a split pool
        # The allocator sets its prefix cache, once its owner index exists.
        self.prefix_cache: PrefixCache | None = None

    # -- blocks and stacks (call with the lock held) -------------------------

    def _add_fresh(self, stream: StreamStack, count: int) -> None:
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

    def _record(self, c: AllocationStats) -> None:
        pos = self._ring_pos
        self._ring[pos % HISTORY_LEN].copy_from(c)
        self._ring_pos = pos + 1

    def _stream(self, name: object) -> StreamStack:
        st = self._stream_of.get(name) if isinstance(name, str) else None
        if st is None:
            raise self._stream_error(name)
        return st

    def _stream_error(self, name: object) -> PoolArgumentError:
        return PoolArgumentError(
            f"unknown stream {name!r}; this pool (separate_kv="
            f"{self.config.separate_kv}) accepts {sorted(self._stream_of)}"
        )

    def _pick_stream(self, stream: str) -> StreamStack:
        """The stream named ``stream`` (plain compares beat a dict look-up here)."""
        if stream == "k":
            return self._k_stream
        if stream == "v":
            return self._v_stream
        if stream == "kv" and self._kv_stream is not None:
            return self._kv_stream
        return self._stream(stream)

    def _grow_or_raise(self, stream: StreamStack, needed: int) -> None:
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

    def _grow(self, stream: StreamStack, gap: int) -> str | None:
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

    def _live_block(self, block: object, verb: str) -> Block:
        """``block`` if it is one of this pool's live blocks; else ForeignBlockError."""
        if not isinstance(block, Block) or self._blocks.get(block.block_id) is not block:
            raise ForeignBlockError(
                f"{block!r} does not belong to this pool (or was retired by shrink); "
                f"{verb} blocks only on the pool that allocated them"
            )
        return block

    # -- taking blocks off a stack (lock held) ------------------------------

    def _count_allocations(self, c: AllocationStats, n: int) -> None:
        """Count ``n`` blocks handed out, the peak in use, and record the stats."""
        in_use = c.n_allocations + n - c.n_frees
        c.n_allocations += n
        if in_use > c.peak_blocks_in_use:
            c.peak_blocks_in_use = in_use
        self._record(c)

    def _take_one(
        self, st: StreamStack, owner: int, format: str, n_used: int, owned: dict[object, Block]
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
        self, st: StreamStack, n: int, owner: int, format: str, last_used: int,
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

    def _retire(self, st: StreamStack, target_free: int) -> int:
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
