"""SSE frames per send (server/http/routes/sse.py): one per token, joined only when behind.

A stream whose next event is not there yet sends each frame at once (no
token waits for another); when events are already waiting (the event loop
fell behind, or a slow reader held up the last send) their frames share one
send, at most ``MAX_FRAMES_PER_SEND``, in order, with the error frame and
``[DONE]`` after whatever was built before them.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.http.errors import APIError
from server.http.routes.sse import (
    MAX_FRAMES_PER_SEND,
    SSE_DONE,
    TEXT_MARK,
    FrameTemplate,
    sse,
    sse_stream,
)
from server.protocol import (
    Finished,
    FinishReason,
    TokenEvent,
    Usage,
)


class ScriptedFanout:
    """``events()`` from a script; ``ready`` says whether the next one is already here."""

    def __init__(self, events: list, waiting_from: int, fail_at: int | None = None) -> None:
        self.events_list = events
        self.waiting_from = waiting_from  # events before this index wait already
        self.fail_at = fail_at
        self.next = 0

    @property
    def ready(self) -> bool:
        return self.next < min(self.waiting_from, len(self.events_list))

    async def events(self):
        for i, event in enumerate(self.events_list):
            if i == self.fail_at:
                raise APIError("model failed mid-stream")
            if i >= self.waiting_from:
                await asyncio.sleep(0)  # arrives later: the reader waited for it
            self.next = i + 1
            yield 0, event


def _events(n: int) -> list:
    return [TokenEvent(f" t{i}", i, None) for i in range(n)] + [
        Finished(FinishReason.LENGTH, Usage(3, n, 1, 0))]


def _sends(fanout: ScriptedFanout) -> list[bytes]:
    async def run() -> list[bytes]:
        return [s async for s in sse_stream(
            fanout, lambda j, e: {"text": e.text},
            lambda j, e: [{"finish_reason": e.reason.value}],
            last=lambda: [{"usage": "u"}])]
    return asyncio.run(run())


def _frames(send: bytes) -> list[str]:
    assert send.endswith(b"\n\n")
    return [f.removeprefix("data: ") for f in send.decode().split("\n\n")[:-1]]


def test_events_that_wait_already_share_sends_in_order():
    sends = _sends(ScriptedFanout(_events(40), waiting_from=41))
    frames = [f for s in sends for f in _frames(s)]
    assert [json.loads(f)["text"] for f in frames[:40]] == [f" t{i}" for i in range(40)]
    assert frames[40:] == ['{"finish_reason":"length"}', '{"usage":"u"}', "[DONE]"]
    sizes = [len(_frames(s)) for s in sends]
    assert max(sizes) == MAX_FRAMES_PER_SEND and len(sends) < 10, sizes


def test_a_stream_that_keeps_up_sends_every_frame_at_once():
    sends = _sends(ScriptedFanout(_events(5), waiting_from=0))
    assert [len(_frames(s)) for s in sends] == [1, 1, 1, 1, 1, 1, 2]  # usage joins [DONE]
    assert sends[-1].endswith(SSE_DONE)


def test_an_error_frame_follows_the_frames_built_before_it():
    sends = _sends(ScriptedFanout(_events(10), waiting_from=11, fail_at=6))
    frames = [f for s in sends for f in _frames(s)]
    assert [json.loads(f)["text"] for f in frames[:6]] == [f" t{i}" for i in range(6)]
    assert json.loads(frames[6])["error"]["message"] == "model failed mid-stream"
    assert frames[7:] == ["[DONE]"]


class _ScriptedCall:
    """A GenerationCall stand-in: its events with pauses, and a request to cancel."""

    class _Request:
        def cancel(self) -> None:
            pass

    def __init__(self, script: list) -> None:
        self.script = script
        self.request = self._Request()

    async def events(self):
        for item in self.script:
            if isinstance(item, float):
                await asyncio.sleep(item)
            else:
                yield item


def test_a_choice_that_ended_is_not_an_event_waiting():
    """Several choices: ``ready`` counts queued events, not a finished choice's end marker
    (reading past that one waits for the other choice, which would hold the frames back)."""
    from server.http.routes.fanout import Fanout

    done = Finished(FinishReason.STOP, Usage(1, 2, 1, 0))
    fanout = Fanout([_ScriptedCall([TokenEvent("a0", 1, None), 0.01, done]),
                     _ScriptedCall([TokenEvent("b0", 2, None), 0.2, done])])

    async def read() -> list[tuple[int, str, bool]]:
        seen = []
        async for j, event in fanout.events():
            seen.append((j, type(event).__name__, fanout.ready))
            if len(seen) == 3:  # choice 0 finished; choice 1 is still generating
                break
        return seen

    seen = asyncio.run(read())
    assert seen == [(0, "TokenEvent", True), (1, "TokenEvent", False), (0, "Finished", False)]
    assert not fanout.ready  # events() ended: nothing merges any more


# -- frames spliced from a template (FrameTemplate) -------------------------------

_CHUNK = {"id": "chatcmpl-9f2c", "object": "chat.completion.chunk", "created": 1764633600,
          "model": "tiny", "choices": [{"index": 3, "delta": {"content": TEXT_MARK},
                                        "logprobs": None, "finish_reason": None}]}


def _with(text: str) -> dict:
    chunk = json.loads(json.dumps(_CHUNK))
    chunk["choices"][0]["delta"]["content"] = text
    return chunk


@pytest.mark.parametrize("text", ["", " hello", 'say "hi"', "back\\slash", "two\nlines\r\t",
                                  "\x00\x1f\x7f", "caf\u00e9 \u4e2d\u6587", "\U0001f600 emoji",
                                  "\ufffd", "</script>", "\u2028\u2029", "\ud800"])
def test_a_template_frame_is_the_frame_of_the_whole_chunk(text: str):
    assert FrameTemplate(_CHUNK).frame(text) == sse(_with(text))


@given(st.text())
@settings(max_examples=300, deadline=None)
def test_any_text_splices_to_the_same_bytes(text: str):
    frame = FrameTemplate(_CHUNK).frame(text)
    assert frame == sse(_with(text))
    assert json.loads(frame.removeprefix(b"data: "))["choices"][0]["delta"]["content"] == text


@pytest.mark.parametrize("chunk", [{"text": "no mark"}, {"a": TEXT_MARK, "b": TEXT_MARK}])
def test_a_template_needs_the_mark_exactly_once(chunk: dict):
    with pytest.raises(ValueError, match="TEXT_MARK once"):
        FrameTemplate(chunk)


def test_sse_stream_sends_ready_frames_as_they_are():
    template = FrameTemplate({"text": TEXT_MARK})

    async def run() -> list[bytes]:
        return [s async for s in sse_stream(
            ScriptedFanout(_events(3), waiting_from=0), lambda j, e: template.frame(e.text),
            lambda j, e: [])]

    frames = [f for s in asyncio.run(run()) for f in _frames(s)]
    assert frames == ['{"text":" t0"}', '{"text":" t1"}', '{"text":" t2"}', "[DONE]"]
