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

Cached prefix blocks (server.engine.kv_memory) no request references are
*evictable*: the pool counts them as available (``pool.n_available``) and
evicts them, least recently used first, when an allocation needs them. A
request's cached prefix blocks count as held (it references them), so its
reservation only asks for the rest.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from server.protocol import ChatPrompt, SamplingParams, ShrinkRefused
from server.refusal import PoolMisfit, Rejected, Why
from server.text.prompts import no_room_in_pool, prompt_field
from veloxquant_mlx.memory import BlockPoolAllocator


@dataclass(frozen=True, slots=True)
class Reservation:
    """Blocks a request may need, per stream (``{"k": n, "v": n}`` or ``{"kv": 2n}``)."""

    per_stream: dict[str, int]

    @property
    def total(self) -> int:
        """Blocks over all streams."""
        return sum(self.per_stream.values())

    def less(self, held: dict[str, int]) -> Reservation:
        """What is left to draw once ``held`` blocks per stream are in the table already
        (a cached prefix it starts on)."""
        if not held:
            return self
        return Reservation({s: max(n - held.get(s, 0), 0) for s, n in self.per_stream.items()})


def maximal_tokens(limit: int, context_length: int | None) -> int:
    """Tokens of the longest request ``limit`` allows: no request goes past the context."""
    return limit if context_length is None else min(limit, context_length)


class CapacityPlanner:
    """Decides whether a reservation fits the pool now, later, or never.

    Args:
        pool: The shared pool.
        n_layers: KV-cache layers per request.
        maximal_tokens: The longest request the limits allow, in tokens (None: no
            such bound, every shrink goes ahead).
    """

    def __init__(self, pool: BlockPoolAllocator, n_layers: int,
                 maximal_tokens: int | None = None) -> None:
        self.pool = pool
        self.n_layers = n_layers
        # Tokens of the longest request the limits allow (prompt + max_tokens, within the
        # context): a shrink must leave room for one.
        self.maximal_tokens = maximal_tokens
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

    def never_fits(self, need: Reservation, n_tokens: int) -> PoolMisfit | None:
        """Why ``need`` (for ``n_tokens``) cannot fit even an empty pool, or None."""
        headroom = self._growth_headroom()
        if headroom is None:
            return None
        capacity = self._stream_capacity()
        short = {s: n for s, n in need.per_stream.items() if n > capacity[s] + headroom}
        if not short and need.total <= sum(capacity.values()) + headroom:
            return None
        stream, blocks = next(iter(short.items())) if short else ("all", need.total)
        have = capacity.get(stream, sum(capacity.values())) + headroom
        return PoolMisfit(n_tokens, blocks, stream, have, self._max_tokens(capacity, headroom),
                          self.n_layers, self.block_size, len(self.streams) == 1)

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

    def fit_context(self, params: SamplingParams, prompt: str | list[int] | ChatPrompt,
                    n_prompt: int, context: dict[str, Any]) -> SamplingParams | Rejected:
        """Keep prompt + ``max_tokens`` within the model's ``context`` length.

        An omitted ``max_tokens`` is lowered to the room the context leaves (the
        settings returned); one the client sent that goes past it is refused, as
        OpenAI refuses it, instead of generating past the positions the model knows.
        The advice never names more than the pool could hold either. ``context``:
        the model's :meth:`~server.model_loader.LoadedModel.context_figures`.
        """
        length = context["context"]
        if length is None or n_prompt + params.max_tokens <= length:
            return params
        room = length - n_prompt
        if params.max_tokens_defaulted and room >= 1:
            return replace(params, max_tokens=room)
        if room < 1 or params.max_tokens_defaulted:
            return Rejected(Why.NO_ROOM_IN_CONTEXT, {"tokens": n_prompt, **context},
                            prompt_field(prompt))
        pool = self.max_request_tokens()
        if pool is not None and n_prompt >= pool:  # the pool would refuse the prompt next
            return no_room_in_pool(prompt, n_prompt, pool)
        fits = room if pool is None else min(room, pool - n_prompt)
        return Rejected(Why.OVER_CONTEXT, {
            "tokens": n_prompt, "max_tokens": params.max_tokens, "fits": fits, "pool": pool,
            "prompt_field": prompt_field(prompt), **context}, params.max_tokens_param)

    def fit(self, params: SamplingParams, prompt: str | list[int] | ChatPrompt,
            n_prompt: int) -> tuple[Reservation, SamplingParams] | Rejected:
        """A request's reservation and settings if an idle pool could hold it, else why not.

        A request that left ``max_tokens`` out asks for the room there is, as
        OpenAI's API reads an omitted ``max_tokens``: its default is lowered to
        what the pool can ever hold beside its prompt (the settings returned),
        rather than the client being told to lower a field it never sent.
        """
        n_tokens = n_prompt + params.max_tokens
        need = self.reservation(n_tokens)
        misfit = self.never_fits(need, n_tokens)
        if misfit is None:
            return need, params
        room = self.max_request_tokens() - n_prompt
        if room >= 1 and not params.max_tokens_defaulted:
            # The number to send, beside the pool's arithmetic.
            return Rejected(Why.NEVER_FITS_POOL, {"misfit": misfit, "room": room},
                            params.max_tokens_param)
        if room >= 1:
            params = replace(params, max_tokens=min(room, params.max_tokens))
            return self.reservation(n_prompt + params.max_tokens), params
        # The prompt alone fills the pool: no max_tokens helps.
        return no_room_in_pool(prompt, n_prompt, n_prompt + room)

    def starts(self, queue: Iterable[Reservation], slots: int,
               outstanding: dict[str, int]) -> int:
        """How many of ``queue`` (in order) the next admission would start.

        Admission is first come first served: it starts requests while there is a
        batch slot (``slots`` free) and all of them so far fit the pool together, and stops at the
        first that does not. Prefix-cache hits are not counted, so this can only
        under-count (a request judged waiting may start).
        """
        total: dict[str, int] = {}
        started = 0
        for reservation in itertools.islice(queue, slots):  # lazy: a long queue costs nothing
            for stream, blocks in reservation.per_stream.items():
                total[stream] = total.get(stream, 0) + blocks
            if not self.fits_now(Reservation(dict(total)), outstanding):
                break
            started += 1
        return started

    def fit_group(self, total: Reservation, size: int, n_prompt: int,
                  params: SamplingParams) -> Reservation | Rejected:
        """``total``, the reservation of ``size`` choices together, or why an idle pool
        never holds it."""
        n_tokens = size * (n_prompt + params.max_tokens)
        misfit = self.never_fits(total, n_tokens)
        if misfit is None:
            return total
        return Rejected(Why.GROUP_NEVER_FITS, {"misfit": misfit, "size": size,
                                               "field": f"n x {params.max_tokens_param}"}, "n")

    # -- resizing -------------------------------------------------------------------

    def maximal_misfit(self, retiring: dict[str, int] | None = None) -> str | None:
        """Why a maximal request could not fit an otherwise idle pool, or None.

        Args:
            retiring: Per stream, free blocks a shrink is about to retire
                (judge the pool as it will be).
        """
        n_tokens = self.maximal_tokens
        if n_tokens is None:
            return None
        retiring = retiring or {}
        need = self.reservation(n_tokens)
        room = self._room(retiring)
        if room is None:
            return None  # the pool grows back without bound
        after, headroom = room
        short = [s for s, n in need.per_stream.items() if n > after[s] + headroom]
        if not short and need.total <= sum(after.values()) + headroom:
            return None
        stream = short[0] if short else "all"
        have = (after[stream] if short else sum(after.values())) + headroom
        return (f"{n_tokens} tokens need {need.per_stream.get(stream, need.total)} blocks on "
                f"stream {stream!r}, the pool holds {have} there")

    def _room(self, retiring: dict[str, int]) -> tuple[dict[str, int], int] | None:
        """Blocks a request could reach per stream once ``retiring`` is retired, and the
        growth headroom shared by the streams; None when the pool grows without bound."""
        config = self.pool.config
        if config.grow_on_exhaustion and config.max_blocks is None:
            return None
        headroom = 0
        total = self.pool.stats.n_blocks - sum(retiring.values())
        if config.grow_on_exhaustion:
            headroom = max(config.max_blocks - total, 0)
        return ({s: self.pool.n_blocks_on(s) - retiring.get(s, 0) for s in config.streams},
                headroom)

    def _reach(self, retiring: dict[str, int]) -> tuple[int, ...] | None:
        """Blocks one request could reach: per stream, then all streams together."""
        room = self._room(retiring)
        if room is None:
            return None
        after, headroom = room
        return (*(n + headroom for n in after.values()), sum(after.values()) + headroom)

    def shrink(self, stream: str, target_free: int, force: bool,
               outstanding: dict[str, int]) -> tuple[int, dict[str, int]]:
        """Retire free blocks down to ``target_free`` per stream; see ``Engine.shrink``.

        Never below ``outstanding``: what running requests reserved and do not hold yet.

        Returns:
            ``(retired, kept_free)``: blocks retired, and per stream the free blocks
            left, counting cached blocks no request references (as admission does).

        Raises:
            ShrinkRefused: It would leave no room for one maximal request and
                ``force`` is off.
        """
        streams = self.pool.config.streams
        targets = streams if stream == "kv" or len(streams) == 1 else (stream,)
        # Unreferenced cached blocks count as free: they are evicted, then retired, but only
        # once the shrink is known to go ahead (a refused one leaves the cache as it was).
        floors = {s: max(target_free, outstanding.get(s, 0)) for s in targets}
        retiring = {s: max(self.pool.n_available(s) - floors[s], 0) for s in targets}
        why = self.maximal_misfit(retiring)
        # A pool that already cannot hold a maximal request (the default model's, at its
        # whole context) is refused too when the shrink lowers the longest request it
        # serves: otherwise an unforced target_free 0 retires all of the default model's pool.
        already = why is not None and self.maximal_misfit() is not None
        # Retired blocks that growth can bring back (under max_blocks) lower nothing.
        lowers = already and any(
            after < before for after, before in
            zip(self._reach(retiring) or (), self._reach({}) or (), strict=True))
        if why is not None and not force and any(retiring.values()) \
                and (lowers or not already):
            raise ShrinkRefused(
                "shrink refused: " + ("the pool already cannot hold one maximal request, and "
                                      f"retiring {sum(retiring.values())} more blocks lowers "
                                      "the longest request it can serve"
                                      if already else
                                      "the pool could no longer hold one maximal request")
                + f" (limits.max_prompt_tokens + limits.max_tokens_cap, at most the model's "
                f"context): {why}; keep more free blocks, lower those limits, or pass "
                "\"force\": true")
        # Evict only what the free blocks cannot cover, the retirements and the running
        # requests' outstanding reservations (so the free list the shrink leaves holds
        # them): the rest of the cache stays warm rather than emptying on every shrink.
        short = {s: retiring[s] + outstanding.get(s, 0) - self.pool.n_free(s) for s in targets}
        if any(n > 0 for n in short.values()):
            self.pool.prefix_cache.evict(short)
        retired = sum(self.pool.shrink(s, self.pool.n_free(s) - retiring[s]) for s in targets)
        return retired, {s: self.pool.n_available(s) for s in targets}

    def degraded(self, start_tokens: int | None) -> str | None:
        """Why the pool is unwell: shrunk below its starting size (``start_tokens``, the
        longest request it held then) and too small for a maximal request; else None.

        A pool that never held a maximal request (sized for its load) is not unwell at
        its start size.
        """
        now = self.max_request_tokens()
        below_start = now is not None and (start_tokens is None or now < start_tokens)
        why = self.maximal_misfit() if below_start else None
        return None if why is None else (
            "the pool, shrunk below its starting size, cannot hold one maximal request "
            f"(limits.max_prompt_tokens + limits.max_tokens_cap): {why}")
