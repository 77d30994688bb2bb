"""Soak: a bounded mixed load against a real server process, then leak checks.

    flock /tmp/velox-bench.lock .venv/bin/python benchmark_scripts/soak.py

starts ``python -m server`` (offline tiny model, loopback, free port), sends
a warm-up round, samples the server's resident memory, then sends the main
load: ``--requests`` requests (3000 by default, in 10 rounds with the RSS
sampled after each) with at most ``--concurrency`` (16) in flight, prompts of
1 to 300 words, ``max_tokens`` up to 64, and a mix
of completions and chats, JSON and streamed, clients that disconnect
mid-stream, clients that time out, asyncio tasks cancelled mid-request, the
official ``openai`` client, and invalid requests. Both count and time are
bounded: no new request starts after ``--time-budget`` seconds.

Afterwards the server must be idle with nothing held: zero 5xx (HTTP status
or an error frame inside a stream), ``blocks_in_use`` 0, no orphaned blocks,
every allocated block freed, and RSS after the run within the stated bound of
RSS after warm-up. Writes ``figures/reliability/soak.json``; exits 1 when a
check fails. ``tests/e2e/test_soak.py`` runs a short version in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_process import ROOT, ServerProcess  # noqa: E402

OUT = ROOT / "figures" / "reliability" / "soak.json"
MIB = 1024 * 1024
# RSS after the run may exceed RSS after warm-up by at most this much. Idle RSS moves by
# +-30 MiB between rounds on its own (glibc malloc arenas of the server's threads, MLX's
# buffer cache), up and down; a leak of 32 KiB per request over 3000 requests would not fit.
RSS_BOUND_ABS = 96 * MIB
RSS_BOUND_REL = 0.15
WORDS = ("the pool holds every block of every request and frees them when it ends "
         "def parse return value error stream token cache layer model server queue").split()
KINDS = {  # kind -> weight
    "complete": 4, "complete_stream": 4, "chat": 3, "chat_stream": 3, "openai_chat": 2,
    "disconnect": 3, "abandon": 2, "task_cancel": 2, "bad": 2,
}


@dataclass(slots=True)
class Outcome:
    """What one request's client saw."""

    kind: str
    status: int | None  # None: the client left before a status (by design)
    stream_error: str = ""
    tokens: int = 0


@dataclass(slots=True)
class LoadResult:
    """One round of load."""

    requests: int
    wall_s: float
    by_kind: dict[str, int] = field(default_factory=dict)
    by_status: dict[str, int] = field(default_factory=dict)
    client_5xx: int = 0
    stream_errors: int = 0
    unexpected: list[str] = field(default_factory=list)
    generated_tokens: int = 0


def _prompt(rng: random.Random) -> str:
    n = rng.choice((1, 3, 10, 30, 80, 150, 300))
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(max(1, n // 2), n)))


def _body(rng: random.Random, chat: bool, stream: bool, max_tokens: int) -> dict:
    body: dict = {"max_tokens": max_tokens, "stream": stream,
                  "temperature": rng.choice((0.0, 0.7, 1.0))}
    if rng.random() < 0.3:
        body["stop"] = [rng.choice(WORDS)]
    if chat:
        body["messages"] = [{"role": "user", "content": _prompt(rng)}]
    else:
        body["prompt"] = _prompt(rng)
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    return body


async def _stream(c: httpx.AsyncClient, path: str, body: dict, kind: str,
                  stop_after: int | None = None) -> Outcome:
    async with c.stream("POST", path, json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return Outcome(kind, resp.status_code)
        frames = 0
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            frames += 1
            if stop_after is not None and frames >= stop_after:
                return Outcome(kind, None)  # leaving the block drops the connection
            if line != "data: [DONE]" and "error" in json.loads(line[6:]):
                return Outcome(kind, 200, stream_error=line[:300])  # an error frame
        return Outcome(kind, 200, tokens=frames)


async def _bad(c: httpx.AsyncClient, rng: random.Random) -> Outcome:
    choice = rng.randrange(5)
    if choice == 0:
        resp = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 0})
    elif choice == 1:
        resp = await c.post("/v1/chat/completions", json={"messages": [], "max_tokens": 3})
    elif choice == 2:
        resp = await c.post("/v1/completions", content=b"{not json",
                            headers={"content-type": "application/json"})
    elif choice == 3:
        resp = await c.post("/v1/completions", json={"prompt": "x", "temperature": 9})
    else:  # a prompt over limits.max_prompt_tokens (8192 by default)
        resp = await c.post("/v1/completions", json={"prompt": [5] * 9000, "max_tokens": 4})
    ok = 400 <= resp.status_code < 500 and "error" in resp.json()
    return Outcome("bad", resp.status_code, "" if ok else f"bad request got {resp.text[:200]}")


async def one_request(c: httpx.AsyncClient, base_url: str, rng: random.Random,
                      kind: str) -> Outcome:
    """Send one request of ``kind`` the way a real client of that kind behaves."""
    max_tokens = rng.randint(1, 64)
    if kind in ("complete", "chat"):
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        resp = await c.post(path, json=_body(rng, kind == "chat", False, max_tokens))
        tokens = resp.json().get("usage", {}).get("completion_tokens", 0) \
            if resp.status_code == 200 else 0
        return Outcome(kind, resp.status_code, tokens=tokens)
    if kind in ("complete_stream", "chat_stream"):
        chat = kind == "chat_stream"
        path = "/v1/chat/completions" if chat else "/v1/completions"
        return await _stream(c, path, _body(rng, chat, True, max_tokens), kind)
    if kind == "openai_chat":
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                             timeout=60)
        body = _body(rng, True, False, max_tokens)
        try:
            out = await client.chat.completions.create(model="default",
                                                       messages=body["messages"],
                                                       max_tokens=max_tokens)
        finally:
            await client.close()
        return Outcome(kind, 200, tokens=out.usage.completion_tokens)
    if kind == "disconnect":
        body = _body(rng, rng.random() < 0.5, True, 400)
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        return await _stream(c, path, body, kind, stop_after=rng.randint(1, 6))
    if kind == "abandon":
        async with httpx.AsyncClient(base_url=base_url,
                                     timeout=rng.uniform(0.05, 0.6)) as short:
            try:
                resp = await short.post("/v1/completions", json=_body(rng, False, False, 400))
            except httpx.TimeoutException:
                return Outcome(kind, None)
            return Outcome(kind, resp.status_code)
    if kind == "task_cancel":
        body = _body(rng, False, True, 400)
        task = asyncio.ensure_future(_stream(c, "/v1/completions", body, kind))
        await asyncio.sleep(rng.uniform(0.05, 0.5))
        task.cancel()
        try:
            return await task
        except asyncio.CancelledError:
            return Outcome(kind, None)
    return await _bad(c, rng)


async def run_load(base_url: str, n_requests: int, concurrency: int, seed: int,
                   time_budget_s: float, request_timeout_s: float = 120.0) -> LoadResult:
    """Send up to ``n_requests`` mixed requests, ``concurrency`` at a time.

    No request starts after ``time_budget_s``; each has its own timeout.
    """
    rng = random.Random(seed)
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=n_requests)
    sem = asyncio.Semaphore(concurrency)
    t0 = time.monotonic()
    outcomes: list[Outcome] = []
    errors: list[str] = []

    async def worker(i: int, kind: str, c: httpx.AsyncClient) -> None:
        async with sem:
            if time.monotonic() - t0 > time_budget_s:
                return
            try:
                outcomes.append(await asyncio.wait_for(
                    one_request(c, base_url, random.Random(seed * 100003 + i), kind),
                    request_timeout_s))
            except Exception as exc:  # a client-side failure is a finding, not a crash
                errors.append(f"{kind}: {type(exc).__name__}: {exc}"[:300])

    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=request_timeout_s,
                                 limits=limits) as c:
        await asyncio.gather(*(worker(i, k, c) for i, k in enumerate(kinds)))
    result = LoadResult(requests=len(outcomes) + len(errors), wall_s=time.monotonic() - t0)
    result.by_kind = dict(Counter(o.kind for o in outcomes))
    result.by_status = {str(k): v for k, v in
                        Counter("left" if o.status is None else o.status
                                for o in outcomes).items()}
    result.client_5xx = sum(1 for o in outcomes if o.status is not None and o.status >= 500)
    result.stream_errors = sum(1 for o in outcomes if o.stream_error)
    result.unexpected = errors + [f"{o.kind}: {o.stream_error}" for o in outcomes
                                  if o.stream_error][:20]
    result.generated_tokens = sum(o.tokens for o in outcomes)
    return result


def scrape(base_url: str) -> dict[str, float]:
    """/metrics as {sample name with labels: value}; the keys leave out ``model_name``
    (one model per server)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    text = httpx.get(base_url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                              if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def wait_idle(base_url: str, timeout_s: float = 30.0) -> tuple[dict[str, float], float]:
    """Metrics once nothing runs, waits or holds a block (or at the timeout); and the wait."""
    t0 = time.monotonic()
    while True:
        m = scrape(base_url)
        if (m["veloxquant_block_pool_request_blocks_in_use"] == 0
                and m["veloxquant_requests_running"] == 0
                and m["veloxquant_requests_waiting"] == 0) or \
                time.monotonic() - t0 > timeout_s:
            return m, time.monotonic() - t0
        time.sleep(0.1)


def server_5xx(m: dict[str, float]) -> int:
    """HTTP 5xx answers the server counted."""
    return int(sum(v for k, v in m.items()
                   if k.startswith("veloxquant_requests_total{") and ",status=5" in k))


def _merge(total: LoadResult, part: LoadResult) -> None:
    """Add one round's counts into the running total."""
    total.requests += part.requests
    total.wall_s += part.wall_s
    for mine, theirs in ((total.by_kind, part.by_kind), (total.by_status, part.by_status)):
        for key, value in theirs.items():
            mine[key] = mine.get(key, 0) + value
    total.client_5xx += part.client_5xx
    total.stream_errors += part.stream_errors
    total.unexpected += part.unexpected
    total.generated_tokens += part.generated_tokens


def soak(n_requests: int, concurrency: int, seed: int, time_budget_s: float,
         warmup_requests: int, log_path: Path, rounds: int = 1, model: str = "tiny") -> dict:
    """Run the whole soak against a fresh server process; return the report.

    ``model`` is the server's ``--model`` (the tiny random model by default: the
    soak checks bookkeeping and memory over many requests, not text quality).

    The main load runs in ``rounds`` equal rounds with the server's RSS sampled
    after each (idle), so a long run shows whether memory levels off.
    """
    main = LoadResult(requests=0, wall_s=0.0)
    rss_rounds: list[float] = []
    mlx_rounds: list[dict[str, float]] = []  # MLX allocator memory after each round
    t0 = time.monotonic()
    with ServerProcess(log_path, ["--model", model]) as server:
        warm = asyncio.run(run_load(server.base_url, warmup_requests, concurrency, seed + 1,
                                    time_budget_s))
        before, _ = wait_idle(server.base_url)
        rss_warm = server.rss()
        for i in range(rounds):
            n = n_requests // rounds + (1 if i < n_requests % rounds else 0)
            budget = time_budget_s - (time.monotonic() - t0)
            _merge(main, asyncio.run(run_load(server.base_url, n, concurrency,
                                              seed + 1000 * i, budget)))
            after, idle_wait = wait_idle(server.base_url)
            rss_rounds.append(round(server.rss() / MIB, 1))
            mlx_rounds.append({kind: round(after.get(f"veloxquant_mlx_memory_bytes{{kind={kind}}}",
                                                     0) / MIB, 1)
                               for kind in ("active", "cache", "peak")})
        rss_after = server.rss()
        exit_code = server.stop()

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    bound = max(RSS_BOUND_ABS, int(RSS_BOUND_REL * rss_warm))
    # Every block handed out is freed or kept by the prefix cache (evictable, a known owner).
    leaked = int(after["veloxquant_block_pool_allocations_total"]
                 - after["veloxquant_block_pool_frees_total"]
                 - after.get("veloxquant_block_pool_cached_blocks", 0))
    checks = {
        "zero_5xx": main.client_5xx == 0 and main.stream_errors == 0
        and server_5xx(after) == 0,
        "no_client_errors": not main.unexpected,
        "blocks_in_use_zero": after["veloxquant_block_pool_request_blocks_in_use"] == 0,
        "no_orphaned_blocks": after["veloxquant_orphaned_blocks"] == 0,
        "no_leaked_blocks": leaked == 0,
        "rss_within_bound": rss_after - rss_warm <= bound,
        "clean_exit": exit_code == 0,
    }
    return {
        "config": {"requests": n_requests, "rounds": rounds, "concurrency": concurrency,
                   "seed": seed, "model": model,
                   "time_budget_s": time_budget_s, "warmup_requests": warmup_requests,
                   "kind_weights": KINDS, "max_tokens": "1..64 (400 for cut requests)",
                   "prompt_words": "1..300"},
        "environment": {"platform": platform.platform(), "python": platform.python_version(),
                        "cpus": __import__("os").cpu_count()},
        "warmup": asdict(warm),
        "load": asdict(main),
        "server": {
            "http_5xx": server_5xx(after),
            "requests_finished": {k.split("=")[1].rstrip("}"): delta(k) for k in after
                                  if k.startswith("veloxquant_request_finished_total{")},
            "requests_rejected": {k.split("=")[1].rstrip("}"): delta(k) for k in after
                                  if k.startswith("veloxquant_request_rejected_total{")},
            "generated_tokens": delta("veloxquant_generation_tokens_total"),
            "blocks_allocated": delta("veloxquant_block_pool_allocations_total"),
            "blocks_reused": delta("veloxquant_block_pool_reused_total"),
            "exhausted": after["veloxquant_block_pool_exhausted_total"],
            "peak_blocks_in_use": after["veloxquant_block_pool_peak_blocks_in_use"],
            "blocks_in_use_after": after["veloxquant_block_pool_request_blocks_in_use"],
            "orphaned_blocks_after": after["veloxquant_orphaned_blocks"],
            "leaked_blocks": leaked,
            "idle_after_s": round(idle_wait, 2),
            "exit_code": exit_code,
        },
        "rss": {"after_warmup_mib": round(rss_warm / MIB, 1),
                "after_each_round_mib": rss_rounds,
                "after_run_mib": round(rss_after / MIB, 1),
                "growth_mib": round((rss_after - rss_warm) / MIB, 1),
                "first_to_last_round_mib": round(rss_rounds[-1] - rss_rounds[0], 1),
                "mlx_memory_each_round_mib": mlx_rounds,
                "bound_mib": round(bound / MIB, 1),
                "bound_rule": f"after_run - after_warmup <= max({RSS_BOUND_ABS // MIB} MiB, "
                              f"{RSS_BOUND_REL:.0%} of after_warmup)"},
        "checks": checks,
        "passed": all(checks.values()),
    }


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns 0 when every check passed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=300,
                        help="requests before the RSS baseline (MLX caches fill up first)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=10,
                        help="split the load in rounds, sampling RSS after each")
    parser.add_argument("--time-budget", type=float, default=600.0,
                        help="seconds after which no new request starts")
    parser.add_argument("--model", default="tiny", help="the server's --model")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        report = soak(args.requests, args.concurrency, args.seed, args.time_budget,
                      args.warmup, Path(tmp) / "server.log", args.rounds, args.model)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"checks": report["checks"], "rss": report["rss"],
                      "load": {k: report["load"][k] for k in ("requests", "wall_s",
                                                               "by_status")}}, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
