"""End to end: a real uvicorn server, the real engine and the tiny model.

Driven by the official ``openai`` client and by httpx.
"""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from tests.support.servers import LiveServer

PROMPT = "The history of the old city begins"


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model_id(client) -> str:
    return client.models.list().data[0].id


def test_models_and_health(live_server, model_id):
    assert model_id == "tiny"
    health = httpx.get(live_server.base_url + "/health").json()
    assert health["status"] == "ok" and health["model"] == "tiny"


def test_completion_non_streaming(client, model_id):
    out = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=12, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason in ("length", "stop") and choice.text
    assert out.usage.prompt_tokens > 0 and out.usage.completion_tokens <= 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    # Peak blocks: 4 layers x (k, v) x ceil(tokens in the cache / 16)
    n = out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.usage.model_extra["kv_blocks"] in {8 * math.ceil(t / 16) for t in (n - 1, n)}


def test_streaming_equals_non_streaming_when_greedy(client, model_id):
    full = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=16, temperature=0)
    stream = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=16,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
        full.choices[0].finish_reason


def test_chat_non_streaming_and_streaming(client, model_id):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Tell me about rivers."}]
    out = client.chat.completions.create(model=model_id, messages=messages, max_tokens=10,
                                         temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason in ("length", "stop")
    stream = client.chat.completions.create(model=model_id, messages=messages, max_tokens=10,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == out.choices[0].message.content
    # max_completion_tokens is honoured too
    out = client.chat.completions.create(model=model_id, messages=messages,
                                         max_completion_tokens=3, temperature=0)
    assert out.usage.completion_tokens <= 3


def test_stop_sequence_across_token_boundary_is_excluded(client, model_id):
    free = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=40, temperature=0,
                                     logprobs=0)
    text = free.choices[0].text
    tokens = free.choices[0].logprobs.tokens
    # A stop string that straddles tokens 3|4 (end of one, start of the next).
    offset = len("".join(tokens[:4]))
    stop = text[offset - 2: offset + 2]
    assert len(stop) == 4
    expected = text[: text.find(stop)]
    for stream in (False, True):
        out = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=40,
                                        temperature=0, stop=[stop, "\u2603never"], stream=stream)
        if stream:
            chunks = list(out)
            got = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            got, reason = out.choices[0].text, out.choices[0].finish_reason
        assert got == expected
        assert reason == "stop"
        assert stop not in got


def test_seed_makes_sampling_repeatable(client, model_id):
    def once(seed):
        return client.completions.create(model=model_id, prompt=PROMPT, max_tokens=12,
                                         temperature=1.0, top_p=0.9, seed=seed,
                                         extra_body={"top_k": 50, "min_p": 0.01}
                                         ).choices[0].text
    assert once(1234) == once(1234)


def test_logprobs(client, model_id):
    out = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=5, temperature=0,
                                    logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == out.usage.completion_tokens
    assert all(len(top) == 3 for top in lp.top_logprobs)
    # Greedy: the chosen token is the most likely one.
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and math.isclose(chosen, max(top.values()), rel_tol=1e-4)
    chat = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 for entry in content)


def test_token_id_prompt(client, model_id):
    out = client.completions.create(model=model_id, prompt=[5, 6, 7, 8], max_tokens=3,
                                    temperature=0)
    assert out.usage.prompt_tokens == 4


def test_bad_requests_reach_openai_client_as_4xx(client, model_id):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_id, prompt=PROMPT, n=17)
    assert "limits.max_choices" in str(info.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_id, prompt=PROMPT, max_tokens=100_000)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-nope", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_id, prompt=[10**9], max_tokens=2)


def test_a_stream_the_client_cuts_counts_as_499(live_server):
    def counts() -> tuple[float, float]:
        m = live_server.metrics()
        key = "veloxquant_requests_total{endpoint=/v1/completions,status=%s}"
        return m.get(key % 200, 0.0), m.get(key % 499, 0.0)

    before = counts()
    body = {"prompt": PROMPT, "max_tokens": 2000, "stream": True,
            "logit_bias": {"1": -100, "3": -100}}
    with httpx.stream("POST", live_server.base_url + "/v1/completions", json=body,
                      timeout=60) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: "))
    live_server.wait_idle()
    finished = httpx.post(live_server.base_url + "/v1/completions", timeout=60,
                          json={"prompt": PROMPT, "max_tokens": 2, "stream": True})
    assert finished.status_code == 200
    after = counts()
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded",
                                          "text/plain"])
def test_a_json_body_is_read_whatever_its_content_type(live_server, content_type):
    # curl -d '{...}' without -H declares a form; the body is JSON all the same.
    headers = {"content-type": content_type} if content_type else {}
    url = live_server.base_url + "/v1/completions"
    # ignore_eos: "hi" ends at once about 1 time in 700 on the random model.
    ok = httpx.post(url, content=b'{"prompt": "hi", "max_tokens": 2, "ignore_eos": true}',
                    headers=headers)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    bad = httpx.post(url, content=b"prompt=hi", headers=headers)
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]


def test_a_compressed_body_is_415_saying_so(live_server):
    import gzip

    url = live_server.base_url + "/v1/completions"
    body = gzip.compress(b'{"prompt": "hi", "max_tokens": 2}')
    resp = httpx.post(url, content=body, headers={"content-encoding": "gzip"})
    assert resp.status_code == 415, resp.text
    error = resp.json()["error"]
    assert error["code"] == "unsupported_content_encoding" and "'gzip'" in error["message"]
    ok = httpx.post(url, content=b'{"prompt": "hi", "max_tokens": 2}',
                    headers={"content-encoding": "identity"})
    assert ok.status_code == 200
    # A GET has no body to decode: the header is harmless there.
    assert httpx.get(live_server.base_url + "/v1/models",
                     headers={"content-encoding": "gzip"}).status_code == 200


def test_server_is_idle_afterwards(live_server):
    m = live_server.wait_idle()
    assert m["veloxquant_block_pool_request_blocks_in_use"] == 0
    assert m["veloxquant_orphaned_blocks"] == 0


def test_metrics_count_the_kv_arena_writes(client, model_id, live_server):
    """On a GPU each write copies the whole arena: decode steps hold their KV (write-back)."""
    before = live_server.wait_idle()
    client.completions.create(model=model_id, prompt="a b c", max_tokens=12, temperature=0)
    after = live_server.wait_idle()
    steps = after["veloxquant_engine_decode_steps_total"] - before[
        "veloxquant_engine_decode_steps_total"]
    writes = after["veloxquant_kv_arena_writes_total"] - before["veloxquant_kv_arena_writes_total"]
    assert steps >= 11
    # The prompt's prefill writes once; the decode steps' columns wait (batch.kv_write_back =
    # 32) until the request ends, when prefix caching writes them to cache its output.
    assert 1 <= writes <= 2
    assert after["veloxquant_kv_arena_writes_total"] == live_server.engine.kv.arena.writes


def test_metrics_say_where_decode_steps_spend_their_time(client, model_id, live_server):
    from prometheus_client.parser import text_string_to_metric_families

    def clock() -> tuple[float, dict[str, float]]:
        text = httpx.get(live_server.base_url + "/metrics").text
        steps, phases = 0.0, {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "veloxquant_engine_decode_steps_total":
                    steps = sample.value
                elif sample.name == "veloxquant_engine_phase_seconds_total":
                    phases[sample.labels["phase"]] = sample.value
        return steps, phases

    steps0, phases0 = clock()
    client.completions.create(model=model_id, prompt="a b c", max_tokens=8, temperature=0)
    steps1, phases1 = clock()
    assert set(phases1) == {"schedule", "prefill", "decode_graph", "sample_graph", "submit",
                            "read", "postprocess", "memory"}
    assert steps1 - steps0 >= 7  # 8 tokens: the first comes from prefill, then one per step
    for phase in ("decode_graph", "submit", "postprocess"):
        assert phases1[phase] > phases0[phase], phase
