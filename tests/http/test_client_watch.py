"""What a streamed token costs the event loop: channel waits, client watch, stall timer.

Unit tests of the three pieces on a real asyncio loop, then a live uvicorn
server (fake engine, real sockets) whose clients leave while their requests
wait: the requests are cancelled as soon as the socket closes, not on a poll.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
import time

import pytest

from server.channel import EventChannel
from server.http.client_watch import SCOPE_KEY, ClientWatch, client_watch
from server.http.routes import call
from server.http.stall_timer import StallTimer
from server.protocol import TokenEvent
from tests.support.fakes import FakeEngine
from tests.support.servers import make_settings, run_server

# -- EventChannel ----------------------------------------------------------------


def _armed_timers(loop: asyncio.AbstractEventLoop) -> int:
    return sum(not h.cancelled() for h in loop._scheduled)  # type: ignore[attr-defined]


def test_channel_wait_returns_events_in_order_from_another_thread():
    async def main():
        channel = EventChannel()
        events = [TokenEvent(str(i), i) for i in range(5)]
        threading.Thread(target=lambda: [channel.put(e) for e in events]).start()
        return [await channel.wait(5.0) for _ in events]

    got = asyncio.run(main())
    assert [e.token_id for e in got] == [0, 1, 2, 3, 4]


def test_channel_wait_times_out_with_none_and_leaves_no_timer_or_task():
    async def main():
        loop = asyncio.get_running_loop()
        channel = EventChannel()
        tasks, timers = len(asyncio.all_tasks()), _armed_timers(loop)
        start = time.monotonic()
        waiting = asyncio.ensure_future(channel.wait(0.05))
        await asyncio.sleep(0.01)
        during = len(asyncio.all_tasks()) - 1  # minus the waiting task itself
        got = await waiting
        return got, time.monotonic() - start, during, tasks, timers, _armed_timers(loop)

    got, waited, during, tasks, timers_before, timers_after = asyncio.run(main())
    assert got is None
    assert 0.045 <= waited < 2.0
    assert during == tasks  # waiting started no task of its own
    assert timers_after == timers_before  # its timer was cancelled or spent


def test_channel_wake_ends_a_wait_without_an_event_and_get_waits_on():
    async def main():
        channel = EventChannel()
        loop = asyncio.get_running_loop()
        loop.call_later(0.02, channel.wake)
        woken = await channel.wait(30.0)
        loop.call_later(0.02, channel.wake)  # get() ignores a wake: it waits for an event
        loop.call_later(0.05, channel.put, TokenEvent("x", 7))
        event = await asyncio.wait_for(channel.get(), 5.0)
        return woken, event, channel.get_nowait()

    woken, event, rest = asyncio.run(main())
    assert woken is None
    assert event.token_id == 7
    assert rest is None


def test_channel_wait_cancelled_cleans_up():
    async def main():
        loop = asyncio.get_running_loop()
        channel = EventChannel()
        timers = _armed_timers(loop)
        task = asyncio.ensure_future(channel.wait(0.05))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        channel.put(TokenEvent("later", 1))
        await asyncio.sleep(0.1)  # past the deadline: its timer fired on no wait
        return channel._waiter, _armed_timers(loop) - timers, channel.get_nowait()

    waiter, timers, event = asyncio.run(main())
    assert waiter is None and timers == 0
    assert event.token_id == 1  # nothing lost after a cancelled wait


def test_channel_waits_share_one_timer():
    async def main():
        loop = asyncio.get_running_loop()
        channel = EventChannel()
        timers = _armed_timers(loop)
        armed = set()
        for i in range(40):  # an event comes 1 ms into each wait, as tokens do
            loop.call_later(0.001, channel.put, TokenEvent(str(i), i))
            assert (await channel.wait(5.0)).token_id == i
            armed.add(_armed_timers(loop) - timers)
        return armed

    assert asyncio.run(main()) == {1}  # the first wait armed it; the others reused it


def test_a_shared_timer_times_each_wait_from_its_own_start():
    async def main():
        loop = asyncio.get_running_loop()
        channel = EventChannel()
        loop.call_later(0.001, channel.put, TokenEvent("x", 1))
        await channel.wait(0.1)  # arms the timer for t0 + 0.1
        await asyncio.sleep(0.05)
        start = time.monotonic()
        got = await channel.wait(0.1)  # the timer fires mid-wait and re-arms for this one
        return got, time.monotonic() - start

    got, waited = asyncio.run(main())
    assert got is None
    assert waited >= 0.09


# -- ClientWatch -----------------------------------------------------------------


def test_watch_runs_callbacks_once_and_late_ones_at_once():
    watch, calls = ClientWatch(), []
    watch.on_gone(lambda: calls.append("a"))
    watch.mark_gone()
    watch.mark_gone()
    watch.on_gone(lambda: calls.append("b"))
    assert watch.gone and calls == ["a", "b"]


def test_watch_listens_until_disconnect_and_wakes_the_channel():
    async def main():
        messages = asyncio.Queue()
        watch, channel = ClientWatch(), EventChannel()
        watch.on_gone(channel.wake)
        watch.listen(messages.get)
        watch.listen(messages.get)  # idempotent: one listener
        await messages.put({"type": "http.request", "body": b"", "more_body": False})
        await asyncio.sleep(0.01)
        gone_early = watch.gone
        asyncio.get_running_loop().call_later(0.02, messages.put_nowait,
                                              {"type": "http.disconnect"})
        start = time.monotonic()
        woken = await channel.wait(30.0)  # woken by the watch, long before the timeout
        return gone_early, watch.gone, woken, time.monotonic() - start

    gone_early, gone, woken, waited = asyncio.run(main())
    assert not gone_early and gone and woken is None
    assert waited < 5.0


def test_watch_treats_a_broken_receive_as_gone_and_close_stops_listening():
    async def broken():
        raise OSError("connection reset")

    async def never():
        await asyncio.sleep(3600)

    async def main():
        broke, idle = ClientWatch(), ClientWatch()
        broke.listen(broken)
        idle.listen(never)
        await asyncio.sleep(0.01)
        listener = idle._listener
        idle.close()
        await asyncio.sleep(0.01)
        return broke.gone, idle.gone, listener.cancelled()

    assert asyncio.run(main()) == (True, False, True)


def test_client_watch_reuses_the_scope_s_watch():
    scope: dict = {}
    first = client_watch(scope)
    assert client_watch(scope) is first and scope[SCOPE_KEY] is first


# -- StallTimer ------------------------------------------------------------------


def test_stall_timer_passes_quick_sends_with_one_timer():
    async def main():
        loop = asyncio.get_running_loop()
        timer, sent = StallTimer(30.0), []

        async def send(message):
            sent.append(message)
            await asyncio.sleep(0)

        timers = _armed_timers(loop)
        handles = set()
        for i in range(50):
            assert await timer.send(send, {"i": i})
            handles.add(id(timer._deadline._handle))
        armed = _armed_timers(loop) - timers
        timer.close()
        return len(sent), len(handles), armed, _armed_timers(loop) - timers

    sent, handles, armed, after_close = asyncio.run(main())
    assert sent == 50
    assert handles == 1  # one timer for all of them
    assert armed == 1 and after_close == 0


def test_stall_timer_cuts_a_send_that_hangs_and_the_task_goes_on():
    async def main():
        timer = StallTimer(0.05)

        async def quick(message):
            await asyncio.sleep(0)

        async def hang(message):
            await asyncio.sleep(3600)

        assert await timer.send(quick, {})
        await asyncio.sleep(0.03)  # the timer armed by the quick send fires mid-hang
        start = time.monotonic()
        ok = await timer.send(hang, {})
        cut_after = time.monotonic() - start
        await asyncio.sleep(0)  # the task was not left cancelled
        cancelling = asyncio.current_task().cancelling() if sys.version_info >= (3, 11) else 0
        timer.close()
        return ok, cut_after, cancelling

    ok, cut_after, cancelling = asyncio.run(main())
    assert ok is False
    assert 0.04 <= cut_after < 2.0  # measured from the hanging send's own start
    assert cancelling == 0


def test_stall_timer_lets_other_cancellations_through():
    async def main():
        timer = StallTimer(30.0)

        async def hang(message):
            await asyncio.sleep(3600)

        task = asyncio.ensure_future(timer.send(hang, {}))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        timer.close()
        return timer.fired

    assert asyncio.run(main()) is False


# -- live: clients that leave while their requests wait ---------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_waiting_request_is_cancelled_when_its_client_hangs_up(stream: bool, monkeypatch):
    # A route's own checks come far apart here: only the watch can end its wait in time.
    monkeypatch.setattr(call, "ENGINE_CHECK_S", 30.0)
    engine = FakeEngine()
    body = (b'{"model":"fake-model","prompt":"SILENT","max_tokens":4,"stream":'
            + (b"true" if stream else b"false") + b"}")
    with run_server(make_settings(), engine) as server:
        port = int(server.base_url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            deadline = time.monotonic() + 10
            while not engine.submitted and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(engine.submitted) == 1
            request = engine.submitted[0]
            time.sleep(0.3)  # admitted, then silent: the route waits
            assert not request.cancelled.is_set()
        closed = time.monotonic()
        assert request.cancelled.wait(10.0), "the request was not cancelled when its client left"
        assert time.monotonic() - closed < 5.0


def test_channels_and_stall_timers_are_freed_without_the_cycle_collector():
    # Their shared timers call back into them; neither may form a cycle (a request's
    # channel holds its events, a stall timer its task).
    import gc
    import weakref

    async def main():
        channel, timer = EventChannel(), StallTimer(30.0)
        asyncio.get_running_loop().call_later(0.001, channel.put, TokenEvent("x", 1))
        await channel.wait(5.0)

        async def send(message):
            await asyncio.sleep(0)

        await timer.send(send, {})
        timer.close()
        return weakref.ref(channel), weakref.ref(timer)

    gc.disable()
    try:
        refs = asyncio.run(main())
        alive = [r() is not None for r in refs]
    finally:
        gc.enable()
    assert alive == [False, False]
