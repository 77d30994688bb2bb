"""Prefix caching on a live server: hits, same output, eviction, cancels, accounting.

A real uvicorn server with the offline tiny model, driven by the official
``openai`` client and httpx. Prompts are token ids so block boundaries
(16 tokens) are exact.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.engine.engine import Engine
from server.metrics import ServerMetrics
from tests.support.servers import ADMIN_TOKEN, LiveServer, make_settings, run_server
from veloxquant_mlx.memory.prefix_cache import CACHED

BS = 16
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
LOGPROB_TOL = 1e-3  # the grouped-prefill tolerance (README, "Continuous batching")


def settings_for(tiny_model_path, env=None, **sections):
    return make_settings(env={"VELOXQUANT_ADMIN_TOKEN": ADMIN_TOKEN, **(env or {})},
                         model={"path": str(tiny_model_path)}, **sections)


@pytest.fixture(scope="module")
def server(tiny_model_path):
    settings = settings_for(tiny_model_path, pool={"n_blocks": 4096},
                            batch={"prefill_chunk_size": 32, "max_prefill_tokens_per_step": 64})
    with run_server(settings) as live:
        yield live


def client_of(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url + "/v1", api_key="unused", max_retries=0)


def complete(live: LiveServer, prompt, **kw):
    c = client_of(live)
    model = c.models.list().data[0].id
    args = {"max_tokens": 6, "temperature": 0.0, "logprobs": 1} | kw
    return c.completions.create(model=model, prompt=prompt, **args)


def cached_tokens(out) -> int:
    return out.usage.prompt_tokens_details.cached_tokens


def reset(live: LiveServer) -> int:
    r = httpx.post(live.base_url + "/admin/cache/reset", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["evicted"]


def assert_same_output(a, b) -> None:
    ca, cb = a.choices[0], b.choices[0]
    assert ca.logprobs.tokens == cb.logprobs.tokens and ca.text == cb.text
    for x, y in zip(ca.logprobs.token_logprobs, cb.logprobs.token_logprobs, strict=True):
        assert abs(x - y) <= LOGPROB_TOL


def assert_accounted(live: LiveServer) -> None:
    """Idle: every block is free or cached; nothing references a cached block."""
    m = live.wait_idle()
    assert m["veloxquant_block_pool_request_blocks_in_use"] == 0
    assert m["veloxquant_orphaned_blocks"] == 0
    pool, cache = live.engine.pool, live.engine.prefix_cache
    assert pool.blocks_held_by_owner() == {} and pool.active_owners() == []
    assert all(e.refs == 0 for e in cache.entries()) and cache.holders() == {}
    assert all(b.owner == CACHED for e in cache.entries() for b in e.blocks)
    assert sum(len(e.blocks) for e in cache.entries()) == cache.cached_blocks
    assert cache.cached_blocks == cache.evictable_blocks
    assert m["veloxquant_block_pool_cached_blocks"] == cache.cached_blocks
    free = sum(pool.n_free(s) for s in pool.config.streams)
    assert free + cache.cached_blocks == pool.stats.n_blocks


def test_repeated_prompt_hits_and_gives_the_cold_output(server):
    reset(server)
    prompt = [5 + (i * 7) % 90 for i in range(70)]
    cold = complete(server, prompt)
    warm = complete(server, prompt)
    assert cached_tokens(cold) == 0
    assert cached_tokens(warm) == 64  # 4 full blocks; the 6-token tail is computed
    assert_same_output(cold, warm)
    assert_accounted(server)


def test_prompt_of_whole_blocks_recomputes_its_last_block(server):
    reset(server)
    prompt = [7 + i % 50 for i in range(48)]
    cold = complete(server, prompt)
    warm = complete(server, prompt)
    assert cached_tokens(warm) == 32  # the last token's logits need its block computed
    assert_same_output(cold, warm)


def test_shared_prefix_is_a_partial_hit(server):
    reset(server)
    system = [11 + i % 80 for i in range(40)]  # 2 full blocks and 8 tokens
    first = complete(server, system + [3, 4, 5, 6, 7, 8, 9, 10, 12])
    assert cached_tokens(first) == 0
    other = system + [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]
    hit = complete(server, other)
    assert cached_tokens(hit) == 32  # the blocks both prompts fill identically
    reset(server)
    assert_same_output(complete(server, other), hit)
    assert_accounted(server)


def test_seeded_sampling_is_the_same_from_cache(server):
    reset(server)
    prompt = [9 + i % 77 for i in range(60)]
    kw = {"temperature": 0.9, "seed": 1234, "max_tokens": 8}
    cold = complete(server, prompt, **kw)
    warm = complete(server, prompt, **kw)
    assert cached_tokens(warm) == 48
    assert cold.choices[0].text == warm.choices[0].text


def test_chat_usage_reports_cached_tokens_streamed_and_not(server):
    reset(server)
    c = client_of(server)
    model = c.models.list().data[0].id
    messages = [{"role": "system", "content": "You are terse. " * 20},
                {"role": "user", "content": "hello there"}]
    first = c.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                      temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = c.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                       temperature=0)
    expected = (first.usage.prompt_tokens - 1) // BS * BS
    assert second.usage.prompt_tokens_details.cached_tokens == expected > 0
    chunks = list(c.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == expected
    assert second.choices[0].message.content == first.choices[0].message.content


def test_the_pool_families_are_the_pools_own_stats_with_a_warm_cache(server):
    """``blocks_in_use == allocations - frees`` on /metrics and /admin/pool with cached
    blocks held, and the pool families are ``AllocationStats.to_prometheus()``'s lines."""
    prompt = [31 + i % 50 for i in range(40)]
    complete(server, prompt)
    complete(server, prompt)
    m = server.wait_idle()
    cached = m["veloxquant_block_pool_cached_blocks"]
    assert cached > 0 and m["veloxquant_block_pool_request_blocks_in_use"] == 0
    assert m["veloxquant_block_pool_blocks_in_use"] == cached == (
        m["veloxquant_block_pool_allocations_total"] - m["veloxquant_block_pool_frees_total"])
    stats = httpx.get(server.base_url + "/admin/pool", headers=ADMIN).json()["stats"]
    assert stats["blocks_in_use"] == stats["n_allocations"] - stats["n_frees"] == cached
    assert stats["request_blocks_in_use"] == 0
    # Idle, so nothing moves between the two reads.
    page = httpx.get(server.base_url + "/metrics").text
    own = server.engine.pool.stats.snapshot().to_prometheus()
    want = [(s.name, s.value) for f in text_string_to_metric_families(own) for s in f.samples]
    names = {name for name, _ in want}
    got = [(s.name, s.value) for f in text_string_to_metric_families(page) for s in f.samples
           if s.name in names]
    assert len(want) == 10 and got == want


def test_metrics_admin_pool_and_reset(server):
    reset(server)
    before = server.metrics()
    prompt = [21 + i % 60 for i in range(50)]
    complete(server, prompt)
    complete(server, prompt)
    m = server.wait_idle()
    assert m["veloxquant_block_pool_cached_blocks"] > 0
    assert m["veloxquant_block_pool_evictable_blocks"] == m["veloxquant_block_pool_cached_blocks"]
    assert m["veloxquant_block_pool_request_blocks_in_use"] == 0
    hit = m["veloxquant_prefix_cache_hit_tokens_total"] - before[
        "veloxquant_prefix_cache_hit_tokens_total"]
    query = m["veloxquant_prefix_cache_query_tokens_total"] - before[
        "veloxquant_prefix_cache_query_tokens_total"]
    assert (hit, query) == (48, 100)
    view = httpx.get(server.base_url + "/admin/pool", headers=ADMIN).json()
    assert view["prefix_cache"]["enabled"] is True
    assert view["prefix_cache"]["cached_blocks"] == m["veloxquant_block_pool_cached_blocks"]
    assert view["stats"]["request_blocks_in_use"] == 0 and view["kv_bytes_in_use"] == 0
    assert all(o["owner"] != CACHED for o in view["owners"])
    cached = int(m["veloxquant_block_pool_cached_blocks"])
    assert reset(server) == cached
    after = server.metrics()
    assert after["veloxquant_block_pool_cached_blocks"] == 0
    assert (after["veloxquant_block_pool_evictions_total"]
            - m["veloxquant_block_pool_evictions_total"]) == cached
    assert httpx.post(server.base_url + "/admin/cache/reset").status_code in (401, 403)


def test_cancel_mid_prefill_of_a_sharing_request_leaves_refs_right(tiny_model_path):
    """A request that shares cached blocks is cancelled between two prefill chunks."""
    settings = settings_for(tiny_model_path, pool={"n_blocks": 2048},
                            batch={"prefill_chunk_size": 16, "max_prefill_tokens_per_step": 16})
    victim = [3 + i % 40 for i in range(64)] + [90 + i % 5 for i in range(80)]
    seen: list[int] = []

    def hook(state):
        if state.prompt_ids == victim:
            seen.append(state.cached_tokens)
            refs = [e.refs for e in state.prefix.entries]
            assert refs and all(r >= 1 for r in refs)
            state.request.cancelled.set()  # the client went away mid-prefill

    engine = Engine(settings, ServerMetrics(), fault_hook=hook)
    with run_server(settings, engine) as live:
        complete(live, victim[:64] + [1, 2])  # caches the shared 64-token head
        c = client_of(live)
        model = c.models.list().data[0].id
        chunks = []
        with contextlib.suppress(openai.APIError):
            chunks = list(c.completions.create(model=model, prompt=victim, max_tokens=4,
                                               stream=True))
        assert not any(ch.choices and ch.choices[0].text for ch in chunks)  # no token came
        assert seen == [64]  # one prefill chunk ran, then the cancel took it out
        assert live.metrics()["veloxquant_request_finished_total{reason=cancelled}"] == 1
        assert_accounted(live)
        assert complete(live, victim[:64] + [1, 2]).usage.prompt_tokens_details.cached_tokens == 64


@pytest.mark.slow
def test_eviction_under_pressure_spares_referenced_blocks(tiny_model_path):
    """A pool of ~4 requests: cached blocks are evicted to admit new ones, never shared ones."""
    settings = settings_for(tiny_model_path, pool={"n_blocks": 256},
                            limits={"max_tokens_cap": 64, "default_max_tokens": 16,
                                    "max_prompt_tokens": 200})
    with run_server(settings) as live:
        prompts = [[(k * 13 + i) % 97 + 2 for i in range(120)] for k in range(6)]
        for p in prompts:  # each leaves 7 positions x 4 layers per stream cached: 168 > 128
            assert complete(live, p, max_tokens=8).choices[0].finish_reason == "length"
        m = live.wait_idle()
        assert m["veloxquant_block_pool_evictions_total"] > 0
        assert_accounted(live)
        # The last prompt's blocks are shared by a long request while three others
        # press on the pool (they must evict to fit): its output is the cold one.
        results: dict[int, object] = {}

        def run(k, p, n):
            results[k] = complete(live, p, max_tokens=n)

        others = [[(k * 31 + i) % 89 + 2 for i in range(120)] for k in range(3)]
        threads = [threading.Thread(target=run, args=(0, prompts[-1], 40))]
        threads += [threading.Thread(target=run, args=(k + 1, p, 8))
                    for k, p in enumerate(others)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert sorted(results) == [0, 1, 2, 3]
        assert cached_tokens(results[0]) == 112
        assert_accounted(live)
        reset(live)
        assert_same_output(complete(live, prompts[-1], max_tokens=40), results[0])


def test_random_mix_of_requests_and_cancels_leaves_every_block_accounted(server):
    rng = random.Random(7)
    head = [40 + i % 30 for i in range(48)]
    prompts = [head + [rng.randrange(2, 90) for _ in range(rng.randrange(1, 40))]
               for _ in range(10)]

    def one(i: int) -> None:
        p = prompts[i % len(prompts)]
        try:
            if i % 3 == 0:  # a client that leaves after its first tokens
                with httpx.stream("POST", server.base_url + "/v1/completions", timeout=60,
                                  json={"prompt": p, "max_tokens": 50, "stream": True,
                                        "model": "x"}) as r:
                    for _ in zip(range(2), r.iter_lines(), strict=False):
                        pass
            else:
                complete(server, p, max_tokens=rng.randrange(1, 8))
        except (openai.APIError, httpx.HTTPError):
            pass

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
        time.sleep(0.01)
    for t in threads:
        t.join(120)
    assert_accounted(server)
    assert server.engine.prefix_cache.counters.hit_tokens > 0


def test_caching_off_by_env(tiny_model_path):
    settings = settings_for(tiny_model_path, env={"VELOXQUANT_CACHE_PREFIX_CACHING": "false"},
                            pool={"n_blocks": 1024})
    assert settings.cache.prefix_caching is False
    with run_server(settings) as live:
        prompt = [5 + i % 60 for i in range(40)]
        complete(live, prompt)
        assert cached_tokens(complete(live, prompt)) == 0
        m = live.wait_idle()
        assert m["veloxquant_block_pool_cached_blocks"] == 0
        assert m["veloxquant_prefix_cache_query_tokens_total"] == 0
        assert live.engine.pool.prefix_cache.cached_blocks == 0
        assert live.engine.prefix_cache is None
        assert reset(live) == 0


@contextlib.contextmanager
def warm_small_pool(tiny_model_path):
    """A 1024-block server whose cache holds one 100-token prompt; yields (server, metrics)."""
    settings = settings_for(tiny_model_path, pool={"n_blocks": 1024},
                            limits={"max_tokens_cap": 64, "default_max_tokens": 16,
                                    "max_prompt_tokens": 256})
    with run_server(settings) as live:
        complete(live, [4 + i % 70 for i in range(100)])
        yield live, live.wait_idle()


def shrink(live, target_free: int, force: bool = False) -> dict:
    r = httpx.post(live.base_url + "/admin/shrink", headers=ADMIN,
                   json={"stream": "kv", "target_free": target_free, "force": force})
    assert r.status_code == 200, r.text
    return r.json()


def test_shrink_counts_cached_blocks_as_free_and_keeps_them_when_it_can(tiny_model_path):
    with warm_small_pool(tiny_model_path) as (live, m):
        cached = int(m["veloxquant_block_pool_cached_blocks"])
        assert cached == 6 * 4 * 2  # 6 full prompt positions x 4 layers x (k, v)
        # Each stream has 512 - 24 free and 24 cached: 312 retire from the free ones alone.
        out = shrink(live, 200)
        assert out["retired"] == 2 * 312
        assert out["kept_free"] == {"k": 200, "v": 200}  # 176 free + 24 cached each
        after = live.metrics()
        assert after["veloxquant_block_pool_cached_blocks"] == cached  # still warm
        assert after["veloxquant_block_pool_evictions_total"] == 0
        assert after["veloxquant_block_pool_blocks_total"] == 400
        # A shrink that retires nothing changes nothing, /health included.
        health = httpx.get(live.base_url + "/health").json()["status"]
        assert shrink(live, 10**6)["retired"] == 0
        assert live.metrics()["veloxquant_block_pool_cached_blocks"] == cached
        assert httpx.get(live.base_url + "/health").json()["status"] == health
        assert_accounted(live)


def test_shrink_evicts_only_the_cached_blocks_it_must(tiny_model_path):
    with warm_small_pool(tiny_model_path) as (live, m):
        # 10 free per stream asked: 488 free cover 478 retirements; the 24 cached blocks
        # would have to give 14, and eviction frees whole prompt positions (4 a stream).
        out = shrink(live, 10, force=True)
        assert out["retired"] == 2 * (488 + 24 - 10)
        assert out["kept_free"] == {"k": 10, "v": 10}
        after = live.metrics()
        assert after["veloxquant_block_pool_evictions_total"] == 2 * 16
        assert after["veloxquant_block_pool_cached_blocks"] == 2 * 8
        assert_accounted(live)


def test_a_refused_shrink_leaves_the_cache_as_it_was(tiny_model_path):
    with warm_small_pool(tiny_model_path) as (live, before):
        r = httpx.post(live.base_url + "/admin/shrink", headers=ADMIN,
                       json={"stream": "kv", "target_free": 0})  # below one maximal request
        assert r.status_code == 409, r.text
        after = live.metrics()
        for name in ("cached_blocks", "evictions_total", "blocks_total"):
            key = f"veloxquant_block_pool_{name}"
            assert after[key] == before[key], key
        assert after["veloxquant_block_pool_cached_blocks"] == 6 * 4 * 2
        assert_accounted(live)


def test_output_blocks_are_cached_and_reused(tiny_model_path):
    """A finished request's generated tokens, in full blocks, serve the next turn's prompt."""
    settings = settings_for(tiny_model_path, pool={"n_blocks": 2048})
    fed: dict[int, list[int]] = {}

    def hook(state):  # before each model call: what the row has fed so far
        for row in live.engine.runner.rows:
            if row.owner == state.owner and row.fed is not None:
                fed[state.owner] = list(row.fed)

    engine = Engine(settings, ServerMetrics(), fault_hook=hook)
    with run_server(settings, engine) as live:
        prompt = [6 + i % 50 for i in range(40)]
        first = complete(live, prompt, max_tokens=30, logit_bias={"1": -100, "3": -100})
        assert first.usage.completion_tokens == 30
        live.wait_idle()
        # 40 prompt + 30 fed tokens: 4 full blocks (the prompt had 2).
        assert len(live.engine.prefix_cache.entries()) == 4
        (generated,) = fed.values()  # 29 seen before the last call fed the 30th
        assert len(generated) == 29
        follow_up = prompt + generated + [7, 8, 9]
        warm = complete(live, follow_up)
        assert cached_tokens(warm) == 64  # prompt blocks and the output blocks
        reset(live)
        assert_same_output(complete(live, follow_up), warm)
        assert_accounted(live)


def test_a_salted_short_prompts_output_blocks_stay_under_its_salt(tiny_model_path):
    """A prompt shorter than a block has no keys of its own; the blocks its answer fills
    chain from its salted root all the same, so no other namespace ever matches them."""
    settings = settings_for(tiny_model_path, pool={"n_blocks": 2048})
    fed: dict[int, list[int]] = {}

    def hook(state):
        for row in live.engine.runner.rows:
            if row.owner == state.owner and row.fed is not None:
                fed[state.owner] = list(row.fed)

    engine = Engine(settings, ServerMetrics(), fault_hook=hook)
    with run_server(settings, engine) as live:
        prompt = [6, 9, 12, 15, 18]
        salted = {"extra_body": {"cache_salt": "tenant-a"}}
        first = complete(live, prompt, max_tokens=30, logit_bias={"1": -100, "3": -100},
                         **salted)
        assert first.usage.completion_tokens == 30
        live.wait_idle()
        assert len(live.engine.prefix_cache.entries()) == 2  # 5 + 29 fed: 2 full blocks
        (generated,) = fed.values()
        follow_up = prompt + generated + [7, 8]
        assert cached_tokens(complete(live, follow_up)) == 0  # no salt: another namespace
        other = {"extra_body": {"cache_salt": "tenant-b"}}
        assert cached_tokens(complete(live, follow_up, **other)) == 0
        assert cached_tokens(complete(live, follow_up, **salted)) == 32
        assert_accounted(live)


def test_keys_root_names_model_and_kv_format():
    """Two arenas that differ in model, dtype or KV format never share a key."""
    import mlx.core as mx

    from server.engine.kv_memory import cache_root

    def arena(tag, dtype=mx.float32):
        layout = SimpleNamespace(dtype=dtype, n_layers=4, n_kv_heads=2, head_dim=32,
                                 format_tag=tag)
        return SimpleNamespace(layout=layout, block_size=BS)

    roots = {cache_root("tiny", arena("fp32")), cache_root("tiny", arena("q8g64")),
             cache_root("tiny", arena("q4g64")), cache_root("other", arena("fp32")),
             cache_root("tiny", arena("bf16", mx.bfloat16))}
    assert len(roots) == 5
    assert cache_root("tiny", arena("fp32")) == cache_root("tiny", arena("fp32"))
