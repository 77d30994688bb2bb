"""Whether an HTTP request's client is still there, told to the routes the moment it leaves.

A route that waits for its engine events must stop when its client leaves, so
the engine frees the request's blocks. Asking Starlette's
``Request.is_disconnected()`` on a timer does that, but each ask enters and
cancels an anyio cancel scope; at 64 streams polled every 100 ms it is about
a fifth of the event loop's CPU. Here one listener task per HTTP request reads
``receive()`` once the body is in (it returns only when the client hangs up)
and the stall guard marks a client that stopped reading; either one calls the
callbacks the routes registered, which wake their waiting channels.

The guards middleware (:mod:`server.http.guards`) puts one watch in every
guarded request's scope; :func:`client_watch` finds it, or adds one to an app
built without the guards (it then learns hang-ups only).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from starlette.types import Receive, Scope

SCOPE_KEY = "veloxquant.client_watch"


class ClientWatch:
    """One HTTP request's client: ``gone`` once it hung up or stopped reading."""

    __slots__ = ("gone", "_callbacks", "_listener")

    def __init__(self) -> None:
        self.gone = False
        self._callbacks: list[Callable[[], Any]] = []
        self._listener: asyncio.Task | None = None

    def mark_gone(self) -> None:
        """The client is gone: run every registered callback once (loop thread)."""
        if self.gone:
            return
        self.gone = True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def on_gone(self, callback: Callable[[], Any]) -> None:
        """Call ``callback`` when the client goes (now, if it already went)."""
        if self.gone:
            callback()
        else:
            self._callbacks.append(callback)

    def listen(self, receive: Receive) -> None:
        """Read ``receive`` until the client hangs up (idempotent; call once the body is read).

        ASGI servers answer ``receive`` after the body only with ``http.disconnect``,
        to every reader that waits (Starlette's streaming responses listen the same way).
        """
        if self._listener is None and not self.gone:
            self._listener = asyncio.ensure_future(self._listen(receive))

    async def _listen(self, receive: Receive) -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception:  # noqa: BLE001 - a connection that broke under receive: gone too
            pass
        self.mark_gone()

    def close(self) -> None:
        """The response is over: stop listening."""
        if self._listener is not None:
            self._listener.cancel()
            self._listener = None


def client_watch(scope: Scope) -> ClientWatch:
    """The request's watch, added to ``scope`` when nothing put one there."""
    watch = scope.get(SCOPE_KEY)
    if watch is None:
        watch = scope[SCOPE_KEY] = ClientWatch()
    return watch
