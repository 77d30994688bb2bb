"""OpenAI API parity on a live server (tiny model): nulls, seeds, leading spaces, models,
stream_options, and fields refused rather than ignored.

Each item goes through the official ``openai`` client, and raw answers are checked
against the client's own pydantic types (tests/support/openai_shapes.py).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from server.http.app import create_app
from tests.support.fakes import FakeEngine
from tests.support.openai_shapes import (
    CHAT,
    COMPLETIONS,
    MESSAGES,
    PROMPT,
    chat,
    chat_stream,
    completion,
    completion_stream,
    error_of,
)
from tests.support.servers import LiveServer, make_settings


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="unused", max_retries=0)


def post(live_server: LiveServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(live_server.base_url + path, json=body, timeout=60)


# -- 1. null means "not given" -------------------------------------------------------------

COMMON_NULLS = dict.fromkeys(
    ["max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "n",
     "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "stream",
     "stream_options", "user", "response_format"])


def test_explicit_nulls_are_defaults_on_completions(live_server):
    body = {**COMMON_NULLS, "model": None, "prompt": PROMPT, "echo": None, "logprobs": None,
            "best_of": None, "suffix": None, "max_tokens": 3}
    out = completion(post(live_server, COMPLETIONS, body))
    assert len(out.choices) == 1 and out.choices[0].logprobs is None
    assert out.usage.completion_tokens <= 3


def test_explicit_nulls_are_defaults_on_chat(live_server):
    nulls = dict.fromkeys(["logprobs", "top_logprobs", "max_completion_tokens", "tools",
                           "tool_choice", "parallel_tool_calls", "functions", "function_call",
                           "audio", "modalities", "metadata", "store", "service_tier",
                           "prediction", "reasoning_effort", "verbosity", "web_search_options"])
    body = {**COMMON_NULLS, **nulls, "messages": [{"role": "user", "content": "hi",
                                                    "name": None}], "max_tokens": 3}
    out = chat(post(live_server, CHAT, body))
    assert len(out.choices) == 1 and out.choices[0].logprobs is None
    resp = post(live_server, COMPLETIONS, {"prompt": None})
    assert error_of(resp)["param"] == "prompt"  # a required field stays required


def test_openai_client_sending_none_explicitly(client):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, n=None,
                                    stream=None, echo=None, logprobs=None, seed=None, stop=None,
                                    temperature=None, top_p=None, best_of=None, user=None)
    assert len(out.choices) == 1
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, n=None,
                                         logprobs=None, top_logprobs=None, seed=None,
                                         stream_options=None, temperature=None)
    assert len(out.choices) == 1


# -- 2. seeds: the int64 range, mapped onto MLX's key modulo 2**64 --------------------------

@pytest.mark.parametrize("seed", [-1, -(2**63), 2**63 - 1, 0])
def test_int64_seeds_are_accepted_and_repeatable(client, seed):
    def once() -> str:
        return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6,
                                         temperature=1.0, seed=seed).choices[0].text
    assert once() == once()


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 2**64 - 1])
def test_seeds_outside_int64_are_400_naming_seed(client, seed):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES, seed=seed)
    assert info.value.body["param"] == "seed"


def test_seed_maps_modulo_two_to_the_64():
    engine = FakeEngine()
    with TestClient(create_app(make_settings(), engine)) as c:
        c.post(COMPLETIONS, json={"prompt": "hi", "seed": -1})
        assert engine.last_params().seed == 2**64 - 1
        c.post(COMPLETIONS, json={"prompt": "hi", "seed": -(2**63)})
        assert engine.last_params().seed == 2**63


# -- 3. the first generated token keeps its leading space ----------------------------------

def test_completion_text_is_its_logprob_tokens(client):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                    logprobs=1)
    choice = out.choices[0]
    assert choice.logprobs.tokens[0].startswith(" ")  # the case mlx-lm's detokenizer trimmed
    assert "".join(choice.logprobs.tokens) == choice.text
    assert choice.logprobs.text_offset == [sum(map(len, choice.logprobs.tokens[:i]))
                                           for i in range(len(choice.logprobs.tokens))]
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6,
                                            temperature=0, logprobs=1, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == choice.logprobs.tokens


def test_chat_content_is_its_logprob_tokens(client, live_server):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True)
    out = client.chat.completions.create(**kwargs)
    content = out.choices[0].message.content
    assert "".join(e.token for e in out.choices[0].logprobs.content) == content
    chunks = chat_stream(post(live_server, CHAT, {**kwargs, "stream": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content
    streamed = [e.token for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert "".join(streamed) == content


# -- 4. GET /v1/models/{id} ------------------------------------------------------------------

def test_models_retrieve(client, live_server):
    model = client.models.retrieve("tiny")
    assert (model.id, model.object, model.owned_by) == ("tiny", "model", "veloxquant")
    assert model == client.models.list().data[0]
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-nope")
    assert info.value.body["code"] == "model_not_found"
    err = error_of(httpx.get(live_server.base_url + "/v1/models/org/other"), 404)
    assert err["param"] == "model" and "'org/other'" in err["message"]


# -- 6. stream_options only with stream: true -----------------------------------------------

@pytest.mark.parametrize("stream", [False, None])
def test_stream_options_without_stream_is_400(client, live_server, stream):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, stream=stream,
                                  stream_options={"include_usage": True})
    assert info.value.body["param"] == "stream_options"
    body = {"messages": MESSAGES, "stream_options": {"include_usage": True}, "stream": stream}
    assert error_of(post(live_server, CHAT, body))["param"] == "stream_options"


def test_stream_options_with_stream_gives_one_usage_chunk(live_server):
    body = {"prompt": PROMPT, "max_tokens": 3, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    chunks = completion_stream(post(live_server, COMPLETIONS, body))
    assert [c.usage is not None for c in chunks].count(True) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


# -- 9. response_format and tools: enforced, or a 400 naming the field ---------------------

@pytest.mark.parametrize("path,base", [(COMPLETIONS, {"prompt": PROMPT}),
                                       (CHAT, {"messages": MESSAGES})])
@pytest.mark.parametrize("fmt", [{"type": "sound"}, {"type": "json_schema"},
                                 {"type": "json_schema", "json_schema": {"name": "x"}},
                                 {"type": "json_schema",
                                  "json_schema": {"name": "x", "schema": {"type": "strnig"}}}])
def test_bad_response_format_is_400_naming_it(live_server, path, base, fmt):
    err = error_of(post(live_server, path, {**base, "response_format": fmt}))
    assert (err["param"], err["code"]) == ("response_format", "invalid_value"), err


def test_text_response_format_is_plain_generation(live_server):
    body = {"messages": MESSAGES, "max_tokens": 2, "response_format": {"type": "text"}}
    assert chat(post(live_server, CHAT, body)).choices[0].message.content is not None


@pytest.mark.parametrize("path,base", [(COMPLETIONS, {"prompt": PROMPT}),
                                       (CHAT, {"messages": MESSAGES})])
def test_json_schema_output_is_enforced_on_both_endpoints(live_server, path, base):
    # A schema with one possible document: even random weights must write exactly it.
    schema = {"type": "object", "properties": {"ok": {"const": True}}, "required": ["ok"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "ok", "schema": schema}}
    resp = post(live_server, path, {**base, "max_tokens": 20, "response_format": fmt})
    answer = completion(resp) if path == COMPLETIONS else chat(resp)
    text = answer.choices[0].text if path == COMPLETIONS else answer.choices[0].message.content
    assert json.loads(text) == {"ok": True}
    assert answer.choices[0].finish_reason == "stop"


def test_json_object_output_opens_an_object(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3,
                                         response_format={"type": "json_object"})
    assert out.choices[0].message.content.startswith("{")
