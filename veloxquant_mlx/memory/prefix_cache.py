"""Prefix caching: full prompt blocks kept in the pool and shared by later requests.

Pure bookkeeping, no MLX. A *cached block* is one block position of a
prompt (``block_size`` tokens) across every stream of a request's block
table (each layer's keys and values: ``2 * n_layers`` pool blocks), named by
a chained hash::

    root  = H(model, KV format, block size)          what else changes the KV
    key_0 = H(root,  tokens[0:16])
    key_1 = H(key_0, tokens[16:32])                   a key names its whole prefix
    ...

so two prompts share ``key_j`` exactly when their first ``16 * (j + 1)``
tokens are equal and were computed by the same model into the same format.

The cache is the pool's own (``pool.prefix_cache``, one per pool). A block
keeps its owner id until it is published; then the pool holds it for the
cache::

    request writes block j -> prompt prefilled -> publish: owner := CACHED
        referenced (refs > 0) by the requests whose tables hold it: never evicted
        unreferenced (refs == 0): evictable, in LRU order
        evicted -> back on the free list, when an allocation finds its free list
        short (the pool evicts before it grows or refuses), or on demand

Cached blocks are allocated (``blocks_in_use == n_allocations - n_frees``
counts them) and held by no request: they are not on any owner's list, so
``active_owners()`` and ``blocks_held_by_owner()`` show requests only.
Evictable blocks are counted once, in :meth:`BlockPoolAllocator.n_available`
(free plus evictable), which is what admission asks. A request *references*
cached blocks, it never owns them, and :meth:`PrefixCache.release` drops its
references. A block being written is never published: only blocks whose
``block_size`` slots are all prompt tokens already computed.

Every method that changes references or blocks takes the pool's lock, so
an allocation on another thread that evicts never meets a half-made change.
Counters are plain ints, safe to read from a scrape without it.

Invariants (checked by the tests): every entry's blocks have owner
:data:`CACHED`; ``refs`` equals the number of owners' references to it; an
entry is in the LRU exactly when ``refs == 0``; the evictable counts are the
LRU entries' blocks per stream.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from veloxquant_mlx.exceptions import PoolArgumentError
from veloxquant_mlx.memory.records import CACHED, Block

__all__ = ["CACHED", "CachedBlock", "PrefixCache", "chain_hashes", "prefix_root"]


def prefix_root(model: str, kv_format: str, block_size: int) -> bytes:
    """The hash every chain starts from: what, besides the tokens, decides the KV.

    Args:
        model: Model identity (name and the dtype it computes in).
        kv_format: How keys and values are stored (``"native"``, or a
            compressed format).
        block_size: Tokens per block.
    """
    return hashlib.sha256(f"{model}\0{kv_format}\0{block_size}".encode()).digest()


def chain_hashes(tokens: Sequence[int], block_size: int, root: bytes) -> list[bytes]:
    """Keys of every full block of ``tokens`` (a partial last block has none)."""
    keys, parent = [], root
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = hashlib.sha256(parent)
        h.update(array("q", tokens[start:start + block_size]).tobytes())
        parent = h.digest()
        keys.append(parent)
    return keys


@dataclass(slots=True, eq=False)
class CachedBlock:
    """One cached block position: its pool blocks in every stream of a table.

    Attributes:
        key: Its chained hash.
        blocks: Pool blocks, in the request table's stream order.
        per_stream: How many of ``blocks`` are on each pool stream.
        refs: Requests referencing it now.
    """

    key: bytes
    blocks: list[Block]
    per_stream: dict[str, int]
    refs: int = 0


@dataclass(slots=True)
class CacheCounters:
    """Cumulative counters (for /metrics).

    Attributes:
        query_tokens: Prompt tokens looked up.
        hit_tokens: Of those, tokens served from cached blocks.
        evicted_blocks: Pool blocks freed by eviction (and resets).
        published_blocks: Pool blocks taken into the cache.
    """

    query_tokens: int = 0
    hit_tokens: int = 0
    evicted_blocks: int = 0
    published_blocks: int = 0


class PrefixCache:
    """Cached blocks by key, their references, and the LRU of unreferenced ones.

    Made by the pool (``pool.prefix_cache``); a second cache on the same pool
    would hide its blocks from the pool's eviction, so it is refused.

    Args:
        pool: The pool the blocks belong to.

    Raises:
        PoolArgumentError: ``pool`` has its cache already.
    """

    def __init__(self, pool: Any) -> None:
        if getattr(pool, "prefix_cache", None) is not None:
            raise PoolArgumentError("this pool has its prefix cache already: use "
                                    "pool.prefix_cache")
        self.pool = pool
        self.counters = CacheCounters()
        self._entries: dict[bytes, CachedBlock] = {}
        self._lru: OrderedDict[bytes, CachedBlock] = OrderedDict()  # oldest first
        self._held: dict[int, list[CachedBlock]] = {}  # owner -> references
        # owner -> pool blocks of its references per stream (admission asks every step)
        self._held_counts: dict[int, Counter[str]] = {}
        # Blocks per stream in the LRU. Every stream's key exists from the start, so a
        # scrape summing the counts on another thread never sees the dict change size.
        self._evictable: Counter[str] = Counter(dict.fromkeys(pool.config.streams, 0))
        self._cached = 0  # pool blocks in entries

    # -- requests ------------------------------------------------------------------

    def match(self, keys: Sequence[bytes]) -> list[CachedBlock]:
        """The longest run of cached entries that starts ``keys`` (nothing acquired)."""
        found = []
        with self.pool._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is None:
                    break
                found.append(entry)
        return found

    def acquire(self, owner: int, entries: Sequence[CachedBlock]) -> None:
        """``owner`` references ``entries`` (they stop being evictable)."""
        with self.pool._lock:
            for entry in entries:
                if entry.refs == 0:
                    del self._lru[entry.key]
                    self._evictable.subtract(entry.per_stream)
                self._reference(owner, entry)

    def record_query(self, prompt_tokens: int, hit_tokens: int) -> None:
        """Count one admitted prompt and how much of it came from the cache."""
        self.counters.query_tokens += prompt_tokens
        self.counters.hit_tokens += hit_tokens

    def publish(self, owner: int, key: bytes, blocks: list[Block]) -> bool:
        """Take ``owner``'s full, computed ``blocks`` of one position into the cache.

        ``owner`` keeps referencing them. When ``key`` is cached already (a
        request with the same prefix published first) nothing changes and the
        blocks stay ``owner``'s, to be freed with it.

        Returns:
            True when the blocks were taken.

        Raises:
            ForeignBlockError: A block is not one of the pool's live blocks.
            PoolArgumentError: A block is not checked out to ``owner``.
        """
        with self.pool._lock:
            if key in self._entries:
                return False
            self.pool._into_cache(owner, blocks)
            entry = CachedBlock(key, list(blocks), dict(Counter(b.stream for b in blocks)))
            self._entries[key] = entry
            self._reference(owner, entry)
            self._cached += len(blocks)
            self.counters.published_blocks += len(blocks)
            return True

    def _reference(self, owner: int, entry: CachedBlock) -> None:
        """``owner`` holds one more reference to ``entry`` (lock held; not in the LRU)."""
        entry.refs += 1
        self._held.setdefault(owner, []).append(entry)
        self._held_counts.setdefault(owner, Counter()).update(entry.per_stream)

    def release(self, owner: int) -> None:
        """Drop every reference ``owner`` holds; entries nobody references become evictable.

        Released tail first, so a chain's last blocks are the first evicted
        (its head, which more prompts share, stays longest).
        """
        with self.pool._lock:
            self._held_counts.pop(owner, None)
            for entry in reversed(self._held.pop(owner, [])):
                entry.refs -= 1
                if entry.refs == 0:
                    self._lru[entry.key] = entry
                    self._evictable.update(entry.per_stream)

    def held_blocks(self, owner: int) -> dict[str, int]:
        """Cached pool blocks ``owner`` references, per stream (kept as references change)."""
        with self.pool._lock:
            return dict(self._held_counts.get(owner, ()))

    # -- capacity ------------------------------------------------------------------

    def evictable(self, stream: str) -> int:
        """Pool blocks on ``stream`` that eviction could free now."""
        return self._evictable[stream]

    def evict(self, need: dict[str, int]) -> int:
        """Free least recently used entries until ``need`` blocks per stream came free.

        Stops early when nothing evictable is left; referenced entries are
        never touched. Allocation does this by itself when a free list runs
        short; call it to make room ahead (a shrink).

        Returns:
            Pool blocks freed.
        """
        with self.pool._lock:
            return self.pool._evicted(self.take_lru(need))

    def reset(self) -> int:
        """Evict every unreferenced entry; returns the pool blocks freed."""
        with self.pool._lock:
            blocks: list[Block] = []
            while self._lru:
                blocks += self._drop(self._lru.popitem(last=False)[1])
            return self.pool._evicted(blocks)

    def take_lru(self, need: dict[str, int]) -> list[Block]:
        """Forget least recently used entries until they cover ``need``; their blocks.

        Call with the pool's lock held: the pool frees what this returns.
        """
        left = {s: n for s, n in need.items() if n > 0}
        blocks: list[Block] = []
        while left and self._lru:
            _, entry = self._lru.popitem(last=False)
            blocks += self._drop(entry)
            for stream, n in entry.per_stream.items():
                if stream in left:
                    left[stream] -= n
                    if left[stream] <= 0:
                        del left[stream]
        return blocks

    def _drop(self, entry: CachedBlock) -> list[Block]:
        """Forget an unreferenced entry (already off the LRU); its blocks, to free."""
        del self._entries[entry.key]
        self._evictable.subtract(entry.per_stream)
        self._cached -= len(entry.blocks)
        self.counters.evicted_blocks += len(entry.blocks)
        return entry.blocks

    # -- observability ---------------------------------------------------------------

    @property
    def cached_blocks(self) -> int:
        """Pool blocks the cache holds (referenced or not)."""
        return self._cached

    @property
    def evictable_blocks(self) -> int:
        """Pool blocks no request references (free for admission)."""
        return sum(self._evictable.values())

    def entries(self) -> list[CachedBlock]:
        """Every entry (for checks and tests)."""
        with self.pool._lock:
            return list(self._entries.values())

    def holders(self) -> dict[int, int]:
        """Owner -> references it holds (for checks and tests)."""
        with self.pool._lock:
            return {owner: len(held) for owner, held in self._held.items() if held}

    def view(self) -> dict[str, int]:
        """The figures /admin/pool shows."""
        c = self.counters
        return {"cached_blocks": self._cached, "evictable_blocks": self.evictable_blocks,
                "entries": len(self._entries), "query_tokens": c.query_tokens,
                "hit_tokens": c.hit_tokens, "evicted_blocks": c.evicted_blocks,
                "published_blocks": c.published_blocks}
