"""Plain records of the block pool: its blocks and its counters.

No MLX and no locking here; ``BlockPoolAllocator`` (block_pool.py) owns the
mutation rules. Kept apart so the allocator module stays about allocation.
"""

from __future__ import annotations

import re
from typing import Any

from veloxquant_mlx.exceptions import PoolArgumentError, PoolArgumentTypeError
from veloxquant_mlx.memory.pool_config import SHARED_STREAM

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_NO_HOME: list[Block] = []  # never appended to: only pool-made blocks are freed

CACHED = -(2**63)
"""``Block.owner`` of a block the pool's prefix cache holds: in use, no request's.
The one int the pool refuses as an owner id."""


class Block:
    """One fixed-size block of KV-cache storage.

    ``block_id`` is stable for the life of the pool; blocks are reused in
    place. ``owner`` is None while the block is free, and :data:`CACHED` while
    the pool's prefix cache holds it. ``n_used`` (token slots
    filled) is set by ``allocate()`` and kept current by whoever writes into
    the block; assigning it keeps the pool's fragmentation count in step.
    ``checkouts`` counts the times the pool handed the block out (a transfer
    is not one): storage compares it to tell a new owner from the last one.
    """

    __slots__ = (
        "block_id", "stream", "format", "_n_used", "owner", "ever_allocated", "_pool", "_key",
        "_home", "checkouts",
    )

    def __init__(
        self,
        block_id: int,
        stream: str = SHARED_STREAM,
        format: str = "fp16",
        n_used: int = 0,
        owner: int | None = None,
        ever_allocated: bool = False,
    ) -> None:
        self.block_id = block_id
        # The id as a ready-made Python int, for dict keys on the hot path: a
        # compiled build would otherwise box a fresh int object per lookup.
        self._key: object = block_id
        self.stream = stream
        self.format = format
        self._n_used = n_used
        self.owner = owner
        self.ever_allocated = ever_allocated
        self.checkouts = 0
        # The BlockPoolAllocator that made it (None for a loose block): it keeps the
        # fragmentation count when n_used changes. Untyped, so this module stays below
        # block_pool.py instead of in a loop with it.
        self._pool: Any = None
        # The pool's free stack this block returns to; set by the pool. Shared
        # placeholder until then: one list per block would double the objects
        # a big pool allocates and scatter its blocks in memory.
        self._home: list[Block] = _NO_HOME

    @property
    def n_used(self) -> int:
        """Token slots currently occupied (0..block_size)."""
        return self._n_used

    @n_used.setter
    def n_used(self, value: object) -> None:
        # Typed object, checked here: a compiled build would refuse a float with a bare
        # TypeError of its own, where the pure one raises PoolArgumentTypeError.
        if isinstance(value, bool) or not isinstance(value, int):
            raise PoolArgumentTypeError(f"n_used must be an int, got {type(value).__name__}")
        pool = self._pool
        if pool is None:
            self._n_used = value
            return
        pool._set_used(self, value)

    def __repr__(self) -> str:
        return (
            f"Block(block_id={self.block_id}, stream={self.stream!r}, format={self.format!r}, "
            f"n_used={self._n_used}, owner={self.owner!r}, "
            f"ever_allocated={self.ever_allocated})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Block):
            return NotImplemented
        return (
            self.block_id, self.stream, self.format, self._n_used, self.owner,
            self.ever_allocated,
        ) == (
            other.block_id, other.stream, other.format, other._n_used, other.owner,
            other.ever_allocated,
        )

    # Mutable; compares by value like the dataclass it stands for.
    __hash__ = None  # type: ignore[assignment]


STAT_FIELDS = (
    "n_blocks", "n_allocations", "n_frees", "n_reused", "n_exhausted", "n_grown",
    "n_retired", "peak_blocks_in_use", "n_partial",
)


class AllocationStats:
    """Running counters of a pool. Every counter counts blocks, not calls, except
    ``n_exhausted``: failed ``allocate()`` calls (one per call, however many
    blocks it asked for).

    Fields (constructor arguments in this order): n_blocks, n_allocations,
    n_frees, n_reused, n_exhausted, n_grown, n_retired, peak_blocks_in_use,
    and n_partial (blocks allocated but not full, kept so that
    ``fragmentation()`` never has to scan). Plain int slots: the allocator
    updates them in place on its hot path.
    """

    __slots__ = STAT_FIELDS

    def __init__(
        self,
        n_blocks: int,
        n_allocations: int = 0,
        n_frees: int = 0,
        n_reused: int = 0,
        n_exhausted: int = 0,
        n_grown: int = 0,
        n_retired: int = 0,
        peak_blocks_in_use: int = 0,
        n_partial: int = 0,
    ) -> None:
        self.n_blocks = n_blocks
        self.n_allocations = n_allocations
        self.n_frees = n_frees
        self.n_reused = n_reused
        self.n_exhausted = n_exhausted
        self.n_grown = n_grown
        self.n_retired = n_retired
        self.peak_blocks_in_use = peak_blocks_in_use
        self.n_partial = n_partial

    def copy_from(self, other: AllocationStats) -> None:
        """Overwrite every counter with ``other``'s (no allocation: history ring)."""
        self.n_blocks = other.n_blocks
        self.n_allocations = other.n_allocations
        self.n_frees = other.n_frees
        self.n_reused = other.n_reused
        self.n_exhausted = other.n_exhausted
        self.n_grown = other.n_grown
        self.n_retired = other.n_retired
        self.peak_blocks_in_use = other.peak_blocks_in_use
        self.n_partial = other.n_partial

    def as_tuple(self) -> tuple[int, ...]:
        """The counters in field order."""
        return (
            self.n_blocks, self.n_allocations, self.n_frees, self.n_reused, self.n_exhausted,
            self.n_grown, self.n_retired, self.peak_blocks_in_use, self.n_partial,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, AllocationStats):
            return NotImplemented
        return self.as_tuple() == other.as_tuple()

    __hash__ = None  # type: ignore[assignment]  # mutable

    def blocks_in_use(self) -> int:
        """Blocks currently checked out (``n_allocations - n_frees``)."""
        return self.n_allocations - self.n_frees

    def fragmentation(self) -> float:
        """Fraction of managed blocks that are allocated but not full."""
        return self.n_partial / self.n_blocks if self.n_blocks else 0.0

    def snapshot(self) -> AllocationStats:
        """An independent copy, unaffected by later pool activity."""
        return AllocationStats(*self.as_tuple())

    def as_dict(self) -> dict[str, float]:
        """Counters plus derived values, for JSON endpoints and logs."""
        out: dict[str, float] = dict(zip(STAT_FIELDS, self.as_tuple(), strict=True))
        out["blocks_in_use"] = self.blocks_in_use()
        out["fragmentation"] = self.fragmentation()
        return out

    def to_prometheus(self, prefix: str = "veloxquant_block_pool") -> str:
        """Render the stats as Prometheus text exposition (newline-terminated).

        Raises:
            PoolArgumentError: ``prefix`` is not a valid metric name (scrapers
                would reject the whole page).
        """
        if not isinstance(prefix, str) or _METRIC_NAME.fullmatch(prefix) is None:
            raise PoolArgumentError(
                f"prefix must be a Prometheus metric name ([a-zA-Z_:][a-zA-Z0-9_:]*), "
                f"got {prefix!r}")
        # Values rendered here, each as its own type: in one tuple with the float
        # fragmentation, a compiled build made every count a float ("3.0").
        rows = (
            ("blocks_in_use", "gauge", "Blocks currently checked out",
             str(self.blocks_in_use())),
            ("blocks_total", "gauge", "Blocks the pool manages", str(self.n_blocks)),
            ("fragmentation", "gauge", "Share of blocks allocated but not full",
             repr(self.fragmentation())),
            ("peak_blocks_in_use", "gauge", "High-water mark of blocks in use",
             str(self.peak_blocks_in_use)),
            ("allocations_total", "counter", "Blocks handed out", str(self.n_allocations)),
            ("frees_total", "counter", "Blocks returned", str(self.n_frees)),
            ("reused_total", "counter", "Blocks handed out again after a free",
             str(self.n_reused)),
            ("exhausted_total", "counter", "Failed allocate() calls (pool exhausted)",
             str(self.n_exhausted)),
            ("grown_total", "counter", "Blocks added by growth", str(self.n_grown)),
            ("retired_total", "counter", "Blocks removed by shrink", str(self.n_retired)),
        )
        lines = []
        for name, kind, help_text, value in rows:
            # Text format 0.0.4: a counter's HELP/TYPE lines name the _total sample.
            family = f"{prefix}_{name}"
            lines.append(f"# HELP {family} {help_text}")
            lines.append(f"# TYPE {family} {kind}")
            lines.append(f"{prefix}_{name} {value}")
        return "\n".join(lines) + "\n"

    def __repr__(self) -> str:
        return (
            f"AllocationStats(in_use={self.blocks_in_use()}/{self.n_blocks}, "
            f"allocations={self.n_allocations}, frees={self.n_frees}, "
            f"reused={self.n_reused}, exhausted={self.n_exhausted}, grown={self.n_grown}, "
            f"retired={self.n_retired}, peak={self.peak_blocks_in_use}, "
            f"fragmentation={self.fragmentation():.3f})"
        )
