"""``POST /v1/embeddings``: the final hidden states of each input, pooled and normalized.

Through the real ``openai`` client (``embeddings.create``): strings, lists of strings,
token ids, float and base64 encodings; each input is an engine request whose KV is
drawn from the pool under its own owner and released at once; the vectors equal a
direct pass of the model's backbone over the same ids.
"""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from tests.support.servers import make_settings, run_server


@pytest.fixture(scope="module")
def client(live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="unused")


def _reference(live_server, ids: list[int], pooling: str = "mean") -> list[float]:
    """The backbone's final hidden states over ``ids``, pooled, at unit length."""
    import mlx.core as mx

    model = live_server.engine.loaded.model

    def run() -> list[float]:
        hidden = model.model(mx.array(ids)[None])[0].astype(mx.float32)
        pooled = hidden.mean(axis=0) if pooling == "mean" else hidden[-1]
        return (pooled / mx.sqrt(mx.sum(pooled * pooled))).tolist()

    return live_server.engine.run_on_engine(run).result(timeout=60)


def test_an_embedding_is_the_pooled_backbone_state_at_unit_length(client, live_server):
    ids = [(11 * i) % 4000 + 10 for i in range(40)]
    out = client.embeddings.create(model="tiny", input=ids)
    [item] = out.data
    assert item.index == 0 and out.object == "list"
    assert len(item.embedding) == live_server.engine.embedding_size
    assert math.isclose(sum(v * v for v in item.embedding), 1.0, rel_tol=1e-4)
    want = _reference(live_server, ids)
    assert max(abs(a - b) for a, b in zip(item.embedding, want, strict=True)) < 1e-4
    assert out.usage.prompt_tokens == out.usage.total_tokens == 40


@pytest.mark.slow
def test_a_long_input_embeds_across_prefill_chunks(client, live_server):
    ids = [(7 * i) % 4000 + 10 for i in range(700)]  # two chunks of 512
    [item] = client.embeddings.create(model="tiny", input=ids).data
    want = _reference(live_server, ids)
    assert max(abs(a - b) for a, b in zip(item.embedding, want, strict=True)) < 1e-3


def test_a_batch_gives_each_input_its_own_vector_in_order(client):
    texts = ["The river bends", "A small dog barks", "The river bends"]
    out = client.embeddings.create(model="tiny", input=texts)
    assert [d.index for d in out.data] == [0, 1, 2]
    one = client.embeddings.create(model="tiny", input=texts[1]).data[0].embedding
    assert max(abs(a - b) for a, b in zip(out.data[1].embedding, one, strict=True)) < 1e-5
    assert out.data[0].embedding == out.data[2].embedding
    assert out.data[0].embedding != out.data[1].embedding


def test_base64_decodes_to_the_float_vector(client, live_server):
    floats = client.embeddings.create(model="tiny", input="hello there").data[0].embedding
    raw = httpx.post(live_server.base_url + "/v1/embeddings", timeout=60,
                     json={"input": "hello there", "encoding_format": "base64"}).json()
    assert isinstance(raw["data"][0]["embedding"], str)
    # The openai client asks for base64 and decodes it itself when no format is given.
    decoded = client.embeddings.create(model="tiny", input="hello there",
                                       encoding_format="base64").data[0].embedding
    import base64

    import numpy as np

    mine = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(mine, floats, atol=1e-6)
    assert isinstance(decoded, str) or np.allclose(decoded, floats, atol=1e-6)


def test_the_pool_is_idle_after_a_batch(client, live_server):
    client.embeddings.create(model="tiny", input=[f"sentence number {i}" for i in range(40)])
    idle = live_server.wait_idle()
    assert idle["veloxquant_block_pool_request_blocks_in_use"] == 0


@pytest.mark.parametrize("body,param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": "x", "dimensions": 3}, "dimensions"),
    ({"input": [10**7]}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
])
def test_bad_input_is_a_400_naming_the_field(live_server, body, param):
    answer = httpx.post(live_server.base_url + "/v1/embeddings", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


def test_last_token_pooling(tiny_model_path):
    settings = make_settings(model={"path": str(tiny_model_path), "embedding_pooling": "last"},
                             pool={"n_blocks": 1024})
    ids = [(5 * i) % 4000 + 10 for i in range(30)]
    with run_server(settings) as server:
        out = httpx.post(server.base_url + "/v1/embeddings", json={"input": ids}, timeout=60)
        assert out.status_code == 200, out.text
        got = out.json()["data"][0]["embedding"]
        want = _reference(server, ids, "last")
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
