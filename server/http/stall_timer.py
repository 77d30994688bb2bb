"""A time limit on each ``send`` of a response, with one timer per response.

The guards cut a stream whose client stopped reading: a body ``send`` that has
not completed ``limits.stream_stall_timeout_s`` after it started. A timer per
``send`` (``asyncio.wait_for`` or ``asyncio.timeout``) costs a handle, and with
``wait_for`` a task, for every streamed token; at 64 streams that is a fifth
of the event loop's CPU. Here a response's sends share one
:class:`~server.deadline.Deadline`, and the one that overruns it is cancelled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from starlette.types import Message

from server.deadline import Deadline


class StallTimer:
    """Cuts one response's ``send`` calls that take longer than ``seconds``."""

    __slots__ = ("fired", "_task", "_deadline", "__weakref__")

    def __init__(self, seconds: float) -> None:
        self.fired = False
        self._task: asyncio.Task | None = None
        self._deadline = Deadline(seconds, self._expire)

    async def send(self, send: Callable[[Message], Awaitable[None]], message: Message) -> bool:
        """``send(message)`` in this task; False when it was cut for taking too long."""
        self._task = asyncio.current_task()
        self._deadline.start()
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
            self._deadline.stop()

    def _expire(self) -> None:
        self.fired = True
        self._task.cancel()

    def close(self) -> None:
        """The response is over: disarm."""
        self._deadline.close()
