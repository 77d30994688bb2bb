"""Quantized KV in a live server: ``[kv] format`` end to end.

Real uvicorn on 127.0.0.1, the real engine and the offline tiny model (head_dim
32, so ``group_size = 32``), the official ``openai`` client. For q8, q4 and the two
compression methods the pool stores (turboquant_mse, polar):
the pool is sized in bytes of the format, ``/admin/pool`` and ``/v1/models``
report it, usage counts tokens as for native, every block a request holds
carries the one format of the arena, and under the hostile mix of lengths
of ``test_kv_memory.py`` MLX memory above idle stays within the KV bytes the
pool counts plus the workspace bound. Then one short check on the real
SmolLM2 model: a q8 server answers the factual questions.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from server.settings import ConfigError
from tests.e2e.test_real_model import FACTS
from tests.engine.test_kv_memory import _scenario
from tests.support.servers import ADMIN_TOKEN, LiveServer, make_settings, run_server

# tiny: 16 tokens x 2 heads x (codes + per 32 values: q8 a zero point and a float16 scale,
# q4 a float16 scale and bias; turboquant_mse 4-bit codes and a float16 norm; polar
# 8 + 2 + 1 + 1 bytes of angle codes and two float16 radii)
BYTES_PER_BLOCK = {"native": 16 * 2 * 32 * 4, "q8": 16 * 2 * (32 + 3), "q4": 16 * 2 * (16 + 4),
                   "turboquant_mse": 16 * 2 * (16 + 2), "polar": 16 * 2 * (12 + 4)}
TAGS = {"native": "fp32", "q8": "q8g32", "q4": "q4g32", "turboquant_mse": "tq4",
        "polar": "polar4"}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def _settings(tiny_model_path, fmt: str):
    return make_settings(env={"VELOXQUANT_ADMIN_TOKEN": ADMIN_TOKEN,
                              "VELOXQUANT_KV_FORMAT": fmt, "VELOXQUANT_KV_GROUP_SIZE": "32"},
                         model={"path": str(tiny_model_path)}, pool={"kv_memory": "4MiB"},
                         limits={"max_prompt_tokens": 1024, "max_tokens_cap": 256})


@pytest.fixture(scope="module", params=["q8", "q4", "turboquant_mse", "polar"])
def quantized_server(request, tiny_model_path):
    with run_server(_settings(tiny_model_path, request.param)) as server:
        assert server.engine.wait_ready(120), server.engine.load_error
        yield request.param, server


def test_bad_format_is_a_config_error_naming_the_choices():
    with pytest.raises(ConfigError, match="kv.format.*'native', 'q8', 'q4', 'turboquant_mse' "
                                          "or 'polar'"):
        make_settings(env={"VELOXQUANT_KV_FORMAT": "fp8"})
    with pytest.raises(ConfigError, match="kv.group_size"):
        make_settings(kv={"format": "q4", "group_size": 16})


def test_pool_bytes_and_reports_follow_the_format(quantized_server):
    fmt, server = quantized_server
    per_block = BYTES_PER_BLOCK[fmt]
    view = httpx.get(server.base_url + "/admin/pool", headers=ADMIN).json()
    assert (view["kv_format"], view["kv_format_tag"]) == (fmt, TAGS[fmt])
    assert view["kv_bytes_per_block"] == per_block
    # The same 4 MiB buys 3.7x (q8), 6.4x (q4), 7.1x (turboquant_mse), 8x (polar) the
    # float32 blocks.
    assert view["config"]["n_blocks"] == 4 * 2**20 // per_block
    meta = httpx.get(server.base_url + "/v1/models").json()["data"][0]["meta"]
    assert meta == {"kv_format": fmt, "kv_format_tag": TAGS[fmt], "kv_bytes_per_block": per_block}
    assert server.engine.kv.format_tag == TAGS[fmt]  # what a prefix cache keys blocks by


def test_openai_client_and_usage_as_native(quantized_server, tiny_model_path):
    import openai

    fmt, server = quantized_server
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello there"}], max_tokens=12,
        temperature=0, logit_bias={"1": -100, "3": -100})
    assert chat.usage.completion_tokens == 12 and chat.choices[0].message.content
    # Usage counts tokens, not bytes: a native server reports the very same figures.
    with run_server(_settings(tiny_model_path, "native")) as native:
        assert native.engine.wait_ready(120)
        same = openai.OpenAI(base_url=native.base_url + "/v1", api_key="unused")
        ref = same.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hello there"}], max_tokens=12,
            temperature=0, logit_bias={"1": -100, "3": -100})
    assert chat.usage.model_dump() == ref.usage.model_dump()


def _formats_held(server: LiveServer, seen: set[str], stop: threading.Event) -> None:
    """Collect the formats of the blocks each running request holds (pool calls are
    thread-safe); a request whose blocks mixed formats adds a tuple of them."""
    pool = server.engine.pool
    while not stop.is_set():
        for owner in pool.active_owners():
            formats = {b.format for b in pool.blocks_for(owner)}
            if formats:  # an owner registered a moment before its first blocks holds none
                seen.add(formats.pop() if len(formats) == 1 else tuple(sorted(formats)))
        time.sleep(0.01)


@pytest.mark.slow
def test_memory_within_pool_bytes_plus_workspace_and_one_format(quantized_server):
    fmt, server = quantized_server
    seen: set = set()
    stop = threading.Event()
    watcher = threading.Thread(target=_formats_held, args=(server, seen, stop), daemon=True)
    watcher.start()
    try:
        idle, samples = asyncio.run(_scenario(server.base_url, shorts=8, long_prompt=800))
    finally:
        stop.set()
        watcher.join(5)
    assert len(samples) > 10 and seen == {TAGS[fmt]}
    workspace = idle["kv_bytes:workspace"]
    assert max(s["kv_bytes:in_use"] for s in samples) >= 2 * 4 * (800 // 16) * BYTES_PER_BLOCK[fmt]
    for s in samples:
        over_idle = s["mlx_memory_bytes:active"] - idle["mlx_memory_bytes:active"]
        assert over_idle <= s["kv_bytes:in_use"] + workspace, s
    assert server.wait_idle()["veloxquant_block_pool_request_blocks_in_use"] == 0


@pytest.fixture(scope="module")
def smollm2_q8_server():
    settings = make_settings(env={"VELOXQUANT_KV_FORMAT": "q8"}, model={"path": "smollm2"},
                             pool={"n_blocks": 2048})
    with run_server(settings) as server:
        assert server.engine.wait_ready(300), server.engine.load_error
        yield server


@pytest.mark.parametrize(("question", "expected"), FACTS)
@pytest.mark.slow
def test_q8_smollm2_answers_the_facts(smollm2_q8_server: LiveServer, question, expected):
    assert smollm2_q8_server.engine.kv.format_tag == "q8g64"
    body = {"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 32,
            "messages": [{"role": "user", "content": question}]}
    resp = httpx.post(smollm2_q8_server.base_url + "/v1/chat/completions", json=body,
                      timeout=120)
    assert resp.status_code == 200, resp.text
    answer = resp.json()["choices"][0]["message"]["content"]
    assert any(word.lower() in answer.lower() for word in expected), answer
