"""Prompt scoring (completions ``echo`` with ``logprobs``) is a request like any other.

It is admitted against the pool and the queue bound, its KV is drawn from the
pool under its own owner, its chunks share each step's prefill budget and
time slice with everyone else's, and a client that leaves stops it at the
next chunk. Scored on the engine thread outside the scheduler, 20 concurrent
4,000-token scoring requests stalled a running stream for 57.5 s, and 150 of
them were all accepted while /health showed nothing running.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import threading
import time

import httpx
import pytest

from server.engine.engine import Engine
from server.metrics import ServerMetrics
from tests.support.servers import make_settings, run_server

NO_EOS = {"1": -100, "3": -100}  # the tiny model's end tokens
COMPLETIONS = "/v1/completions"


def _scoring_body(i: int, n_tokens: int) -> dict:
    # Distinct ids per request, all inside the tiny model's vocabulary.
    return {"prompt": [10 + (i * 131 + 7 * j) % 4000 for j in range(n_tokens)],
            "max_tokens": 0, "echo": True, "logprobs": 5}


def _stream_gaps(base: str, stop: threading.Event, gaps: list[float],
                 started: threading.Event) -> None:
    """Stream a long greedy completion, recording the time between its tokens."""
    body = {"prompt": "STREAM", "max_tokens": 4000, "stream": True, "temperature": 0,
            "logit_bias": NO_EOS}
    with httpx.Client(base_url=base, timeout=120) as client, \
            client.stream("POST", COMPLETIONS, json=body) as stream:
        last = None
        for line in stream.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.monotonic()
            if last is not None:
                gaps.append(now - last)
            last = now
            started.set()
            if stop.is_set():
                return


def test_scoring_requests_hold_pool_blocks_under_their_own_owner(tiny_model_path):
    seen: list[tuple[int, int]] = []  # (owner, blocks it held) before each scoring call
    engine_box: list[Engine] = []

    def record(state) -> None:  # before each model call of a row, on the engine thread
        if state.request.score is not None:
            seen.append((state.owner, engine_box[0].pool.n_blocks_held(state.owner)))

    settings = make_settings(model={"path": str(tiny_model_path)}, pool={"n_blocks": 2048},
                             batch={"prefill_chunk_size": 64})
    engine = Engine(settings, ServerMetrics(), fault_hook=record)
    engine_box.append(engine)
    with run_server(settings, engine) as server:
        answer = httpx.post(server.base_url + COMPLETIONS, json=_scoring_body(0, 300),
                            timeout=60)
        assert answer.status_code == 200, answer.text
        assert len(answer.json()["choices"][0]["logprobs"]["token_logprobs"]) == 300
        owners = {owner for owner, _ in seen}
        assert len(owners) == 1 and min(owners) >= 1
        assert len(seen) >= 300 // 64  # chunk after chunk, each a call of its own
        assert seen[-1][1] > seen[0][1]  # its KV grew in the pool, block by block
        idle = server.wait_idle()
        assert idle["veloxquant_block_pool_request_blocks_in_use"] == 0
        assert engine.pool.n_blocks_held(next(iter(owners))) == 0


def _post_and_stay(base: str, body: dict) -> socket.socket:
    """Send a POST over a raw socket and leave it open (closing it is the client leaving)."""
    host, port = base.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(f"POST {COMPLETIONS} HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                 f"application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
                 + payload)
    return sock


@pytest.mark.slow
def test_a_stream_keeps_flowing_while_20_long_prompts_are_scored(live_server):
    base = live_server.base_url
    stop, started = threading.Event(), threading.Event()
    gaps: list[float] = []
    streamer = threading.Thread(target=_stream_gaps, args=(base, stop, gaps, started))
    streamer.start()
    assert started.wait(60)
    sockets = []
    try:
        sockets = [_post_and_stay(base, _scoring_body(i, 4000)) for i in range(20)]
        deadline = time.monotonic() + 8.0  # a bounded window of scoring beside the stream
        busy = False
        while time.monotonic() < deadline:
            running, waiting = live_server.engine.queue_depths()
            busy = busy or running + waiting > 1  # the scoring requests are requests
            time.sleep(0.2)
        during = list(gaps)
    finally:
        for sock in sockets:  # the clients leave: their scoring stops at the next chunk
            sock.close()
        stop.set()
        streamer.join(60)
    assert busy
    assert len(during) >= 10
    # The default slice lets a step prefill about 1 s; its decode and the events come on
    # top. Scored outside the scheduler, the stream stopped for the whole window.
    assert max(during) <= 2.0, f"largest gap between a stream's tokens {max(during):.2f} s"
    idle = live_server.wait_idle(timeout=30)  # scoring all of them would take minutes
    assert idle["veloxquant_block_pool_request_blocks_in_use"] == 0
    assert idle["veloxquant_requests_running"] == 0


@pytest.mark.slow
def test_a_flood_of_scoring_requests_meets_the_queue_bound(tiny_model_path):
    settings = make_settings(model={"path": str(tiny_model_path)}, pool={"n_blocks": 2048},
                             batch={"max_batch_size": 2}, limits={"max_queue": 3})
    with run_server(settings) as server, \
            concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(httpx.post, server.base_url + COMPLETIONS,
                               json=_scoring_body(i, 1500), timeout=120) for i in range(16)]
        codes = sorted(f.result().status_code for f in futures)
        assert codes.count(429) >= 8, codes  # 2 run, 3 wait, the rest are turned away
        assert set(codes) <= {200, 429} and codes.count(200) >= 2
        refused = next(f.result() for f in futures if f.result().status_code == 429)
        assert refused.json()["error"]["code"] == "queue_full"
        assert server.wait_idle()["veloxquant_block_pool_request_blocks_in_use"] == 0
