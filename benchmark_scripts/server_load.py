"""Bounded streaming load against an OpenAI-compatible server (loopback).

Shared by the server benchmarks (``benchmark_server.py``, ``benchmark_real_model.py``):
``run_requests`` sends ``n_requests`` streaming completions with at most
``concurrency`` in flight, stops launching new ones after ``time_limit_s``,
and measures each request on the client side: time to first token (first
chunk with text), end-to-end latency, generated tokens (from the final usage
chunk) and errors.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, field

import httpx


@dataclass(slots=True)
class RequestResult:
    """One streamed request as the client saw it."""

    ok: bool
    ttft_s: float | None = None
    latency_s: float = 0.0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


@dataclass(slots=True)
class LevelResult:
    """Aggregates of one concurrency level."""

    concurrency: int
    requests: int
    errors: int
    wall_s: float
    generated_tokens: int
    tok_per_s: float
    req_per_s: float
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    latency_p50_s: float | None
    latency_p99_s: float | None
    mean_prompt_tokens: float
    error_samples: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


async def stream_completion(client: httpx.AsyncClient, model: str, prompt: str,
                            max_tokens: int) -> RequestResult:
    """Send one streaming completion (temperature 0, usage requested) and time it."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    result = RequestResult(ok=False)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                result.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"])[:200]
                    return result
                choices = chunk.get("choices") or []
                if result.ttft_s is None and choices and choices[0].get("text"):
                    result.ttft_s = time.perf_counter() - t0
                usage = chunk.get("usage")
                if usage:
                    result.completion_tokens = usage.get("completion_tokens", 0)
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        return result
    result.latency_s = time.perf_counter() - t0
    result.ok = True
    return result


async def run_requests(base_url: str, model: str, prompts: list[str], concurrency: int,
                       n_requests: int, max_tokens: int, time_limit_s: float,
                       keep_alive: bool = True) -> tuple[list[RequestResult], float]:
    """Send ``prompts[0..n_requests)`` with ``concurrency`` in flight; bounded in count and time.

    ``keep_alive=False`` opens a fresh connection for every request.

    Returns:
        The per-request results and the wall time of the whole batch.
    """
    results: list[RequestResult] = []
    # keep_alive=False opens a connection per request: some servers (llama-server) close a
    # kept-alive connection at times, which the client would count as an error of theirs.
    limits = httpx.Limits(max_connections=concurrency + 4,
                          max_keepalive_connections=20 if keep_alive else 0)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        next_index = 0
        start = time.perf_counter()

        async def worker() -> None:
            nonlocal next_index
            while next_index < n_requests and time.perf_counter() - start < time_limit_s:
                i = next_index
                next_index += 1
                results.append(await stream_completion(
                    client, model, prompts[i % len(prompts)], max_tokens))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return results, wall


def summarize(concurrency: int, results: list[RequestResult], wall: float) -> LevelResult:
    """Aggregate requests (possibly from several rounds; ``wall`` is their summed time)."""
    ok = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    lats = [r.latency_s for r in ok]
    return LevelResult(
        concurrency=concurrency, requests=len(results), errors=len(results) - len(ok),
        wall_s=round(wall, 3), generated_tokens=tokens,
        tok_per_s=round(tokens / wall, 3) if wall else 0.0,
        req_per_s=round(len(ok) / wall, 4) if wall else 0.0,
        ttft_p50_s=_round(percentile(ttfts, 50)), ttft_p90_s=_round(percentile(ttfts, 90)),
        ttft_p99_s=_round(percentile(ttfts, 99)),
        latency_p50_s=_round(percentile(lats, 50)), latency_p99_s=_round(percentile(lats, 99)),
        mean_prompt_tokens=round(statistics.fmean([r.prompt_tokens for r in ok]), 1) if ok
        else 0.0,
        error_samples=[r.error for r in results if not r.ok][:3],
    )


async def run_level(base_url: str, model: str, prompts: list[str], concurrency: int,
                    n_requests: int, max_tokens: int, time_limit_s: float) -> LevelResult:
    """Drive one concurrency level once and summarize it."""
    results, wall = await run_requests(base_url, model, prompts, concurrency, n_requests,
                                       max_tokens, time_limit_s)
    return summarize(concurrency, results, wall)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
