"""Model calls failing in a row turn ``/health`` to 503 until one runs again.

The counting on hand-made pass results; then a live server whose model forward is the
real one until a switch makes every call raise, as a device whose stream broke would
(MLX's CUDA encoder after a throw in a graph commit, ml-explore/mlx#4326).
"""

from __future__ import annotations

import dataclasses
import threading

import httpx
import pytest

from server.engine.engine import Engine
from server.engine.run_output import (
    FAILED_CALLS_UNHEALTHY,
    CallHealth,
    RunOutput,
)
from server.metrics import ServerMetrics
from server.model_loader import load_model
from tests.support.servers import make_settings, run_server

BOOM = RuntimeError("device stream broken")


def _failed() -> RunOutput:
    return RunOutput(call_error=BOOM)


def test_failures_in_a_row_make_it_failing_and_one_call_that_runs_clears_it() -> None:
    health = CallHealth()
    for _ in range(FAILED_CALLS_UNHEALTHY - 1):
        health.record(_failed())
    assert health.failing is None  # one bad batch is not a broken device
    health.record(RunOutput())  # a pass with no model call changes nothing
    health.record(_failed())
    assert health.failing == (f"the last {FAILED_CALLS_UNHEALTHY} model calls failed "
                              "(last: RuntimeError: device stream broken)")
    health.record(RunOutput(calls_ran=1))
    assert health.failing is None and health.failed_in_row == 0


def test_a_pass_where_some_call_ran_is_not_a_failure() -> None:
    health = CallHealth(unhealthy_after=1)
    health.record(RunOutput(calls_ran=1, call_error=BOOM))  # a group failed, another ran
    assert health.failing is None
    health.record(_failed())
    assert health.failing is not None


class SwitchableForward:
    """The real model; while ``broken`` is set, every call raises before computing."""

    def __init__(self, model) -> None:
        self._model = model
        self.broken = threading.Event()

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, *args, **kwargs):
        if self.broken.is_set():
            raise RuntimeError("cudaGraphAddDependencies failed: invalid argument")
        return self._model(*args, **kwargs)


@pytest.fixture(scope="module")
def switchable_server(tiny_model_path):
    forwards: list[SwitchableForward] = []

    def loader(section):
        loaded = load_model(section)
        forwards.append(SwitchableForward(loaded.model))
        return dataclasses.replace(loaded, model=forwards[-1])

    # Compiled decode calls the blocks, not the model: keep it off so every call passes here.
    settings = make_settings(model={"path": str(tiny_model_path)}, pool={"n_blocks": 1024},
                             batch={"compile_decode": False}, cache={"prefix_caching": False})
    with run_server(settings, Engine(settings, ServerMetrics(), loader=loader)) as server:
        yield server, forwards[0]


def _complete(base_url: str, prompt: str) -> httpx.Response:
    return httpx.post(base_url + "/v1/completions", timeout=60,
                      json={"prompt": prompt, "max_tokens": 4, "temperature": 0})


def test_health_says_503_while_every_call_fails_and_ok_once_one_runs(switchable_server):
    server, forward = switchable_server
    assert _complete(server.base_url, "warm up").status_code == 200
    assert httpx.get(server.base_url + "/health", timeout=10).json()["status"] == "ok"
    forward.broken.set()
    try:
        for i in range(FAILED_CALLS_UNHEALTHY):
            failed = _complete(server.base_url, f"prompt {i}")
            assert failed.status_code == 500
            assert failed.json()["error"]["code"] == "generation_failed"
        health = httpx.get(server.base_url + "/health", timeout=10)
        assert health.status_code == 503
        error = health.json()["error"]
        assert error["code"] == "unavailable"
        assert error["message"] == (
            f"model calls are failing: the last {FAILED_CALLS_UNHEALTHY} model calls failed "
            "(last: RuntimeError: cudaGraphAddDependencies failed: invalid argument)")
    finally:
        forward.broken.clear()
    # Requests are still admitted: the first call that runs shows the device works again.
    assert _complete(server.base_url, "after").status_code == 200
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    assert server.wait_idle()["veloxquant_block_pool_request_blocks_in_use"] == 0
