"""Every answer carries ``x-request-id``, as OpenAI's do, and a generation's id is built on it.

Through the real ``openai`` client (``_request_id``, an error's ``request_id``) on the
shared live server.
"""

from __future__ import annotations

import re

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from server.http.app import create_app
from server.http.connections import _busy_response, _with_id
from tests.support.fakes import FakeEngine
from tests.support.servers import make_settings


def test_every_answer_carries_a_request_id_that_names_the_generation(live_server):
    # OpenAI sends x-request-id on every answer; the SDK shows it as _request_id.
    client = openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="x", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    request_id = raw.headers["x-request-id"]
    assert len(request_id) == 24 and raw.parse().id == f"chatcmpl-{request_id}"
    out = client.completions.create(model="default", prompt="hi", max_tokens=2)
    assert out.id == f"cmpl-{out._request_id}"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="default", prompt="hi", max_tokens=-1)
    assert bad.value.request_id and bad.value.request_id != out._request_id
    assert httpx.get(f"{live_server.base_url}/health").headers["x-request-id"]


def test_an_unhandled_error_answers_500_with_the_id_it_logs(caplog):
    # Starlette answers this 500 outside every middleware: the handler adds the id itself.
    app = create_app(make_settings(), FakeEngine())

    @app.get("/boom")
    async def boom():
        raise RuntimeError("a bug")

    with TestClient(app, raise_server_exceptions=False) as client:
        answer = client.get("/boom")
    request_id = answer.headers["x-request-id"]
    assert answer.status_code == 500 and request_id in answer.json()["error"]["message"]
    assert any(request_id in r.getMessage() for r in caplog.records)


def test_the_connection_cap_answer_carries_a_fresh_id():
    # Written below the ASGI app (server/http/connections.py), one id per answer.
    busy = _busy_response(1, 10)
    heads = [_with_id(busy).split(b"\r\n\r\n")[0].decode() for _ in range(2)]
    ids = [re.search(r"\r\nx-request-id: ([0-9a-f]{24})\r\n", h + "\r\n").group(1)
           for h in heads]
    assert ids[0] != ids[1]
    assert heads[0].startswith("HTTP/1.1 503 ")
