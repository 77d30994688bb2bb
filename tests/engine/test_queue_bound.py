"""The bound on waiting requests (``limits.max_queue``) counts only requests that will wait.

The engine takes in every request that arrived since its last step before it
admits any, so a burst into an idle server is in the waiting list all at once.
Those the next admission starts (a batch slot each, room in the pool for all
of them in order) are not waiting for anything; counting them refused a burst
of 70 with 65 answered on an idle default server (32 slots, 64 queue places).
Also: a pool too small for any request that leaves ``max_tokens`` out is named
at start-up.
"""

from __future__ import annotations

from types import SimpleNamespace

from server.engine.request_state import RequestState
from server.engine.scheduler import Scheduler
from server.http.refusals import describe
from server.metrics import ServerMetrics
from server.protocol import GenerationRequest, SamplingParams
from server.refusal import Reason
from tests.support.servers import make_settings
from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig


class _Events:
    """Stands in for a request's event channel: keeps what the scheduler sends."""

    def __init__(self) -> None:
        self.events: list = []

    def put(self, event) -> None:
        self.events.append(event)


def _scheduler(tokenizer, max_batch: int, max_queue: int, n_blocks: int = 400) -> Scheduler:
    settings = make_settings(batch={"max_batch_size": max_batch},
                             limits={"max_queue": max_queue})
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=n_blocks))
    # what the scheduler reads
    loaded = SimpleNamespace(n_layers=2, tokenizer=tokenizer, context_length=None,
                             context_figures=lambda: {"context": None})
    return Scheduler(settings, pool, loaded, ServerMetrics())


def _burst(scheduler: Scheduler, n: int, max_tokens: int = 13) -> list[GenerationRequest]:
    """``n`` requests taken in back to back, as one engine intake does (3 prompt tokens)."""
    requests = [GenerationRequest(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=max_tokens),
                                  _Events()) for i in range(n)]
    for request in requests:
        scheduler.intake(RequestState(request, [5, 6, 7]))
    return requests


def _refused(requests: list[GenerationRequest]) -> list[str]:
    return [r.request_id for r in requests if r.channel.events]


def test_a_burst_into_an_idle_server_fills_the_batch_then_the_queue(tiny_model):
    scheduler = _scheduler(tiny_model[1], max_batch=4, max_queue=2)
    requests = _burst(scheduler, 7)
    assert _refused(requests) == ["r6"]  # 4 start, 2 wait, the 7th finds the queue full
    event = requests[6].channel.events[0]
    assert event.reason is Reason.QUEUE_FULL
    assert event.figures == {"waiting": 2, "max_queue": 2}
    assert "2 requests already wait" in describe(event)
    assert len(list(scheduler.admit())) == 4 and len(scheduler.waiting) == 2


def test_requests_the_pool_cannot_hold_yet_count_as_waiting(tiny_model):
    # 2 layers x ceil(16 / 16) = 2 blocks a stream each; 5 blocks a stream fit two at once.
    scheduler = _scheduler(tiny_model[1], max_batch=8, max_queue=2, n_blocks=10)
    requests = _burst(scheduler, 5)
    assert _refused(requests) == ["r4"]  # 2 start, 2 wait for KV, the 5th is refused
    assert len(list(scheduler.admit())) == 2


def test_no_queue_still_takes_what_starts_at_once(tiny_model):
    scheduler = _scheduler(tiny_model[1], max_batch=3, max_queue=0)
    assert _refused(_burst(scheduler, 5)) == ["r3", "r4"]


def test_a_pool_too_small_for_default_requests_is_named_at_start_up(tiny_model, caplog):
    from server.engine.startup import _warn_if_default_requests_never_fit

    # 2 layers x ceil(257 / 16) = 34 blocks a stream: 20 blocks (10 a stream) are too few.
    with caplog.at_level("WARNING", logger="veloxquant.server"):
        _warn_if_default_requests_never_fit(_scheduler(tiny_model[1], 4, 4, n_blocks=20), 256)
    [record] = caplog.records
    assert "cannot hold a request that leaves max_tokens out" in record.getMessage()
    assert "limits.default_max_tokens=256" in record.getMessage()
    caplog.clear()
    with caplog.at_level("WARNING", logger="veloxquant.server"):
        _warn_if_default_requests_never_fit(_scheduler(tiny_model[1], 4, 4, n_blocks=80), 256)
    assert not caplog.records
