"""A real server process: SIGTERM drains and exits 0 with no abort, request-end JSON logs,
no secret in any log line.

Each test starts ``python -m server`` (benchmark_scripts/server_process.py)
on a free loopback port, with its output captured to a file.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark_scripts"))
from server_process import ServerProcess  # noqa: E402

API_KEY = "sk-test-SECRET-api-key-4f1c9"
ADMIN = "admin-SECRET-token-77d2e"
NO_EOS = {"1": -100, "3": -100}


def request_lines(log: str) -> list[dict]:
    """The JSON request-end lines of a server log."""
    out = []
    for line in log.splitlines():
        if line.startswith("{") and '"request_end"' in line:
            out.append(json.loads(line))
    return out


def _first_chunk(stream: httpx.Response) -> tuple[object, str]:
    lines = stream.iter_lines()
    for line in lines:
        if line.startswith("data: "):
            return lines, line
    raise AssertionError("stream ended before any chunk")


@pytest.mark.slow
def test_sigterm_drains_logs_requests_and_never_logs_secrets(tiny_model_path, tmp_path):
    env = {"VELOXQUANT_API_KEY": API_KEY, "VELOXQUANT_ADMIN_TOKEN": ADMIN,
           "VELOXQUANT_SERVER_LOG_LEVEL": "debug", "VELOXQUANT_SERVER_SHUTDOWN_GRACE_S": "60"}
    server = ServerProcess(tmp_path / "server.log", ["--model", str(tiny_model_path)], env)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with server:
        base = server.base_url
        with httpx.Client(base_url=base, timeout=60) as c:
            done = c.post("/v1/completions", headers=auth,
                          json={"prompt": "hello", "max_tokens": 5, "temperature": 0})
            assert done.status_code == 200
            wrong = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2},
                           headers={"Authorization": "Bearer sk-wrong-guess"})
            assert wrong.status_code == 401
            assert API_KEY not in wrong.text
            assert c.get("/admin/pool", headers={"Authorization": f"Bearer {ADMIN}"}
                         ).status_code == 200
            assert c.get("/admin/pool", headers=auth).status_code == 401
            too_long = c.post("/v1/completions", headers=auth,
                              json={"prompt": [5] * 9000, "max_tokens": 2})
            assert too_long.status_code == 400
            past_context = c.post("/v1/completions", headers=auth,
                                  json={"prompt": "word " * 5000, "max_tokens": 2})
            assert past_context.status_code == 400

            # In flight when SIGTERM arrives: it must finish normally.
            body = {"prompt": "x", "max_tokens": 600, "stream": True, "logit_bias": NO_EOS}
            with httpx.Client(base_url=base, timeout=60) as sc, \
                    sc.stream("POST", "/v1/completions", json=body, headers=auth) as stream:
                lines, _ = _first_chunk(stream)
                server.terminate()
                time.sleep(0.3)  # the signal is handled between event-loop ticks
                refused = c.post("/v1/completions", headers=auth,
                                 json={"prompt": "late", "max_tokens": 2})
                health = c.get("/health")
                rest = [line for line in lines if line.startswith("data: ")]
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "shutting_down"
        assert refused.headers["Retry-After"] == "1"
        assert health.status_code == 503
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert server.wait(timeout=30) == 0  # drained, then a clean exit
    log = server.log()
    assert API_KEY not in log and ADMIN not in log, "a secret reached the log"
    assert "drained; exiting" in log
    # No abort at exit: the process ends with os._exit before MLX's C++ static
    # destructors run (server/__main__.py run; on CUDA they printed this and aborted).
    assert "terminate called" not in log and "Traceback" not in log, log[-2000:]
    assert "Token indices sequence length" not in log  # the tokenizer's own bound is off
    lines = request_lines(log)
    by_id = {line["request_id"]: line for line in lines}
    first = by_id[done.json()["id"]]
    assert first["status"] == 200 and first["finish_reason"] in ("stop", "length")
    assert first["owner"] >= 1 and first["completion_tokens"] == done.json()["usage"][
        "completion_tokens"]
    assert first["blocks_peak"] > 0 and 0 <= first["ttft_s"] <= first["latency_s"]
    rejected = [line for line in lines if line["finish_reason"] == "rejected"]
    assert len(rejected) == 2 and rejected[0]["status"] == 400
    assert rejected[0]["code"] == "context_length_exceeded"
    assert rejected[0]["prompt_tokens"] == 9000  # tokenized, then refused
    drained = [line for line in lines if line["completion_tokens"] == 600]
    assert drained and drained[0]["status"] == 200 and drained[0]["finish_reason"] == "length"


@pytest.mark.slow
def test_sigterm_refuses_queued_requests_at_once(tiny_model_path, tmp_path):
    # 1,024 blocks a stream: one 3,000-token answer (4 x 188 blocks) leaves no room for a
    # second, which queues. At SIGTERM it gets its 503 while the first still runs, instead
    # of waiting out the 60 s grace, and its refusal is logged like any other.
    env = {"VELOXQUANT_SERVER_SHUTDOWN_GRACE_S": "60", "VELOXQUANT_POOL_N_BLOCKS": "2048"}
    server = ServerProcess(tmp_path / "server.log", ["--model", str(tiny_model_path)], env)
    long = {"prompt": "x", "max_tokens": 3000, "stream": True, "logit_bias": NO_EOS}
    with server, httpx.Client(base_url=server.base_url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=long) as running:
            lines, _ = _first_chunk(running)
            queued: dict = {}
            waiter = threading.Thread(target=lambda: queued.update(
                response=c.post("/v1/completions", json={**long, "stream": False})))
            waiter.start()
            deadline = time.monotonic() + 30
            while server_waiting(c) < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            server.terminate()
            waiter.join(30)
            assert next(line for line in lines if line).startswith("data: ")  # still streaming
        refused = queued["response"]
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert server.wait(timeout=30) == 0
    lines = request_lines(server.log())
    (line,) = [x for x in lines if x["finish_reason"] == "rejected"]
    assert line["code"] == "shutting_down" and line["status"] == 503
    assert line["request_id"].endswith(refused.headers["x-request-id"])


def server_waiting(client: httpx.Client) -> float:
    """The engine's waiting queue length, from /metrics."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(("veloxquant_requests_waiting ", "veloxquant_requests_waiting{")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.slow
def test_sigterm_grace_period_bounds_the_drain(tiny_model_path, tmp_path):
    # Request lines off as well: uvicorn's logging set-up must not turn them back on.
    env = {"VELOXQUANT_SERVER_SHUTDOWN_GRACE_S": "1.0", "VELOXQUANT_SERVER_REQUEST_LOG": "false"}
    server = ServerProcess(tmp_path / "server.log", ["--model", str(tiny_model_path)], env)
    with server:
        body = {"prompt": "x", "max_tokens": 4000, "stream": True, "logit_bias": NO_EOS}
        with httpx.Client(base_url=server.base_url, timeout=60) as c, \
                c.stream("POST", "/v1/completions", json=body) as stream:
            lines, _ = _first_chunk(stream)
            t0 = time.monotonic()
            server.terminate()
            try:
                rest = [line for line in lines if line.startswith("data: ")]
            except httpx.HTTPError:
                rest = []  # a cut connection is acceptable; a hang is not
        ended_s = time.monotonic() - t0
        assert server.wait(timeout=30) == 0
    assert "terminate called" not in server.log()
    # Stopped at the grace period, long before 4000 tokens, with an error frame if any.
    assert ended_s < 10, ended_s
    assert len(rest) < 3900
    if rest:
        assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2]
    assert "grace period" in server.log()
    assert "request_end" not in server.log()


@pytest.mark.parametrize("host,key,warns", [
    ("127.0.0.1", None, False), ("::1", None, False), ("localhost", None, False),
    ("0.0.0.0", None, True), ("192.168.1.20", None, True), ("0.0.0.0", "k", False),
])
def test_non_loopback_bind_without_key_warns(host, key, warns):
    from server.http.serve import bind_warning
    from tests.support.servers import make_settings

    settings = make_settings(env={"VELOXQUANT_API_KEY": key} if key else None,
                             server={"host": host})
    assert (bind_warning(settings) is not None) == warns


def test_default_bind_is_loopback():
    from server.settings import Settings
    from tests.support.servers import make_settings

    assert Settings().server.host == "127.0.0.1"
    assert make_settings().server.host == "127.0.0.1"  # config/default.toml
