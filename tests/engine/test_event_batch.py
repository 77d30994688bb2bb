"""EventBatch: a step's events reach their channels in order, with one wake-up per loop."""

from __future__ import annotations

import asyncio
import threading

from server.channel import (
    EventBatch,
    EventChannel,
)
from server.protocol import TokenEvent


def test_each_channel_gets_its_events_in_order_with_one_call_per_loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        channels = [EventChannel(loop) for _ in range(3)]
        calls = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (calls.append(a[0]), real(*a))[1]
        batch = EventBatch()
        for k in range(4):
            for i, channel in enumerate(channels):
                batch.add(channel, TokenEvent(f"{i}:{k}", k))
        batch.send()
        batch.send()  # nothing queued: no call
        channels[0].put(TokenEvent("after", 9))  # a later single put comes after the batch
        assert len(calls) == 2

        async def read(channel, n):
            return [(await channel.get()).text for _ in range(n)]

        got = [asyncio.run_coroutine_threadsafe(read(c, 5 if i == 0 else 4), loop).result(5)
               for i, c in enumerate(channels)]
        assert got[0] == ["0:0", "0:1", "0:2", "0:3", "after"]
        assert got[2] == ["2:0", "2:1", "2:2", "2:3"]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_a_closed_loop_marks_its_channels_closed():
    loop = asyncio.new_event_loop()
    channel = EventChannel(loop)
    loop.close()
    batch = EventBatch()
    batch.add(channel, TokenEvent("x", 1))
    batch.send()  # no exception: nobody listens any more
    assert channel._closed
