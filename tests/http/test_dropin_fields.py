"""The request bodies popular front ends send are answered, not refused.

Open WebUI sends Ollama's ``num_ctx`` and ``keep_alive`` (and ``options``)
along with OpenAI's fields; LlamaIndex and Dify send vLLM's
``chat_template_kwargs``; Cherry Studio a top-level ``enable_thinking``. By
default a top-level field no endpoint knows is ignored, logged once per name
and counted (``server.unknown_fields = "ignore"``; ``"reject"`` is checked in
tests/http/test_openai_fields.py). Template variables are checked here; that
they reach the template is shown in tests/http/test_reasoning.py.
"""

from __future__ import annotations

import logging
import uuid

import httpx
import openai
import pytest

from server.http.unknown_fields import MAX_LOGGED_NAMES, UnknownFields
from server.metrics import ServerMetrics
from tests.support.openai_shapes import CHAT, COMPLETIONS, MESSAGES, chat, error_of, sse_chunks
from tests.support.servers import LiveServer

UNKNOWN_METRIC = "veloxquant_request_unknown_fields_total{endpoint=%s}"
# Open WebUI's chat request to an OpenAI-compatible server, its Ollama options included.
OPEN_WEBUI = {"num_ctx": 4096, "keep_alive": "5m", "options": {"num_ctx": 4096},
              "session_id": "abc", "chat_id": "def", "id": "ghi"}


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="unused")


def post(server: LiveServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


def test_an_open_webui_body_is_answered_through_the_openai_client(client):
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                            extra_body=OPEN_WEBUI)
    assert answer.choices[0].message.content is not None
    chunks = list(client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=2, stream=True,
        stream_options={"include_usage": True}, extra_body=OPEN_WEBUI))
    assert chunks[-1].usage.completion_tokens == 2


def test_an_open_webui_body_is_answered_over_raw_http(live_server):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}, **OPEN_WEBUI}
    with httpx.stream("POST", live_server.base_url + CHAT, json=body, timeout=60) as resp:
        resp.read()
    assert sse_chunks(resp)[-1]["usage"]["completion_tokens"] == 2
    assert chat(post(live_server, CHAT, {**body, "stream": False, "stream_options": None}))


@pytest.mark.parametrize("path,body", [
    (COMPLETIONS, {"prompt": "Once", "max_tokens": 2}),
    (CHAT, {"messages": MESSAGES, "max_tokens": 2}),
    ("/v1/responses", {"input": "Once", "max_output_tokens": 2}),
])
def test_unknown_fields_are_ignored_logged_once_and_counted(live_server, caplog, path, body):
    caplog.set_level(logging.WARNING, logger="veloxquant.server")
    name = f"x_{uuid.uuid4().hex[:8]}"  # new to the shared server's log
    before = live_server.metrics().get(UNKNOWN_METRIC % path, 0.0)
    for _ in range(2):
        resp = post(live_server, path, {**body, name: 1, "keep_alive": "5m"})
        assert resp.status_code == 200, resp.text
    assert live_server.metrics()[UNKNOWN_METRIC % path] == before + 4
    logged = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert len(logged) == 1 and path in logged[0]


def test_a_null_unknown_field_counts_as_not_sent(live_server):
    before = live_server.metrics().get(UNKNOWN_METRIC % CHAT, 0.0)
    assert chat(post(live_server, CHAT, {"messages": MESSAGES, "max_tokens": 1,
                                         "keep_alive": None}))
    assert live_server.metrics().get(UNKNOWN_METRIC % CHAT, 0.0) == before


def test_fields_the_server_cannot_honour_keep_their_400(live_server):
    err = error_of(post(live_server, CHAT, {"messages": MESSAGES, "audio": {"voice": "a"},
                                            "num_ctx": 4096}))
    assert (err["param"], err["code"]) == ("audio", "unsupported_parameter")


def test_logged_names_are_bounded(caplog):
    caplog.set_level(logging.WARNING, logger="veloxquant.server")
    metrics = ServerMetrics()
    fields = UnknownFields("ignore", metrics)
    names = [f"field{i}" + "x" * 1000 for i in range(MAX_LOGGED_NAMES + 50)]
    for _ in range(2):
        fields.check(names, CHAT)
    assert len(caplog.records) == MAX_LOGGED_NAMES + 1  # one a name, then one saying "more"
    assert all(len(r.getMessage()) < 400 for r in caplog.records)  # long names shortened
    assert len(fields._logged) == MAX_LOGGED_NAMES + 1
    assert metrics.registry.get_sample_value("veloxquant_request_unknown_fields_total",
                                             {"endpoint": CHAT}) == 2 * len(names)


# -- template variables ------------------------------------------------------------------

def test_template_variables_are_accepted(client):
    for fields in ({"reasoning_effort": "low"},
                   {"extra_body": {"chat_template_kwargs": {"enable_thinking": False},
                                   "enable_thinking": True}}):
        answer = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1,
                                                **fields)
        assert answer.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("path,field,value,param", [
    (CHAT, "chat_template_kwargs", [1], "chat_template_kwargs"),
    (CHAT, "chat_template_kwargs", {"tokenize": False}, "chat_template_kwargs.tokenize"),
    (CHAT, "chat_template_kwargs", {"add_generation_prompt": False},
     "chat_template_kwargs.add_generation_prompt"),
    (CHAT, "enable_thinking", "yes", "enable_thinking"),
    (CHAT, "reasoning_effort", 3, "reasoning_effort"),
    ("/tokenize", "chat_template_kwargs", {"messages": []}, "chat_template_kwargs.messages"),
])
def test_bad_template_variables_are_a_400_naming_them(live_server, path, field, value, param):
    err = error_of(post(live_server, path, {"messages": MESSAGES, "max_tokens": 1,
                                            field: value}))
    assert err["param"] == param, err
