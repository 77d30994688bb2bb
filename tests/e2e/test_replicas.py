"""Replicas behind nginx: ``scripts/run_replicas.sh`` with ``config/nginx-replicas.conf``.

Two replicas of the tiny model and the balancer, all real processes on loopback ports.
200 requests at concurrency 16 go through the balancer and one replica gets SIGTERM
mid-run: no client sees a 5xx (its in-flight requests, a long stream among them, finish
through the drain; nginx retries the 503 it answers new ones on the other replica),
every request is generated exactly once, the surviving replica's pool ends idle with no
orphaned block, and the stopped replica exits 0. Then the last replica drains too: the
balancer passes its 503 and Retry-After through, and the script exits 0 once no replica
is left. A second test stops the script as a terminal's Ctrl-C would. The tests that run
nginx are skipped where it is not installed (``apt-get install nginx-light``); the checks
of ``config/prometheus.yml``, the dashboard's replica selector and docs/operations.md's compose
example always run.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.servers import make_settings

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark_scripts"))
from replica_set import Replica, ReplicaSet  # noqa: E402

CONFIG = ROOT / "config" / "nginx-replicas.conf"
PROMETHEUS = ROOT / "config" / "prometheus.yml"
DASHBOARD = ROOT / "config" / "grafana-dashboard.json"
NGINX = shutil.which("nginx") or next(
    (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).exists()), None)
needs_nginx = pytest.mark.skipif(NGINX is None or shutil.which("curl") is None,
                                 reason="nginx (or curl) is not installed")

N_REQUESTS, CONCURRENCY, MAX_TOKENS = 200, 16, 8
SIGTERM_AFTER = 60          # answers received before replica 1 gets SIGTERM
LOAD_TIMEOUT_S = 90         # the whole load phase; it takes ~6 s here
NO_EOS = {"1": -100, "3": -100}  # the tiny model's EOS ids: every request runs to max_tokens


@dataclass(slots=True)
class Outcome:
    """One client request as the client saw it."""

    status: int
    tokens: int = 0
    complete: bool = False   # JSON with choices, or a stream ending in [DONE] with no error frame
    detail: str = ""


async def one_request(client: httpx.AsyncClient, i: int) -> Outcome:
    """A completion through the balancer: every other one streamed."""
    body = {"prompt": f"request {i}", "max_tokens": MAX_TOKENS, "temperature": 0,
            "logit_bias": NO_EOS}
    if i % 2:
        resp = await client.post("/v1/completions", json=body)
        if resp.status_code != 200:
            return Outcome(resp.status_code, detail=resp.text[:200])
        data = resp.json()
        return Outcome(200, data["usage"]["completion_tokens"], bool(data["choices"]))
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return Outcome(resp.status_code, detail=resp.text[:200])
        frames = [line[6:] async for line in resp.aiter_lines() if line.startswith("data: ")]
    chunks = [json.loads(f) for f in frames[:-1]]
    errors = [c for c in chunks if "error" in c]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    return Outcome(200, usage[-1]["completion_tokens"] if usage else 0,
                   frames[-1:] == ["[DONE]"] and not errors, str(errors)[:200])


async def run_load(base_url: str, midway) -> list[Outcome]:
    """N_REQUESTS at CONCURRENCY; ``await midway()`` once SIGTERM_AFTER answers are in."""
    results: list[Outcome] = []
    next_index = 0
    async with httpx.AsyncClient(base_url=base_url, timeout=60,
                                 limits=httpx.Limits(max_connections=CONCURRENCY + 4)) as client:
        async def worker() -> None:
            nonlocal next_index
            while next_index < N_REQUESTS:
                i = next_index
                next_index += 1
                try:
                    results.append(await one_request(client, i))
                except httpx.HTTPError as exc:
                    results.append(Outcome(0, detail=f"{type(exc).__name__}: {exc}"))
                if len(results) == SIGTERM_AFTER:
                    await midway()

        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(CONCURRENCY))),
                               LOAD_TIMEOUT_S)
    return results


def scrape(url: str) -> dict[str, float]:
    """A replica's /metrics (on its own port): samples labelled at most with the model's
    name, by name."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.name: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.labels.keys() <= {"model_name"}}


def wait_idle(url: str, timeout: float = 15.0) -> dict[str, float]:
    """Metrics once nothing runs, waits or holds a block (or the last ones at the deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        busy = (m["veloxquant_block_pool_request_blocks_in_use"] + m["veloxquant_requests_running"]
                + m["veloxquant_requests_waiting"])
        if busy == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def served(log: Path) -> list[dict]:
    """The request-end lines with status 200 in a replica's log."""
    lines = [json.loads(x) for x in log.read_text().splitlines()
             if x.startswith("{") and '"request_end"' in x]
    return [x for x in lines if x["status"] == 200]


@dataclass(slots=True)
class Stream:
    """A long greedy stream read on a thread, started before the caller goes on."""

    thread: threading.Thread
    frames: list[str]            # the data frames so far ("[DONE]" last when complete)
    status: list[int]            # the HTTP status, once answered

    def finish(self, timeout: float = 60) -> list[str]:
        """Wait for the end; the frames, asserted complete."""
        self.thread.join(timeout)
        assert self.frames[-1:] == ["[DONE]"] and '"error"' not in self.frames[-2], \
            (self.status, self.frames[-3:])
        return self.frames


def start_stream(url: str, max_tokens: int) -> Stream:
    """POST a stream to ``url`` on a thread; return once its first frame has arrived."""
    stream = Stream(threading.Thread(), [], [])
    started = threading.Event()
    body = {"prompt": "x", "max_tokens": max_tokens, "stream": True, "logit_bias": NO_EOS}

    def read() -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
                stream.status.append(resp.status_code)
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        stream.frames.append(line[6:])
                        started.set()
                    elif line:
                        stream.frames.append(line)
        finally:
            started.set()

    stream.thread = threading.Thread(target=read, daemon=True)
    stream.thread.start()
    started.wait(30)
    assert stream.status == [200] and stream.frames, (stream.status, stream.frames[:3])
    return stream


def running(url: str) -> float:
    """Requests generating on a replica now (its own /metrics)."""
    return scrape(url)["veloxquant_requests_running"]


@needs_nginx
@pytest.mark.slow
def test_the_shipped_config_passes_nginx_t(tmp_path):
    out = subprocess.run([NGINX, "-t", "-q", "-c", str(CONFIG), "-p", str(tmp_path), "-g",
                          f"pid {tmp_path}/nginx.pid; error_log {tmp_path}/error.log;"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr


@pytest.mark.slow
def test_config_agrees_with_the_server_settings():
    """nginx closes idle upstream connections before the server does; same body cap."""
    text = CONFIG.read_text()
    upstream = text[text.index("upstream veloxquant_replicas"):]
    upstream = upstream[:upstream.index("\n    }")]
    nginx_idle_s = float(re.search(r"keepalive_timeout (\d+)s;", upstream)[1])
    limits, server = make_settings().limits, make_settings().server
    assert nginx_idle_s < server.keep_alive_timeout_s
    assert f"client_max_body_size {limits.max_body_bytes // 2**20}m;" in text
    assert "proxy_next_upstream error timeout http_503 non_idempotent;" in text


def check_public_port(lb: str, replica: str) -> None:
    """The balancer serves the API and /health only; admin and metrics stay on each replica."""
    assert httpx.get(lb + "/health", timeout=10).json()["status"] == "ok"
    for path in ("/admin/pool", "/metrics", "/%61dmin/pool", "/v1/../admin/pool", "/docs"):
        resp = httpx.get(lb + path, timeout=10)
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found", path
    assert httpx.get(replica + "/metrics", timeout=10).status_code == 200


def long_stream_on(lb: str, replica: str) -> list[Stream]:
    """Long streams through the balancer until one runs on ``replica`` (a few at most).

    least_conn sends the next stream to the replica without one, so two tries suffice
    unless both tie. Such a stream is certainly in flight when the replica gets SIGTERM
    (short requests end in batches: one may just have emptied it), must finish through the
    drain, and keeps the replica draining while the load goes on, so nginx meets its 503s.
    """
    streams: list[Stream] = []
    while running(replica) == 0 and len(streams) < 6:
        streams.append(start_stream(lb, 1000))
    assert running(replica) >= 1, "no long stream landed on the replica"
    return streams


def check_last_replica_drains(rs: ReplicaSet, lb: str, last: Replica) -> None:
    """The last replica drains: its 503 and Retry-After reach the client; the script ends."""
    stream = start_stream(lb, 1000)
    os.kill(last.pid, signal.SIGTERM)
    time.sleep(0.3)  # the signal is handled between event-loop ticks
    refused = httpx.post(lb + "/v1/completions", json={"prompt": "late", "max_tokens": 2},
                         timeout=10)
    stream.finish()
    assert refused.status_code == 503, refused.text
    assert refused.headers["Retry-After"] == "1"
    assert refused.json()["error"]["code"] in ("shutting_down", "unavailable")
    rs.wait_for_line(rf"replica {last.index} \(pid {last.pid}\) exited with status 0", 40)
    rs.wait_for_line("no replica left", 10)
    assert rs.proc.wait(30) == 0


@needs_nginx
@pytest.mark.slow
def test_sigterm_on_one_replica_mid_load_costs_no_client_a_5xx(tiny_model_path, tmp_path):
    t0 = time.monotonic()
    nginx_log = tmp_path / "nginx-error.log"
    # A grace well past the long streams' time on a loaded 2-core machine.
    with ReplicaSet(2, tmp_path, model=str(tiny_model_path),
                    env={"VELOXQUANT_SERVER_SHUTDOWN_GRACE_S": "120"}) as rs:
        first, second = rs.replicas
        lb = rs.balancer_url
        check_public_port(lb, second.url)
        started_s = time.monotonic() - t0
        long_streams = long_stream_on(lb, first.url)
        sigterm_at: list[float] = []

        async def stop_first() -> None:
            sigterm_at.append(time.time())
            os.kill(first.pid, signal.SIGTERM)

        t_load = time.monotonic()
        results = asyncio.run(run_load(lb, stop_first))
        load_s = time.monotonic() - t_load
        bad = [r for r in results if r.status != 200 or not r.complete]
        assert len(results) == N_REQUESTS and not bad, (bad[:5], nginx_log.read_text())
        assert all(r.tokens == MAX_TOKENS for r in results)
        for stream in long_streams:
            stream.finish()
        rs.wait_for_line(rf"replica 1 \(pid {first.pid}\) exited with status 0", 40)
        assert "drained; exiting" in first.log.read_text()

        idle = wait_idle(second.url)
        assert idle["veloxquant_block_pool_request_blocks_in_use"] == 0
        assert idle["veloxquant_orphaned_blocks"] == 0
        assert idle["veloxquant_requests_running"] == idle["veloxquant_requests_waiting"] == 0
        by_first, by_second = served(first.log), served(second.log)
        # Each request generated once: nginx retried only refusals, which ran nothing.
        assert len(by_first) + len(by_second) == N_REQUESTS + len(long_streams)
        drained = [x for x in by_first if x["ts"] >= sigterm_at[0]]
        after = [x for x in by_second if x["ts"] >= sigterm_at[0]]
        assert any(x["completion_tokens"] == 1000 for x in drained), drained
        # Requests sent after the SIGTERM all went to replica 2 (at most CONCURRENCY were
        # in flight then, some of them on replica 1).
        assert len(after) >= N_REQUESTS - SIGTERM_AFTER - CONCURRENCY
        # nginx met the draining replica's 503 and took it out (and retried the request).
        log = nginx_log.read_text()
        assert "temporarily disabled while reading response header" in log, log
        check_last_replica_drains(rs, lb, second)
    short_drained = sum(x["completion_tokens"] == MAX_TOKENS for x in drained)
    print(f"\nreplicas: start {started_s:.1f}s, load {load_s:.1f}s; replica 1 served "
          f"{len(by_first)} ({len(drained)} finished in its drain, {short_drained} of them "
          f"short), replica 2 {len(by_second)} ({len(after)} after the SIGTERM); "
          f"{len(long_streams)} long stream(s); nginx took a replica out "
          f"{log.count('temporarily disabled')} time(s), {log.count('Connection refused')} "
          f"connection(s) refused; total {time.monotonic() - t0:.1f}s")


SYSTEM = "You answer questions about the weather in short sentences. " * 12  # ~9 blocks


@needs_nginx
@pytest.mark.slow
def test_a_session_sticks_to_one_replica_and_reuses_its_cache(tiny_model_path, tmp_path):
    """X-Session-Id: every turn of a conversation on one replica, each turn a cache hit."""
    with ReplicaSet(2, tmp_path, model=str(tiny_model_path)) as rs:
        lb, logs = rs.balancer_url, [r.log for r in rs.replicas]
        homes = set()
        # nginx hashes the session id over the replicas' addresses (free ports, new each
        # run): five sessions all land on one of two replicas 1 run in 16, so sessions go
        # on (16 at most: 1 in 32,768) until both replicas have one.
        for n, session in enumerate(f"session-{i}" for i in range(16)):
            if n >= 5 and homes == {0, 1}:
                break
            messages = [{"role": "system", "content": SYSTEM}]
            before = [len(served(log)) for log in logs]
            for turn in range(3):
                messages.append({"role": "user", "content": f"{session} turn {turn}?"})
                resp = httpx.post(lb + "/v1/chat/completions", timeout=30,
                                  headers={"X-Session-Id": session},
                                  json={"messages": messages, "max_tokens": 4,
                                        "temperature": 0})
                assert resp.status_code == 200, resp.text
                usage = resp.json()["usage"]
                cached = usage["prompt_tokens_details"]["cached_tokens"]
                # Turn 0 may meet the system prompt cached by an earlier session there.
                assert turn == 0 or cached >= 16 * ((usage["prompt_tokens"] - 1) // 16) - 32
                messages.append(resp.json()["choices"][0]["message"])
            time.sleep(0.2)  # the replicas' request logs are written after the answer
            grew = [len(served(log)) - b for log, b in zip(logs, before, strict=True)]
            assert sorted(grew) == [0, 3], (session, grew)
            homes.add(grew.index(3))
        assert homes == {0, 1}, "sixteen sessions all hashed to one replica"


@needs_nginx
@pytest.mark.slow
def test_ctrl_c_drains_and_stops_everything(tiny_model_path, tmp_path):
    with ReplicaSet(1, tmp_path, model=str(tiny_model_path)) as rs:
        stream = start_stream(rs.balancer_url, 600)
        rs.signal_script(signal.SIGINT)  # a terminal's Ctrl-C: the script's process group
        rs.wait_for_line("^stopping", 10)
        stream.finish()
        assert rs.proc.wait(60) == 0
        rs.wait_for_line("^stopped", 5)
        out = rs.output
    assert any(re.fullmatch(r"replica 1 \(pid \d+\) exited with status 0", x) for x in out), out


def test_prometheus_scrapes_every_replica_with_a_replica_label():
    """One target per replica of run_replicas.sh's default ports, each labelled."""
    jobs = {j["job_name"]: j for j in yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]}
    job = jobs["veloxquant_replicas"]
    assert job["metrics_path"] == "/metrics"
    targets = {t: c["labels"]["replica"] for c in job["static_configs"] for t in c["targets"]}
    assert targets == {"127.0.0.1:8001": "r1", "127.0.0.1:8002": "r2"}
    assert "server 127.0.0.1:8001 " in CONFIG.read_text()  # the same ports as the balancer


def test_dashboard_panels_filter_by_the_replica_selector():
    dash = json.loads(DASHBOARD.read_text())
    replica = next(v for v in dash["templating"]["list"] if v["name"] == "replica")
    assert replica["includeAll"] and replica["allValue"] == ".*"  # also a lone server
    for panel in dash["panels"]:
        for target in panel["targets"]:
            selectors = re.findall(r"\{[^{}]*\}", target["expr"])
            assert selectors and all('replica=~"$replica"' in x for x in selectors), \
                (panel["title"], target["expr"])


def test_compose_example_parses_and_drains():
    """The compose text in docs/operations.md (not run here: no Docker) is valid YAML and
    gives ``docker stop`` more time than the drain's grace period."""
    page = (ROOT / "docs" / "operations.md").read_text()
    section = page[page.index("### Containers"):]
    compose = yaml.safe_load(section.split("```yaml\n", 1)[1].split("```", 1)[0])
    grace_s = make_settings().server.shutdown_grace_s
    for name in ("replica1", "replica2"):
        service = compose["services"][name]
        assert float(service["stop_grace_period"].removesuffix("s")) > grace_s
        assert "/health" in " ".join(service["healthcheck"]["test"])
    assert compose["services"]["balancer"]["ports"] == ["8080:8080"]
