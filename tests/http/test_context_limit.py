"""Requests stay within the model's context, and an omitted ``max_tokens`` fits what there is.

The tiny model states a context of 4,096 positions (``max_position_embeddings``).
A request whose prompt plus ``max_tokens`` goes past the context gets 400
``context_length_exceeded`` naming the field the client sent; one that left
``max_tokens`` out gets the room left, in the context and in the pool, as
OpenAI's API reads an omitted ``max_tokens``. A pool that grows never reports
itself degraded. Real uvicorn servers, the real ``openai`` client for chat and
Responses.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.servers import ADMIN_TOKEN, LiveServer, make_settings, run_server

NO_EOS = {"1": -100, "3": -100}  # the tiny model's end tokens never win
CONTEXT = 4096  # the tiny model's max_position_embeddings


def _complete(base: str, **body) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", json={"temperature": 0, **body}, timeout=120)


def _error(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    return error


def test_the_context_is_reported(live_server: LiveServer):
    base = live_server.base_url
    model = httpx.get(f"{base}/v1/models").json()["data"][0]
    assert model["max_model_len"] == CONTEXT
    tokens = httpx.post(f"{base}/tokenize", json={"prompt": "hello"}).json()
    assert tokens["max_model_len"] == CONTEXT


@pytest.mark.slow
def test_max_tokens_past_the_context_is_refused_naming_the_room_left(live_server: LiveServer):
    error = _error(_complete(live_server.base_url, prompt=[5] * 3000, max_tokens=2000))
    assert error["param"] == "max_tokens"
    assert "context of 4096 tokens (the model's max_position_embeddings)" in error["message"]
    assert "lower max_tokens to at most 1096" in error["message"]
    # The same request within the context runs.
    ok = _complete(live_server.base_url, prompt=[5] * 3000, max_tokens=1096, logit_bias=NO_EOS)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1096
    assert live_server.wait_idle()["veloxquant_block_pool_request_blocks_in_use"] == 0


@pytest.mark.slow
def test_an_omitted_max_tokens_takes_the_room_the_context_leaves(live_server: LiveServer):
    # default_max_tokens is 256; a 4,000-token prompt leaves 96 positions.
    out = _complete(live_server.base_url, prompt=[5] * 4000, logit_bias=NO_EOS)
    assert out.status_code == 200, out.text
    body = out.json()
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (4000, 96)
    assert usage["total_tokens"] == CONTEXT
    assert body["choices"][0]["finish_reason"] == "length"
    # A prompt that fills the context leaves nothing to generate: the prompt is named.
    error = _error(_complete(live_server.base_url, prompt=[5] * CONTEXT))
    assert error["param"] == "prompt" and "no room for a generated token" in error["message"]


def test_chat_and_responses_name_their_own_field(live_server: LiveServer):
    client = openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model="default", max_completion_tokens=CONTEXT,
                                       messages=[{"role": "user", "content": "hi"}])
    error = chat.value.body
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "max_completion_tokens"
    assert "lower max_completion_tokens" in error["message"]
    with pytest.raises(openai.BadRequestError) as responses:
        client.responses.create(model="default", input="hi", max_output_tokens=CONTEXT)
    error = responses.value.body
    assert error["param"] == "max_output_tokens" and "lower max_output_tokens" in error["message"]


@pytest.fixture(scope="module")
def small_pool(tiny_model_path) -> LiveServer:
    # 128 blocks per stream, growth to 512 in all: at most 64 blocks a layer and stream
    # for one request (4 layers, k and v), 1,024 tokens. The context is set to 2,048.
    settings = make_settings(
        model={"path": str(tiny_model_path)},
        pool={"n_blocks": 256, "grow_on_exhaustion": True, "max_blocks": 512},
        limits={"max_prompt_tokens": 1100, "max_tokens_cap": 1100, "default_max_tokens": 256,
                "max_context_tokens": 2048})
    with run_server(settings) as server:
        yield server


@pytest.mark.slow
def test_an_omitted_max_tokens_takes_the_room_the_pool_leaves(small_pool: LiveServer):
    base = small_pool.base_url
    assert httpx.get(f"{base}/v1/models").json()["data"][0]["max_model_len"] == 2048
    out = _complete(base, prompt=[7] * 900, logit_bias=NO_EOS)
    assert out.status_code == 200, out.text
    assert out.json()["usage"]["completion_tokens"] == 1024 - 900
    # Sent by the client, the same max_tokens is refused, with what would fit.
    error = _error(_complete(base, prompt=[7] * 900, max_tokens=256))
    assert error["param"] == "max_tokens"
    assert "lower max_tokens" in error["message"] and "fit 1024 tokens" in error["message"]
    assert "with this prompt, max_tokens can be at most 124" in error["message"]
    # A prompt that takes the whole pool leaves no room: the prompt is named.
    error = _error(_complete(base, prompt=[7] * 1030))
    assert error["param"] == "prompt" and "at most 1024 tokens a request" in error["message"]
    # So it is with max_tokens sent: no max_tokens helps, so none is named.
    error = _error(_complete(base, prompt=[7] * 1030, max_tokens=5))
    assert error["param"] == "prompt" and "max_tokens" not in error["message"]
    assert "shorten the prompt" in error["message"]
    # Past the configured context (2,048) too: the one refusal already says what the pool
    # allows, so following its advice is served (the context's room alone, "at most 1048",
    # would name a request the pool refuses).
    error = _error(_complete(base, prompt=[7] * 1000, max_tokens=1100))
    assert error["param"] == "max_tokens"
    assert "the served context of 2048 tokens (limits.max_context_tokens)" in error["message"]
    assert ("lower max_tokens to at most 24 (the KV pool holds at most 1024 tokens a request)"
            in error["message"])
    out = _complete(base, prompt=[7] * 1000, max_tokens=24, logit_bias=NO_EOS)
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 24
    # And a prompt the pool cannot hold is named at once, whatever max_tokens says.
    error = _error(_complete(base, prompt=[7] * 1100, max_tokens=1000))
    assert error["param"] == "prompt" and "max_tokens" not in error["message"]
    assert "at most 1024 tokens a request" in error["message"]
    assert small_pool.wait_idle()["veloxquant_block_pool_request_blocks_in_use"] == 0


def test_chat_names_max_completion_tokens_when_the_pool_refuses(small_pool: LiveServer):
    client = openai.OpenAI(base_url=f"{small_pool.base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model="default", max_completion_tokens=1100,
                                       messages=[{"role": "user", "content": "hi"}])
    error = chat.value.body
    assert error["param"] == "max_completion_tokens"
    assert "lower max_completion_tokens" in error["message"]


@pytest.mark.slow
def test_a_pool_that_grows_is_not_degraded(small_pool: LiveServer):
    # A maximal request (1,100 + 1,100, cut to the 2,048 context) never fit this pool;
    # growing it must not turn /health to "degraded".
    base = small_pool.base_url
    assert httpx.get(f"{base}/health").json()["status"] == "ok"
    before = httpx.get(f"{base}/metrics").text
    out = _complete(base, prompt=[7] * 300, max_tokens=300, logit_bias=NO_EOS)
    assert out.status_code == 200
    grown = httpx.get(f"{base}/metrics").text
    assert before != grown
    n_blocks = [line for line in grown.splitlines()
                if line.startswith("veloxquant_block_pool_blocks_total ")]
    assert n_blocks and float(n_blocks[0].split()[1]) > 256, n_blocks
    assert httpx.get(f"{base}/health").json()["status"] == "ok"


def test_scoring_a_prompt_past_the_context_is_refused(live_server: LiveServer):
    error = _error(_complete(live_server.base_url, prompt=[5] * (CONTEXT + 1), max_tokens=0,
                             echo=True, logprobs=1))
    assert error["param"] == "prompt" and "context of 4096 tokens" in error["message"]



@pytest.mark.parametrize("grows", [False, True])
@pytest.mark.slow
def test_degraded_means_shrunk_below_what_the_pool_started_with(tiny_model_path, grows):
    # 300 blocks a stream hold 1,200 tokens a request: never a maximal one (4,096 tokens).
    pool = {"n_blocks": 600, "grow_on_exhaustion": grows, "max_blocks": 600 if grows else 0}
    settings = make_settings(env={"VELOXQUANT_ADMIN_TOKEN": ADMIN_TOKEN},
                             model={"path": str(tiny_model_path)}, pool=pool)
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    with run_server(settings) as server:
        base = server.base_url
        assert httpx.get(f"{base}/health").json()["status"] == "ok"
        body = {"stream": "k", "target_free": 200}
        if not grows:
            # The pool already cannot hold a maximal request, but the shrink would lower
            # the longest one it can (1,200 -> 800 tokens): not without "force".
            refused = httpx.post(f"{base}/admin/shrink", headers=admin, json=body)
            assert refused.status_code == 409, refused.text
            assert "already cannot hold one maximal request" in refused.text
            body["force"] = True
        # Growing (up to max_blocks) brings retired blocks back: nothing is lowered.
        shrink = httpx.post(f"{base}/admin/shrink", headers=admin, json=body)
        assert shrink.status_code == 200 and shrink.json()["retired"] == 100, shrink.text
        health = httpx.get(f"{base}/health").json()
        if grows:  # the pool may grow back: a request can still hold all it could at start
            assert health["status"] == "ok"
            out = _complete(base, prompt=[7] * 1100, max_tokens=100, logit_bias=NO_EOS)
            assert out.status_code == 200, out.text
        else:
            assert health["status"] == "degraded"
            assert "below its starting size" in health["reason"]
