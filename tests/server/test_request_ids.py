"""Every answer carries ``x-request-id``, as OpenAI's do, and a generation's id is built on it.

Through the real ``openai`` client (``_request_id``, an error's ``request_id``) on the
shared live server.
"""

from __future__ import annotations

import httpx
import openai
import pytest


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
