"""A served request's KV is the seed's PoolBackedKVCache, owned by the request.

On the live server (real uvicorn, tiny model), while two streaming requests
decode, every row the engine holds has one ``PoolBackedKVCache`` per layer
over the pool's block storage, owned by that request's owner id (the
scheduler's id for it), holding exactly its tokens' blocks, and its row refers to
the scheduler's record for its prompt and settings. When the
requests end their caches are released, their owners are retired on the
pool, and the pool is back at its idle figures.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from veloxquant_mlx.memory import PoolBackedKVCache

pytestmark = pytest.mark.slow

NO_EOS = {"1": -100, "3": -100}  # the tiny model's EOS ids: the answers run to max_tokens


def _engine_view(engine, references: dict | None = None):
    """(owner -> (request id, caches), requests running), read on the engine thread.

    ``references`` gets, per owner, whether the runner's row refers to the scheduler's
    record (its prompt ids and settings are the record's objects, not copies).
    """
    def look():
        live = engine.scheduler.live_requests()
        rows = engine.runner.held_rows()
        if references is not None:
            for r in rows:
                state = engine.scheduler.running.get(r.owner)
                references[r.owner] = state is not None and (
                    r.prompt_ids is state.prompt_ids and r.params is state.request.params)
        return {r.owner: (live.get(r.owner), r.kv) for r in rows}
    return engine.run_on_engine(look).result(timeout=30)


def test_a_served_requests_kv_is_its_pool_backed_caches_and_its_end_releases_them(live_server):
    engine, pool = live_server.engine, live_server.engine.pool
    idle_in_use = pool.stats.blocks_in_use()
    results: list[int] = []

    def stream(i: int) -> None:
        body = {"model": "tiny", "prompt": f"request {i}: " * 20, "max_tokens": 400,
                "logit_bias": NO_EOS, "stream": True, "temperature": 0}
        with httpx.stream("POST", f"{live_server.base_url}/v1/completions", json=body,
                          timeout=120) as r:
            results.append(r.status_code)
            for _ in r.iter_lines():
                pass

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    seen: dict = {}
    references: dict = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(t.is_alive() for t in threads):
        # until both decode (each holds blocks)
        references.clear()
        seen = _engine_view(engine, references)
        if len(seen) == 2 and all(caches and caches[0].size() > 0
                                  for _, caches in seen.values()):
            break
        time.sleep(0.02)
    assert len(seen) == 2, seen
    assert references == dict.fromkeys(seen, True)  # the runner refers to the records
    layers = len(engine.runner.model.layers)
    kept = []
    for owner, (request_id, caches) in seen.items():
        assert request_id is not None and request_id.startswith("cmpl-")
        assert len(caches) == layers
        assert all(type(c) is PoolBackedKVCache and c.owner == owner for c in caches)
        assert all(c.blocks is caches[0].blocks for c in caches)  # one table, every layer
        assert caches[0].blocks.storage is engine.runner.arena
        # Its own blocks plus any cached prefix blocks its table starts on.
        own = {b.block_id for b in pool.blocks_for(owner)}
        table = {b.block_id for stream in caches[0].blocks.row.blocks for b in stream}
        assert own and own <= table
        kept.append(caches)
    for t in threads:
        t.join(120)
    assert results == [200, 200]
    for caches in kept:
        assert all(c.released for c in caches)
        assert caches[0].owner not in pool.active_owners()
        assert pool.n_blocks_held(caches[0].owner) == 0
    # Idle again: no request holds a block (cached prompt blocks may stay in the pool).
    held = engine.run_on_engine(engine.runner.held_rows).result(timeout=30)
    assert held == [] and engine.scheduler.live_requests() == {}
    stats = pool.stats
    assert stats.n_allocations - stats.n_frees == stats.blocks_in_use() >= idle_in_use
