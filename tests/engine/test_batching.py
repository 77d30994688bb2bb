"""Continuous batching on a live server (tiny model, real engine, loopback).

Requests decode together in one model call per step; these tests check that
a request's output does not depend on its batch-mates, that a newcomer gets
its first token while others decode, that admission keeps the pool bounded,
and that random cancellations leave no block behind.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import httpx
import pytest

from server.settings import ConfigError
from tests.support.servers import LiveServer, make_settings, run_server

NO_EOS = {"1": -100, "3": -100}  # the tiny model's EOS ids: keep requests running


@pytest.fixture(scope="module")
def batch_server(tiny_model_path):
    settings = make_settings(model={"path": str(tiny_model_path)}, pool={"n_blocks": 4096},
                             limits={"max_tokens_cap": 4096, "queue_timeout_s": 30.0})
    with run_server(settings) as server:
        yield server


def _bodies() -> list[dict]:
    """Eight requests with different prompts, lengths and sampling settings."""
    out = []
    for i in range(8):
        body = {"prompt": f"def handler_{i}(request, *args):" + " x" * (i * 5),
                "max_tokens": 20 + 3 * i, "logit_bias": NO_EOS}
        if i % 2:
            body.update(temperature=0.9, top_p=0.9, top_k=50, min_p=0.01, seed=100 + i)
        else:
            body.update(temperature=0)
        out.append(body)
    out[3]["stop"] = ["e"]  # a stop string in the mix
    return out


async def _post_all(base_url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as c:
        return await asyncio.gather(*[c.post("/v1/completions", json=b) for b in bodies])


@pytest.mark.slow
def test_requests_in_a_batch_of_eight_get_what_they_get_alone(batch_server: LiveServer):
    bodies = _bodies()
    alone = [httpx.post(batch_server.base_url + "/v1/completions", json=b, timeout=60)
             for b in bodies]
    before = batch_server.metrics()
    together = asyncio.run(_post_all(batch_server.base_url, bodies))
    after = batch_server.wait_idle()
    for body, a, t in zip(bodies, alone, together, strict=True):
        assert a.status_code == t.status_code == 200
        assert t.json()["choices"][0]["text"] == a.json()["choices"][0]["text"], body
        assert t.json()["usage"]["completion_tokens"] == a.json()["usage"]["completion_tokens"]
    assert together[0].json()["usage"]["completion_tokens"] == 20
    assert together[3].json()["choices"][0]["finish_reason"] in ("stop", "length")
    steps = after["veloxquant_batch_size_count"] - before.get("veloxquant_batch_size_count", 0)
    rows = after["veloxquant_batch_size_sum"] - before.get("veloxquant_batch_size_sum", 0)
    assert rows / steps > 4  # they really decoded together (one call for many rows)
    assert after["veloxquant_block_pool_request_blocks_in_use"] == 0


async def _first_token_while_eight_decode(base_url: str) -> dict:
    times: dict[str, float] = {}
    started = asyncio.Event()
    first_seen = 0

    async def stream(name: str, max_tokens: int) -> None:
        nonlocal first_seen
        body = {"prompt": f"story {name}", "max_tokens": max_tokens, "stream": True,
                "temperature": 0, "logit_bias": NO_EOS}
        async with c.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {") and name + ":first" not in times:
                    times[name + ":first"] = time.monotonic()
                    if name.startswith("long"):
                        first_seen += 1
                        if first_seen == 8:
                            started.set()
        times[name + ":end"] = time.monotonic()

    async with httpx.AsyncClient(base_url=base_url, timeout=60) as c:
        longs = [asyncio.ensure_future(stream(f"long{i}", 300)) for i in range(8)]
        await asyncio.wait_for(started.wait(), 30)
        await stream("late", 5)
        await asyncio.gather(*longs)
    return times


@pytest.mark.slow
def test_a_late_request_gets_its_first_token_while_eight_decode(batch_server: LiveServer):
    times = asyncio.run(_first_token_while_eight_decode(batch_server.base_url))
    first_end = min(times[f"long{i}:end"] for i in range(8))
    assert times["late:first"] < first_end
    assert times["late:end"] < first_end  # it even finished its 5 tokens first
    assert batch_server.wait_idle()["veloxquant_block_pool_request_blocks_in_use"] == 0


async def _random_request(c: httpx.AsyncClient, rng: random.Random) -> str:
    body: dict = {"prompt": "x " * rng.randrange(1, 60), "max_tokens": rng.randrange(1, 80),
                  "temperature": rng.choice([0, 0.7, 1.2]), "top_p": rng.choice([1.0, 0.8])}
    if rng.random() < 0.3:
        body["seed"] = rng.randrange(1000)
    if rng.random() < 0.2:
        body["stop"] = [rng.choice(["a", "e", "\n"])]
    mode = rng.choice(["plain", "stream", "cut", "abandon"])
    if mode == "plain":
        r = await c.post("/v1/completions", json=body)
        return f"{mode}:{r.status_code}"
    if mode == "abandon":  # the client gives up while the request runs
        body["max_tokens"] = 2000
        body["logit_bias"] = NO_EOS
        try:
            await c.post("/v1/completions", json=body, timeout=rng.uniform(0.05, 0.5))
        except httpx.TimeoutException:
            return "abandon:gone"
        return "abandon:200"
    body["stream"] = True
    cut_after = rng.randrange(1, 6) if mode == "cut" else None
    async with c.stream("POST", "/v1/completions", json=body) as resp:
        seen = 0
        async for line in resp.aiter_lines():
            seen += line.startswith("data: ")
            if cut_after is not None and seen >= cut_after:
                break  # leaving the block disconnects mid-stream
        return f"{mode}:{resp.status_code}"


async def _fifty(base_url: str) -> list[str]:
    rng = random.Random(2024)
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as c:
        jobs = [_random_request(c, random.Random(rng.randrange(2**32))) for _ in range(50)]
        return await asyncio.wait_for(asyncio.gather(*jobs), 55)


@pytest.mark.slow
def test_fifty_random_requests_with_cancellations_free_every_block(batch_server: LiveServer):
    t0 = time.monotonic()
    results = asyncio.run(_fifty(batch_server.base_url))
    assert len(results) == 50
    assert all(r.endswith((":200", ":gone")) for r in results), results
    assert {r.split(":")[0] for r in results} >= {"plain", "stream", "cut", "abandon"}
    m = batch_server.wait_idle(timeout=20)
    assert m["veloxquant_block_pool_request_blocks_in_use"] == 0
    assert m["veloxquant_orphaned_blocks"] == 0
    assert m["veloxquant_requests_running"] == m["veloxquant_requests_waiting"] == 0
    assert time.monotonic() - t0 < 60


def _sample_gauges(server: LiveServer, stop: threading.Event, seen: list) -> None:
    while not stop.is_set():
        m = server.metrics()
        seen.append((m["veloxquant_block_pool_request_blocks_in_use"],
                     m["veloxquant_requests_running"]))
        time.sleep(0.02)


@pytest.mark.slow
def test_admission_keeps_blocks_within_the_pool_and_rows_within_the_batch(tiny_model_path):
    # 256 blocks per stream; one request needs 4 layers x ceil((~7 + 100) / 16) = 28 per
    # stream, so at most 9 fit at once; the batch holds at most 6.
    settings = make_settings(model={"path": str(tiny_model_path)}, pool={"n_blocks": 512},
                             batch={"max_batch_size": 6, "prefill_chunk_size": 4,
                                    "max_prefill_tokens_per_step": 8},
                             limits={"max_queue": 64, "queue_timeout_s": 60.0})
    bodies = [{"prompt": f"item {i} of the list", "max_tokens": 100, "temperature": 0,
               "logit_bias": NO_EOS} for i in range(24)]
    with run_server(settings) as server:
        seen: list = []
        stop = threading.Event()
        sampler = threading.Thread(target=_sample_gauges, args=(server, stop, seen))
        sampler.start()
        try:
            results = asyncio.run(_post_all(server.base_url, bodies))
        finally:
            stop.set()
            sampler.join()
        m = server.wait_idle()
    assert [r.status_code for r in results] == [200] * 24
    assert all(r.json()["usage"]["completion_tokens"] == 100 for r in results)
    assert seen and max(b for b, _ in seen) <= 512
    assert max(r for _, r in seen) <= 6
    assert max(r for _, r in seen) >= 2  # several ran at once
    assert m["veloxquant_block_pool_exhausted_total"] == 0  # nobody ran out mid-generation
    assert m["veloxquant_block_pool_peak_blocks_in_use"] <= 512
    assert m["veloxquant_block_pool_request_blocks_in_use"] == 0


def test_batch_settings_are_validated():
    with pytest.raises(ConfigError, match="batch.max_batch_size"):
        make_settings(batch={"max_batch_size": 0})
    with pytest.raises(ConfigError, match="batch.prefill_chunk_size"):
        make_settings(batch={"prefill_chunk_size": 0})
    s = make_settings(env={"VELOXQUANT_BATCH_MAX_PREFILL_TOKENS_PER_STEP": "64"})
    assert s.batch.max_prefill_tokens_per_step == 64


async def _cut_during_prefill(base_url: str, bodies: list[dict]) -> list:
    async def abandon(body: dict) -> str:
        async with httpx.AsyncClient(base_url=base_url, timeout=0.15) as c:
            try:
                await c.post("/v1/completions", json=body)
            except httpx.TimeoutException:
                return "gone"
        return "finished?!"

    async with httpx.AsyncClient(base_url=base_url, timeout=60) as c:
        jobs = [abandon(b) if i % 2 else c.post("/v1/completions", json=b)
                for i, b in enumerate(bodies)]
        return await asyncio.gather(*jobs)


@pytest.mark.slow
def test_requests_leaving_mid_prefill_free_their_blocks_and_spare_the_group(tiny_model_path):
    """Long prompts prefill as one group in small chunks; half the clients leave meanwhile."""
    settings = make_settings(model={"path": str(tiny_model_path)}, pool={"n_blocks": 4096},
                             batch={"prefill_chunk_size": 8, "max_prefill_tokens_per_step": 48})
    bodies = [{"prompt": f"request {i} " + "word " * (120 + 17 * i), "max_tokens": 12,
               "temperature": 0, "logit_bias": NO_EOS} for i in range(6)]
    with run_server(settings) as server:
        alone = [httpx.post(server.base_url + "/v1/completions", json=b, timeout=60)
                 for b in bodies[::2]]
        results = asyncio.run(_cut_during_prefill(server.base_url, bodies))
        m = server.wait_idle(timeout=20)
    assert results[1::2] == ["gone"] * 3
    for a, r in zip(alone, results[::2], strict=True):
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == a.json()["choices"][0]["text"]
    assert m["veloxquant_block_pool_request_blocks_in_use"] == 0
    assert m["veloxquant_orphaned_blocks"] == 0
    # Mostly mid-prefill; on a loaded machine one may still be waiting when its client goes.
    assert (m["veloxquant_request_finished_total{reason=cancelled}"]
            + m.get("veloxquant_request_rejected_total{reason=cancelled_waiting}", 0)) == 3


def test_rows_ending_on_their_first_token_leave_their_group(batch_server: LiveServer):
    """A group of six prefills together; three end on their first token, three go on."""
    bodies = [{"prompt": f"item {i}: " + "x " * (3 * i), "max_tokens": 1 if i % 2 else 15,
               "temperature": 0, "logit_bias": NO_EOS} for i in range(6)]
    alone = [httpx.post(batch_server.base_url + "/v1/completions", json=b, timeout=60)
             for b in bodies]
    together = asyncio.run(_post_all(batch_server.base_url, bodies))
    for a, t in zip(alone, together, strict=True):
        assert t.status_code == 200
        assert t.json()["choices"][0]["text"] == a.json()["choices"][0]["text"]
        # kv_blocks too; cached_tokens differ (the second run reuses the first's prompt blocks)
        assert _uncached(t.json()["usage"]) == _uncached(a.json()["usage"])
    assert [t.json()["usage"]["completion_tokens"] for t in together] == [15, 1] * 3
    assert all(t.json()["usage"]["kv_blocks"] > 0 for t in together)
    assert batch_server.wait_idle()["veloxquant_block_pool_request_blocks_in_use"] == 0


def _uncached(usage: dict) -> dict:
    """``usage`` without ``prompt_tokens_details`` (what the prefix cache served)."""
    return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}
