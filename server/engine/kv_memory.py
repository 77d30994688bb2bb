"""The server's KV memory: the pool sized in bytes, its arena, the workspace bound.

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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from server.settings import Settings
from server.settings_sections import DEFAULT_N_BLOCKS, LimitsSection
from veloxquant_mlx.memory import BlockPoolAllocator
from veloxquant_mlx.memory.kv_arena import KVArena, KVLayout, workspace_bytes
from veloxquant_mlx.memory.kv_format import KVFormat


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
