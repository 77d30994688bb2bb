"""Admission by capacity: reserve what a request can need before it runs.

A request of ``P`` prompt tokens and ``max_tokens = M`` can write at most
``P + M`` token slots into each layer's K and V cache. The pool-backed cache
grows in ``block_size`` steps, so per layer and stream it can hold at most
``ceil((P + M) / block_size)`` blocks::

    reservation[stream] = n_layers * ceil((P + M) / block_size)   # k and v
    reservation["kv"]   = 2 * n_layers * ceil((P + M) / block_size)  # shared stream

A request is admitted only when every stream's free blocks, minus what the
already running requests may still draw (their reservation minus what they
hold), cover its reservation. So a running request never meets an exhausted
pool, whatever the others do. Runs on the engine thread; reads the pool
through its thread-safe methods only.

Cached prefix blocks (server.engine.prefix) no request references are
*evictable*: the pool counts them as available (``pool.n_available``) and
evicts them, least recently used first, when an allocation needs them. A
request's cached prefix blocks count as held (it references them), so its
reservation only asks for the rest.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from veloxquant_mlx.memory import BlockPoolAllocator


@dataclass(frozen=True, slots=True)
class Reservation:
    """Blocks a request may need, per stream (``{"k": n, "v": n}`` or ``{"kv": 2n}``)."""

    per_stream: dict[str, int]

    @property
    def total(self) -> int:
        """Blocks over all streams."""
        return sum(self.per_stream.values())


class CapacityPlanner:
    """Decides whether a reservation fits the pool now, later, or never.

    Args:
        pool: The shared pool.
        n_layers: KV-cache layers per request.
    """

    def __init__(self, pool: BlockPoolAllocator, n_layers: int) -> None:
        self.pool = pool
        self.n_layers = n_layers
        self.block_size = pool.config.block_size
        self.streams = pool.config.streams

    def reservation(self, n_tokens: int) -> Reservation:
        """Blocks a request that may write ``n_tokens`` slots per layer can hold."""
        per_layer = -(-n_tokens // self.block_size)
        per_stream = self.n_layers * per_layer
        if len(self.streams) == 1:
            return Reservation({self.streams[0]: 2 * per_stream})
        return Reservation({s: per_stream for s in self.streams})

    def _growth_headroom(self) -> int | None:
        """Blocks the pool may still add by growing; None for unbounded."""
        config = self.pool.config
        if not config.grow_on_exhaustion:
            return 0
        if config.max_blocks is None:
            return None
        return max(config.max_blocks - self.pool.stats.n_blocks, 0)

    def _stream_capacity(self) -> dict[str, int]:
        """Blocks each stream manages now (free, held, cached)."""
        return {s: self.pool.n_blocks_on(s) for s in self.streams}

    def never_fits(self, need: Reservation, n_tokens: int,
                   field: str = "max_tokens") -> str | None:
        """Explain why ``need`` cannot fit even an empty pool, or return None.

        ``field`` is the request field the message tells the client to lower.
        """
        headroom = self._growth_headroom()
        if headroom is None:
            return None
        capacity = self._stream_capacity()
        short = {s: n for s, n in need.per_stream.items() if n > capacity[s] + headroom}
        if not short and need.total <= sum(capacity.values()) + headroom:
            return None
        stream, blocks = next(iter(short.items())) if short else ("all", need.total)
        have = capacity.get(stream, sum(capacity.values())) + headroom
        most = self._max_tokens(capacity, headroom)
        fix = (f"lower {field} or shorten the prompt to fit {most} tokens in total, or "
               if most > 0 else "the pool holds no request now (shrunk by /admin/shrink?); ")
        return (
            f"prompt plus {field} ({n_tokens} tokens) needs {blocks} KV blocks on stream "
            f"{stream!r} ({self.n_layers} layers x ceil({n_tokens}/{self.block_size})"
            f"{' x 2 (k and v)' if len(self.streams) == 1 else ''}), but the pool holds at most "
            f"{have} there; {fix}raise pool.n_blocks "
            "(or pool.max_blocks with pool.grow_on_exhaustion)"
        )

    def max_request_tokens(self) -> int | None:
        """The most tokens (prompt + max_tokens) one request could reserve in an idle pool.

        None when the pool grows without bound. Exactly the largest ``n_tokens``
        whose reservation :meth:`never_fits` accepts.
        """
        headroom = self._growth_headroom()
        if headroom is None:
            return None
        return self._max_tokens(self._stream_capacity(), headroom)

    def _max_tokens(self, capacity: dict[str, int], headroom: int) -> int:
        # Growth may go to any stream, so it counts toward each one and once toward all.
        per_layer = (sum(capacity.values()) + headroom) // (2 * self.n_layers)
        if len(self.streams) > 1:
            per_layer = min(per_layer, *((capacity[s] + headroom) // self.n_layers
                                         for s in self.streams))
        return per_layer * self.block_size

    def fits_now(self, need: Reservation, outstanding: dict[str, int],
                 pinned: dict[str, int] | None = None) -> bool:
        """Whether ``need`` fits beside what running requests may still draw.

        Args:
            need: The candidate's reservation (new blocks only).
            outstanding: Per stream, blocks running requests reserved but do not hold yet.
            pinned: Per stream, evictable blocks the candidate itself will
                reference (its cached prefix): they stop counting as free.
        """
        headroom = self._growth_headroom()
        if headroom is None:
            return True
        pinned = pinned or {}
        deficit = 0
        for stream, blocks in need.per_stream.items():
            spare = (self.pool.n_available(stream)
                     - pinned.get(stream, 0) - outstanding.get(stream, 0))
            deficit += max(blocks - spare, 0)
        return deficit <= headroom

    def outstanding(self, running: Iterable[tuple[int, Reservation]]) -> dict[str, int]:
        """Blocks reserved by running requests (owner, reservation) but not yet held."""
        out = dict.fromkeys(self.streams, 0)
        for owner, reservation in running:
            # Cached blocks it references count as held: they are in its table.
            held = self.pool.n_blocks_held_per_stream(owner)
            for stream, n in self.pool.prefix_cache.held_blocks(owner).items():
                held[stream] = held.get(stream, 0) + n
            for stream, blocks in reservation.per_stream.items():
                out[stream] += max(blocks - held.get(stream, 0), 0)
        return out
