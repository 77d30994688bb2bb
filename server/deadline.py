"""One timer for many consecutive waits, each of which may last at most ``seconds``.

A streaming request waits once per token for its next event and sends once
per token; each may only take so long (an engine that stopped, a client that
stopped reading). A timer per wait is a handle pushed onto and cancelled from
the event loop's heap per token, ~8% of the loop's CPU at 64 streams. Here one
timer serves every wait of a request: armed for the first, it fires at the
earliest moment the current wait could be overdue and either re-arms for the
wait in progress or reports it. Between waits nothing is armed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


class Deadline:
    """Calls ``on_expiry`` when a wait begun with :meth:`start` lasts ``seconds``.

    Loop thread only. At most one timer is armed at a time.
    """

    __slots__ = ("seconds", "_on_expiry", "_since", "_handle")

    def __init__(self, seconds: float, on_expiry: Callable[[], Any]) -> None:
        self.seconds = seconds
        self._on_expiry = on_expiry
        self._since: float | None = None  # loop time the wait in progress began
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """A wait begins now."""
        loop = asyncio.get_running_loop()
        self._since = loop.time()
        if self._handle is None:
            self._handle = loop.call_at(self._since + self.seconds, self._fire)

    def stop(self) -> None:
        """The wait in progress ended in time."""
        self._since = None

    def _fire(self) -> None:
        self._handle = None
        if self._since is None:
            return  # no wait in progress: the next one arms the timer again
        loop = asyncio.get_running_loop()
        due = self._since + self.seconds
        if loop.time() < due:  # a later wait than the one the timer was armed for
            self._handle = loop.call_at(due, self._fire)
            return
        self._since = None
        self._on_expiry()

    def close(self) -> None:
        """No more waits: disarm, and drop ``on_expiry`` (often its owner's method: a cycle)."""
        self._since = None
        self._on_expiry = _closed
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


def _closed() -> None:
    """What a closed :class:`Deadline` calls (never: its timer is cancelled)."""
