"""Route tests against a fake engine: shapes, validation, errors, admin, metrics."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from server.http.app import create_app
from tests.support.fakes import FakeEngine
from tests.support.servers import ADMIN_TOKEN, make_settings

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture()
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture()
def client(engine):
    settings = make_settings(env={"VELOXQUANT_ADMIN_TOKEN": ADMIN_TOKEN},
                             limits={"max_tokens_cap": 100, "default_max_tokens": 50})
    with TestClient(create_app(settings, engine)) as c:
        yield c


def assert_error(resp, status: int, param: str | None = "any") -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if param != "any":
        assert body["error"]["param"] == param
    return body["error"]


def sse_events(resp) -> list:
    frames = [line[len("data: "):] for line in resp.text.split("\n") if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    return [json.loads(f) for f in frames[:-1]]


def test_completion_json_shape(client, engine):
    resp = client.post(COMPLETIONS, json={"model": "fake-model", "prompt": "hi", "max_tokens": 5,
                                          "temperature": 0, "stop": "x", "seed": 7})
    assert resp.status_code == 200
    body = resp.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == "Hello world"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 0}, "kv_blocks": 2}
    params = engine.last_params()
    assert (params.max_tokens, params.temperature, params.stop, params.seed) == (5, 0.0, ("x",), 7)


def test_defaults_come_from_settings(client, engine):
    client.post(COMPLETIONS, json={"prompt": "hi", "top_k": -1})
    params = engine.last_params()
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (50, 1.0, 1.0, 0)
    assert (params.seed, params.stop, params.logprobs) == (None, (), False)


def test_completion_stream_with_usage(client):
    resp = client.post(COMPLETIONS, json={"prompt": "hi", "stream": True,
                                          "stream_options": {"include_usage": True}})
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp)
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == "Hello world"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] == 5


def test_chat_json_and_stream(client, engine):
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    resp = client.post(CHAT, json={"messages": msgs, "max_completion_tokens": 9})
    assert resp.status_code == 200
    body = resp.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello world"}
    assert engine.last_params().max_tokens == 9
    assert engine.submitted[-1].prompt.messages[1] == {"role": "user", "content": "hi"}
    events = sse_events(client.post(CHAT, json={"messages": msgs, "stream": True}))
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert text == "Hello world"
    assert events[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (COMPLETIONS, {}, "prompt"),
        (COMPLETIONS, {"prompt": 5}, "any"),
        (COMPLETIONS, {"prompt": "hi", "temperature": 2.5}, "temperature"),
        (COMPLETIONS, {"prompt": "hi", "temperature": "hot"}, "temperature"),
        (COMPLETIONS, {"prompt": "hi", "top_p": 0}, "top_p"),
        (COMPLETIONS, {"prompt": "hi", "top_p": 1.5}, "top_p"),
        (COMPLETIONS, {"prompt": "hi", "min_p": -0.1}, "min_p"),
        (COMPLETIONS, {"prompt": "hi", "top_k": -2}, "top_k"),
        (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        (COMPLETIONS, {"prompt": "hi", "max_tokens": 101}, "max_tokens"),
        (COMPLETIONS, {"prompt": "hi", "n": 0}, "n"),
        (COMPLETIONS, {"prompt": "hi", "n": 17}, "n"),  # limits.max_choices = 16
        (COMPLETIONS, {"prompt": "hi", "stop": ["a"] * 9}, "stop"),
        (COMPLETIONS, {"prompt": "hi", "stop": [""]}, "stop"),
        (COMPLETIONS, {"prompt": "hi", "logprobs": 21}, "logprobs"),
        (COMPLETIONS, {"prompt": ""}, "prompt"),
        (COMPLETIONS, {"prompt": ["a", ""]}, "prompt"),
        (COMPLETIONS, {"prompt": ["a"] * 9, "n": 2}, "n"),
        (COMPLETIONS, {"prompt": "hi", "suffix": "x"}, "suffix"),
        (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        (COMPLETIONS, {"prompt": "hi", "best_of": 2}, "best_of"),
        (COMPLETIONS, {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
        (CHAT, {}, "messages"),
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "any"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
         "top_logprobs"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
         "max_completion_tokens"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 9,
                "max_completion_tokens": 10**6}, "max_completion_tokens"),  # over the cap
    ],
)
def test_bad_input_is_400_in_openai_shape(client, path, body, param):
    err = assert_error(client.post(path, json=body), 400, param)
    assert err["type"] == "invalid_request_error"


def test_too_many_choices_says_why(client):
    err = assert_error(client.post(COMPLETIONS, json={"prompt": "hi", "n": 17}), 400, "n")
    assert "limits.max_choices=16" in err["message"]


def test_invalid_json_and_wrong_content(client):
    resp = client.post(COMPLETIONS, content=b"{not json", headers={"content-type":
                                                                   "application/json"})
    assert "JSON" in assert_error(resp, 400)["message"]
    assert_error(client.post(COMPLETIONS, content=b"[1, 2]",
                             headers={"content-type": "application/json"}), 400)


@pytest.mark.parametrize("path", [COMPLETIONS, "/v1/chat/completions", "/v1/responses",
                                  "/tokenize"])
def test_an_empty_body_is_named_as_empty(client, path):
    err = assert_error(client.post(path, content=b""), 400)
    assert err["message"].startswith("request body is empty"), err


@pytest.mark.parametrize("raw,param", [
    (b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    (b'{"prompt": "hi", "top_p": Infinity}', "top_p"),
    (b'{"prompt": "hi", "logit_bias": {"5": -Infinity}}', "logit_bias.5"),
])
def test_nan_and_infinity_are_refused_as_not_finite(client, raw, param):
    # Python's JSON parser reads these non-JSON tokens; the range check alone said
    # "less than or equal to 2" of a NaN.
    err = assert_error(client.post(COMPLETIONS, content=raw,
                                   headers={"content-type": "application/json"}), 400, param)
    assert "finite number" in err["message"], err


@pytest.mark.parametrize("path,body,message,param", [
    (COMPLETIONS, {"prompt": 5}, "prompt: must be a string or a list, got a number", "prompt"),
    (COMPLETIONS, {"prompt": "hi", "stop": 5}, "stop: must be a string or a list, got a number",
     "stop"),
    ("/v1/chat/completions", {"messages": [5]}, "messages[0]: must be an object, got a number",
     "messages[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": 5},
     "tool_choice: must be a string or an object, got a number", "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text",
                                                                         "text": 5}]}]},
     "messages[0].content: part 0 is a text part without a string 'text'",
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800"}]},
     "messages[0] is not valid Unicode: a lone surrogate (U+D800)", "messages[0]"),
    ("/tokenize", {}, "give exactly one of prompt (or llama.cpp's content) and messages", None),
    (COMPLETIONS, {"prompt": "hi", "stop": [1, "x"]}, "stop[0]: must be a string, got a number",
     "stop[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]},
     "messages[0].role: must be 'system', 'developer', 'user', 'assistant' or 'tool', "
     'got "wizard"', "messages[0].role"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": -1},
     "max_tokens must be at least 1; 0 is allowed only with echo: true", "max_tokens"),
])
def test_validation_messages_say_what_was_wrong_in_json_terms(client, path, body, message,
                                                              param):
    # Not pydantic's words: union branches as "stop.str: ...; stop.list[str]: ..." with
    # param "stop.str", list items as "messages.0", validators as "body: Value error, ...".
    raw = json.dumps(body).encode()  # the lone surrogate as JSON escapes it: valid JSON
    err = assert_error(client.post(path, content=raw), 400, param)
    assert err["message"].startswith(message), err


def test_a_body_that_is_not_an_object_or_not_json_says_so(client):
    err = assert_error(client.post(COMPLETIONS, content=b"[1]"), 400, None)
    assert err["message"] == "request body must be a JSON object with this endpoint's fields"
    err = assert_error(client.post(COMPLETIONS, content=b'{"prompt": "hi",}'), 400, None)
    assert err["message"] == ("request body is not valid JSON: Expecting property name "
                              "enclosed in double quotes at character 16")


def test_a_long_model_name_is_not_quoted_back_whole(client):
    err = assert_error(client.post(COMPLETIONS, json={"prompt": "hi", "model": "m" * 100_000}),
                       404, "model")
    assert len(err["message"]) < 300 and "(100000 characters)" in err["message"]


def test_unknown_model_is_404(client):
    err = assert_error(client.post(COMPLETIONS, json={"prompt": "hi", "model": "gpt-9"}), 404)
    assert err["code"] == "model_not_found"


def test_404_and_405_are_openai_shaped(client):
    assert assert_error(client.get("/v1/nothing"), 404)["type"] == "not_found_error"
    assert_error(client.get(COMPLETIONS), 405)
    assert_error(client.delete("/health"), 405)


@pytest.mark.parametrize("body,code,param", [
    ({"prompt": ""}, "empty_prompt", "prompt"),
    ({"prompt": []}, "empty_prompt", "prompt"),
    ({"prompt": "hi", "max_tokens": 0}, "invalid_value", "max_tokens"),
    ({"prompt": "hi", "max_tokens": -1}, "invalid_value", "max_tokens"),
    ({"prompt": "hi", "stop": ["x" * 1000]}, "invalid_value", "stop"),
    ({"prompt": "hi", "best_of": 2}, "unsupported_parameter", "best_of"),
    (b'{"prompt": "\xff"}', "invalid_value", None),  # not UTF-8
], ids=["empty", "empty-list", "max_tokens-0", "max_tokens-negative", "long-stop", "best_of",
        "not-utf8"])
def test_every_400_has_a_code_from_the_readme_table(client, body, code, param):
    resp = (client.post(COMPLETIONS, content=body, headers={"content-type": "application/json"})
            if isinstance(body, bytes) else client.post(COMPLETIONS, json=body))
    assert assert_error(resp, 400, param)["code"] == code


def test_engine_rejections_map_to_status(client):
    resp = client.post(COMPLETIONS, json={"prompt": "REJECT429"})
    err = assert_error(resp, 429)
    assert err["code"] == "queue_full"
    # Retry-After comes from limits.retry_after_s (config/default.toml: 1).
    assert err["type"] == "rate_limit_error" and resp.headers["Retry-After"] == "1"
    resp = client.post(COMPLETIONS, json={"prompt": "REJECT429", "stream": True})
    assert_error(resp, 429)  # refused before any stream byte is sent
    err = assert_error(client.post(COMPLETIONS, json={"prompt": "REJECT400"}), 400, "max_tokens")
    assert err["code"] == "context_length_exceeded"


def test_model_failure_is_reported_not_crashed(client):
    err = assert_error(client.post(COMPLETIONS, json={"prompt": "FAIL"}), 500)
    assert err["code"] == "generation_failed" and "injected" in err["message"]
    events = sse_events(client.post(COMPLETIONS, json={"prompt": "FAIL", "stream": True}))
    assert events[0]["choices"][0]["text"] == "Hello"
    assert events[-1]["error"]["code"] == "generation_failed"


def test_not_ready_engine_gives_503():
    settings = make_settings()
    with TestClient(create_app(settings, FakeEngine(ready=False))) as c:
        err = assert_error(c.get("/health"), 503)
        assert "boom" in err["message"]
        resp = c.post(COMPLETIONS, json={"prompt": "hi"})
        assert_error(resp, 503)
        assert resp.headers["Retry-After"] == "1"


def test_health_and_models(client):
    assert client.get("/health").json()["status"] == "ok"
    head = client.head("/health")  # some probes only send HEAD
    assert head.status_code == 200 and head.content == b""
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "fake-model"


def test_admin_auth():
    with TestClient(create_app(make_settings(), FakeEngine())) as c:
        err = assert_error(c.get("/admin/pool"), 403)
        assert "VELOXQUANT_ADMIN_TOKEN" in err["message"]
        assert_error(c.post("/admin/shrink", json={"stream": "k", "target_free": 0}), 403)
    settings = make_settings(env={"VELOXQUANT_ADMIN_TOKEN": ADMIN_TOKEN})
    with TestClient(create_app(settings, FakeEngine())) as c:
        assert_error(c.get("/admin/pool"), 401)
        assert_error(c.get("/admin/pool", headers={"Authorization": "Bearer nope"}), 401)
        assert_error(c.get("/admin/pool", headers={"Authorization": ADMIN_TOKEN}), 401)
        ok = c.get("/admin/pool", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        assert ok.status_code == 200


def test_admin_shrink_and_pool(client, engine):
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    engine.pool.allocate("k", 20, owner=5)  # 2 blocks held on k
    engine.live[5] = "cmpl-live"
    resp = client.post("/admin/shrink", json={"stream": "k", "target_free": 4}, headers=auth)
    assert resp.status_code == 200
    assert resp.json()["retired"] == 16 - 2 - 4
    assert engine.pool.n_free("k") == 4 and len(engine.pool.blocks_for(5)) == 2
    view = client.get("/admin/pool", headers=auth).json()
    assert view["owners"] == [{"owner": 5, "request_id": "cmpl-live", "blocks": 2}]
    assert view["free"]["k"] == 4 and view["stats"]["n_retired"] == 10
    assert view["history"]
    assert_error(client.post("/admin/shrink", json={"stream": "q", "target_free": 1},
                             headers=auth), 400)
    assert_error(client.post("/admin/shrink", json={"stream": "k", "target_free": -1},
                             headers=auth), 400)


def parse_metrics(text: str) -> dict[str, float]:
    names = []
    samples = {}
    for family in text_string_to_metric_families(text):
        names.append(family.name)
        for s in family.samples:
            key = s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items()))
            samples[key] = s.value
    assert len(names) == len(set(names)), "duplicate metric names"
    return samples


def test_metrics_page_parses_and_detects_orphans(client, engine):
    client.post(COMPLETIONS, json={"prompt": "hi"})
    samples = parse_metrics(client.get("/metrics").text)
    assert samples["veloxquant_block_pool_request_blocks_in_use"] == 0
    assert samples["veloxquant_orphaned_blocks"] == 0
    assert samples["veloxquant_requests_total,endpoint=/v1/completions,status=200"] == 1
    for name in ("veloxquant_requests_running", "veloxquant_requests_waiting",
                 "veloxquant_prompt_tokens_total", "veloxquant_generation_tokens_total",
                 "veloxquant_time_to_first_token_seconds_count",
                 "veloxquant_inter_token_latency_seconds_count",
                 "veloxquant_request_latency_seconds_count", "veloxquant_request_kv_blocks_count"):
        assert f"{name},model_name=fake-model" in samples, name
    # Blocks held by an owner the engine does not know: an orphan, and the gauge sees it.
    engine.pool.allocate("k", 40, owner=777)
    engine.pool.allocate("v", 40, owner=777)
    samples = parse_metrics(client.get("/metrics").text)
    assert samples["veloxquant_orphaned_blocks"] == 6
    engine.live[777] = "cmpl-x"  # the same blocks owned by a live request are not orphans
    assert parse_metrics(client.get("/metrics").text)["veloxquant_orphaned_blocks"] == 0


def test_many_apps_can_coexist():
    for _ in range(3):
        create_app(make_settings(), FakeEngine())


def test_api_key_guards_inference_routes_only():
    settings = make_settings(env={"VELOXQUANT_API_KEY": "k1"})
    with TestClient(create_app(settings, FakeEngine())) as c:
        assert_error(c.post(COMPLETIONS, json={"prompt": "hi"}), 401)
        assert_error(c.post(CHAT, json={"messages": [{"role": "user", "content": "x"}]},
                            headers={"Authorization": "Bearer k2"}), 401)
        assert_error(c.get("/v1/models"), 401)
        ok = c.post(COMPLETIONS, json={"prompt": "hi"}, headers={"Authorization": "Bearer k1"})
        assert ok.status_code == 200
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200


def test_pool_families_match_the_library_text(client, engine):
    """/metrics exports the pool under the names and values of pool.stats.to_prometheus()."""
    engine.pool.allocate("k", 40, owner=9)
    engine.pool.free(engine.pool.blocks_for(9)[:1])
    library = {s.name: s.value
               for f in text_string_to_metric_families(engine.pool.stats.to_prometheus())
               for s in f.samples}
    page = parse_metrics(client.get("/metrics").text)
    assert library and {name: page[name] for name in library} == library
