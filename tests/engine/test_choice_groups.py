"""One prompt's ``n`` choices are admitted together or refused at once, never half-started,
and no single request reserves more than ``limits.max_pool_share`` of the pool while others
wait.

Admitted one by one, an n=16 request with a 2,000-token prompt started 15 choices, the
16th waited at the head of the queue with most of the pool reserved, another client's
5-token request waited 23.7 s behind it, and then the 16th got a 429 and the 15 were thrown
away. Everything here runs on a real pool with stand-ins for the model and the channels.
"""

from __future__ import annotations

from types import SimpleNamespace

import httpx

from server.engine.request_state import ChoiceGroup, RequestState
from server.engine.scheduler import Scheduler
from server.http.refusals import describe
from server.metrics import ServerMetrics
from server.protocol import GenerationRequest, SamplingParams
from server.refusal import Reason
from tests.support.servers import make_settings
from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig

PROMPT = [5, 6, 7]  # with max_tokens 13: 16 tokens, 1 block a layer and stream


class _Events:
    def __init__(self) -> None:
        self.events: list = []

    def put(self, event) -> None:
        self.events.append(event)


def _scheduler(n_blocks: int, max_batch: int = 32, share: float = 1.0,
               timeout: float = 30.0) -> Scheduler:
    settings = make_settings(batch={"max_batch_size": max_batch},
                             limits={"max_queue": 16, "max_pool_share": share,
                                     "queue_timeout_s": timeout})
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=n_blocks))
    tokenizer = SimpleNamespace(detokenizer=None, eos_token_ids=[1])
    loaded = SimpleNamespace(n_layers=2, tokenizer=tokenizer, context_length=None,
                             context_figures=lambda: {"context": None})
    return Scheduler(settings, pool, loaded, ServerMetrics())


def _request(name: str, max_tokens: int = 13, group: ChoiceGroup | None = None):
    return GenerationRequest(name, PROMPT, SamplingParams(max_tokens=max_tokens), _Events(),
                             choices=group)


def _group(n: int, max_tokens: int = 13) -> ChoiceGroup:
    group = ChoiceGroup()
    group.members = [_request(f"c{i}", max_tokens, group) for i in range(n)]
    return group


def _arrive(scheduler: Scheduler, *requests: GenerationRequest) -> None:
    for request in requests:
        scheduler.intake(RequestState(request, list(PROMPT)))


def _admit(scheduler: Scheduler) -> list[str]:
    return [state.request_id for state in scheduler.admit()]


def test_a_group_the_pool_can_never_hold_is_refused_whole_at_once():
    # 2 layers x 1 block = 2 blocks a stream per choice; 10 blocks a stream hold 5.
    scheduler = _scheduler(n_blocks=20)
    group = _group(6)
    _arrive(scheduler, *group.members)
    assert _admit(scheduler) == [] and not scheduler.waiting and not scheduler.choices.ready
    events = [m.channel.events for m in group.members]
    assert all(len(e) == 1 and e[0].reason is Reason.TOO_LARGE for e in events)
    assert events[0][0].param == "n" and events[0][0].figures["size"] == 6
    assert "n=6" in describe(events[0][0])
    assert scheduler.pool.stats.blocks_in_use() == 0


def test_a_group_waits_whole_and_starts_whole():
    scheduler = _scheduler(n_blocks=20)  # 5 choices' worth
    _arrive(scheduler, _request("alone"))  # takes 1 of the 5
    assert _admit(scheduler) == ["alone"]
    group = _group(5)
    _arrive(scheduler, *group.members)
    assert _admit(scheduler) == []  # 4 would fit now, but a group starts whole or not at all
    assert len(scheduler.waiting) == 1  # the group waits as one entry
    scheduler.release(scheduler.running[1])
    assert sorted(_admit(scheduler)) == [f"c{i}" for i in range(5)]


def test_choices_sent_after_the_first_is_admitted_start_on_its_reservation():
    # The route sends the other choices once the first is prefilled (a shared prompt).
    scheduler = _scheduler(n_blocks=20)
    group = _group(4)
    _arrive(scheduler, group.members[0])
    assert _admit(scheduler) == ["c0"]
    _arrive(scheduler, _request("newcomer", max_tokens=29))  # 2 blocks a layer: needs 4
    assert _admit(scheduler) == []  # the group's 3 unsent choices keep their room
    _arrive(scheduler, *group.members[1:])
    assert _admit(scheduler) == ["c1", "c2", "c3"]
    scheduler.expire()  # every member arrived: the group's record goes
    assert not scheduler.choices.holds


def test_choices_cancelled_before_they_arrive_give_their_room_back():
    scheduler = _scheduler(n_blocks=20)
    group = _group(4)
    _arrive(scheduler, group.members[0])
    assert _admit(scheduler) == ["c0"]
    assert scheduler.outstanding() == {"k": 8, "v": 8}  # all 4 reserved, none written yet
    for member in group.members[1:]:
        member.cancel()
    scheduler.expire()
    assert scheduler.outstanding() == {"k": 2, "v": 2}
    assert not scheduler.choices.holds


def test_a_group_that_times_out_is_refused_whole_and_later_choices_too():
    scheduler = _scheduler(n_blocks=20, timeout=1e-6)
    _arrive(scheduler, _request("hog", max_tokens=45))  # 3 blocks a layer: 6 of 10
    assert _admit(scheduler) == ["hog"]
    group = _group(3)
    _arrive(scheduler, *group.members[:2])
    scheduler.expire()  # past its deadline
    assert [m.channel.events[0].reason for m in group.members[:2]] == [Reason.QUEUE_TIMEOUT] * 2
    _arrive(scheduler, group.members[2])
    assert group.members[2].channel.events[0].reason is Reason.QUEUE_TIMEOUT
    assert len(scheduler.running) == 1 and not scheduler.waiting


def test_a_request_over_the_pool_share_is_passed_over_while_others_wait():
    scheduler = _scheduler(n_blocks=40, share=0.5)  # 20 blocks a stream
    _arrive(scheduler, _request("running", max_tokens=29))  # 2 blocks a layer: 8 blocks
    assert _admit(scheduler) == ["running"]
    big = _request("big", max_tokens=109)  # 8 blocks a layer: 32 of 40 blocks, over half
    _arrive(scheduler, big, _request("small"))
    assert _admit(scheduler) == ["small"]  # big does not fit yet, and may not hold it back
    for state in list(scheduler.running.values()):
        scheduler.release(state)
    assert _admit(scheduler) == ["big"]  # alone in the queue: it may take the pool


def test_n16_over_the_pool_is_a_400_with_nothing_started(live_server):
    before = live_server.metrics()
    answer = httpx.post(live_server.base_url + "/v1/completions", timeout=60, json={
        "prompt": "word " * 1500, "n": 16, "max_tokens": 2000})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "n" and error["code"] == "context_length_exceeded"
    after = live_server.wait_idle()
    assert after["veloxquant_generation_tokens_total"] == \
        before["veloxquant_generation_tokens_total"]
    small = httpx.post(live_server.base_url + "/v1/completions", timeout=60,
                       json={"prompt": "hi", "max_tokens": 2})
    assert small.status_code == 200
