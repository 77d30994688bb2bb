"""CORS (``server.cors_allow_origins``): off by default, preflights answered for the listed
origins, before the API key is asked for. Real uvicorn, real httpx ``OPTIONS``; the engine
is the fake one (no model is needed to answer a browser's preflight).
"""

from __future__ import annotations

import httpx
import pytest

from server.settings import ConfigError, load_settings
from tests.support.fakes import FakeEngine
from tests.support.openai_shapes import CHAT, COMPLETIONS, error_of
from tests.support.servers import make_settings, run_server

APP = "https://app.example.com"
PREFLIGHT = {"Origin": APP, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"}


@pytest.fixture(scope="module")
def cors_server():
    settings = make_settings(env={"VELOXQUANT_API_KEY": "k1",
                                  "VELOXQUANT_SERVER_CORS_ALLOW_ORIGINS": f"{APP}, http://lo:3000"})
    with run_server(settings, FakeEngine()) as server:
        yield server


def test_cors_is_off_by_default():
    assert load_settings(env={}).server.cors_allow_origins == []
    with run_server(make_settings(), FakeEngine()) as server:
        resp = httpx.options(server.base_url + CHAT, headers=PREFLIGHT)
        assert "access-control-allow-origin" not in resp.headers
        error_of(resp, 405)  # no CORS layer: OPTIONS is just a method the route lacks
        resp = httpx.post(server.base_url + COMPLETIONS, json={"prompt": "hi"},
                          headers={"Origin": APP})
        assert resp.status_code == 200 and "access-control-allow-origin" not in resp.headers


def test_preflight_is_answered_before_the_api_key(cors_server):
    resp = httpx.options(cors_server.base_url + CHAT, headers=PREFLIGHT)
    assert resp.status_code == 200
    assert resp.headers["access-control-allow-origin"] == APP
    assert "POST" in resp.headers["access-control-allow-methods"]
    assert "x-stainless-os" in resp.headers["access-control-allow-headers"]
    assert "access-control-allow-credentials" not in resp.headers


def test_answers_carry_cors_headers_errors_included(cors_server):
    url = cors_server.base_url + COMPLETIONS
    ok = httpx.post(url, json={"prompt": "hi"},
                    headers={"Origin": APP, "Authorization": "Bearer k1"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == APP
    denied = httpx.post(url, json={"prompt": "hi"}, headers={"Origin": APP})
    error_of(denied, 401)  # the guards' refusal is still readable by the page
    assert denied.headers["access-control-allow-origin"] == APP
    assert "Retry-After" in denied.headers["access-control-expose-headers"]


def test_other_origins_are_refused_in_the_openai_shape(cors_server):
    resp = httpx.options(cors_server.base_url + CHAT,
                         headers={**PREFLIGHT, "Origin": "https://evil.example"})
    err = error_of(resp, 400)
    assert err["code"] == "cors_refused" and "origin" in err["message"]
    assert "access-control-allow-origin" not in resp.headers
    simple = httpx.post(cors_server.base_url + COMPLETIONS, json={"prompt": "hi"},
                        headers={"Origin": "https://evil.example", "Authorization": "Bearer k1"})
    assert "access-control-allow-origin" not in simple.headers


@pytest.mark.parametrize("raw,want", [
    ("https://a.example,http://localhost:3000", ["https://a.example", "http://localhost:3000"]),
    ('["https://a.example"]', ["https://a.example"]),
    ("*", ["*"]),
    ("", []),
])
def test_origins_from_the_environment(raw, want):
    env = {"VELOXQUANT_SERVER_CORS_ALLOW_ORIGINS": raw}
    assert load_settings(env=env).server.cors_allow_origins == want


@pytest.mark.parametrize("raw", ["https://a.example/", "a.example", '["x"', "https://a.example/app"])
def test_bad_origins_stop_start_up_naming_the_key(raw):
    with pytest.raises(ConfigError) as info:
        load_settings(env={"VELOXQUANT_SERVER_CORS_ALLOW_ORIGINS": raw})
    assert "server.cors_allow_origins" in str(info.value)
