"""The server's KV memory: the pool sized in bytes, and the prompt prefixes cached in it.

Every byte of KV that requests hold is a pool block (a slot range of the
:class:`~veloxquant_mlx.memory.kv_arena.KVArena`), so::

    MLX memory held for KV  =  arena (capacity, allocated at start)  +  transients
    transients (one model call, one layer at a time)  <=  kv_workspace_bytes

    kv_bytes_in_use    = blocks in use x bytes per block
    kv_bytes_reserved  = blocks reserved by running requests (admission) x bytes per block
    kv_bytes_capacity  = blocks the pool manages x bytes per block

``kv_workspace_bytes`` is fixed by the settings: ``batch.max_batch_size`` rows
of ``limits.max_prompt_tokens + limits.max_tokens_cap`` tokens, one layer's
keys and values, plus the trash block.

Prefix caching (:class:`PromptPrefixes`, further down): what a prompt can reuse, and
what it leaves.

The bookkeeping (hash chain, references, LRU) is the pool's own
(``pool.prefix_cache``, :class:`~veloxquant_mlx.memory.prefix_cache.PrefixCache`),
and the pool evicts unreferenced blocks when an allocation needs them; this
module decides what a prompt looks up and publishes (engine thread only)::

    admission   lookup(prompt): full-block keys, the longest cached run
                (at most (P - min_tail) // block_size blocks: the last prompt token
                is always computed, its logits give the first token) -> acquire
    prefill     the row's table starts on the shared blocks; only the rest is fed
    prefilled   publish: the row's own full prompt blocks join the cache
    finished    publish_output: full blocks of prompt + generated tokens join too
    request end release: its references go; unreferenced blocks are evictable

Keys hash the model's identity and the KV format (:func:`cache_root`), so a
block computed by another model or stored in another format never matches.
With caching off (``cache.prefix_caching = false``) a lookup finds nothing and
nothing is published, so the pool's cache stays empty.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from server.settings import Settings
from server.settings_sections import DEFAULT_N_BLOCKS, LimitsSection
from veloxquant_mlx.memory import BlockPoolAllocator
from veloxquant_mlx.memory.block_pool import Block
from veloxquant_mlx.memory.kv_arena import KVArena, KVLayout, workspace_bytes
from veloxquant_mlx.memory.kv_format import KVFormat
from veloxquant_mlx.memory.prefix_cache import (
    CachedBlock,
    PrefixCache,
    chain_hashes,
    prefix_root,
)


@dataclass(frozen=True, slots=True)
class KVMemory:
    """The arena and the byte figures the server reports.

    Attributes:
        arena: The pool's KV arena.
        bytes_per_block: Bytes one pool block stands for.
        workspace_bytes: The fixed bound on a model call's transient KV.
    """

    arena: KVArena
    bytes_per_block: int
    workspace_bytes: int

    @property
    def kv_format(self) -> str:
        """The configured format's name: ``"native"``, ``"q8"`` or ``"q4"``."""
        return self.arena.layout.kv_format.name

    @property
    def format_tag(self) -> str:
        """What every block stores, as one string (``"fp32"``, ``"q8g64"``, ...).

        Two blocks with equal tags hold interchangeable bytes, so a prefix
        cache keys its block hashes with it.
        """
        return self.arena.format_tag

    def snapshot(self, pool: BlockPoolAllocator, reserved_blocks: int) -> dict[str, int]:
        """``{in_use, cached, reserved, workspace, capacity}`` in bytes (in_use: requests')."""
        stats = pool.stats
        per = self.bytes_per_block
        cached = pool.prefix_cache.cached_blocks  # the prefix cache's, shown apart
        return {"in_use": (stats.blocks_in_use() - cached) * per, "cached": cached * per,
                "reserved": reserved_blocks * per,
                "workspace": self.workspace_bytes, "capacity": stats.n_blocks * per}


def kv_format_of(settings: Settings) -> KVFormat:
    """The ``[kv]`` section as the library's :class:`KVFormat`."""
    return KVFormat(settings.kv.format, settings.kv.group_size)


def blocks_for_bytes(settings: Settings, layout: KVLayout) -> int | None:
    """``pool.n_blocks`` that ``pool.kv_memory`` buys for ``layout`` (None: not set).

    Raises:
        ValueError: The budget does not buy the pool's minimum of blocks.
    """
    budget = settings.pool.kv_memory_bytes
    if budget is None:
        return None
    per = layout.bytes_per_block(settings.pool.block_size)
    blocks = budget // per
    least = 2 if settings.pool.separate_kv else 1
    if blocks < least:
        raise ValueError(f"pool.kv_memory = {settings.pool.kv_memory!r} buys {blocks} blocks "
                         f"of {per} bytes; raise it to at least {least * per} bytes")
    return blocks


def longest_request(limits: LimitsSection, context: int | None) -> int:
    """Tokens (prompt + ``max_tokens``) of the longest request the limits let in, within
    ``context`` (the served context length; None: unbounded)."""
    longest = limits.max_prompt_tokens + limits.max_tokens_cap
    return min(longest, context) if context else longest


def blocks_for_longest_request(settings: Settings, layout: KVLayout, context: int | None,
                               device_memory: int) -> int | None:
    """``pool.n_blocks`` that lets the default pool hold one request of the longest length the
    limits and the served context allow, when the default holds less (None: keep it).

    Only a pool the operator did not size (``n_blocks`` at its default, no
    ``kv_memory``) grows, and only while its KV arena stays within a quarter of
    the device's memory: a server that states a context of 8,192 tokens should
    take a prompt of 7,000 (SmolLM2's needs 30,720 blocks where the default has
    16,384), but a 128k-token model must not claim half a laptop.

    A pool left short is logged at start-up (``_warn_if_the_context_never_fits``).
    """
    pool = settings.pool
    if pool.kv_memory_bytes is not None or pool.n_blocks != DEFAULT_N_BLOCKS:
        return None
    longest = longest_request(settings.limits, context)
    streams = 2  # k and v: split evenly when separate_kv, or both in one stream
    need = streams * layout.n_layers * -(-longest // pool.block_size)
    if pool.max_blocks:  # the operator's cap on the pool's size holds here too
        need = min(need, pool.max_blocks)
    if need <= pool.n_blocks:
        return None
    if device_memory > 0 and need * layout.bytes_per_block(pool.block_size) > device_memory // 4:
        return None
    return need


def build_kv_memory(settings: Settings, pool: BlockPoolAllocator, layout: KVLayout,
                    context: int | None = None) -> KVMemory:
    """Allocate the arena for ``pool`` and fix the workspace bound.

    The bound's longest row is the longest request the limits let in: prompt
    plus ``max_tokens`` within ``context`` (the served context length; None:
    unbounded) and within ``max_prompt_tokens + max_tokens_cap``.
    """
    bs = settings.pool.block_size
    longest = longest_request(settings.limits, context)
    return KVMemory(KVArena(pool, layout), layout.bytes_per_block(bs),
                    workspace_bytes(layout, bs, settings.batch.max_batch_size, longest,
                                    settings.batch.kv_write_back))


def describe(kv: KVMemory, pool: BlockPoolAllocator, layout: KVLayout) -> str:
    """The start-up line: blocks, tokens in flight, bytes per block, workspace."""
    blocks, bs = pool.stats.n_blocks, pool.config.block_size
    tokens = blocks // (2 * layout.n_layers) * bs  # whole blocks a layer, as admission counts
    return (f"KV pool: {blocks} blocks x {_size(kv.bytes_per_block)} ({bs} tokens of one "
            f"layer's k or v; {layout.n_kv_heads} heads x {layout.head_dim}, "
            f"{str(layout.dtype).removeprefix('mlx.core.')}, stored as {kv.format_tag}) = "
            f"{_size(blocks * kv.bytes_per_block)}, {tokens} tokens in flight "
            f"({layout.n_layers} layers); workspace {_size(kv.workspace_bytes)}")


def _size(n: Any) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def memory_snapshot() -> dict[str, int]:
    """MLX allocator counters in bytes (active, cache, peak)."""
    return {
        "active": int(mx.get_active_memory()),
        "cache": int(mx.get_cache_memory()),
        "peak": int(mx.get_peak_memory()),
    }


def kv_format_tag(arena: KVArena) -> str:
    """The tag of how ``arena`` stores KV (``"fp32"``, ``"q8g64"``...): part of every key."""
    layout = arena.layout
    tag = getattr(layout, "format_tag", None)  # a layout without one stores the native dtype
    return tag if isinstance(tag, str) else f"native-{layout.dtype}"


def cache_root(model_name: str, arena: KVArena) -> bytes:
    """Root of every key: the model, the dtype it computes in, the KV format, the block size."""
    layout = arena.layout
    model = f"{model_name}|{layout.dtype}|{layout.n_layers}x{layout.n_kv_heads}x{layout.head_dim}"
    return prefix_root(model, kv_format_tag(arena), arena.block_size)


def salted_root(root: bytes, salt: str) -> bytes:
    """The chain root of a cache namespace (any string, lone surrogates included)."""
    return hashlib.sha256(root + b"\0salt\0" + salt.encode("utf-8", "surrogatepass")).digest()


@dataclass(slots=True)
class PrefixHit:
    """What one prompt reuses.

    Attributes:
        keys: Keys of every full block of the prompt (to publish later).
        entries: The cached run it starts on (position order).
        root: The root its keys chain from (salted or not; empty: caching off),
            which the blocks past the prompt's chain from too, when it has none.
    """

    keys: list[bytes] = field(default_factory=list)
    entries: list[CachedBlock] = field(default_factory=list)
    root: bytes = b""

    def per_stream(self) -> dict[str, int]:
        """Pool blocks the shared run covers, per stream."""
        out: dict[str, int] = {}
        for entry in self.entries:
            for stream, n in entry.per_stream.items():
                out[stream] = out.get(stream, 0) + n
        return out

    def pinned(self) -> dict[str, int]:
        """Of those, blocks that are evictable now (acquiring them takes them off the LRU)."""
        out: dict[str, int] = {}
        for entry in self.entries:
            if entry.refs == 0:
                for stream, n in entry.per_stream.items():
                    out[stream] = out.get(stream, 0) + n
        return out

    def blocks(self) -> list[list[Block]]:
        """The shared blocks, position by position (each in table stream order)."""
        return [entry.blocks for entry in self.entries]


class PromptPrefixes:
    """Prefix caching for one engine.

    Args:
        cache: The pool's prefix cache.
        root: :func:`cache_root` of the served model and arena.
        block_size: Tokens per block.
        min_tail: Prompt tokens a hit always leaves to compute. 1 (the last token's
            logits give the first generated one), or more where the number of rows
            picks the arithmetic: with the CPU's products from quantized codes (calls
            of at most ``codes_linear.INT8_MAX_ROWS`` rows), a tail of that many
            rows or fewer would run with int8 activations where the cold prompt ran
            in float32, and a near-tie first token (SmolLM2 asked the capital of
            France: "The" 0.10 above "L") flipped on the second asking. One row more
            keeps the tail on the cold prompt's float32 path.
        enabled: False: every lookup misses and nothing is published.
    """

    def __init__(self, cache: PrefixCache, root: bytes, block_size: int,
                 min_tail: int = 1, enabled: bool = True) -> None:
        self.cache = cache
        self.root = root
        self.block_size = block_size
        self.min_tail = max(min_tail, 1)
        self.enabled = enabled

    def lookup(self, prompt_ids: Sequence[int], salt: str | None = None,
               whole_prompt: bool = False) -> PrefixHit:
        """Keys of the prompt and the cached run it may start on (nothing acquired).

        A whole-prompt task (scoring, embedding) computes every position: it finds
        nothing and publishes nothing.

        ``salt`` (a request's ``cache_salt``) starts the chain from a root of its
        own, so its blocks match only prompts sent under the same salt: what one
        client's prompts leave in the cache is invisible to clients without it.
        """
        if not self.enabled or whole_prompt:
            return PrefixHit()
        root = self.root if salt is None else salted_root(self.root, salt)
        keys = chain_hashes(prompt_ids, self.block_size, root)
        usable = max(len(prompt_ids) - self.min_tail, 0) // self.block_size
        return PrefixHit(keys, self.cache.match(keys[:usable]), root)

    def acquire(self, owner: int, hit: PrefixHit, prompt_tokens: int) -> int:
        """``owner`` references ``hit``'s blocks; returns the prompt tokens they cover."""
        if not self.enabled:
            return 0
        self.cache.acquire(owner, hit.entries)
        tokens = len(hit.entries) * self.block_size
        self.cache.record_query(prompt_tokens, tokens)
        return tokens

    def publish(self, owner: int, keys: Sequence[bytes], shared: int,
                table: Sequence[Sequence[Block]]) -> int:
        """Take ``owner``'s computed full prompt blocks (positions ``shared`` on) into the cache.

        Args:
            owner: The request.
            keys: Its prompt's full-block keys.
            shared: Positions it started on (already cached).
            table: Its blocks, ``table[stream][position]``.

        Returns:
            Positions published.
        """
        published = 0
        if not self.enabled:
            return published
        for j in range(shared, len(keys)):
            published += self.cache.publish(owner, keys[j], [stream[j] for stream in table])
        return published

    def publish_output(self, owner: int, prompt_keys: Sequence[bytes], root: bytes,
                       tokens: Sequence[int], stored: int,
                       table: Sequence[Sequence[Block]]) -> int:
        """Publish the full blocks past the prompt's: prompt tail and generated tokens.

        Args:
            owner: The request (it is ending: nothing writes its blocks any more).
            prompt_keys: Keys of its prompt's full blocks (published at prefill).
            root: The root they chain from (its ``cache_salt``'s, if it sent one).
            tokens: Prompt plus the generated tokens it fed to the model.
            stored: Tokens its block table holds (must equal ``len(tokens)``).
            table: Its blocks, ``table[stream][position]``.

        Returns:
            Positions published (0 when ``stored`` disagrees with ``tokens``).
        """
        if stored != len(tokens) or not root:
            return 0
        start = len(prompt_keys)
        parent = prompt_keys[-1] if prompt_keys else root
        keys = chain_hashes(tokens[start * self.block_size:], self.block_size, parent)
        return self.publish(owner, [*prompt_keys, *keys], start, table)

    def publish_rows(self, rows: Sequence[Any], paged: Sequence[Any]) -> int:
        """Publish each prefilled row's full prompt blocks (``rows[i]``, a prefill Row,
        stored as ``paged[i]``, its batch row); returns positions published."""
        return sum(self.publish(row.owner, row.prefix_keys, len(row.cached_blocks), kv.blocks)
                   for row, kv in zip(rows, paged, strict=True))

    def publish_ending(self, rows: Sequence[Any], batch: Any, owners: set[int]) -> int:
        """Publish the full blocks (prompt and output) of decode ``rows`` whose owner is in
        ``owners``: requests finishing now, so no call writes their blocks any more.

        ``batch`` is the decode batch (``batch.rows[i]`` stores ``rows[i]``). Its held
        columns (``kv_write_back``) are written first, so a step in which requests end
        with prefix caching on writes them early. A row whose stored tokens do not match
        prompt plus fed tokens publishes nothing. Returns positions published.
        """
        ending = [(row, kv) for row, kv in zip(rows, batch.rows, strict=True)
                  if row.owner in owners and row.fed]
        if ending:  # their newest tokens may be held out of the arena: write them first
            batch.flush()
        return sum(self.publish_output(row.owner, row.prefix_keys, row.prefix_root,
                                       row.prompt_ids + row.fed, kv.tokens, kv.blocks)
                   for row, kv in ending)

    def release(self, owner: int) -> None:
        """Drop ``owner``'s references (the request ended)."""
        self.cache.release(owner)

    def reset(self) -> int:
        """Drop every unreferenced block; returns blocks freed."""
        return self.cache.reset()
