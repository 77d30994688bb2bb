"""Running the app under uvicorn: the SIGTERM drain, the insecure-bind warning, and
connection limits (server/http/connections.py; the soft open-file limit raised at start).

SIGTERM (what ``docker stop``, systemd and Kubernetes send) drains instead of
stopping at once::

    SIGTERM -> draining: new requests 503 (Retry-After), /health 503, /metrics served
            -> requests still queued for room (not started) 503 at once
            -> running requests finish, up to server.shutdown_grace_s
            -> grace over with requests left: the engine stops, they end with 503
            -> uvicorn closes the listeners, the engine stops, exit code 0

A second SIGTERM, or SIGINT (Ctrl-C), takes uvicorn's own immediate path.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import signal
import socket
from collections.abc import Generator
from types import FrameType
from typing import Any

import uvicorn

from server.file_limit import raise_open_file_limit
from server.http.connections import guarded_protocol, parser_name
from server.http.guards import DrainState
from server.settings import Settings

log = logging.getLogger("veloxquant.server")

# Seconds uvicorn waits for connections to close once it stops (after the drain).
CLOSE_TIMEOUT_S = 5


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname: it may resolve to any interface


def bind_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on now, else None.

    Checked before the model loads, so a port in use or a host that does not
    resolve is one line and exit code 2 at once, not uvicorn's exit code 3
    after a load that can take minutes. uvicorn binds again later (a port
    taken in between still fails there).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"--host {host!r} does not resolve to an address here ({exc.strerror})"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as exc:
            return (f"cannot listen on {host}:{port}: {exc.strerror or exc}; stop what holds "
                    "the port or pick another with --port")
    return None


def bind_warning(settings: Settings) -> str | None:
    """The warning to log for a non-loopback bind without an API key, else None."""
    host = settings.server.host
    if is_loopback(host) or settings.api_key:
        return None
    return (f"binding {host} without VELOXQUANT_API_KEY: anyone who can reach this port can "
            "run generations; set VELOXQUANT_API_KEY or bind 127.0.0.1")


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a draining first SIGTERM (see the module docstring).

    Args:
        config: The uvicorn config (its app is ours).
        drain: The drain state the app's :class:`~server.http.guards.Guards` obeys.
        grace_s: How long in-flight requests may take after SIGTERM.
        engine: Stopped when the grace period runs out, so the requests left
            end with a 503 instead of a cut connection.
    """

    def __init__(self, config: uvicorn.Config, drain: DrainState, grace_s: float,
                 engine: Any = None) -> None:
        super().__init__(config)
        self.drain = drain
        self.grace_s = grace_s
        self.engine = engine
        self._queue_refused = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.drain.draining:
            # Not recorded as a captured signal: after a clean drain the process exits 0
            # instead of uvicorn re-raising SIGTERM on itself.
            self.drain.begin(self.grace_s)
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain.draining and not self._queue_refused:
            # Requests still waiting for room get their 503 now, not at the grace's end.
            self._queue_refused = True
            if self.engine is not None:
                self.engine.drain()
        if self.drain.draining and not self.should_exit:
            if counter % 10 == 0:
                log.info("draining: %d request(s) in flight", self.drain.inflight)
            if self.drain.done():
                if self.drain.inflight:
                    log.warning("shutdown grace period (server.shutdown_grace_s=%.1f) over "
                                "with %d request(s) in flight: stopping them",
                                self.grace_s, self.drain.inflight)
                    if self.engine is not None:
                        await asyncio.to_thread(self.engine.stop)
                self.should_exit = True
        return await super().on_tick(counter)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        with super().capture_signals():
            yield
        if self.drain.draining:
            log.info("drained; exiting")


def uvicorn_config(app: Any, settings: Settings, **overrides: Any) -> uvicorn.Config:
    """The uvicorn config: guarded connections (header deadline, connection cap).

    Args:
        app: The app from ``create_app``.
        settings: Server settings.
        overrides: uvicorn.Config arguments that win (tests pick a port, a log level).
    """
    server = settings.server
    kwargs: dict[str, Any] = {
        "host": server.host, "port": server.port, "log_level": server.log_level,
        "timeout_graceful_shutdown": CLOSE_TIMEOUT_S, "http": guarded_protocol(settings),
        "timeout_keep_alive": server.keep_alive_timeout_s,
    }
    return uvicorn.Config(app, **{**kwargs, **overrides})


class ModelLoadFailed(Exception):
    """The model (or what is built around it, such as the KV arena) could not be loaded."""


def serve(app: Any, settings: Settings) -> None:
    """Serve ``app`` (from ``create_app``) until SIGTERM has drained it, or SIGINT.

    The model loads first, before uvicorn starts (its lifespan then finds it loaded):
    a load that fails is one line and exit code 2 from the entry point, not
    Starlette's lifespan traceback and uvicorn's exit code 3, and SIGTERM during the
    load ends the process at once (there is nothing to drain yet).

    Raises:
        ModelLoadFailed: With the engine's one-line reason.
    """
    engine = app.state.engine
    engine.start()
    if not engine.wait_ready():
        engine.stop()
        raise ModelLoadFailed(getattr(engine, "load_error", None) or "the engine stopped")
    warning = bind_warning(settings)
    if warning:
        log.warning(warning)
    soft = raise_open_file_limit(settings.server.max_connections)
    log.info("open-file limit %s; server.max_connections=%d, header timeout %.1fs, "
             "HTTP parser %s", soft, settings.server.max_connections,
             settings.server.header_timeout_s, parser_name(settings))
    DrainingServer(uvicorn_config(app, settings), app.state.drain,
                   settings.server.shutdown_grace_s, app.state.engine).run()
