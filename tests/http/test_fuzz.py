"""Fuzzing a live server: schemathesis over its own OpenAPI document, Hypothesis JSON bodies.

The server under fuzz caps ``max_tokens`` at 8 so any valid generation ends
at once, and its pool may grow, so admin shrinks never starve the next
request. Every answer must be below 500, and every 4xx must carry the OpenAI
error shape. Examples per operation are bounded and derandomized, so a run
is repeatable and takes well under a minute.
"""

from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.support.servers import ADMIN_TOKEN, LiveServer, make_settings, run_server

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
FUZZ_SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                         suppress_health_check=list(HealthCheck), database=None)


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_path):
    settings_ = make_settings(
        env={"VELOXQUANT_ADMIN_TOKEN": ADMIN_TOKEN},
        model={"path": str(tiny_model_path)},
        pool={"n_blocks": 512, "grow_on_exhaustion": True},
        limits={"max_tokens_cap": 8, "default_max_tokens": 4, "max_queue": 8,
                "queue_timeout_s": 5.0})
    with run_server(settings_) as server:
        yield server


# Answers seen, by status class: the last test checks the fuzz reached the model too.
SEEN: Counter[str] = Counter()


def check_answer(status: int, body: bytes, content_type: str) -> None:
    """No 5xx; a 4xx has the OpenAI error shape; a stream has no server-error frame."""
    SEEN[f"{status // 100}xx"] += 1
    assert status < 500, f"{status}: {body[:500]!r}"
    if 400 <= status < 500:
        err = json.loads(body)["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"]
        assert isinstance(err["type"], str) and err["type"]
    elif content_type.startswith("text/event-stream"):
        frames = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
        assert frames
        if frames[-1] != "[DONE]":  # a Responses stream: typed events, no [DONE] (OpenAI's)
            last = json.loads(frames[-1])
            assert last["type"] in ("response.completed", "response.incomplete"), last
            frames.append("[DONE]")
        for frame in frames[:-1]:
            assert "server_error" not in frame, frame


# Every documented operation; test_openapi_documents_exactly_these keeps the list honest.
ROUTES = [("/v1/completions", "POST"), ("/v1/chat/completions", "POST"),
          ("/v1/responses", "POST"), ("/v1/embeddings", "POST"), ("/v1/models", "GET"),
          ("/v1/models/{model_id}", "GET"), ("/health", "GET"), ("/health", "HEAD"),
          ("/metrics", "GET"), ("/tokenize", "POST"), ("/detokenize", "POST"),
          ("/admin/pool", "GET"), ("/admin/shrink", "POST"), ("/admin/cache/reset", "POST")]


@pytest.fixture(scope="module")
def openapi(fuzz_server: LiveServer):
    """The server's own OpenAPI document, loaded by schemathesis."""
    return schemathesis.openapi.from_url(fuzz_server.base_url + "/openapi.json")


def test_openapi_documents_exactly_these(fuzz_server: LiveServer):
    paths = httpx.get(fuzz_server.base_url + "/openapi.json").json()["paths"]
    documented = {(path, method.upper()) for path, ops in paths.items() for method in ops}
    assert documented == set(ROUTES)


# Operations with a body can also get deliberately invalid cases; the GETs have no input.
CASES = [(path, method, GenerationMode.POSITIVE) for path, method in ROUTES] + [
    (path, method, GenerationMode.NEGATIVE) for path, method in ROUTES if method == "POST"]


@pytest.mark.parametrize("path,method,mode", CASES, ids=lambda v: getattr(v, "value", v))
@pytest.mark.slow
def test_openapi_operation(openapi, path, method, mode):
    """schemathesis cases (schema-valid, or deliberately invalid) for one operation."""
    operation = openapi[path][method]

    @FUZZ_SETTINGS
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        response = case.call(headers=AUTH, timeout=30)
        content_type = response.headers.get("content-type") or [""]  # schemathesis: lists
        check_answer(response.status_code, response.content, content_type[0])

    run()


# -- Hypothesis: JSON bodies near and far from valid --------------------------------------

scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.floats()
           | st.text(max_size=30))
anything = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=10), inner, max_size=4),
                        max_leaves=12)


def near(*good: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly plausible values for a field, sometimes anything at all."""
    return st.one_of(*good, anything)


SAMPLING = {
    "model": near(st.sampled_from(["default", "tiny", "gpt-4", ""])),
    "max_tokens": near(st.integers(-2, 12)),
    "temperature": near(st.floats(-1, 3)),
    "top_p": near(st.floats(-0.5, 1.5)),
    "top_k": near(st.integers(-3, 100)),
    "min_p": near(st.floats(-0.5, 1.5)),
    "seed": near(st.sampled_from([-1, 0, 2**63, 2**64 - 1, 2**64, 2**70]),
                 st.integers(-(2**70), 2**70)),
    "stop": near(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=10)),
    "n": near(st.integers(-1, 3)),
    "presence_penalty": near(st.floats(-3, 3)),
    "frequency_penalty": near(st.floats(-3, 3)),
    "repetition_penalty": near(st.floats(-1, 3)),
    # Ids around 0, around the tiny model's vocabulary end (4096) and far outside it.
    "logit_bias": near(st.dictionaries(
        st.one_of(st.integers(-3, 10), st.integers(4090, 4100), st.integers(-(10**9), 10**9)
                  ).map(str), st.floats(-200, 200), max_size=3)),
    "stream": near(st.booleans()),
    "stream_options": near(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "user": near(st.text(max_size=10)),
}
COMPLETION = {
    **SAMPLING,
    "prompt": near(st.text(max_size=60), st.lists(st.integers(-5, 10**6), max_size=20),
                   st.lists(st.integers(4090, 4100), min_size=1, max_size=3),
                   st.lists(st.text(max_size=10), max_size=2)),
    "logprobs": near(st.integers(-1, 25)),
    "echo": near(st.booleans()),
    "suffix": near(st.text(max_size=5)),
}
message = st.fixed_dictionaries(
    {"role": near(st.sampled_from(["system", "user", "assistant", "tool", "robot"])),
     "content": near(st.text(max_size=40),
                     st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                     "text": st.text(max_size=20)}),
                              max_size=2))})
CHAT = {
    **SAMPLING,
    "messages": near(st.lists(message, max_size=3)),
    "logprobs": near(st.booleans()),
    "top_logprobs": near(st.integers(-1, 25)),
    "max_completion_tokens": near(st.integers(-1, 12)),
}


def bodies(fields: dict, required: str) -> st.SearchStrategy:
    """JSON bodies: the required field usually present, any subset of the others."""
    objects = st.fixed_dictionaries({required: fields[required]},
                                    optional={k: v for k, v in fields.items() if k != required})
    return st.one_of(objects, objects.map(lambda d: {k: v for k, v in d.items()
                                                     if k != required}), anything)


def post_json(base_url: str, path: str, body) -> None:
    try:
        raw = json.dumps(body, allow_nan=True).encode()
    except (ValueError, OverflowError):
        raw = b"{"
    resp = httpx.post(base_url + path, content=raw, timeout=30,
                      headers={"content-type": "application/json"})
    check_answer(resp.status_code, resp.content, resp.headers.get("content-type", ""))


@FUZZ_SETTINGS
@given(body=bodies(COMPLETION, "prompt"))
@pytest.mark.slow
def test_completions_hypothesis_bodies(fuzz_server: LiveServer, body):
    post_json(fuzz_server.base_url, "/v1/completions", body)


@FUZZ_SETTINGS
@given(body=bodies(CHAT, "messages"))
@pytest.mark.slow
def test_chat_hypothesis_bodies(fuzz_server: LiveServer, body):
    post_json(fuzz_server.base_url, "/v1/chat/completions", body)


@pytest.mark.parametrize("extra,param", [
    ({"logit_bias": {"10000000": 5}}, "logit_bias"),  # unchecked: MLX out of bounds, a crash
    ({"logit_bias": {"4096": 5}}, "logit_bias"),  # one past the tiny vocabulary
    ({"logit_bias": {"-5": 5}}, "logit_bias"),  # unchecked: biases a token from the end
    ({"seed": 2**70}, "seed"),  # unchecked: a 500 from mx.random.key
    ({"seed": 2**63}, "seed"),  # past int64, the API's seed range
    ({"logit_bias": {"5": 1e308}, "logprobs": 2}, "logit_bias"),  # NaN logprobs: a 500
    ({"repetition_penalty": 1e-300, "logprobs": 2}, "repetition_penalty"),  # inf logits: a 500
])
def test_fuzz_findings_answer_400(fuzz_server: LiveServer, extra, param):
    """Inputs that crash or 500 a server that does not check them get a plain 400."""
    for path, base in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        body = {**base, **extra}
        if path.endswith("chat/completions") and "logprobs" in body:
            body["logprobs"] = True
        resp = httpx.post(fuzz_server.base_url + path, json=body, timeout=30)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"].startswith(param)


def test_fuzzing_left_the_pool_idle(fuzz_server: LiveServer):
    m = fuzz_server.wait_idle(timeout=20)
    assert m["veloxquant_block_pool_request_blocks_in_use"] == 0
    assert m["veloxquant_orphaned_blocks"] == 0
    if SEEN["2xx"] + SEEN["4xx"] > 300:  # the whole module ran, not a -k selection
        # Both sides were exercised: generations that ran, and refusals.
        assert SEEN["2xx"] > 50 and SEEN["4xx"] > 100, SEEN
        assert m["veloxquant_generation_tokens_total"] > 100
