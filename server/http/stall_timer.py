"""A time limit on each ``send`` of a response, with one timer per response.

The guards cut a stream whose client stopped reading: a body ``send`` that has
not completed ``limits.stream_stall_timeout_s`` after it started. A timer per
``send`` (``asyncio.wait_for`` or ``asyncio.timeout``) costs a handle, and with
``wait_for`` a task, for every streamed token; at 64 streams that was a fifth
of the event loop's CPU. Here the response keeps one timer: it fires at the
earliest moment the current send could be overdue, and either re-arms for the
send in progress or cancels it. Between sends nothing is armed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from starlette.types import Message


class StallTimer:
    """Cuts one response's ``send`` calls that take longer than ``seconds``."""

    __slots__ = ("seconds", "fired", "_since", "_task", "_handle")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.fired = False
        self._since: float | None = None  # loop time the send in progress started
        self._task: asyncio.Task | None = None
        self._handle: asyncio.TimerHandle | None = None

    async def send(self, send: Callable[[Message], Awaitable[None]], message: Message) -> bool:
        """``send(message)`` in this task; False when it was cut for taking too long."""
        loop = asyncio.get_running_loop()
        self._since = loop.time()
        self._task = asyncio.current_task()
        if self._handle is None:
            self._handle = loop.call_at(self._since + self.seconds, self._check)
        try:
            await send(message)
            return True
        except asyncio.CancelledError:
            if not self.fired:
                raise  # somebody else's cancellation
            uncancel = getattr(self._task, "uncancel", None)  # Python 3.11+
            if uncancel is not None:
                uncancel()
            return False
        finally:
            self._since = None

    def _check(self) -> None:
        self._handle = None
        if self._since is None or self.fired:
            return  # no send in progress: the next one arms the timer again
        loop = asyncio.get_running_loop()
        due = self._since + self.seconds
        if loop.time() < due:  # a later send than the one the timer was armed for
            self._handle = loop.call_at(due, self._check)
            return
        self.fired = True
        self._task.cancel()

    def close(self) -> None:
        """The response is over: disarm."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
