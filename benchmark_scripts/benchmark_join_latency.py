"""Time to first token of requests that arrive while others decode, ours against peers.

Ours, our previous revision (``--old-root``) and llama-server, on one GGUF.

A benchmark that starts every request at once measures prefill throughput: every
TTFT there is mostly the prompts queued before it. This one measures what a user
of a busy server feels. Per server and round: ``--streams`` greedy streams start
and decode (``ignore_eos``, so they run to ``--stream-tokens``); once every one of
them has streamed a few tokens, ``--newcomers`` short requests (about
``--prompt-tokens`` tokens, 2 new tokens) arrive one after another, each sent
``--gap-s`` after the one before got its first token. Recorded per server: each
newcomer's TTFT, and the streams' median gap between two tokens while the
newcomers come (one decode step, plus what a prefill adds to it).

The servers are all resident and take turns (the first rotates each round); they
get the same prompts, and none sees a prompt twice. Ratios are ours over each
peer, measured in the same run.

Usage (2 cores: nothing else heavy at the same time)::

    .venv/bin/python benchmark_scripts/benchmark_join_latency.py [--gguf FILE] \\
        [--old-root DIR] [--no-llama] [--rounds 3] [--out FILE]

Writes ``figures/cpu/join_latency_<gguf stem>.json`` (``--out``) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_codes import NEW, OLD, add_server_args, convert_first, gguf_run, start  # noqa: E402
from benchmark_revisions import checkout_revision  # noqa: E402
from benchmark_server import make_prompts, stop_server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WARM_TOKENS = 4  # tokens every stream has streamed before the first newcomer is sent


async def _stream(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int,
                  arrivals: list[float]) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                arrivals.append(time.monotonic())  # a token's chunk (not the usage one)


async def _ttft(client: httpx.AsyncClient, model: str, prompt: str) -> float:
    arrivals: list[float] = []
    sent = time.monotonic()
    await _stream(client, model, prompt, 2, arrivals)
    if not arrivals:
        raise RuntimeError("a newcomer streamed no token")
    return arrivals[0] - sent


async def scenario(base: str, model: str, streams: list[str], newcomers: list[str],
                   args: argparse.Namespace) -> dict:
    """The streams decode, the newcomers arrive one by one; their TTFTs and the streams'
    token gaps meanwhile."""
    limits = httpx.Limits(max_keepalive_connections=0)  # a fresh connection per request
    async with httpx.AsyncClient(base_url=base, timeout=args.time_limit,
                                 limits=limits) as client:
        arrivals: list[list[float]] = [[] for _ in streams]
        running = [asyncio.create_task(_stream(client, model, p, args.stream_tokens, a))
                   for p, a in zip(streams, arrivals, strict=True)]
        deadline = time.monotonic() + args.time_limit
        while min(len(a) for a in arrivals) < WARM_TOKENS:
            if time.monotonic() > deadline or any(t.done() for t in running):
                raise RuntimeError("the streams did not all start decoding")
            await asyncio.sleep(0.02)
        began = time.monotonic()
        ttfts = []
        for prompt in newcomers:
            ttfts.append(await _ttft(client, model, prompt))
            await asyncio.sleep(args.gap_s)
        ended = time.monotonic()
        if any(t.done() for t in running):
            raise RuntimeError("a stream ended before the newcomers were done: raise "
                               "--stream-tokens")
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
    gaps = [b - a for times in arrivals for a, b in zip(times, times[1:], strict=False)
            if began <= a and b <= ended]
    return {"ttft_s": [round(t, 4) for t in ttfts],
            "stream_gap_median_s": round(statistics.median(gaps), 4) if gaps else None}


def summarize(runs: list[dict]) -> dict:
    ttfts = [t for run in runs for t in run["ttft_s"]]
    gaps = [run["stream_gap_median_s"] for run in runs if run["stream_gap_median_s"]]
    return {"newcomers": len(ttfts), "ttft_p50_s": round(statistics.median(ttfts), 4),
            "ttft_mean_s": round(statistics.fmean(ttfts), 4),
            "ttft_max_s": round(max(ttfts), 4),
            "stream_gap_median_s": round(statistics.median(gaps), 4) if gaps else None,
            "rounds": runs}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_server_args(p, "join_latency")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, default=4, help="requests decoding meanwhile")
    p.add_argument("--stream-tokens", type=int, default=400,
                   help="tokens each stream asks for (it must outlast the newcomers)")
    p.add_argument("--newcomers", type=int, default=6, help="per server and round")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--gap-s", type=float, default=0.3,
                   help="pause after a newcomer's first token before the next is sent")
    p.add_argument("--time-limit", type=float, default=300.0,
                   help="longest any one request or wait may take (s)")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    gguf, out_path, env, names, llama_bin = gguf_run(args, "join_latency")
    folder = convert_first(ROOT, gguf, env)["folder"]
    if folder is None:
        raise SystemExit(f"this checkout cannot convert {gguf}")
    if args.old_root:
        convert_first(args.old_root, gguf, env)
    per_round = args.streams + args.newcomers
    prompts = make_prompts(Path(folder), per_round * (args.rounds + 1), args.prompt_tokens)
    servers, runs = [], {name: [] for name in names}
    try:
        for name in names:
            print(f"starting {name}", flush=True)
            servers.append(start(name, gguf, env, args, llama_bin)[0])
        for r in range(args.rounds + 1):  # round 0 warms every server up, not recorded
            batch = prompts[r * per_round:(r + 1) * per_round]
            order = servers[r % len(servers):] + servers[:r % len(servers)]
            for s in order:
                got = asyncio.run(scenario(s.base, s.model_id, batch[:args.streams],
                                           batch[args.streams:], args))
                if r:
                    runs[s.name].append(got)
                print(f"round {r} {s.name}: ttft {got['ttft_s']} stream gap "
                      f"{got['stream_gap_median_s']}", flush=True)
    finally:
        for s in servers:
            stop_server(s)
    summary = {name: summarize(rs) for name, rs in runs.items()}
    ratios = {peer: {"ttft_p50": round(summary[NEW]["ttft_p50_s"]
                                       / summary[peer]["ttft_p50_s"], 3),
                     "ttft_mean": round(summary[NEW]["ttft_mean_s"]
                                        / summary[peer]["ttft_mean_s"], 3)}
              for peer in names[1:]}
    result = {"benchmark": "benchmark_scripts/benchmark_join_latency.py",
              "argv": sys.argv[1:], "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "revisions": {NEW: checkout_revision(ROOT),
                            **({OLD: checkout_revision(args.old_root)} if args.old_root
                               else {})},
              "model": {"gguf": str(gguf)},
              "load": {"streams": args.streams, "stream_tokens": args.stream_tokens,
                       "newcomers_per_round": args.newcomers,
                       "newcomer_prompt_tokens": args.prompt_tokens, "newcomer_max_tokens": 2,
                       "gap_s": args.gap_s, "rounds": args.rounds,
                       "order": "first server rotates each round; round 0 is a warm-up"},
              "servers": summary, "ratios_ours_over": ratios}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    for name, s in summary.items():
        print(f"{name:15s} ttft p50 {s['ttft_p50_s']:.3f}s mean {s['ttft_mean_s']:.3f}s "
              f"max {s['ttft_max_s']:.3f}s  stream gap {s['stream_gap_median_s']}s")
    for peer, r in ratios.items():
        print(f"ours / {peer}: ttft p50 {r['ttft_p50']}  mean {r['ttft_mean']}")
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
