"""Tokens/s through the nginx balancer with 1 and 2 replicas, in the same run.

Each configuration is started with ``scripts/run_replicas.sh`` (``replica_set.py``), warmed
up, driven with the same bounded streaming load at one concurrency (``server_load.py``),
then stopped: 1 replica straight to its own port (what the balancer costs), 1 replica
through the balancer, 2 replicas through the balancer. Per configuration it records tok/s,
TTFT and latency percentiles, errors, how the generated tokens split over the replicas
(their ``/metrics``), and the replicas' CPU seconds per generated token. The replicas share
this machine's cores, so on a small machine two replicas mostly split the same CPU time:
the figure to read is the ratio next to ``cpus``.

Usage::

    flock /tmp/velox-bench.lock .venv/bin/python benchmark_scripts/benchmark_replicas.py \\
        [--model small] [--concurrency 32] [--requests 96] [--max-tokens 64]

Writes ``figures/scale_out/results.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replica_set import ReplicaSet  # noqa: E402
from server_load import run_requests, summarize  # noqa: E402

from veloxquant_mlx.offline_model import ensure_model, iter_corpus  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "figures" / "scale_out" / "results.json"
WARMUP = 8  # prompts kept apart for the warm-up


def make_prompts(n: int, words: int) -> list[str]:
    """``n`` distinct prompts of ``words`` words from the offline corpus (no two alike)."""
    text = " ".join(iter_corpus(400_000)).split()
    stride = max((len(text) - words) // max(n, 1), 1)
    return [" ".join(text[i * stride: i * stride + words]) for i in range(n)]


def generated_tokens(url: str) -> float:
    """A replica's ``veloxquant_generation_tokens_total`` (its own port)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "veloxquant_generation_tokens_total")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux /proc), all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(name: str, rs: ReplicaSet, url: str, prompts: list[str],
            args: argparse.Namespace) -> dict:
    """Warm up, then drive ``url`` once; one result row."""
    model_id = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    # Warm-up at the measured concurrency: the first batches of each size are slower.
    c = args.concurrency
    asyncio.run(run_requests(url, model_id, prompts[-WARMUP:], c, c, 16, 60))
    before = [generated_tokens(r.url) for r in rs.replicas]
    cpu0 = [cpu_seconds(r.pid) for r in rs.replicas]
    results, wall = asyncio.run(run_requests(url, model_id, prompts[:-WARMUP], c,
                                             args.requests, args.max_tokens, args.time_limit))
    cpu = sum(cpu_seconds(r.pid) for r in rs.replicas) - sum(cpu0)
    split = [generated_tokens(r.url) - b for r, b in zip(rs.replicas, before, strict=True)]
    row = {"config": name, "replicas": len(rs.replicas), **summarize(
        args.concurrency, results, wall).as_dict()}
    row["tokens_per_replica"] = [int(x) for x in split]
    row["replica_cpu_ms_per_token"] = round(1000 * cpu / max(sum(split), 1), 3)
    print(f"  {name:<26} {row['tok_per_s']:8.1f} tok/s  ttft p50 {row['ttft_p50_s']}s  "
          f"errors {row['errors']}  split {row['tokens_per_replica']}", flush=True)
    return row


def run_config(n: int, direct: bool, prompts: list[str], args: argparse.Namespace,
               logs: Path) -> list[dict]:
    """Start ``n`` replicas + nginx, measure (the first replica directly too), stop."""
    rows = []
    with ReplicaSet(n, logs / f"n{n}", model=args.model) as rs:
        if direct:
            rows.append(measure(f"{n} replica, direct", rs, rs.replicas[0].url, prompts, args))
        rows.append(measure(f"{n} replica(s) via nginx", rs, rs.balancer_url, prompts, args))
        status = rs.stop()
    if status != 0:
        raise RuntimeError(f"run_replicas.sh {n} exited {status}:\n" + "\n".join(rs.output))
    return rows


def git_revision() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                         capture_output=True, text=True).stdout.strip()
    return out or "unknown"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="offline preset or model path")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=96, help="per configuration")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=48)
    parser.add_argument("--time-limit", type=float, default=90.0,
                        help="seconds per configuration after which no request starts")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if args.model in ("tiny", "small"):
        ensure_model(args.model)  # built once, before several replicas want it at once
    prompts = make_prompts(args.requests + WARMUP, args.prompt_words)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp:
        rows = run_config(1, True, prompts, args, Path(tmp))
        rows += run_config(2, False, prompts, args, Path(tmp))
    by = {r["config"]: r for r in rows}
    one, two = by["1 replica(s) via nginx"], by["2 replica(s) via nginx"]
    direct = by["1 replica, direct"]
    result = {
        "benchmark": "benchmark_scripts/benchmark_replicas.py",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "revision": git_revision(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version()},
        "load": {"model": args.model, "concurrency": args.concurrency,
                 "requests": args.requests, "max_tokens": args.max_tokens,
                 "prompt_words": args.prompt_words, "stream": True, "temperature": 0.0},
        "balancer": "nginx, config/nginx-replicas.conf (least_conn, unbuffered, keepalive)",
        "results": rows,
        "ratios": {
            "two_over_one_replica_tok_per_s": round(two["tok_per_s"] / one["tok_per_s"], 3),
            "via_nginx_over_direct_tok_per_s": round(one["tok_per_s"] / direct["tok_per_s"], 3),
        },
        "wall_s": round(time.monotonic() - t0, 1),
        "note": "Replicas share the machine's cores: each replica's engine and BLAS threads "
                "compete for the same CPUs, so a gain needs cores (or devices) the one "
                "replica leaves idle.",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["ratios"]), f"cpus={os.cpu_count()}", f"wrote {args.out}")
    errors = sum(r["errors"] for r in rows)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
