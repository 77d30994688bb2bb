"""Admission arithmetic and the scheduler's queue rules, each checked exactly.

Capacity: a candidate's own cached prefix stops counting as free once it
will reference it, and the cached blocks a running request references count
as held, so it is not reserved for twice. Scheduler: a waiter whose client
left is dropped and counted as such (not as a timeout, and sent nothing); a
pool resized behind the scheduler's back re-judges the waiters (an omitted
``max_tokens`` and its reservation are lowered, what can never fit is
refused); the queue bound counts requests already running; a draining
scheduler refuses new arrivals at once.

Everything runs on a real pool, with a stand-in for the loaded model and for
each request's event channel.
"""

from __future__ import annotations

from types import SimpleNamespace

from server.engine.capacity import CapacityPlanner, Reservation
from server.engine.kv_memory import PromptPrefixes
from server.engine.request_state import RequestState
from server.engine.scheduler import Scheduler
from server.http.refusals import describe
from server.metrics import ServerMetrics
from server.protocol import GenerationRequest, SamplingParams
from server.refusal import Reason, Rejected, Why
from tests.support.servers import make_settings
from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig

BS = 16


class _Events:
    """Stands in for a request's event channel: keeps what the scheduler sends."""

    def __init__(self) -> None:
        self.events: list = []

    def put(self, event) -> None:
        self.events.append(event)


def _cached_planner(n_blocks: int, prompt: list[int]) -> tuple[BlockPoolAllocator,
                                                               PromptPrefixes,
                                                               CapacityPlanner]:
    """One layer; owner 1 computed ``prompt``, published its full blocks and ended."""
    pool = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=n_blocks))
    prefixes = PromptPrefixes(pool.prefix_cache, b"root", BS)
    pool.register_owner(1)
    table = [pool.allocate(s, len(prompt), 1) for s in ("k", "v")]
    prefixes.publish(1, prefixes.lookup(prompt).keys, 0, table)
    prefixes.release(1)
    pool.free_all(1)
    return pool, prefixes, CapacityPlanner(pool, 1)


def test_fits_now_does_not_count_the_candidates_own_cached_prefix_as_free():
    prompt = list(range(BS + 1))  # one cached position: 1 block a stream
    pool, prefixes, planner = _cached_planner(8, prompt)
    assert (pool.n_free("k"), pool.n_available("k")) == (3, 4)
    pinned = prefixes.lookup(prompt).pinned()
    assert pinned == {"k": 1, "v": 1}
    # 3 free + 1 evictable - 1 pinned = 3 a stream.
    assert planner.fits_now(Reservation({"k": 3, "v": 3}), {}, pinned)
    assert not planner.fits_now(Reservation({"k": 4, "v": 4}), {}, pinned)
    assert planner.fits_now(Reservation({"k": 4, "v": 4}), {})  # another prompt may evict it
    # Less what running requests may still draw.
    assert planner.fits_now(Reservation({"k": 2, "v": 3}), {"k": 1}, pinned)
    assert not planner.fits_now(Reservation({"k": 3, "v": 3}), {"k": 1}, pinned)


def test_outstanding_counts_referenced_cached_blocks_as_held():
    prompt = list(range(2 * BS + 8))  # two full blocks cached, a partial third
    pool, prefixes, planner = _cached_planner(40, prompt)
    hit = prefixes.lookup(prompt)
    pool.register_owner(2)
    prefixes.acquire(2, hit, len(prompt))  # a prefix hit: references 2 blocks a stream
    for stream in ("k", "v"):
        pool.allocate(stream, 8, 2)  # computes its tail: 1 block a stream of its own
    reservation = planner.reservation(len(prompt) + 24)  # 64 tokens: 4 blocks a stream
    assert reservation.per_stream == {"k": 4, "v": 4}
    assert pool.prefix_cache.held_blocks(2) == {"k": 2, "v": 2}
    assert planner.outstanding([(2, reservation)]) == {"k": 4 - 1 - 2, "v": 4 - 1 - 2}


# -- scheduler -------------------------------------------------------------------------


def _scheduler(n_blocks: int = 64, max_batch: int = 8, max_queue: int = 8) -> Scheduler:
    """Two layers over a split pool of ``n_blocks`` (half a stream), block_size 16."""
    settings = make_settings(batch={"max_batch_size": max_batch},
                             limits={"max_queue": max_queue})
    pool = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=n_blocks))
    # What the scheduler reads of the loaded model (admission copies the tokenizer's two).
    tokenizer = SimpleNamespace(detokenizer=None, eos_token_ids=())
    loaded = SimpleNamespace(n_layers=2, tokenizer=tokenizer, context_length=None,
                             context_figures=lambda: {"context": None})
    return Scheduler(settings, pool, loaded, ServerMetrics())


def _arrive(scheduler: Scheduler, rid: str, prompt: list[int], max_tokens: int = 13,
            defaulted: bool = False) -> GenerationRequest:
    params = SamplingParams(max_tokens=max_tokens, max_tokens_defaulted=defaulted)
    request = GenerationRequest(rid, prompt, params, _Events())
    scheduler.intake(RequestState(request, prompt))
    return request


def _rejections(scheduler: Scheduler, reason: Reason) -> float:
    value = scheduler.metrics.registry.get_sample_value(
        "veloxquant_request_rejected_total", {"reason": reason.value})
    return value or 0.0


def test_a_cancelled_waiter_is_dropped_as_cancelled_waiting_not_timed_out():
    scheduler = _scheduler()
    request = _arrive(scheduler, "r0", [5, 6, 7])
    assert len(scheduler.waiting) == 1
    request.cancel()
    scheduler.expire()
    assert not scheduler.waiting
    assert request.channel.events == []  # its client left: nothing to send
    assert _rejections(scheduler, Reason.CANCELLED_WAITING) == 1
    assert _rejections(scheduler, Reason.QUEUE_TIMEOUT) == 0


def _shrunk_behind_the_scheduler():
    """Three waiters of 14 blocks a stream, then the pool shrunk to 10 a stream directly.

    10 blocks a stream hold 10 // 2 layers = 5 blocks (80 tokens) a request.
    """
    scheduler = _scheduler()
    lowered = _arrive(scheduler, "lowered", [5, 6, 7], max_tokens=100, defaulted=True)
    explicit = _arrive(scheduler, "explicit", [5, 6, 7], max_tokens=100)
    long_prompt = _arrive(scheduler, "long", list(range(90)), max_tokens=10, defaulted=True)
    assert len(scheduler.waiting) == 3
    assert scheduler.pool.shrink("kv", 20) == 44
    scheduler.expire()
    return scheduler, lowered, explicit, long_prompt


def test_expire_re_judges_waiters_after_the_pool_shrank_behind_the_scheduler():
    scheduler, lowered, explicit, long_prompt = _shrunk_behind_the_scheduler()
    assert lowered.params.max_tokens == 80 - 3  # the room beside its prompt
    assert lowered.channel.events == []
    [too_large] = explicit.channel.events  # the client asked for 100: told the most
    assert isinstance(too_large, Rejected) and too_large.reason is Reason.TOO_LARGE
    assert too_large.why is Why.NEVER_FITS_POOL and too_large.figures["room"] == 77
    assert too_large.param == "max_tokens" and "max_tokens can be at most 77" in describe(too_large)
    [no_room] = long_prompt.channel.events  # its prompt alone fills the pool
    assert no_room.reason is Reason.TOO_LARGE and no_room.param == "prompt"
    assert [p.request for p in scheduler.waiting] == [lowered]
    assert _rejections(scheduler, Reason.TOO_LARGE) == 2


def test_a_lowered_max_tokens_lowers_the_reservation_so_the_waiter_runs():
    scheduler, lowered, _, _ = _shrunk_behind_the_scheduler()
    [pending] = scheduler.waiting
    expected = scheduler.planner.reservation(3 + lowered.params.max_tokens)
    assert expected.per_stream == {"k": 10, "v": 10}
    assert pending.reservation == expected
    [state] = scheduler.admit()
    assert state.request is lowered and state.reservation == expected
    assert lowered.channel.events == []


def test_the_queue_bound_counts_requests_already_running():
    scheduler = _scheduler(n_blocks=400, max_batch=2, max_queue=1)
    _arrive(scheduler, "r0", [5, 6, 7])
    _arrive(scheduler, "r1", [5, 6, 7])
    assert len(list(scheduler.admit())) == 2
    waits = _arrive(scheduler, "r2", [5, 6, 7])
    refused = _arrive(scheduler, "r3", [5, 6, 7])
    assert waits.channel.events == []
    assert [e.reason for e in refused.channel.events] == [Reason.QUEUE_FULL]
    assert [p.request for p in scheduler.waiting] == [waits]


def test_after_close_an_arrival_gets_the_drain_refusal_and_is_not_queued():
    scheduler = _scheduler()
    drain = Rejected(Why.SHUTTING_DOWN)
    scheduler.close(drain)
    request = _arrive(scheduler, "late", [5, 6, 7])
    assert request.channel.events == [drain]
    assert not scheduler.waiting
    assert _rejections(scheduler, Reason.SHUTTING_DOWN) == 1
