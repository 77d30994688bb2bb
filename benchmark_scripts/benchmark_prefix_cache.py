"""Multi-turn chat on the real default model: prefix caching on vs off, and the peers.

The workload a chat client makes: ``--conversations`` conversations of
``--turns`` turns, every conversation starting with the same ~1000-token system
prompt, every turn resending the whole conversation (system prompt, earlier
user turns and the server's own earlier answers) plus a new user message.
Turns go round-robin (turn 1 of every conversation, then turn 2 ...), one
request at a time, so time to first token (TTFT) is the server's own
latency, not queueing behind other requests, and a cache must keep every
conversation alive at once.

Servers, one after another on the same machine (never two at once):

- ours with ``[cache] prefix_caching = true`` and with it off
  (``VELOXQUANT_CACHE_PREFIX_CACHING=false``), SmolLM2-135M-Instruct
  (``--model smollm2``), both with ``pool.kv_memory`` large enough for the
  run (``--kv-memory``) so that the comparison is about reuse, not eviction;
- llama.cpp's ``llama-server`` on the same GGUF (``serve_llama_server.sh``,
  one slot per conversation and enough context per slot; its prompt cache on,
  as by default);
- ``mlx_lm.server`` on our MLX conversion (its LRU of prompt caches on, as by
  default). It decodes ~20x slower on quantized CPU weights, so it runs
  ``--peer-conversations`` of the conversations (TTFT percentiles per turn
  over those; the workload per request is the same).

TTFT is measured by the client: request sent -> first streamed chunk with
content. Ratios (ours over ours-off, ours over the better peer) are computed
from the same run. Writes ``figures/prefix_cache/results.json``.

Usage::

    flock /tmp/vq-bench.lock .venv/bin/python benchmark_scripts/benchmark_prefix_cache.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_real_model import LLAMA, MLX_LM, OURS, commands, llama_server_binary  # noqa: E402
from benchmark_server import (  # noqa: E402
    Running,
    free_port,
    git_revision,
    stop_server,
    wait_up,
)
from server_load import percentile  # noqa: E402

from veloxquant_mlx.cpu_backend import child_env  # noqa: E402
from veloxquant_mlx.offline_model import iter_corpus  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "figures" / "prefix_cache" / "results.json"
OURS_OFF = "veloxquant (prefix caching off)"
TARGETS = {"ours_over_off_p50_max": 0.35, "ours_over_best_peer_p50_max": 1.0}


def make_texts(folder: Path, args: argparse.Namespace) -> tuple[str, list[list[str]]]:
    """The shared system prompt and every conversation's user messages, from the corpus."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    ids = tok.encode(" ".join(iter_corpus(400_000)), add_special_tokens=False)
    system = tok.decode(ids[: args.system_tokens])
    users, at = [], args.system_tokens
    for _ in range(args.conversations):
        turns = []
        for _ in range(args.turns):
            turns.append(tok.decode(ids[at: at + args.user_tokens]) + " Summarize briefly.")
            at += args.user_tokens
        users.append(turns)
    return system, users


def start(name: str, cmd: list[str], env: dict[str, str], model_id: str | None,
          port: int) -> Running:
    base = f"http://127.0.0.1:{port}"
    log_path = Path(tempfile.mkstemp(prefix="bench-prefix-", suffix=".log")[1])
    log_file = log_path.open("w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log_file, stderr=log_file, text=True)
    wait_up(base, proc, timeout=300)
    if model_id is None:
        model_id = httpx.get(base + "/v1/models").json()["data"][0]["id"]
    return Running(name, proc, base, model_id, log_path, log_file)


def chat_turn(s: Running, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat request to server ``s`` (see :func:`stream_chat`)."""
    return stream_chat(s.base, messages, max_tokens, model=s.model_id)


def stream_chat(base: str, messages: list[dict], max_tokens: int, model: str | None = None,
                headers: dict[str, str] | None = None) -> dict:
    """One streamed, greedy chat request: TTFT, the answer, and the usage the server reports."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    text, ttft, usage = [], None, None
    t0 = time.perf_counter()
    with httpx.Client(timeout=600) as client, \
            client.stream("POST", base + "/v1/chat/completions", json=body,
                          headers=headers or {}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(piece)
            if chunk.get("usage"):
                usage = chunk["usage"]
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {"ttft_s": ttft if ttft is not None else time.perf_counter() - t0,
            "answer": "".join(text), "prompt_tokens": (usage or {}).get("prompt_tokens"),
            "cached_tokens": details.get("cached_tokens")}


def run_conversations(s: Running, system: str, users: list[list[str]], max_tokens: int,
                      deadline: float) -> list[list[dict]]:
    """Every conversation, turns round-robin; returns ``[turn][conversation]`` records."""
    history = [[{"role": "system", "content": system}] for _ in users]
    turns: list[list[dict]] = []
    for t in range(len(users[0])):
        rows = []
        for c, conv in enumerate(users):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{s.name}: time limit reached at turn {t + 1}")
            history[c].append({"role": "user", "content": conv[t]})
            rec = chat_turn(s, history[c], max_tokens)
            history[c].append({"role": "assistant", "content": rec["answer"]})
            rows.append(rec)
        turns.append(rows)
    return turns


def summarize(turns: list[list[dict]]) -> list[dict]:
    out = []
    for t, rows in enumerate(turns):
        ttfts = [r["ttft_s"] for r in rows]
        cached = [r["cached_tokens"] for r in rows]
        out.append({"turn": t + 1, "requests": len(rows),
                    "ttft_p50_s": round(percentile(ttfts, 50), 4),
                    "ttft_p99_s": round(percentile(ttfts, 99), 4),
                    "prompt_tokens_mean": round(sum(r["prompt_tokens"] or 0 for r in rows)
                                                / len(rows), 1),
                    "cached_tokens": cached})
    return out


def idle_pool(s: Running) -> dict:
    """Our /metrics after the run: blocks in use, orphans, cached and evictable blocks."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(s.base + "/metrics", timeout=10).text
    want = ("veloxquant_block_pool_request_blocks_in_use", "veloxquant_orphaned_blocks",
            "veloxquant_block_pool_cached_blocks", "veloxquant_block_pool_evictable_blocks",
            "veloxquant_block_pool_evictions_total", "veloxquant_prefix_cache_hit_tokens_total",
            "veloxquant_prefix_cache_query_tokens_total")
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in want:
                out[sample.name] = sample.value
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--peer-conversations", type=int, default=3,
                   help="conversations mlx_lm.server runs (it decodes ~20x slower)")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--user-tokens", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--kv-memory", default="256MiB", help="our pool.kv_memory for the run")
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds per server")
    p.add_argument("--servers", nargs="+", default=[OURS, OURS_OFF, LLAMA, MLX_LM])
    p.add_argument("--llama-server", help="llama-server binary (default: build/find it)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args()


def server_plan(args: argparse.Namespace, folder: Path, env: dict[str, str],
                llama_bin: str) -> dict[str, tuple[str, dict[str, str], str | None]]:
    """Name -> (which command of ``commands()``, environment, model id or None: ask it)."""
    ours_env = {**env, "VELOXQUANT_POOL_KV_MEMORY": args.kv_memory}
    ctx = args.system_tokens + args.turns * (args.user_tokens + args.max_tokens + 40) + 256
    return {
        OURS: (OURS, {**ours_env, "VELOXQUANT_CACHE_PREFIX_CACHING": "true"}, None),
        OURS_OFF: (OURS, {**ours_env, "VELOXQUANT_CACHE_PREFIX_CACHING": "false"}, None),
        LLAMA: (LLAMA, {**env, "LLAMA_SERVER": llama_bin, "PARALLEL": str(args.conversations),
                        "CTX_PER_SLOT": str(ctx)}, "smollm2"),
        MLX_LM: (MLX_LM, env, str(folder)),
    }


def main() -> int:
    args = parse_args()
    from veloxquant_mlx.gguf import convert_gguf, smollm2_gguf_path
    from veloxquant_mlx.paths import models_dir

    gguf = smollm2_gguf_path()
    folder = convert_gguf(gguf, models_dir())
    llama_bin = llama_server_binary(args.llama_server) if LLAMA in args.servers else ""
    env = child_env(preload=True)
    env["PYTHONPATH"] = str(ROOT)
    system, users = make_texts(folder, args)
    plan = server_plan(args, folder, env, llama_bin)
    results: dict[str, dict] = {}
    for name in args.servers:
        kind, proc_env, model_id = plan[name]
        port = free_port()
        s = start(name, commands(gguf, folder, port)[kind], proc_env, model_id, port)
        record: dict = {}
        try:
            # Warm-up on an unrelated prompt: loads kernels, caches nothing of the workload.
            chat_turn(s, [{"role": "user", "content": "Say hello."}], 4)
            convs = users[: args.peer_conversations] if name == MLX_LM else users
            t0 = time.monotonic()
            turns = run_conversations(s, system, convs, args.max_tokens,
                                      t0 + args.time_limit)
            record = {"conversations": len(convs), "wall_s": round(time.monotonic() - t0, 1),
                      "turns": summarize(turns)}
            if name in (OURS, OURS_OFF):
                time.sleep(0.5)
                record["pool_after_run"] = idle_pool(s)
        except (TimeoutError, httpx.HTTPError) as exc:
            record["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            record["log_tail"] = stop_server(s)[-400:]
        results[name] = record
        print(name, json.dumps({k: v for k, v in record.items() if k != "log_tail"}),
              flush=True)
    result = build_result(args, gguf, folder, results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"ratios": result["ratios"], "targets": result["targets"]}, indent=2))
    print(f"wrote {args.out}")
    return 0


def build_result(args: argparse.Namespace, gguf: Path, folder: Path,
                 results: dict[str, dict]) -> dict:
    def p50(name: str, turn: int) -> float | None:
        turns = results.get(name, {}).get("turns") or []
        return turns[turn - 1]["ttft_p50_s"] if len(turns) >= turn else None

    ratios, later = [], range(2, args.turns + 1)
    for t in range(1, args.turns + 1):
        peers = [p for p in (p50(LLAMA, t), p50(MLX_LM, t)) if p is not None]
        ratios.append({"turn": t, "ours_over_off_p50": ratio(p50(OURS, t), p50(OURS_OFF, t)),
                       "ours_over_llama_server_p50": ratio(p50(OURS, t), p50(LLAMA, t)),
                       "ours_over_mlx_lm_p50": ratio(p50(OURS, t), p50(MLX_LM, t)),
                       "ours_over_best_peer_p50": ratio(p50(OURS, t), min(peers, default=None))})
    ours = results.get(OURS, {})
    cached_later = [c for row in (ours.get("turns") or [])[1:] for c in row["cached_tokens"]]
    pool = ours.get("pool_after_run", {})
    off_ok = [r["ours_over_off_p50"] for r in ratios if r["turn"] in later]
    peer_ok = [r["ours_over_best_peer_p50"] for r in ratios if r["turn"] in later]
    targets = {
        "turns_2_on_ours_over_off_p50_le_0.35": bool(off_ok) and all(
            r is not None and r <= TARGETS["ours_over_off_p50_max"] for r in off_ok),
        "turns_2_on_ours_over_best_peer_p50_le_1.0": bool(peer_ok) and all(
            r is not None and r <= TARGETS["ours_over_best_peer_p50_max"] for r in peer_ok),
        "cached_tokens_gt_0_every_later_turn": bool(cached_later) and all(
            (c or 0) > 0 for c in cached_later),
        "no_unaccounted_blocks_after_run":
            pool.get("veloxquant_block_pool_request_blocks_in_use") == 0
        and pool.get("veloxquant_orphaned_blocks") == 0
        and pool.get("veloxquant_block_pool_cached_blocks")
        == pool.get("veloxquant_block_pool_evictable_blocks"),
    }
    return {
        "benchmark": "benchmark_scripts/benchmark_prefix_cache.py",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "revision": git_revision(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "model": {"gguf": gguf.name, "mlx_folder_for_mlx_lm": folder.name},
        "workload": {"conversations": args.conversations, "turns": args.turns,
                     "system_prompt_tokens": args.system_tokens,
                     "user_tokens_per_turn": args.user_tokens, "max_tokens": args.max_tokens,
                     "temperature": 0.0, "order": "round-robin by turn, one request at a time",
                     "mlx_lm_conversations": args.peer_conversations,
                     "our_pool_kv_memory": args.kv_memory},
        "servers": results,
        "ratios": ratios,
        "targets": targets,
    }


if __name__ == "__main__":
    sys.exit(main())
