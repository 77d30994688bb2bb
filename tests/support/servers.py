"""Live servers for the tests: settings builders, an in-process uvicorn server, fixtures.

Live servers run a real uvicorn on a free loopback port in a background
thread, with the real engine and the offline tiny model. One default server
is shared by the whole session; tests that need odd settings (a tiny pool, a
fault hook) start their own.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.settings import Settings, load_settings

ADMIN_TOKEN = "test-admin-token"


def make_settings(env: dict[str, str] | None = None, **sections: dict[str, Any]) -> Settings:
    """Settings from config/default.toml plus overrides, ignoring the real environment."""
    return load_settings(None, overrides=sections, env=env or {})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    """A running server: its base URL, app and engine."""

    base_url: str
    app: Any
    engine: Any

    def metrics(self) -> dict[str, float]:
        """Scrape /metrics into {sample name (with labels): value}.

        The keys leave out ``model_name``: a server has one model, whose name every
        labelled sample must carry (checked here).
        """
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                model = sample.labels.pop("model_name", self.engine.model_name)
                assert model == self.engine.model_name, (sample.name, model)
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
        return out

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Wait until no request runs or waits and no block is in use; return metrics."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["veloxquant_block_pool_request_blocks_in_use"] == 0
                    and m["veloxquant_requests_running"] == 0
                    and m["veloxquant_requests_waiting"] == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)


@contextlib.contextmanager
def run_server(settings: Settings, engine: Any = None) -> Iterator[LiveServer]:
    """Serve ``create_app(settings, engine)`` with uvicorn in a thread."""
    import uvicorn

    from server.http.app import create_app
    from server.http.serve import uvicorn_config

    port = free_port()
    app = create_app(settings, engine)
    # The production connection handling (header deadline, connection cap, keep-alive).
    config = uvicorn_config(app, settings, host="127.0.0.1", port=port, log_level="warning",
                            timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("test server failed to start")
        time.sleep(0.05)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", app, app.state.engine)
    finally:
        server.should_exit = True
        thread.join(15)


@pytest.fixture(scope="session")
def live_settings(tiny_model_path: Path) -> Settings:
    """Settings of the shared live server: tiny model, admin token set."""
    return make_settings(
        env={"VELOXQUANT_ADMIN_TOKEN": ADMIN_TOKEN},
        model={"path": str(tiny_model_path)},
        pool={"n_blocks": 4096},
        limits={"max_tokens_cap": 4096, "queue_timeout_s": 20.0},
    )


@pytest.fixture(scope="session")
def live_server(live_settings: Settings) -> Iterator[LiveServer]:
    """One real server for the session (tiny model, default-sized pool)."""
    with run_server(live_settings) as server:
        yield server
