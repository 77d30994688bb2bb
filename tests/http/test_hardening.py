"""Hostile-client and operator cases on live servers: bad input never 500s, auth comes
first, no open redirect, strict types, secrets from files, shrinks that keep the pool usable.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.http.test_security import assert_openai_error
from tests.support.servers import ADMIN_TOKEN, LiveServer, make_settings, run_server

KEY = "sk-hardening-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
NO_EOS = {"1": -100, "3": -100}
ROUTES = [("/v1/completions", {"prompt": "hi"}),
          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]


@pytest.fixture(scope="module")
def keyed_server(tiny_model_path):
    """API key and admin token both set; the key arrives with a trailing newline."""
    settings = make_settings(env={"VELOXQUANT_API_KEY": KEY + "\n",
                                  "VELOXQUANT_ADMIN_TOKEN": ADMIN_TOKEN},
                             model={"path": str(tiny_model_path)}, pool={"n_blocks": 512})
    with run_server(settings) as server:
        yield server


@pytest.mark.parametrize("path,base", ROUTES)
@pytest.mark.parametrize("key", ["²", "--5", "٣", "1" * 5000, "+-1", ""])
def test_bad_logit_bias_keys_are_400_and_keep_the_connection(live_server: LiveServer, path,
                                                             base, key):
    with httpx.Client(base_url=live_server.base_url, timeout=30) as c:
        resp = c.post(path, json={**base, "max_tokens": 2, "logit_bias": {key: 1}})
        err = assert_openai_error(resp, 400, "invalid_value")
        assert err["param"] == "logit_bias"
        assert resp.headers.get("connection") != "close"
        assert c.post(path, json={**base, "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("path,base", ROUTES)
@pytest.mark.parametrize("field,value", [("max_tokens", True), ("stream", "yes"),
                                         ("temperature", True), ("seed", "5"),
                                         ("max_tokens", 2.5), ("n", "1")])
def test_loose_types_are_400(live_server: LiveServer, path, base, field, value):
    resp = httpx.post(live_server.base_url + path, json={**base, field: value}, timeout=30)
    assert assert_openai_error(resp, 400, "invalid_value")["param"] == field


def test_prompt_of_booleans_and_admin_count_as_string_are_400(live_server: LiveServer):
    url = live_server.base_url
    resp = httpx.post(url + "/v1/completions", json={"prompt": [True, False]}, timeout=30)
    assert assert_openai_error(resp, 400, "invalid_value")["param"].startswith("prompt")
    resp = httpx.post(url + "/admin/shrink", headers=ADMIN,
                      json={"stream": "kv", "target_free": "5"})
    assert assert_openai_error(resp, 400, "invalid_value")["param"] == "target_free"
    resp = httpx.post(url + "/admin/shrink", headers=ADMIN,
                      json={"stream": "kv", "target_free": 10**9, "force": "yes"})
    assert assert_openai_error(resp, 400, "invalid_value")["param"] == "force"


def test_trailing_slash_is_404_not_a_redirect_to_the_host_header(live_server: LiveServer):
    resp = httpx.post(live_server.base_url + "/v1/completions/", json={"prompt": "x"},
                      headers={"Host": "attacker.example"}, follow_redirects=False)
    assert_openai_error(resp, 404)
    assert "location" not in resp.headers
    models = httpx.get(live_server.base_url + "/v1/models/", follow_redirects=False)
    assert "GET /v1/models (no trailing slash)" in assert_openai_error(models, 404)["message"]


def test_authentication_comes_before_body_parsing(keyed_server: LiveServer):
    url = keyed_server.base_url
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        resp = httpx.post(url + path, content=b"{not json",
                          headers={"content-type": "application/json"})
        assert_openai_error(resp, 401, "invalid_api_key")
    resp = httpx.post(url + "/admin/shrink", content=b"{not json",
                      headers={"content-type": "application/json"})
    assert_openai_error(resp, 401, "invalid_api_key")
    ok = httpx.post(url + "/v1/completions", content=b"{not json",
                    headers={"content-type": "application/json",
                             "Authorization": f"Bearer {KEY}"})
    assert_openai_error(ok, 400, "invalid_value")


def test_docs_are_behind_the_key(keyed_server: LiveServer):
    url = keyed_server.base_url
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert_openai_error(httpx.get(url + path), 401)
        assert httpx.get(url + path, headers={"Authorization": f"Bearer {KEY}"}
                         ).status_code == 200
    assert httpx.get(url + "/health").status_code == 200  # still open


def test_docs_can_be_turned_off(tiny_model_path):
    settings = make_settings(model={"path": str(tiny_model_path)}, pool={"n_blocks": 256},
                             server={"docs": False})
    with run_server(settings) as server:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert_openai_error(httpx.get(server.base_url + path), 404)


def test_a_file_mounted_key_with_a_newline_works(keyed_server: LiveServer):
    resp = httpx.post(keyed_server.base_url + "/v1/completions", timeout=30,
                      json={"prompt": "hi", "max_tokens": 2},
                      headers={"Authorization": f"Bearer {KEY}"})
    assert resp.status_code == 200
    wrong = httpx.post(keyed_server.base_url + "/v1/completions",
                       json={"prompt": "hi", "max_tokens": 2},
                       headers={"Authorization": "Bearer t\u00f6ken".encode()})  # UTF-8 bytes
    assert_openai_error(wrong, 401)


# -- shrinking -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def shrink_server(tiny_model_path):
    """320 blocks per stream; a maximal request (512 + 512 tokens) needs 4 x 64 = 256."""
    settings = make_settings(env={"VELOXQUANT_ADMIN_TOKEN": ADMIN_TOKEN},
                             model={"path": str(tiny_model_path)}, pool={"n_blocks": 640},
                             limits={"max_prompt_tokens": 512, "max_tokens_cap": 512,
                                     "default_max_tokens": 16, "queue_timeout_s": 20.0})
    with run_server(settings) as server:
        yield server


async def _shrink_under_load(base: str) -> dict:
    out: dict = {}
    async with httpx.AsyncClient(base_url=base, timeout=60) as c:
        running = {"prompt": "x", "max_tokens": 500, "stream": True, "logit_bias": NO_EOS}
        async with c.stream("POST", "/v1/completions", json=running) as stream:
            lines = stream.aiter_lines()
            await lines.__anext__()  # 4 x ceil(501/16) = 128 blocks per stream reserved
            # 500 + 500 tokens: 4 x 63 = 252 blocks; 128 + 252 > 320, so it waits.
            waiter = asyncio.create_task(c.post("/v1/completions", json={
                "prompt": [5] * 500, "max_tokens": 500}))
            for _ in range(100):
                if (await c.get("/health")).json()["waiting"] == 1:
                    break
                await asyncio.sleep(0.05)
            out["refused"] = await c.post("/admin/shrink", headers=ADMIN,
                                          json={"stream": "kv", "target_free": 0})
            out["huge"] = await c.post("/admin/shrink", headers=ADMIN,
                                       json={"stream": "kv", "target_free": 10**23})
            t0 = time.monotonic()
            out["forced"] = await c.post("/admin/shrink", headers=ADMIN, json={
                "stream": "kv", "target_free": 0, "force": True})
            out["waiter"] = await waiter
            out["waiter_s"] = time.monotonic() - t0
            out["health"] = (await c.get("/health")).json()
            out["pool"] = (await c.get("/admin/pool", headers=ADMIN)).json()
            out["rest"] = [line async for line in lines if line]
    return out


@pytest.mark.slow
def test_shrink_safety_and_waiting_requests_rechecked(shrink_server: LiveServer):
    assert httpx.get(shrink_server.base_url + "/health").json()["status"] == "ok"
    out = asyncio.run(_shrink_under_load(shrink_server.base_url))
    err = assert_openai_error(out["refused"], 409, "shrink_refused")
    assert "maximal request" in err["message"] and '"force": true' in err["message"]
    huge = out["huge"].json()  # nothing retired; kept_free says what is really free
    assert huge["retired"] == 0 and max(huge["kept_free"].values()) < 320
    forced = out["forced"].json()
    assert out["forced"].status_code == 200 and forced["retired"] > 0 and forced["degraded"]
    # The waiting request can never fit the shrunk pool: 400 at once, not a 429 later.
    waiter = out["waiter"]
    assert_openai_error(waiter, 400, "context_length_exceeded")
    assert out["waiter_s"] < 5
    health = out["health"]
    assert health["status"] == "degraded" and "maximal request" in health["reason"]
    pool = out["pool"]
    assert pool["config"]["n_blocks"] == pool["stats"]["n_blocks"] < 640
    # Free blocks left: what the running request reserved and does not hold yet.
    assert 0 < forced["kept_free"]["k"] <= 128
    assert out["rest"][-1] == "data: [DONE]"  # the running request was never touched
    m = shrink_server.wait_idle()
    assert m["veloxquant_block_pool_request_blocks_in_use"] == 0
    assert m.get("veloxquant_request_rejected_total{reason=queue_timeout}", 0) == 0
    assert m["veloxquant_request_rejected_total{reason=context_length_exceeded}"] == 1
