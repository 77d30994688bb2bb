"""When the engine hands a step's events to the event loop (``batch.events_at_submit``).

On (``auto`` on a GPU), a decode step's token events (and the end events of
that step) wait in the engine's batch until the next decode is handed to the
device, when the engine thread lets the GIL go; where no decode follows (the
last row ended, a prefill comes first) they go at once. Off (``auto`` on the
CPU backend), every batch goes as soon as it is complete. Either way each
request's events arrive in order: admitted, its tokens, then its end.

The engine is driven step by step on the test thread (tiny model), its
channels bound to a loop the test runs between steps, so what reached the
loop after each step is exact.
"""

from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest

from server.channel import EventChannel
from server.engine import runner as runner_module
from server.engine.engine import Engine
from server.metrics import ServerMetrics
from server.protocol import (
    Admitted,
    Finished,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from tests.support.servers import make_settings

NO_EOS = ((1, -100.0), (3, -100.0))  # the tiny model's end tokens never come


class SteppedEngine:
    """An engine whose steps the test runs, and a loop that receives its events."""

    def __init__(self, model_path, events_at_submit: bool) -> None:
        settings = make_settings(model={"path": str(model_path)},
                                 batch={"events_at_submit": events_at_submit})
        self.engine = Engine(settings, ServerMetrics())
        assert self.engine._load(), self.engine.load_error
        self.loop = asyncio.new_event_loop()
        self.received: dict[str, list] = {}
        self.channels: dict[str, EventChannel] = {}

    def submit(self, name: str, max_tokens: int) -> None:
        channel = self.channels[name] = EventChannel(self.loop)
        self.received[name] = []
        params = SamplingParams(max_tokens=max_tokens, logit_bias=NO_EOS)
        self.engine.submit(GenerationRequest(name, f"{name} once upon a time", params, channel))
        self.engine._intake(timeout=10.0)  # the prompt worker's tokenized request

    def step(self) -> None:
        self.engine.steps.step()
        self.step_events()

    def step_events(self) -> None:
        """Receive what the engine has sent so far."""
        self.loop.run_until_complete(asyncio.sleep(0))  # run what the engine sent
        for name, channel in self.channels.items():
            while (event := channel.get_nowait()) is not None:
                self.received[name].append(event)

    def pending(self) -> int:
        """Events the engine holds back right now."""
        return len(self.engine.steps._events._pending)

    def close(self) -> None:
        self.engine.steps.send_events()
        self.engine._preparer.close()
        self.engine.runner.close()
        self.loop.close()


@pytest.fixture(params=[True, False], ids=["at_submit", "at_once"])
def stepped(request, tiny_model_path):
    engine = SteppedEngine(tiny_model_path, request.param)
    yield engine
    engine.close()


def _tokens(events: list) -> int:
    return sum(isinstance(e, TokenEvent) for e in events)


def test_each_request_hears_admitted_tokens_then_its_end(stepped):
    lengths = {"a": 3, "b": 7, "c": 12}
    for name, n in lengths.items():
        stepped.submit(name, n)
    for _ in range(40):
        stepped.step()
        if all(isinstance(r[-1:] and r[-1], Finished) for r in stepped.received.values()):
            break
    for name, n in lengths.items():
        events = stepped.received[name]
        assert isinstance(events[0], Admitted), events[:2]
        assert all(isinstance(e, TokenEvent) for e in events[1:-1])
        assert isinstance(events[-1], Finished) and events[-1].usage.completion_tokens == n
        assert _tokens(events) == n
    assert stepped.pending() == 0


def test_a_steps_tokens_wait_for_the_next_submit_only_when_asked(stepped, monkeypatch):
    at_submit = stepped.engine.steps.events_at_submit
    held_at_submit = []  # events still held whenever a decode is handed to the device
    submit = runner_module.mx.async_eval

    def watched_submit(*arrays):
        held_at_submit.append(stepped.pending())
        return submit(*arrays)

    monkeypatch.setattr(runner_module.mx, "async_eval", watched_submit)
    stepped.submit("long", 12)
    seen = []  # (tokens the loop had, events held back) after each step
    while not (stepped.received["long"] and isinstance(stepped.received["long"][-1],
                                                       Finished)):
        stepped.step()
        seen.append((_tokens(stepped.received["long"]), stepped.pending()))
        assert len(seen) < 40, seen
    held = [p for _, p in seen[:-1]]
    if at_submit:
        # While the row runs, the last decode's token waits for the next step's submit,
        # which sends it: the loop is one step's token behind the engine, never more.
        assert all(p >= 1 for p in held[1:]), seen
        counts = [t for t, _ in seen]
        assert all(b - a <= 2 for a, b in zip(counts, counts[1:], strict=False)), seen
    else:
        assert held == [0] * len(held), seen
    assert seen[-1] == (12, 0)  # the last step sends its tokens and the end at once
    # Sent by then, in both modes: nothing waits while the engine waits for the device.
    assert held_at_submit and set(held_at_submit) == {0}, held_at_submit


def test_the_last_rows_events_are_not_kept_waiting(stepped):
    stepped.submit("short", 2)
    for _ in range(10):
        stepped.step()
    events = stepped.received["short"]
    assert isinstance(events[-1], Finished) and _tokens(events) == 2
    assert stepped.pending() == 0


# auto: on a GPU only (on the CPU backend the submit's wait is the model computing)
ON_GPU = mx.default_device().type == mx.DeviceType.gpu


@pytest.mark.parametrize(("value", "expected"), [
    (None, ON_GPU), ("auto", ON_GPU), (True, True), (False, False),
])
def test_the_setting_and_its_auto_choice(value, expected):
    from server.engine.startup import events_at_submit

    settings = make_settings(**({} if value is None else {"batch": {"events_at_submit": value}}))
    assert settings.batch.events_at_submit == ("auto" if value is None else value)
    assert events_at_submit(settings) is expected


@pytest.mark.parametrize(("raw", "expected"), [("true", True), ("false", False),
                                               ("auto", ON_GPU)])
def test_the_environment_sets_it(raw, expected):
    from server.engine.startup import events_at_submit

    settings = make_settings(env={"VELOXQUANT_BATCH_EVENTS_AT_SUBMIT": raw})
    assert events_at_submit(settings) is expected


def test_a_wrong_value_is_refused():
    from server.settings import ConfigError

    with pytest.raises(ConfigError, match="events_at_submit"):
        make_settings(batch={"events_at_submit": "sometimes"})
