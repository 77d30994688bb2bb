"""One engine step that never ends (a hung device, a peer rank gone inside an all-sum).

The engine thread cannot be interrupted inside a device call, so what the server
can do is say so: ``/health`` 503 and new requests 503 at once, instead of a 200
health check beside requests that wait forever. A fault hook holds one step for
a few seconds, past a one-second ``limits.engine_stall_timeout_s``.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from server.engine.engine import Engine
from server.metrics import ServerMetrics
from tests.support.servers import make_settings, run_server

pytestmark = pytest.mark.slow

HOLD_S = 4.0


@pytest.fixture(scope="module")
def holding_server(tiny_model_path):
    release = threading.Event()

    def hold(state) -> None:  # runs inside the step, for each row's model work
        if "HOLD" in str(state.request.prompt):
            release.wait(HOLD_S)

    settings = make_settings(model={"path": str(tiny_model_path)}, pool={"n_blocks": 1024},
                             limits={"engine_stall_timeout_s": 1.0})
    with run_server(settings, Engine(settings, ServerMetrics(), fault_hook=hold)) as server:
        yield server, release


def test_a_step_past_the_stall_timeout_turns_health_and_new_requests_503(holding_server):
    server, release = holding_server
    base = server.base_url
    held = threading.Thread(target=httpx.post, args=(base + "/v1/completions",),
                            kwargs={"json": {"prompt": "HOLD", "max_tokens": 2},
                                    "timeout": 60})
    held.start()
    try:
        # The held step passes the 1 s limit about 1 s after it starts (later on a busy
        # machine); it is held for HOLD_S.
        deadline = time.monotonic() + 1 + HOLD_S
        while (health := httpx.get(base + "/health", timeout=10)).status_code == 200 \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert health.status_code == 503, health.text
        message = health.json()["error"]["message"]
        assert "the engine has been in one step for" in message
        assert "limits.engine_stall_timeout_s=1" in message
        start = time.monotonic()
        refused = httpx.post(base + "/v1/completions", timeout=10,
                             json={"prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503 and time.monotonic() - start < 2  # not queued
        assert refused.json()["error"]["code"] == "unavailable"
    finally:
        release.set()
        held.join(timeout=60)
    # The step ended: healthy again, and requests are served.
    assert httpx.get(base + "/health", timeout=10).status_code == 200
    ok = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200
    assert server.wait_idle()["veloxquant_block_pool_request_blocks_in_use"] == 0
