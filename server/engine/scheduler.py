"""The scheduler: intake, the waiting and running queues, expiry, admission.

Runs on the engine thread. It is the one owner of a request's lifetime:

    submit -> preparer  tokenize, prompt limits (worker threads, server.text.prompts)
           -> intake()  max_tokens resolved (context, then pool: the one place), fits the
                        pool at all? queue bound  -> refused (Rejected) or waiting
    waiting -> expire()  cancelled or past limits.queue_timeout_s -> dropped / Rejected;
                         can never fit after the pool shrank -> Rejected (capacity_changed)
    waiting -> admit()   first come first served, while the batch has room and
                         the pool can hold the reservation (server.engine.capacity):
                         a fresh owner id, registered on the pool, its cached prompt
                         prefix referenced (server.engine.kv_memory) -> running
    running -> release() the owner is retired on the pool (its blocks went back
                         when its rows left the runner), its cache references
                         dropped -> gone

:meth:`admit` is the only place an owner is registered and :meth:`release`
the only place one is retired; everything else reads :attr:`running`.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator

from server.engine.capacity import CapacityPlanner, Reservation, maximal_tokens
from server.engine.kv_memory import PrefixHit, PromptPrefixes
from server.engine.request_state import ChoiceHolds, RequestState, Status, times
from server.metrics import ServerMetrics
from server.model_loader import LoadedModel
from server.protocol import GenerationRequest
from server.refusal import Reason, Rejected, Why
from server.settings import Settings
from server.text.prompts import RequestRejected
from veloxquant_mlx.memory import BlockPoolAllocator


class Scheduler:
    """Waiting and running requests, and who may run next.

    Args:
        settings: Server settings (``limits`` and ``batch.max_batch_size``).
        pool: The shared pool.
        loaded: The loaded model (tokenizer, vocabulary, layer count).
        metrics: Where refusals and admissions are recorded.
        prefixes: Prefix caching over ``pool.prefix_cache`` (default: off).

    Invariant: an owner is in :attr:`running` exactly while it is registered
    on the pool (registered right after it is listed, retired right before
    it is unlisted), so an owner holding blocks is always a listed one.
    """

    def __init__(self, settings: Settings, pool: BlockPoolAllocator, loaded: LoadedModel,
                 metrics: ServerMetrics, prefixes: PromptPrefixes | None = None) -> None:
        self.limits = settings.limits
        self.max_batch_size = settings.batch.max_batch_size
        self.pool = pool
        self.loaded = loaded
        self.metrics = metrics
        # Prefix caching; without one, off: every lookup misses.
        self.prefixes = prefixes or PromptPrefixes(pool.prefix_cache, b"",
                                                   pool.config.block_size, enabled=False)
        self.planner = CapacityPlanner(pool, loaded.n_layers, maximal_tokens(
            self.limits.max_prompt_tokens + self.limits.max_tokens_cap, loaded.context_length))
        self.waiting: deque[RequestState] = deque()
        # The n choices of a prompt, admitted together (server.engine.request_state).
        self.choices = ChoiceHolds(self.reject, self._drop_cancelled,
                                   self.limits.queue_timeout_s)
        self.max_pool_share = self.limits.max_pool_share
        self.running: dict[int, RequestState] = {}  # owner -> state; written under _lock
        self._lock = threading.Lock()
        self._owners = itertools.count(1)
        self._seen_blocks = pool.stats.n_blocks
        self._releases = 0  # requests released so far
        # (releases, candidate, queue length) when the candidate did not fit
        self._stuck: tuple[int, RequestState, int] | None = None
        # Why the pool cannot hold one maximal request since a shrink left it smaller than
        # at start (capacity_changed), else None.
        self.degraded: str | None = None
        # The most tokens one request could hold at start (None: unbounded growth): a pool
        # back at this size after a shrink is as healthy as it started.
        self._start_tokens = self.planner.max_request_tokens()
        # Set when the server drains (SIGTERM): what has not started is refused, not queued.
        self.closing: Rejected | None = None

    # -- read from any thread ----------------------------------------------------

    def live_requests(self) -> dict[int, str]:
        """Owner id -> request id of every running request."""
        with self._lock:
            return {owner: state.request_id for owner, state in self.running.items()}

    def depths(self) -> tuple[int, int]:
        """(running, waiting) request counts."""
        return len(self.running), len(self.waiting) + len(self.choices.ready)

    # -- intake --------------------------------------------------------------------

    def intake(self, state: RequestState) -> None:
        """Queue a tokenized request, or refuse it at once (can never fit, queue full)."""
        request, prompt_ids = state.request, state.prompt_ids
        if self.closing is not None:
            self.reject(state, self.closing, 0.0)
            return
        group = request.choices if request.choices and request.choices.size > 1 else None
        if group is not None and group in self.choices:
            self.choices.join(state)
            return
        each = None
        try:
            need = each = self._check_size(request, prompt_ids)
            if group is not None:  # the first of its group stands for all of it
                need = self._check_group(request, prompt_ids, need, group.size)
            # The queue's bound counts requests that will really wait: a burst the
            # engine takes in before its next admission starts partly at once.
            starting = self._starts_next(
                itertools.chain((p.reservation for p in self.waiting), (need,)))
            behind = len(self.waiting) - starting
            if behind >= self.limits.max_queue:
                raise RequestRejected(Rejected(
                    Why.QUEUE_FULL, {"waiting": behind, "max_queue": self.limits.max_queue}))
        except RequestRejected as exc:  # refused on arrival: it waited in no queue
            self.reject(state, exc.event, 0.0)
            if group is not None:
                self.choices.open(group, request, each or Reservation({}), refused=exc.event)
            return
        state.queued(need, time.monotonic(), self.limits.queue_timeout_s, group)
        if group is not None:
            self.choices.open(group, request, each, state)
        self.waiting.append(state)

    def _check_group(self, request: GenerationRequest, prompt_ids: list[int],
                     need: Reservation, size: int) -> Reservation:
        """The reservation of a whole choice group, or the 400 when the pool never holds it."""
        total = times(need, size)
        if self._fits_now(total):
            return total
        fitted = self.planner.fit_group(total, size, len(prompt_ids), request.params)
        if isinstance(fitted, Rejected):
            raise RequestRejected(fitted)
        return fitted

    def _refit_group(self, entry: RequestState, need: Reservation) -> Reservation | Rejected:
        """A waiting group's reservation after a resize, or why it can never fit now."""
        self.choices.refit(entry, need)
        try:
            return self._check_group(entry.request, entry.prompt_ids, need, entry.group.size)
        except RequestRejected as exc:
            return exc.event

    def reject(self, state: RequestState, event: Rejected, waited_s: float) -> None:
        """Refuse a request that never ran: it is done (its prompt's size and wait logged)."""
        state.status = Status.DONE
        self.metrics.rejected(event.reason, state.request, len(state.prompt_ids), waited_s)
        state.request.channel.put(event)

    def _check_size(self, request: GenerationRequest, prompt_ids: list[int]) -> Reservation:
        """Its reservation; its limits resolved here, once: the context, then the pool."""
        fitted = self.planner.fit_context(request.params, request.prompt, len(prompt_ids),
                                          self.loaded.context_figures())
        if isinstance(fitted, Rejected):
            raise RequestRejected(fitted)
        request.params = fitted
        need = self.planner.reservation(len(prompt_ids) + request.params.max_tokens)
        if self._fits_now(need):
            return need
        fitted = self._fit_pool(request, prompt_ids)
        if isinstance(fitted, Rejected):
            raise RequestRejected(fitted)
        return fitted

    def _fit_pool(self, request: GenerationRequest,
                  prompt_ids: list[int]) -> Reservation | Rejected:
        """The request's reservation if an idle pool could hold it, else why not; an
        omitted ``max_tokens`` is lowered to fit (:meth:`CapacityPlanner.fit`)."""
        fitted = self.planner.fit(request.params, request.prompt, len(prompt_ids))
        if isinstance(fitted, Rejected):
            return fitted
        need, request.params = fitted
        return need

    # -- capacity changes ------------------------------------------------------------

    def capacity_changed(self) -> None:
        """Re-judge after the pool's size changed (shrink, growth).

        Waiting requests that can no longer ever fit get 400 now rather than a
        429 ``queue_timeout`` later; :attr:`degraded` says whether one maximal
        request still fits.
        """
        self._seen_blocks = self.pool.stats.n_blocks
        self._stuck = None
        keep: deque[RequestState] = deque()
        for pending in self.waiting:
            fitted = self._fit_pool(pending.request, pending.prompt_ids)
            if pending.group is not None and not isinstance(fitted, Rejected):
                fitted = self._refit_group(pending, fitted)
            if isinstance(fitted, Rejected):
                waited = time.monotonic() - pending.submitted_at
                self.reject(pending, fitted, waited)
                if pending.group is not None:
                    self.choices.refuse(pending, fitted, waited)
                continue
            pending.reservation = fitted  # smaller, if its omitted max_tokens was lowered
            keep.append(pending)
        self.waiting = keep
        self.degraded = self.planner.degraded(self._start_tokens)

    def shrink(self, stream: str, target_free: int, force: bool) -> tuple[int, dict[str, int]]:
        """Retire free blocks down to ``target_free`` per stream (see
        :meth:`CapacityPlanner.shrink`), then re-judge the waiting requests."""
        retired, kept = self.planner.shrink(stream, target_free, force, self.outstanding())
        if retired:  # nothing retired: capacity, and so /health, stay as they were
            self.capacity_changed()
        return retired, kept

    # -- expiry and admission ------------------------------------------------------

    def expire(self) -> None:
        """Drop waiting requests whose client left; refuse those past their deadline.

        Also notices a pool whose size changed since the last look (growth, or
        a shrink from outside the engine) and re-judges the waiting requests.
        """
        if self.pool.stats.n_blocks != self._seen_blocks:
            self.capacity_changed()
        if self.choices.holds:
            self.choices.expire()
        if not self.waiting:
            return
        now = time.monotonic()
        keep: deque[RequestState] = deque()
        for pending in self.waiting:
            waited = now - pending.submitted_at
            if pending.request.cancelled.is_set():  # the route cancels every choice together
                self._drop_cancelled(pending)
                event = Rejected(Why.CANCELLED_WAITING)
            elif now >= pending.deadline:
                event = Rejected(Why.QUEUE_TIMEOUT, {"timeout_s": self.limits.queue_timeout_s})
                self.reject(pending, event, waited)
            else:
                keep.append(pending)
                continue
            if pending.group is not None:
                self.choices.refuse(pending, event, waited)
        self.waiting = keep

    def _drop_cancelled(self, pending: RequestState) -> None:
        """A waiting request whose client left: done, counted, nothing sent."""
        pending.status = Status.DONE
        self.metrics.rejected(Reason.CANCELLED_WAITING, pending.request,
                              len(pending.prompt_ids), time.monotonic() - pending.submitted_at)

    def admit(self) -> Iterator[RequestState]:
        """Move waiting requests to running, first come first served, while they fit.

        Yields:
            Each admitted request, its owner registered on the pool.
        """
        yield from self._admit_ready()
        if not self.waiting or not self._has_room() or self._still_stuck():
            return
        outstanding = self.outstanding()
        i = 0
        while i < len(self.waiting) and self._has_room():
            head = self.waiting[i]
            if len(self.waiting) > 1 and self._over_share(head.reservation):
                i += 1  # others wait: it may not hold them back (limits.max_pool_share)
                continue
            hit = self._lookup(head)
            need = head.reservation.less(hit.per_stream())  # its cached prefix is held
            if not self.planner.fits_now(need, outstanding, hit.pinned()):
                # Nothing but a release, an arrival or a pool resize can make it fit: skip
                # the per-step re-check over every running request until then.
                self._stuck = (self._releases, head, len(self.waiting))
                break
            del self.waiting[i]
            if head.group is not None:  # it stands for its group: the hold keeps the rest
                self.choices.admitted(head)
            state = self._register(head, hit)
            for stream, blocks in need.per_stream.items():
                outstanding[stream] = outstanding.get(stream, 0) + blocks
            yield state
            yield from self._admit_ready()

    def _admit_ready(self) -> Iterator[RequestState]:
        """Choices of admitted groups take free batch slots (their blocks are reserved)."""
        while self.choices.ready and self._has_room():
            pending = self.choices.ready.popleft()
            yield self._register(pending, self._lookup(pending))

    def _lookup(self, pending: RequestState) -> PrefixHit:
        """Its cached prompt prefix (a whole-prompt task computes every position: none)."""
        request = pending.request
        return self.prefixes.lookup(pending.prompt_ids, request.cache_salt, request.whole_prompt)

    def _over_share(self, reservation: Reservation) -> bool:
        """More of the pool than one request may reserve while others wait."""
        return reservation.total > self.max_pool_share * self.pool.stats.n_blocks

    def reset_cache(self) -> int:
        """Drop every unreferenced cached block (``POST /admin/cache/reset``); blocks freed."""
        freed = self.prefixes.reset()
        self._stuck = None  # free blocks appeared: a stuck head may fit now
        return freed

    def _register(self, state: RequestState, hit: PrefixHit) -> RequestState:
        """``state`` runs: a fresh owner id, registered on the pool; its prefix referenced."""
        state.start(next(self._owners), self.loaded.tokenizer)
        with self._lock:
            self.running[state.owner] = state
        self.pool.register_owner(state.owner)
        if hit.root:  # caching is on for it
            state.prefix = hit
            state.cached_tokens = self.prefixes.acquire(state.owner, hit, len(state.prompt_ids))
        return state

    def release(self, state: RequestState, held: int = 0) -> int:
        """Retire a running request's owner; the one place a request leaves.

        Its rows left the runner already, which gave its blocks back; should that
        have failed half-way, what the owner still holds is freed here, so no block
        outlives the request. ``held``: blocks it held when its rows left. Returns
        the most blocks it held (for its usage record).
        """
        left = shared = 0
        try:  # cached blocks in its table count as held
            shared = sum(self.pool.prefix_cache.held_blocks(state.owner).values())
            left = self.pool.n_blocks_held(state.owner)
            if left:
                self.pool.free_all(state.owner)
            else:
                self.pool.release_owner(state.owner)
        finally:
            self.prefixes.release(state.owner)  # its cached blocks may become evictable
            state.status = Status.DONE
            with self._lock:
                self.running.pop(state.owner, None)
            self._releases += 1  # blocks came back: a stuck head may fit now
        return max(held, left) + shared

    def cancelled(self) -> list[RequestState]:
        """Running requests whose client left or gave up."""
        return [s for s in self.running.values() if s.request.cancelled.is_set()]

    def outstanding(self) -> dict[str, int]:
        """Per stream, blocks running requests reserved but do not hold yet, and those of
        admitted groups' choices not running yet."""
        out = self.planner.outstanding((s.owner, s.reservation) for s in self.running.values())
        for stream, blocks in self.choices.reserved().items():
            out[stream] = out.get(stream, 0) + blocks
        return out

    def _still_stuck(self) -> bool:
        """The head did not fit and no request has released blocks since."""
        stuck = self._stuck
        return (stuck is not None and stuck[0] == self._releases
                and stuck[2] == len(self.waiting)
                and any(p is stuck[1] for p in self.waiting))

    def _has_room(self) -> bool:
        return len(self.running) < self.max_batch_size

    def _fits_now(self, need: Reservation) -> bool:
        return self.planner.fits_now(need, self.outstanding())

    def _starts_next(self, queue: Iterable[Reservation]) -> int:
        """How many of ``queue`` (in order) the next admission would start."""
        slots = max(self.max_batch_size - len(self.running), 0)
        return self.planner.starts(queue, slots, self.outstanding()) if slots else 0

    def close(self, event: Rejected) -> None:
        """Refuse every waiting request, and every later one, with ``event`` (logged and
        counted as rejections); running requests go on (the server is draining)."""
        self.closing = event
        now = time.monotonic()
        while self.waiting:
            pending = self.waiting.popleft()
            self.reject(pending, event, now - pending.submitted_at)
            if pending.group is not None:
                self.choices.refuse(pending, event, now - pending.submitted_at)
        self.choices.close(event)
