"""One record per request inside the engine: queued, running and ended as the same object.

The scheduler owns it (its waiting queue, then its running map); its status says where it
is. Driven on a real scheduler and pool with a stand-in tokenizer: no model work.
"""

from __future__ import annotations

from types import SimpleNamespace

from server.engine.request_state import RequestState, Status
from server.engine.scheduler import Scheduler
from server.metrics import ServerMetrics
from server.protocol import GenerationRequest, SamplingParams
from server.refusal import Reason, Rejected, Why
from tests.support.servers import make_settings
from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig


class _Events:
    def __init__(self) -> None:
        self.events: list = []

    def put(self, event) -> None:
        self.events.append(event)


def _scheduler(max_batch: int = 1, n_blocks: int = 400) -> Scheduler:
    settings = make_settings(batch={"max_batch_size": max_batch})
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=n_blocks))
    tokenizer = SimpleNamespace(detokenizer=object(), eos_token_ids=(2,))
    loaded = SimpleNamespace(n_layers=2, tokenizer=tokenizer, context_length=None,
                             context_figures=lambda: {"context": None})
    return Scheduler(settings, pool, loaded, ServerMetrics())


def _record(rid: str, max_tokens: int = 8) -> RequestState:
    request = GenerationRequest(rid, [5, 6, 7], SamplingParams(max_tokens=max_tokens),
                                _Events())
    return RequestState(request, [5, 6, 7])


def test_the_queued_record_is_the_running_one_and_the_ended_one():
    scheduler = _scheduler(max_batch=1)
    first, second = _record("a"), _record("b")
    scheduler.intake(first)
    scheduler.intake(second)
    assert list(scheduler.waiting) == [first, second]
    assert (first.status, first.owner, first.stop) == (Status.WAITING, 0, None)
    assert first.reservation.per_stream == {"k": 2, "v": 2}  # 2 layers x ceil(11 / 16)

    (admitted,) = scheduler.admit()  # one batch slot
    assert admitted is first and scheduler.running == {first.owner: first}
    assert first.status is Status.RUNNING and first.owner >= 1
    assert first.owner in scheduler.pool.active_owners()
    assert first.eos_ids == frozenset({2}) and first.stop is not None
    assert list(scheduler.waiting) == [second] and second.status is Status.WAITING

    scheduler.release(first)
    assert first.status is Status.DONE and scheduler.running == {}
    assert first.owner not in scheduler.pool.active_owners()
    (next_up,) = scheduler.admit()
    assert next_up is second and second.owner != first.owner


def test_a_refused_record_ends_without_an_owner():
    scheduler = _scheduler()
    too_long = _record("big", max_tokens=10_000)  # 400 blocks hold 3,200 tokens
    scheduler.intake(too_long)
    assert too_long.status is Status.DONE and too_long.owner == 0
    assert scheduler.waiting == type(scheduler.waiting)()
    (event,) = too_long.request.channel.events
    assert event.reason is Reason.TOO_LARGE

    closing = Rejected(Why.SHUTTING_DOWN)
    waiting = _record("w")
    scheduler.intake(waiting)
    scheduler.close(closing)
    assert waiting.status is Status.DONE and not scheduler.waiting
    late = _record("late")
    scheduler.intake(late)
    assert late.status is Status.DONE and late.request.channel.events == [closing]
