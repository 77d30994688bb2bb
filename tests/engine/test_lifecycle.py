"""Request lifecycle on a live server: leaks, disconnects, admission, model faults.

Every test ends by checking the pool is back to idle: ``blocks_in_use`` 0
and no orphaned blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import pytest

from server.engine.engine import Engine
from server.metrics import ServerMetrics
from tests.support.servers import ADMIN_TOKEN, LiveServer, make_settings, run_server

LONG = 3000  # tokens: far longer than any test waits for
# The tiny model's EOS ids, banned in requests that must still run when their client leaves
# (a sampled EOS would end them early and make the test flaky).
NO_EOS = {"1": -100, "3": -100}


async def _complete(c: httpx.AsyncClient, **body) -> httpx.Response:
    body.setdefault("prompt", "Once upon a time")
    return await c.post("/v1/completions", json=body)


async def _cancelled_stream(c: httpx.AsyncClient, chunks: int) -> str:
    body = {"prompt": "A long story", "max_tokens": LONG, "stream": True, "logit_bias": NO_EOS}
    async with c.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        seen = 0
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen >= chunks:
                    break  # leaving the block closes the connection mid-stream
    return "cancelled"


async def _abandoned(base_url: str, chat: bool) -> str:
    """A non-streaming request whose client gives up (timeout) long before the end."""
    async with httpx.AsyncClient(base_url=base_url, timeout=0.5) as c:
        try:
            if chat:
                await c.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "go"}], "max_tokens": LONG,
                    "logit_bias": NO_EOS})
            else:
                await _complete(c, max_tokens=LONG, logit_bias=NO_EOS)
        except httpx.TimeoutException:
            return "abandoned"
    return "finished?!"


async def _task_cancelled_stream(c: httpx.AsyncClient) -> str:
    task = asyncio.ensure_future(_cancelled_stream(c, chunks=10**9))
    await asyncio.sleep(0.4)
    task.cancel()  # asyncio cancellation of the client mid-stream
    try:
        await task
    except asyncio.CancelledError:
        pass
    return "task-cancelled"


async def _mixed_load(base_url: str) -> list:
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as c:
        jobs = []
        jobs += [_complete(c, max_tokens=16, temperature=0) for _ in range(5)]
        jobs += [c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hello"}], "max_tokens": 30,
            "stop": ["e", "\n"], "stream": s}) for s in (True, False, True)]
        jobs += [_cancelled_stream(c, chunks=n) for n in (1, 2, 3, 5)]
        jobs += [_abandoned(base_url, chat) for chat in (False, True, False)]
        # Prompt + max_tokens past the model's context (4,096): 400 at once.
        jobs += [_complete(c, prompt=[5] * 3000, max_tokens=4000) for _ in range(3)]
        jobs += [_task_cancelled_stream(c) for _ in range(2)]
        assert len(jobs) == 20
        return await asyncio.gather(*jobs)


def test_twenty_mixed_requests_leave_no_block_behind(live_server: LiveServer):
    assert {int(t) for t in NO_EOS} >= set(live_server.engine.loaded.tokenizer.eos_token_ids)
    before = live_server.metrics()
    results = asyncio.run(_mixed_load(live_server.base_url))
    statuses = [r.status_code for r in results if isinstance(r, httpx.Response)]
    assert statuses.count(200) == 8 and statuses.count(400) == 3, statuses
    for r in results:
        if isinstance(r, httpx.Response) and r.status_code == 400:
            assert "lower max_tokens" in r.json()["error"]["message"]
    assert results.count("cancelled") == 4
    assert results.count("abandoned") == 3
    assert results.count("task-cancelled") == 2
    m = live_server.wait_idle(timeout=20)
    assert m["veloxquant_block_pool_request_blocks_in_use"] == 0
    assert m["veloxquant_orphaned_blocks"] == 0
    assert m["veloxquant_block_pool_reused_total"] > 0
    # Every cut stream and abandoned request was stopped (running or still waiting).
    stopped = sum(m.get(k, 0) - before.get(k, 0) for k in (
        "veloxquant_request_finished_total{reason=cancelled}",
        "veloxquant_request_rejected_total{reason=cancelled_waiting}"))
    assert stopped == 9
    # Nobody generated anywhere near LONG tokens for the cut requests.
    generated = (m["veloxquant_generation_tokens_total"]
                 - before.get("veloxquant_generation_tokens_total", 0))
    assert generated < 9 * LONG / 4


@pytest.fixture(scope="module")
def small_pool_server(tiny_model_path):
    """Tiny pool (one long request fills it), short queue, and a fault hook."""

    def fault(state):
        if "FAULT" in str(state.request.prompt) and state.generated >= 2:
            raise RuntimeError("injected fault in the model step")

    settings = make_settings(env={"VELOXQUANT_ADMIN_TOKEN": ADMIN_TOKEN},
                             model={"path": str(tiny_model_path)},
                             pool={"n_blocks": 2048},  # 1024 per stream = 4 layers x 256
                             # A context over the model's 4,096 so a request can outgrow
                             # the pool before it outgrows the context.
                             limits={"max_queue": 2, "queue_timeout_s": 1.0,
                                     "max_context_tokens": 8192})
    engine = Engine(settings, ServerMetrics(), fault_hook=fault)
    with run_server(settings, engine) as server:
        yield server


def _waiting(metrics: str) -> float:
    """``veloxquant_requests_waiting`` (labelled with the model's name) from a /metrics page."""
    line = next(x for x in metrics.splitlines() if x.startswith("veloxquant_requests_waiting{"))
    return float(line.rsplit(" ", 1)[1])


async def _admission_scenario(base_url: str) -> dict:
    out = {}
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as c:
        # 4 layers x ceil(4001/16) = 1004 of 1024 blocks per stream: fills the pool.
        # EOS is banned so the hog runs (~6 s) until its client leaves.
        body = {"prompt": "x", "max_tokens": 4000, "stream": True, "logit_bias": NO_EOS}
        async with c.stream("POST", "/v1/completions", json=body) as hog:
            lines = hog.aiter_lines()
            await lines.__anext__()  # admitted and generating
            waiting = [asyncio.ensure_future(_complete(c, max_tokens=100)) for _ in range(2)]
            for _ in range(100):  # until both wait (at most 10 s)
                if _waiting((await c.get("/metrics")).text) == 2:
                    break
                await asyncio.sleep(0.1)
            out["queue_full"] = await _complete(c, max_tokens=100)
            # 4 blocks a stream: it fits the 20 free ones alone, but the two waiting ahead
            # (first come, first served) take them first: the full queue must refuse it.
            out["small_behind"] = await _complete(c, prompt="x", max_tokens=10)
            out["never_fits"] = await _complete(c, prompt="x", max_tokens=4096)
            metrics = (await c.get("/metrics")).text
            out["waiting_gauge"] = _waiting(metrics) == 2
        # The hog's client left: its blocks return and both waiters run.
        out["waiters"] = await asyncio.gather(*waiting)
        async with c.stream("POST", "/v1/completions", json=body) as hog:
            lines = hog.aiter_lines()  # keep a reference: a collected iterator closes the stream
            await lines.__anext__()
            t0 = time.monotonic()
            out["timed_out"] = await _complete(c, max_tokens=100)
            out["waited_s"] = time.monotonic() - t0
    return out


@pytest.mark.slow
def test_admission_by_capacity(small_pool_server: LiveServer, caplog):
    caplog.set_level(logging.INFO, logger="veloxquant.requests")
    out = asyncio.run(_admission_scenario(small_pool_server.base_url))
    full = out["queue_full"]
    assert full.status_code == 429 and full.headers["Retry-After"] == "1"
    assert full.json()["error"]["code"] == "queue_full"
    small = out["small_behind"]
    assert small.status_code == 429 and small.json()["error"]["code"] == "queue_full"
    never = out["never_fits"]
    assert never.status_code == 400
    msg = never.json()["error"]["message"]
    assert "needs 1028 KV blocks" in msg and "at most 1024" in msg and "pool.n_blocks" in msg
    assert out["waiting_gauge"]
    assert [r.status_code for r in out["waiters"]] == [200, 200]
    timed_out = out["timed_out"]
    assert timed_out.status_code == 429 and timed_out.json()["error"]["code"] == "queue_timeout"
    assert 0.9 <= out["waited_s"] < 4
    # Its request line has the prompt's size and its wait in the queue.
    lines = [json.loads(r.getMessage()) for r in caplog.records
             if r.name == "veloxquant.requests"]
    timeout_line = next(line for line in lines if line.get("code") == "queue_timeout")
    assert timeout_line["status"] == 429 and timeout_line["prompt_tokens"] > 0
    assert 0.9 <= timeout_line["latency_s"] < 4
    m = small_pool_server.wait_idle()
    assert m["veloxquant_block_pool_request_blocks_in_use"] == 0
    assert m["veloxquant_block_pool_exhausted_total"] == 0  # never ran out mid-generation
    assert m["veloxquant_orphaned_blocks"] == 0


async def _fault_scenario(base_url: str):
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as c:
        return await asyncio.gather(
            # No EOS: a faulty request must live past the fault's second token.
            _complete(c, prompt="FAULT here", max_tokens=50, logit_bias=NO_EOS),
            _complete(c, prompt="fine", max_tokens=30),
            c.post("/v1/completions", json={"prompt": "FAULT stream", "max_tokens": 50,
                                            "stream": True, "logit_bias": NO_EOS}),
        )


def test_model_fault_fails_one_request_only(small_pool_server: LiveServer):
    faulty, fine, stream = asyncio.run(_fault_scenario(small_pool_server.base_url))
    assert faulty.status_code == 500
    err = faulty.json()["error"]
    assert err["code"] == "generation_failed" and "injected fault" in err["message"]
    assert fine.status_code == 200 and fine.json()["usage"]["completion_tokens"] > 0
    assert stream.status_code == 200
    assert '"generation_failed"' in stream.text and stream.text.endswith("data: [DONE]\n\n")
    m = small_pool_server.wait_idle()
    assert m["veloxquant_block_pool_request_blocks_in_use"] == 0
    assert m["veloxquant_orphaned_blocks"] == 0
    assert m["veloxquant_request_finished_total{reason=error}"] == 2
    # The engine goes on serving.
    assert httpx.post(small_pool_server.base_url + "/v1/completions",
                      json={"prompt": "after", "max_tokens": 3}).status_code == 200


async def _shrink_while_generating(base_url: str) -> dict:
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as c:
        body = {"prompt": "x", "max_tokens": 600, "stream": True, "logit_bias": NO_EOS}
        async with c.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.aiter_lines()
            await lines.__anext__()
            view = (await c.get("/admin/pool", headers=auth)).json()
            # Forced: a pool this small can no longer hold one maximal request.
            shrink = (await c.post("/admin/shrink", headers=auth,
                                   json={"stream": "kv", "target_free": 0, "force": True})).json()
            after = (await c.get("/admin/pool", headers=auth)).json()
            rest = [line async for line in lines if line]
    return {"view": view, "shrink": shrink, "after": after, "rest": rest}


@pytest.mark.slow
def test_shrink_with_growth_and_no_prefix_cache_while_a_request_runs(tiny_model_path):
    # The running request reserves 4 layers x ceil(601/16) = 152 blocks a stream, more than
    # the 128 each has (growth covers it), and there is no prefix cache to evict from: the
    # shrink must not fail with a 500 there.
    settings = make_settings(env={"VELOXQUANT_ADMIN_TOKEN": ADMIN_TOKEN},
                             model={"path": str(tiny_model_path)}, cache={"prefix_caching": False},
                             pool={"n_blocks": 256, "grow_on_exhaustion": True,
                                   "max_blocks": 2048})
    with run_server(settings) as server:
        out = asyncio.run(_shrink_while_generating(server.base_url))
        assert out["shrink"]["retired"] >= 0 and out["rest"][-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in "".join(out["rest"])
        assert server.wait_idle()["veloxquant_block_pool_request_blocks_in_use"] == 0


@pytest.mark.slow
def test_shrink_with_a_request_in_flight(small_pool_server: LiveServer):
    out = asyncio.run(_shrink_while_generating(small_pool_server.base_url))
    (owner,) = out["view"]["owners"]
    assert owner["request_id"].startswith("cmpl-") and owner["blocks"] > 0
    # 4 layers x ceil(601/16) = 152 blocks per stream stay free for the running request.
    assert out["shrink"]["kept_free"]["k"] >= 152 - owner["blocks"] // 2
    assert out["shrink"]["retired"] > 0
    assert out["after"]["owners"][0]["owner"] == owner["owner"]
    assert out["rest"][-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in "".join(out["rest"])  # ran to the end, no error
    m = small_pool_server.wait_idle()
    assert m["veloxquant_block_pool_exhausted_total"] == 0
    assert m["veloxquant_block_pool_request_blocks_in_use"] == 0
