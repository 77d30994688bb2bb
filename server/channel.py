"""How the engine thread's events reach a route's event loop.

Each request has one :class:`EventChannel`; the engine thread puts
protocol records (server.protocol) into it and the route awaits them. The
channel hops threads with ``loop.call_soon_threadsafe``, so the engine never
touches the event loop's data structures directly; a decode step's token
events go over together (:class:`EventBatch`).
"""

from __future__ import annotations

import asyncio
import collections
import weakref
from functools import partial
from typing import Any

from server.deadline import Deadline
from server.protocol import Event


class EventChannel:
    """Thread-to-asyncio channel of one request's events.

    ``put`` is called by the engine thread; ``get`` and ``wait`` are awaited by
    one reader on the loop that created the channel.

    A deque and one waiter future instead of an ``asyncio.Queue``: a streaming
    route waits once per token, and a timed wait on a queue needs
    ``asyncio.wait_for``, which starts a task for every wait (at 64 streams,
    about a sixth of the event loop's CPU). The timed waits of a channel share
    one :class:`~server.deadline.Deadline` instead.
    """

    __slots__ = ("_loop", "_events", "_waiter", "_deadline", "_closed", "__weakref__")

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._events: collections.deque[Event] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._deadline: Deadline | None = None
        self._closed = False

    def put(self, event: Event) -> None:
        """Deliver an event from any thread (no-op once the loop is closed)."""
        try:
            self._loop.call_soon_threadsafe(self._push, event)
        except RuntimeError:
            # The event loop shut down under us (server stopping): nobody listens.
            self._closed = True

    def _push(self, event: Event) -> None:
        self._events.append(event)
        self.wake()

    def wake(self) -> None:
        """End the reader's current wait, event or not (loop thread; e.g. its client left)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> Event:
        """Wait for the next event."""
        while not self._events:
            await self._wait_once(None)
        return self._events.popleft()

    async def wait(self, timeout: float) -> Event | None:
        """The next event, or ``None`` after ``timeout`` seconds or a :meth:`wake`."""
        if not self._events:
            await self._wait_once(timeout)
        return self._events.popleft() if self._events else None

    async def _wait_once(self, timeout: float | None) -> None:
        self._waiter = self._loop.create_future()
        deadline = None
        if timeout is not None:
            deadline = self._deadline
            if deadline is None:  # holding the channel weakly: no cycle for the collector
                deadline = self._deadline = Deadline(timeout, partial(_wake, weakref.ref(self)))
            deadline.seconds = timeout
            deadline.start()
        try:
            await self._waiter
        finally:
            self._waiter = None
            if deadline is not None:
                deadline.stop()

    def get_nowait(self) -> Any:
        """Return the next event if one is ready, else ``None``."""
        return self._events.popleft() if self._events else None

    @property
    def ready(self) -> bool:
        """Whether an event waits to be read (a read would not wait)."""
        return bool(self._events)


def _wake(channel: weakref.ref[EventChannel]) -> None:
    live = channel()
    if live is not None:
        live.wake()


class EventBatch:
    """Events of many channels, handed over with one ``call_soon_threadsafe`` per loop.

    Why: each ``call_soon_threadsafe`` takes the loop's lock and writes to
    its wake-up pipe (a system call). The engine thread produces one token
    event per running request and decode step; sent one by one, 64 of them
    took the engine thread 821 us a step on this machine, sent together 116
    us (benchmark_scripts/benchmark_event_batch.py). Each channel still sees
    its events in the order they were added, and before anything it is sent
    later.
    """

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending: list[tuple[EventChannel, Event]] = []

    def add(self, channel: EventChannel, event: Event) -> None:
        """Queue ``event`` for ``channel`` until :meth:`send`."""
        self._pending.append((channel, event))

    def send(self) -> None:
        """Hand every queued event to its channel's loop (one call per loop)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[EventChannel, Event]]] = {}
        for channel, event in pending:
            by_loop.setdefault(channel._loop, []).append((channel, event))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that loop shut down: nobody listens
                for channel, _ in items:
                    channel._closed = True


def _deliver(items: list[tuple[EventChannel, Event]]) -> None:
    for channel, event in items:
        channel._push(event)
