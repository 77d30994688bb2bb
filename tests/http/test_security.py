"""Limits against abuse and the /metrics key, on live servers (OpenAI error shape throughout)."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest

from tests.support.servers import LiveServer, make_settings, run_server

KEY = "sk-test-metrics-key"


def assert_openai_error(resp: httpx.Response, status: int, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


@pytest.fixture(scope="module")
def guarded_server(tiny_model_path):
    """Small body limit, /metrics behind the API key, 2 generations per client."""
    settings = make_settings(env={"VELOXQUANT_API_KEY": KEY},
                             model={"path": str(tiny_model_path)}, pool={"n_blocks": 1024},
                             server={"metrics_require_key": True},
                             limits={"max_body_bytes": 4096, "max_concurrent_per_client": 2})
    with run_server(settings) as server:
        yield server


def test_body_over_the_limit_gets_413(guarded_server: LiveServer):
    auth = {"Authorization": f"Bearer {KEY}"}
    url = guarded_server.base_url + "/v1/completions"
    big = {"prompt": "word " * 2000, "max_tokens": 2}
    err = assert_openai_error(httpx.post(url, json=big, headers=auth), 413, "request_too_large")
    assert "limits.max_body_bytes=4096" in err["message"]

    def chunks():  # no Content-Length: the limit applies while reading
        for _ in range(10):
            yield b" " * 1000
        yield b'{"prompt": "x"}'

    resp = httpx.post(url, content=chunks(), headers={**auth, "content-type": "application/json"})
    assert_openai_error(resp, 413)
    ok = httpx.post(url, json={"prompt": "word " * 100, "max_tokens": 2}, headers=auth,
                    timeout=30)
    assert ok.status_code == 200


def test_metrics_behind_the_key_when_configured(guarded_server: LiveServer):
    url = guarded_server.base_url + "/metrics"
    assert_openai_error(httpx.get(url), 401, "invalid_api_key")
    assert_openai_error(httpx.get(url, headers={"Authorization": "Bearer nope"}), 401)
    ok = httpx.get(url, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and "veloxquant_block_pool_blocks_in_use" in ok.text
    assert httpx.get(guarded_server.base_url + "/health").status_code == 200  # always open
    assert_openai_error(httpx.post(guarded_server.base_url + "/v1/completions",
                                   json={"prompt": "x"}), 401)
    assert httpx.get(guarded_server.base_url + "/no/such/route").status_code == 404

    # Refused before routing, yet counted under the route they were for.
    from prometheus_client.parser import text_string_to_metric_families

    counts = {(s.labels["endpoint"], s.labels["status"]): s.value
              for family in text_string_to_metric_families(
                  httpx.get(url, headers={"Authorization": f"Bearer {KEY}"}).text)
              if family.name == "veloxquant_requests" for s in family.samples
              if s.name == "veloxquant_requests_total"}
    assert counts[("/metrics", "401")] >= 2 and counts[("/v1/completions", "401")] >= 1
    assert counts[("unmatched", "404")] >= 1


def test_metrics_open_by_default(live_server: LiveServer):
    assert httpx.get(live_server.base_url + "/metrics").status_code == 200


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "stop": [str(i) for i in range(9)]}, "stop"),  # 9 > max_stop_sequences
    ({"prompt": "x", "stop": "s" * 257}, "stop"),  # longer than max_stop_length
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": [5] * 8193, "max_tokens": 1}, "prompt"),  # over max_prompt_tokens
    ({"prompt": "x", "max_tokens": 4097}, "max_tokens"),  # over max_tokens_cap
])
def test_request_limits(live_server: LiveServer, body, param):
    resp = httpx.post(live_server.base_url + "/v1/completions", json=body, timeout=30)
    assert assert_openai_error(resp, 400)["param"] == param


async def _per_client_cap(base_url: str) -> dict:
    auth = {"Authorization": f"Bearer {KEY}"}
    # 2 x 4 layers x ceil(1001/16) = 504 of the 512 blocks per stream: both run at once.
    body = {"prompt": "x", "max_tokens": 1000, "stream": True,
            "logit_bias": {"1": -100, "3": -100}}
    out = {}
    async with httpx.AsyncClient(base_url=base_url, timeout=30, headers=auth) as c:
        async with c.stream("POST", "/v1/completions", json=body) as first, \
                c.stream("POST", "/v1/completions", json=body) as second:
            keep = [first.aiter_lines(), second.aiter_lines()]
            for lines in keep:
                await lines.__anext__()  # both generating
            out["third"] = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
            out["models"] = await c.get("/v1/models")  # not a generation: not capped
        # The server notices the two clients left when their sockets close (client watch).
        for _ in range(50):
            out["after"] = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            if out["after"].status_code != 429:
                break
            await asyncio.sleep(0.1)
    return out


def test_concurrent_generations_per_client_are_capped(guarded_server: LiveServer):
    out = asyncio.run(_per_client_cap(guarded_server.base_url))
    err = assert_openai_error(out["third"], 429, "too_many_concurrent_requests")
    assert "limits.max_concurrent_per_client" in err["message"]
    assert out["third"].headers["Retry-After"] == "1"
    assert out["models"].status_code == 200
    assert out["after"].status_code == 200  # the two streams ended: room again
    for _ in range(100):  # /metrics needs the key on this server, so no wait_idle()
        text = httpx.get(guarded_server.base_url + "/metrics",
                         headers={"Authorization": f"Bearer {KEY}"}).text
        if re.search(r"^veloxquant_block_pool_request_blocks_in_use 0(\.0)?$", text, re.M):
            break
        time.sleep(0.1)
    else:
        pytest.fail("blocks still in use after the capped requests ended")
