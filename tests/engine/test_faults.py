"""Faults on a live server: an exception inside the model forward, a client that stalls.

(The per-request fault hook and a failing request among others are covered in
test_lifecycle.py; SIGTERM draining in test_drain.py.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import time

import httpx
import pytest

from server.engine.engine import Engine
from server.metrics import ServerMetrics
from server.model_loader import load_model
from tests.support.servers import LiveServer, make_settings, run_server

MARKER = [99, 98, 97, 96]  # token ids that make the wrapped model's prefill raise
NO_EOS = {"1": -100, "3": -100}  # the tiny model's end tokens, banned so requests run long


class FaultyForward:
    """The real model, except that a prefill whose input holds ``MARKER`` raises.

    The exception is raised inside the model call itself (the engine sees a
    model error mid-request); everything else is the real model.
    """

    def __init__(self, model) -> None:
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, inputs, *args, **kwargs):
        # Prompts prefill in groups (several rows per call): any row with the marker raises.
        for ids in (inputs.tolist() if inputs.ndim == 2 and inputs.shape[1] > 1 else []):
            if any(ids[i:i + len(MARKER)] == MARKER for i in range(len(ids))):
                raise RuntimeError("injected fault inside the model forward")
        return self._model(inputs, *args, **kwargs)


def faulty_loader(section):
    loaded = load_model(section)
    return dataclasses.replace(loaded, model=FaultyForward(loaded.model))


@pytest.fixture(scope="module")
def faulty_server(tiny_model_path):
    settings = make_settings(model={"path": str(tiny_model_path)}, pool={"n_blocks": 2048},
                             limits={"stream_stall_timeout_s": 1.0})
    engine = Engine(settings, ServerMetrics(), loader=faulty_loader)
    with run_server(settings, engine) as server:
        yield server


GOOD = ["def parse(", "The pool holds", "Once upon a time there"]


async def _good(c: httpx.AsyncClient, prompt: str) -> httpx.Response:
    return await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 24,
                                                  "temperature": 0, "logit_bias": NO_EOS})


async def _fault_mix(base_url: str) -> list[httpx.Response]:
    bad = [5, 6, 7, *MARKER, 8, 9]
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as c:
        return await asyncio.gather(
            *[_good(c, p) for p in GOOD],
            c.post("/v1/completions", json={"prompt": bad, "max_tokens": 20}),
            c.post("/v1/completions", json={"prompt": bad, "max_tokens": 20, "stream": True}),
            c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hello"}], "max_tokens": 12,
                "logit_bias": NO_EOS}),
        )


def test_exception_in_model_forward_fails_that_request_only(faulty_server: LiveServer):
    before = faulty_server.metrics()
    *good, faulty, faulty_stream, chat = asyncio.run(_fault_mix(faulty_server.base_url))
    assert faulty.status_code == 500
    err = faulty.json()["error"]
    assert err["code"] == "generation_failed" and err["type"] == "server_error"
    assert "injected fault inside the model forward" in err["message"]
    assert faulty_stream.status_code == 200
    frames = [line[6:] for line in faulty_stream.text.splitlines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    assert json.loads(frames[-2])["error"]["code"] == "generation_failed"
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"]
    assert [r.status_code for r in good] == [200, 200, 200]
    m = faulty_server.wait_idle()
    assert m["veloxquant_block_pool_request_blocks_in_use"] == 0
    assert m["veloxquant_orphaned_blocks"] == 0
    assert m["veloxquant_block_pool_exhausted_total"] == 0
    assert m["veloxquant_block_pool_blocks_total"] == before["veloxquant_block_pool_blocks_total"]
    # Blocks the prefix cache kept are allocated and not freed (shown apart, evictable).
    assert (m["veloxquant_block_pool_allocations_total"]
            == m["veloxquant_block_pool_frees_total"] + m["veloxquant_block_pool_cached_blocks"])

    # The pool and the model are intact: the same greedy prompts alone give the same text.
    async def alone() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=faulty_server.base_url, timeout=60) as c:
            return [await _good(c, p) for p in GOOD]

    again = asyncio.run(alone())
    assert [r.json()["choices"][0]["text"] for r in again] == \
        [r.json()["choices"][0]["text"] for r in good]
    assert all(r.json()["usage"]["completion_tokens"] == 24 for r in again)


def _stalled_stream(port: int) -> socket.socket:
    """Open a stream whose client never reads (tiny receive buffer, fat frames)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: small window
    sock.connect(("127.0.0.1", port))
    body = json.dumps({"prompt": "x", "max_tokens": 4000, "stream": True, "logprobs": 20,
                       "logit_bias": NO_EOS}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


@pytest.mark.slow
def test_stalled_client_is_cut_off_and_its_blocks_freed(faulty_server: LiveServer, caplog):
    caplog.set_level("WARNING", logger="veloxquant.server")
    before = faulty_server.metrics()
    key = "veloxquant_request_finished_total{reason=cancelled}"
    port = int(faulty_server.base_url.rsplit(":", 1)[1])
    sock = _stalled_stream(port)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            m = faulty_server.metrics()
            if m.get(key, 0) > before.get(key, 0):
                break
            time.sleep(0.2)
        else:
            pytest.fail("the stalled stream was never cancelled")
        m = faulty_server.wait_idle()
        assert m["veloxquant_block_pool_request_blocks_in_use"] == 0
        assert m["veloxquant_orphaned_blocks"] == 0
        generated = m["veloxquant_generation_tokens_total"] - before.get(
            "veloxquant_generation_tokens_total", 0)
        assert 0 < generated < 4000  # cut long before max_tokens
        assert "limits.stream_stall_timeout_s" in caplog.text  # cut by the stall guard
        # The server closed the connection: what was buffered, then EOF, and no [DONE].
        sock.settimeout(10)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        assert data.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in data
    finally:
        sock.close()
    # The server goes on serving.
    r = httpx.post(faulty_server.base_url + "/v1/completions",
                   json={"prompt": "after", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200


class _Abort(BaseException):
    """Not an Exception: nothing in the engine catches it."""


@pytest.mark.parametrize("error", [RuntimeError("steps could not be built"),
                                   _Abort("engine thread killed")])
def test_a_start_up_that_fails_after_the_model_loaded_ends_the_wait(tiny_model_path, monkeypatch,
                                                                    error):
    """Start-up waits for the engine to be ready; a failure past the model's load (here:
    building the step loop) must end that wait, or the server hangs and ignores SIGTERM."""
    import server.engine.engine as engine_module

    def broken(*args, **kwargs):
        raise error

    monkeypatch.setattr(engine_module, "EngineSteps", broken)
    engine = Engine(make_settings(model={"path": str(tiny_model_path)}), ServerMetrics())
    monkeypatch.setattr("threading.excepthook", lambda args: None)  # _Abort: expected
    engine.start()
    try:
        started = time.monotonic()
        assert engine.wait_ready(90) is False
        assert time.monotonic() - started < 60, "the wait only ended at its timeout"
        assert not engine.is_ready
        if isinstance(error, Exception):
            assert engine.load_error == f"RuntimeError: {error}"
    finally:
        engine.stop()
