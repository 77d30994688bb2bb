"""Our server from two checkouts, one after the other, under the same streaming load.

Compares this checkout with another one (e.g. ``git worktree add /tmp/kvbase HEAD``; copy
``veloxquant_mlx/memory/*.so`` into it so both run the compiled allocator). Each server runs
from its own root (``PYTHONPATH`` = that root), the same offline model (``small`` unless
``--model``), the same optimized BLAS; rounds alternate who goes first and no prompt
repeats. Besides tok/s it records CPU milliseconds per generated token, for the whole
process and for its main thread alone: the asyncio loop that serves HTTP, whose share of
the GIL the engine thread waits behind when it builds a step.

It also records each side's engine time per decode step by phase (``/metrics``'s
``veloxquant_engine_phase_seconds`` over the measured rounds). ``--old-env`` and
``--new-env`` set environment variables of one side only: with ``--old-root .`` that is
the A/B of one setting in this checkout.

Where a side stands is not quite neutral: on 2 cores the same tree against itself read
0.966 at SmolLM2 c=16, more than the margins measured. ``--both-orders`` runs the whole
comparison twice, each side's server started first (and first in the first round) once,
and reports the geometric mean of the two ratios, in which that lean cancels.

Usage::

    flock /tmp/velox-bench.lock .venv/bin/python benchmark_scripts/benchmark_revisions.py \\
        --old-root /tmp/kvbase [--rounds 4] [--out figures/server/kv_memory_uniform.json] \\
        [--model tiny --concurrency 64 --requests 64 --tokens 128 --max-batch 64] \\
        [--old-env VELOXQUANT_BATCH_EVENTS_AT_SUBMIT=false] [--both-orders]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_server import free_port, make_prompts, process_cpu_s, wait_up  # noqa: E402
from server_load import run_requests, summarize  # noqa: E402

from veloxquant_mlx.cpu_backend import child_env  # noqa: E402
from veloxquant_mlx.offline_model import ensure_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONCURRENCY, REQUESTS, TOKENS = 16, 32, 64



def checkout_revision(root: Path) -> str:
    """The checkout's commit, ``+dirty`` when tracked files differ from it."""
    git = ["git", "-C", str(root)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    dirty = subprocess.run([*git, "diff", "--quiet", "HEAD"]).returncode != 0
    return head + ("+dirty" if dirty else "")


def start(root: Path, model: Path, max_batch: int | None = None,
          extra_env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    env = child_env(preload=True)
    env["PYTHONPATH"] = str(root)
    if max_batch:
        env["VELOXQUANT_BATCH_MAX_BATCH_SIZE"] = str(max_batch)
    env.update(extra_env or {})
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "server", "--model", str(model), "--port",
                             str(port), "--log-level", "warning"], cwd=root, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_up(f"http://127.0.0.1:{port}", proc)
    return proc, f"http://127.0.0.1:{port}"


def phase_totals(base: str) -> dict[str, float]:
    """The engine's seconds per step phase so far, and its decode steps (``steps``)."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(base + "/metrics").text):
        if family.name in ("veloxquant_engine_phase_seconds", "veloxquant_engine_decode_steps"):
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    totals[sample.labels.get("phase", "steps")] = sample.value
    return totals


def memory_figures(base: str) -> dict[str, float]:
    """The side's KV and MLX memory after the rounds: ``/metrics``'s byte gauges by kind
    (``kv:in_use``, ``kv:capacity``, ``mlx:peak``...) and the pool's peak blocks in use."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(base + "/metrics").text):
        prefix = {"veloxquant_kv_bytes": "kv", "veloxquant_mlx_memory_bytes": "mlx"}.get(
            family.name)
        for sample in family.samples:
            if prefix is not None:
                out[f"{prefix}:{sample.labels['kind']}"] = sample.value
            elif sample.name == "veloxquant_block_pool_peak_blocks_in_use":
                out["pool:peak_blocks_in_use"] = sample.value
    return out


def env_pair(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` of ``--old-env``."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def compare(args: argparse.Namespace, model: Path, order: tuple[str, str]) -> dict:
    """Both sides under the same rounds, the servers started in ``order``."""
    roots = {"new": ROOT, "old": args.old_root}
    envs = {"new": dict(args.new_env), "old": dict(args.old_env)}
    n = args.requests
    prompts = make_prompts(model, n * args.rounds + 2, args.tokens)
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        # Inside the try: a side that fails to start does not leave the other running.
        for k in order:
            servers[k] = start(roots[k], model, args.max_batch, envs[k])
        ids = {k: httpx.get(b + "/v1/models").json()["data"][0]["id"]
               for k, (_, b) in servers.items()}
        for k, (_, base) in servers.items():  # warm-up, not measured
            asyncio.run(run_requests(base, ids[k], prompts[-2:], 2, 2, TOKENS, 60))
        got = {k: [] for k in servers}
        wall, cpu = dict.fromkeys(servers, 0.0), dict.fromkeys(servers, 0.0)
        loop_cpu = dict.fromkeys(servers, 0.0)
        phases: dict[str, dict[str, float]] = {k: {} for k in servers}
        for r in range(args.rounds):
            batch = prompts[r * n: (r + 1) * n]
            for k in (order if r % 2 == 0 else order[::-1]):
                proc, base = servers[k]
                cpu0, loop0 = process_cpu_s(proc.pid), process_cpu_s(proc.pid, proc.pid)
                before = phase_totals(base)
                res, sec = asyncio.run(run_requests(base, ids[k], batch, args.concurrency,
                                                    n, args.tokens, 240))
                for phase, value in phase_totals(base).items():
                    phases[k][phase] = phases[k].get(phase, 0.0) + value - before.get(phase, 0)
                cpu[k] += process_cpu_s(proc.pid) - cpu0
                loop_cpu[k] += process_cpu_s(proc.pid, proc.pid) - loop0
                got[k] += res
                wall[k] += sec
        memory = {k: memory_figures(base) for k, (_, base) in servers.items()}
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    out = {k: summarize(args.concurrency, got[k], wall[k]).as_dict() for k in order}
    for k in order:
        tokens = max(out[k]["generated_tokens"], 1)
        out[k]["cpu_ms_per_token"] = round(1000 * cpu[k] / tokens, 3)
        out[k]["main_thread_cpu_ms_per_token"] = round(1000 * loop_cpu[k] / tokens, 4)
        steps = max(phases[k].pop("steps", 0.0), 1.0)
        out[k]["engine_ms_per_step"] = {phase: round(1000 * v / steps, 3)
                                        for phase, v in phases[k].items()}
        out[k]["memory_after_rounds"] = memory[k]
    out["load"] = {"model": args.model, "concurrency": args.concurrency, "requests": n,
                   "rounds": args.rounds, "tokens": args.tokens, "max_batch": args.max_batch}
    out["revisions"] = {"new": checkout_revision(ROOT), "old": checkout_revision(args.old_root)}
    out["started_first"] = order[0]
    out["env"] = {"new": dict(args.new_env), "old": dict(args.old_env)}
    out["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out["ratio_new_over_old_tok_per_s"] = round(out["new"]["tok_per_s"] / out["old"]["tok_per_s"],
                                                3)
    out["ratio_old_over_new_main_thread_cpu"] = round(
        out["old"]["main_thread_cpu_ms_per_token"]
        / max(out["new"]["main_thread_cpu_ms_per_token"], 1e-9), 3)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old-root", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--model", default="small",
                   help="offline preset (tiny, small) or a model folder")
    p.add_argument("--concurrency", type=int, default=CONCURRENCY)
    p.add_argument("--requests", type=int, default=REQUESTS, help="per server and round")
    p.add_argument("--tokens", type=int, default=TOKENS, help="prompt and completion tokens")
    p.add_argument("--max-batch", type=int, default=None, help="batch.max_batch_size")
    p.add_argument("--old-env", type=env_pair, action="append", default=[],
                   help="KEY=VALUE in the old side's environment only (repeatable)")
    p.add_argument("--new-env", type=env_pair, action="append", default=[],
                   help="KEY=VALUE in the new side's environment only (repeatable)")
    p.add_argument("--both-orders", action="store_true",
                   help="run it all twice, each side started first once; the ratio is the "
                        "geometric mean of the two (what start order favours cancels)")
    args = p.parse_args()
    model = Path(args.model) if Path(args.model).is_dir() else ensure_model(args.model)
    orders = [("new", "old"), ("old", "new")] if args.both_orders else [("new", "old")]
    runs = [compare(args, model, order) for order in orders]
    out = runs[0]
    if args.both_orders:
        ratios = [run["ratio_new_over_old_tok_per_s"] for run in runs]
        out = {"new_started_first": runs[0], "old_started_first": runs[1],
               "ratio_new_over_old_tok_per_s_by_order": ratios,
               "ratio_new_over_old_tok_per_s": round(math.sqrt(ratios[0] * ratios[1]), 3)}
    print(json.dumps(out, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
