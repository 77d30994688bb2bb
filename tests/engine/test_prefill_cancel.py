"""A client that leaves during a long prompt stops its prefill at the next chunk.

One engine step prefills up to ``batch.max_prefill_tokens_per_step`` prompt tokens
in chunks of ``batch.prefill_chunk_size``. Seen only at the next step, a
cancellation would leave a hung-up 1,900-token prompt costing its whole prefill (~16 s
of SmolLM2 on 2 cores) while every other stream waits. The fault hook runs
before each model call of a row; here it raises the request's cancellation flag
(what the HTTP layer does when the client disconnects) during the first chunk.
"""

from __future__ import annotations

import httpx
import pytest

from server.engine.engine import Engine
from server.metrics import ServerMetrics
from tests.support.servers import make_settings, run_server

CHUNK = 16
PROMPT_TOKENS = 8 * CHUNK  # eight chunks, all within one step's prefill budget


@pytest.fixture(scope="module")
def cutting_server(tiny_model_path):
    calls: dict[str, int] = {}

    def cut(state) -> None:  # before each of the row's model calls
        text = str(state.request.prompt)
        if "CUT" in text:
            calls[text] = calls.get(text, 0) + 1
            state.request.cancelled.set()  # the client is gone from here on

    settings = make_settings(model={"path": str(tiny_model_path)}, pool={"n_blocks": 1024},
                             batch={"prefill_chunk_size": CHUNK,
                                    "max_prefill_tokens_per_step": 4 * PROMPT_TOKENS},
                             limits={"max_prompt_tokens": 4 * PROMPT_TOKENS})
    with run_server(settings, Engine(settings, ServerMetrics(), fault_hook=cut)) as server:
        yield server, calls


def test_a_request_cancelled_in_its_first_chunk_runs_no_other_chunk(cutting_server):
    server, calls = cutting_server
    before = server.metrics()
    prompt = "CUT" + " seven" * PROMPT_TOKENS
    n_tokens = len(httpx.post(server.base_url + "/tokenize", timeout=30,
                              json={"prompt": prompt}).json()["tokens"])
    assert n_tokens >= PROMPT_TOKENS  # eight chunks or more, all in one step's budget
    response = httpx.post(server.base_url + "/v1/completions", timeout=60,
                          json={"prompt": prompt, "max_tokens": 4})
    assert response.status_code in (200, 499), response.text
    assert list(calls.values()) == [1], calls  # one chunk ran, not eight
    m = server.wait_idle()
    assert m["veloxquant_block_pool_request_blocks_in_use"] == 0
    cancelled = "veloxquant_request_finished_total{reason=cancelled}"
    assert m[cancelled] - before.get(cancelled, 0) == 1
    # Others are served as before.
    ok = httpx.post(server.base_url + "/v1/completions", timeout=60,
                    json={"prompt": [7] * PROMPT_TOKENS, "max_tokens": 3,
                          "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
