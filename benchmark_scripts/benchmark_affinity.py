"""Prefix-aware routing: multi-turn chats through nginx to 2 replicas, by session vs least_conn.

The multi-turn workload of ``benchmark_prefix_cache.py`` (conversations sharing a
system prompt, every turn resending the whole conversation), with a short system
prompt (200 tokens) and long turns (300 tokens), so that most of a prompt is the
conversation's own history, on SmolLM2 with prefix caching on in both replicas, all
conversations at once, as concurrent chat users send them. Two runs through the same balancer:

- ``least_conn``: no session header; a turn goes to whichever replica has fewer
  open requests, so it finds its conversation's earlier blocks only when it lands
  where the previous turn ran;
- ``by_session``: ``X-Session-Id: <conversation>``; every turn of a conversation goes
  to one replica (consistent hash, ``config/nginx-replicas.conf``).

Each user pauses before each turn (``--think-s``, exponential, the same pauses in both
runs): with back-to-back turns the load is a closed loop in which least_conn sends a
user's next turn to the replica that has just finished its last one (that replica's
count just dropped), which is affinity by accident, not what independent clients get.

Each run starts from fresh replicas (no cache carried over). Reported per turn:
TTFT p50/p99 and the cached prompt tokens the replicas report
(``usage.prompt_tokens_details.cached_tokens``). Writes
``figures/scale_out/affinity.json``.

Usage::

    flock /tmp/vq-bench.lock .venv/bin/python benchmark_scripts/benchmark_affinity.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_prefix_cache import make_texts, stream_chat, summarize  # noqa: E402
from benchmark_server import git_revision  # noqa: E402
from replica_set import ReplicaSet  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "figures" / "scale_out" / "affinity.json"


def chat_turn(url: str, messages: list[dict], max_tokens: int, session: str | None) -> dict:
    """One streamed chat turn through the balancer, with the session header when given."""
    return stream_chat(url, messages, max_tokens,
                       headers={"X-Session-Id": session} if session else None)


def conversation(url: str, system: str, turns: list[str], max_tokens: int,
                 session: str | None, think: list[float]) -> list[dict]:
    """One user: a turn, a pause (``think[t]`` seconds), the next turn."""
    history, out = [{"role": "system", "content": system}], []
    for text, pause in zip(turns, think, strict=True):
        time.sleep(pause)
        history.append({"role": "user", "content": text})
        rec = chat_turn(url, history, max_tokens, session)
        history.append({"role": "assistant", "content": rec["answer"]})
        out.append(rec)
    return out


def run_mode(mode: str, system: str, users: list[list[str]], args: argparse.Namespace) -> dict:
    """Fresh replicas, every conversation at once; per-turn summary."""
    with tempfile.TemporaryDirectory(prefix="affinity-") as logs, \
            ReplicaSet(2, Path(logs), model="smollm2",
                       env={"VELOXQUANT_POOL_KV_MEMORY": args.kv_memory},
                       startup_timeout_s=300) as rs:
        url = rs.balancer_url
        chat_turn(url, [{"role": "user", "content": "Say hello."}], 4, None)  # warm-up
        chat_turn(url, [{"role": "user", "content": "Say hi."}], 4, None)
        t0 = time.monotonic()
        # The same pauses in both runs: user c waits think[c][t] before turn t.
        rng = random.Random(args.seed)
        think = [[rng.expovariate(1 / args.think_s) if args.think_s else 0.0
                  for _ in turns] for turns in users]
        with ThreadPoolExecutor(len(users)) as pool:
            futures = [pool.submit(conversation, url, system, turns, args.max_tokens,
                                   f"conv-{c}" if mode == "by_session" else None, think[c])
                       for c, turns in enumerate(users)]
            per_conv = [f.result(timeout=args.time_limit) for f in futures]
        wall = time.monotonic() - t0
    by_turn = [[conv[t] for conv in per_conv] for t in range(len(users[0]))]
    return {"wall_s": round(wall, 1), "turns": summarize(by_turn)}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=200)
    p.add_argument("--user-tokens", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--kv-memory", default="512MiB", help="each replica's pool.kv_memory")
    p.add_argument("--think-s", type=float, default=3.0,
                   help="mean pause before each turn (exponential; 0: none). Without "
                        "pauses the load is a closed loop, in which least_conn itself sends "
                        "a user's next turn back to the replica that just finished its last")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--time-limit", type=float, default=600.0, help="seconds per run")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    from veloxquant_mlx.gguf import convert_gguf, smollm2_gguf_path
    from veloxquant_mlx.paths import models_dir

    folder = convert_gguf(smollm2_gguf_path(), models_dir())
    system, users = make_texts(folder, args)
    runs = {mode: run_mode(mode, system, users, args) for mode in ("least_conn", "by_session")}
    later = range(1, args.turns)  # turns 2..N, 0-based
    ratio = [round(runs["by_session"]["turns"][t]["ttft_p50_s"]
                   / runs["least_conn"]["turns"][t]["ttft_p50_s"], 3) for t in later]
    result = {
        "what": "TTFT of multi-turn chats through nginx to 2 SmolLM2 replicas (prefix caching "
                "on), all conversations at once: routed by X-Session-Id vs least_conn",
        "revision": git_revision(), "cpus": os.cpu_count(),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "workload": {k: getattr(args, k) for k in (
            "conversations", "turns", "system_tokens", "user_tokens", "max_tokens", "kv_memory",
            "think_s", "seed")},
        "runs": runs, "ttft_p50_ratio_by_session_over_least_conn_turns_2_on": ratio,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for mode, run in runs.items():
        print(mode, [(t["turn"], t["ttft_p50_s"], sum(c or 0 for c in t["cached_tokens"]))
                     for t in run["turns"]])
    print("p50 ratio (turns 2..):", ratio, f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
