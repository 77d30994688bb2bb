"""This server vs ``mlx_lm.server`` on the same model, machine, BLAS and load.

Starts our server and ``mlx_lm.server`` (same run), then at each concurrency
level drives them one after the other with the same bounded streaming load,
for ``--rounds`` rounds in which they alternate going first (the machine is
shared, so background load drifts; alternating spreads it over both). No
server sees a prompt twice, so mlx-lm's prompt cache cannot answer from cache.
The single-stream ceiling is ``mlx_lm.stream_generate`` in a child process.
Per level it records aggregate tok/s, req/s, TTFT and latency p50/p99, errors,
and the server process's CPU time per generated token (steadier than wall
time on a busy machine). Every child runs on the same BLAS (the optimized one
when installed: ``veloxquant_mlx.cpu_backend.child_env``; ``mlx_lm`` loads it
through ``cpu_backend.module_command``), and the model is the offline
``small`` preset in float32 on both sides.

Usage::

    flock /tmp/velox-bench.lock .venv/bin/python benchmark_scripts/benchmark_server.py \
        [--concurrency 1 4 16 32] [--requests-per-level N] [--time-limit S]

Writes ``figures/server/results.json`` and prints a table. ``--workload constrained
--concurrency 16`` is the structured-outputs row instead: decode tok/s with every
row constrained by a JSON schema vs none (``benchmark_structured.py``, writing
``figures/structured/results.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mixed_load import mixed_rounds, run_mixed  # noqa: E402
from replica_set import default_signals  # noqa: E402
from server_load import run_requests, summarize  # noqa: E402

from veloxquant_mlx.blas_finder import OPT_OUT_ENV  # noqa: E402
from veloxquant_mlx.cpu_backend import (  # noqa: E402
    LOAD_FIRST,
    child_env,
    module_command,
)
from veloxquant_mlx.offline_model import ensure_model, iter_corpus  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "figures" / "server" / "results.json"
OURS, PEER = "veloxquant", "mlx_lm.server"
TARGETS_C1 = {"tok_per_s_ratio_min": 0.95, "ttft_p50_ratio_max": 1.1}
# Continuous batching's targets: ours over the peer.
TARGETS_BATCHING = {"c16_tok_per_s_ratio_min": 1.15, "c16_ttft_p99_ratio_max": 0.7,
                    "c1_tok_per_s_ratio_min": 0.95, "peak_rss_ratio_max": 1.0, "errors": 0}

_CEILING = """
import json, statistics, sys, mlx.core as mx, mlx_lm
from mlx_lm.sample_utils import make_sampler
model, tok = mlx_lm.load(sys.argv[1])
prompt, n = sys.argv[2], int(sys.argv[3])
runs = []
for _ in range(4):
    last = None
    for last in mlx_lm.stream_generate(model, tok, prompt, max_tokens=n,
                                       sampler=make_sampler(0.0)):
        pass
    runs.append((last.generation_tps, last.prompt_tps, last.generation_tokens))
runs = runs[1:]  # the first run warms up
print(json.dumps({"generation_tps_median": statistics.median(r[0] for r in runs),
                  "prompt_tps_median": statistics.median(r[1] for r in runs),
                  "generation_tokens": runs[-1][2], "runs": len(runs),
                  "model_dtype": str(model.layers[0].self_attn.q_proj.weight.dtype)}))
"""

_BACKEND = LOAD_FIRST + ("from veloxquant_mlx.blas_status import describe_backend; "
                         "import mlx.core; print(describe_backend('float32'))")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_prompts(model_path: Path, n: int, n_tokens: int) -> list[str]:
    """``n`` distinct prompts of about ``n_tokens`` tokens, cut from the offline corpus."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    ids = tok.encode(" ".join(iter_corpus(200_000)), add_special_tokens=False)
    stride = max((len(ids) - n_tokens) // max(n, 1), 1)
    return [tok.decode(ids[i * stride: i * stride + n_tokens]) for i in range(n)]


def server_command(name: str, model: Path, port: int) -> list[str]:
    py = sys.executable
    if name == OURS:
        return [py, "-m", "server", "--model", str(model), "--port", str(port),
                "--log-level", "warning"]
    return module_command("mlx_lm", "server", "--model", str(model), "--port", str(port),
                          "--log-level", "WARNING")


def wait_up(base_url: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was up")
        try:
            if httpx.get(base_url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server at {base_url} not up after {timeout}s")


def peak_rss_mb(pid: int) -> float | None:
    """VmHWM (peak resident set) of a live process, in MiB (Linux)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def process_cpu_s(pid: int, tid: int | None = None) -> float:
    """User + system CPU seconds of a live process (Linux): all its threads, or thread ``tid``.

    A server's thread ``pid`` is its main thread: for ours (and uvicorn servers) the
    asyncio loop serving HTTP, whose share of the GIL the engine thread waits behind.
    """
    stat = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(stat).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Running:
    """A started server under test."""

    name: str
    proc: subprocess.Popen
    base: str
    model_id: str
    log_path: Path
    log_file: object


def start_server(name: str, model: Path, env: dict[str, str]) -> Running:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # A file, not a pipe: an unread pipe could fill up and stall the server.
    log_path = Path(tempfile.mkstemp(prefix=f"bench-{name}-", suffix=".log")[1])
    log_file = log_path.open("w")
    proc = subprocess.Popen(server_command(name, model, port), cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=log_file, text=True,
                            preexec_fn=default_signals)  # it is stopped with SIGINT
    wait_up(base, proc)
    # mlx_lm.server treats an unknown model id as a hub id; its own path selects the loaded one.
    model_id = str(model) if name == PEER else \
        httpx.get(base + "/v1/models").json()["data"][0]["id"]
    return Running(name, proc, base, model_id, log_path, log_file)


def stop_server(server: Running) -> str:
    """Stop a server; return the tail of its log."""
    server.proc.send_signal(signal.SIGINT)
    try:
        server.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()
    server.log_file.close()
    err = server.log_path.read_text(errors="replace")
    server.log_path.unlink()
    return err[-1500:]


def drive(s: Running, batch: list[str], c: int, n: int, args: argparse.Namespace,
          keep_alive: bool = True) -> tuple[list, float, float]:
    """One bounded load on one server: its results, wall seconds and server CPU seconds."""
    cpu0 = process_cpu_s(s.proc.pid)
    results, seconds = asyncio.run(run_requests(
        s.base, s.model_id, batch, c, n, args.max_tokens, args.time_limit, keep_alive))
    return results, seconds, process_cpu_s(s.proc.pid) - cpu0


def level_summary(name: str, c: int, results: list, wall: float, cpu: float,
                  loop_cpu: float | None = None) -> dict:
    """Aggregate one server's requests at one level (all rounds), print a line, return it.

    ``cpu``: the server process's CPU seconds; ``loop_cpu``: its main thread's, if measured.
    """
    level = summarize(c, results, wall).as_dict()
    tokens = max(level["generated_tokens"], 1)
    level["server_cpu_ms_per_token"] = round(1000 * cpu / tokens, 2)
    if loop_cpu is not None:
        level["server_main_thread_cpu_ms_per_token"] = round(1000 * loop_cpu / tokens, 3)
    print(f"  {name:14s} c={c:<3d} {level['tok_per_s']:8.1f} tok/s "
          f"ttft p50 {level['ttft_p50_s']}s p99 {level['ttft_p99_s']}s "
          f"errors {level['errors']} {level['error_samples'][:1]}", flush=True)
    return level


def run_levels(servers: list[Running], prompts: list[str], args: argparse.Namespace,
               n_requests: Callable[[str, int], int] | None = None,
               keep_alive: bool = True) -> dict:
    """Every level in ``args.rounds`` rounds; the first server rotates every round.

    All servers take their requests from the front of the same prompts in a round
    and no server sees a prompt twice (prompt caches would otherwise answer
    repeats from cache). ``n_requests(name, c)`` sets a server's requests per
    round (default ``--requests-per-level`` or ``max(12, 2 x c)`` for all).
    """
    out: dict[str, list[dict]] = {s.name: [] for s in servers}
    offset = 0
    for c in args.concurrency:
        if n_requests is None:
            counts = dict.fromkeys((s.name for s in servers),
                                   args.requests_per_level or max(12, 2 * c))
        else:
            counts = {s.name: n_requests(s.name, c) for s in servers}
        got: dict[str, list] = {s.name: [] for s in servers}
        wall = dict.fromkeys(got, 0.0)
        cpu = dict.fromkeys(got, 0.0)
        for rnd in range(args.rounds):
            batch = prompts[offset: offset + max(counts.values())]
            offset += len(batch)
            k = rnd % len(servers)
            for s in servers[k:] + servers[:k]:
                results, seconds, cpu_s = drive(s, batch, c, counts[s.name], args, keep_alive)
                got[s.name] += results
                wall[s.name] += seconds
                cpu[s.name] += cpu_s
        for s in servers:
            out[s.name].append(level_summary(s.name, c, got[s.name], wall[s.name], cpu[s.name]))
    return out


def bench_servers(model: Path, envs: dict[str, dict[str, str]], prompts: list[str],
                  args: argparse.Namespace) -> dict:
    """Start both servers (each with its own environment), warm up, run every level, stop."""
    servers: list[Running] = []
    try:
        for name in (OURS, PEER):
            servers.append(start_server(name, model, envs[name]))
        for s in servers:  # warm-up, not measured (prompts outside the measured pool)
            asyncio.run(run_requests(s.base, s.model_id, prompts[-2:], 1, 2, args.max_tokens,
                                     120))
        levels = run_levels(servers, prompts[:-2], args)
        rss = {s.name: peak_rss_mb(s.proc.pid) for s in servers}
    finally:
        logs = {s.name: stop_server(s) for s in servers}
    return {s.name: {"levels": levels[s.name], "peak_rss_mib": rss[s.name],
                     "log_tail": logs[s.name]} for s in servers}


def ratios(ours: dict, peer: dict) -> dict:
    out = {}
    for a, b in zip(ours["levels"], peer["levels"], strict=True):
        def ratio(key, a=a, b=b):
            return round(a[key] / b[key], 3) if a[key] and b[key] else None
        out[f"c{a['concurrency']}"] = {
            "tok_per_s": ratio("tok_per_s"), "req_per_s": ratio("req_per_s"),
            "ttft_p50": ratio("ttft_p50_s"), "ttft_p90": ratio("ttft_p90_s"),
            "ttft_p99": ratio("ttft_p99_s"),
            "latency_p50": ratio("latency_p50_s"), "latency_p99": ratio("latency_p99_s"),
        }
    return out


def git_revision() -> str:
    """The commit the servers ran (with ``+dirty`` when server/ had local edits)."""
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True).stdout
    rev = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    return rev + ("+dirty" if git("status", "--porcelain", "--", "server").strip() else "")


def batching_targets(result: dict) -> dict:
    """The batching targets, each with the measured value and whether it was met."""
    r = result["ratios_ours_over_peer"]
    servers = result["servers"]
    ours, peer = servers[OURS]["peak_rss_mib"], servers[PEER]["peak_rss_mib"]
    measured = {
        "c16_tok_per_s_ratio_min": (r.get("c16") or {}).get("tok_per_s"),
        "c16_ttft_p99_ratio_max": (r.get("c16") or {}).get("ttft_p99"),
        "c1_tok_per_s_ratio_min": (r.get("c1") or {}).get("tok_per_s"),
        "peak_rss_ratio_max": round(ours / peer, 3) if ours and peer else None,
        "errors": sum(lv["errors"] for lv in servers[OURS]["levels"]),
    }
    out = {}
    for key, target in TARGETS_BATCHING.items():
        value = measured[key]
        if value is None:
            met = None
        elif key.endswith("_min"):
            met = value >= target
        else:
            met = value <= target
        out[key] = {"target": target, "measured": value, "met": met}
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small", help="offline model preset")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests-per-level", type=int, default=0,
                   help="requests per level and round (default max(12, 2 x concurrency))")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds per level; the servers alternate who goes first")
    p.add_argument("--time-limit", type=float, default=240.0,
                   help="stop launching requests in a level after this many seconds")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=None,
                   help="default figures/server/results.json (uniform) or kv_memory.json (mixed)")
    p.add_argument("--workload", choices=("uniform", "mixed", "constrained"), default="uniform",
                   help="mixed: rounds of 1 prompt of --long-tokens among 15 of "
                        "--prompt-tokens, all at once (see mixed_load.py); constrained: "
                        "decode tok/s with every row under a JSON schema vs none, at the "
                        "largest --concurrency (benchmark_structured.py)")
    p.add_argument("--long-tokens", type=int, default=2000)
    p.add_argument("--kv-memory", default="",
                   help="our pool.kv_memory (e.g. 128MiB); empty: the default pool")
    p.add_argument("--out-of-the-box", action="store_true",
                   help="start both servers from a plain environment (no shared preload); "
                        "write e.g. --out figures/server/out_of_the_box.json")
    return p.parse_args()


def main_mixed(args: argparse.Namespace, model: Path, env: dict[str, str]) -> dict:
    """Run the mixed-length workload on both servers; tok/s, TTFT and peak KV memory."""
    rounds = mixed_rounds(make_prompts, model, args.rounds + 1, args.long_tokens,
                          args.prompt_tokens)
    ours_env = {**env, "VELOXQUANT_POOL_KV_MEMORY": args.kv_memory} if args.kv_memory else env
    servers: list[Running] = []
    try:
        servers.append(start_server(OURS, model, ours_env))
        servers.append(start_server(PEER, model, env))
        for s in servers:  # warm-up round, not measured
            asyncio.run(run_requests(s.base, s.model_id, rounds[0][-2:], 2, 2,
                                     args.max_tokens, 120))
        levels = run_mixed(servers, rounds[1:], args.max_tokens, args.time_limit)
        text = httpx.get(servers[0].base + "/metrics").text
        capacity = next(float(line.split()[-1]) for line in text.splitlines()
                        if line.startswith('veloxquant_kv_bytes{kind="capacity"}'))
    finally:
        for s in servers:
            stop_server(s)
    ours, peer = levels[OURS], levels[PEER]
    ours["kv_arena_mib"] = round(capacity / 2**20, 1)
    ours["kv_memory_mib"] = round(ours["kv_arena_mib"] + ours["peak_rss_growth_mib"], 1)
    peer["kv_memory_mib"] = peer["peak_rss_growth_mib"]
    ratio = {"tok_per_s": round(ours["tok_per_s"] / peer["tok_per_s"], 3),
             "kv_memory": round(ours["kv_memory_mib"] / peer["kv_memory_mib"], 3)}
    return {"workload": {"long_prompt_tokens": args.long_tokens, "short_prompt_tokens":
                         args.prompt_tokens, "short_requests": 15, "max_tokens":
                         args.max_tokens, "rounds": args.rounds, "kv_memory": args.kv_memory
                         or "default pool"},
            "servers": levels, "ratios_ours_over_peer": ratio,
            "targets": {"kv_memory_ratio_max": 0.5, "tok_per_s_ratio_min": 1.0,
                        "met": ratio["kv_memory"] <= 0.5 and ratio["tok_per_s"] >= 1.0}}


def main_constrained(args: argparse.Namespace) -> int:
    """The constrained-decoding row: benchmark_structured.py in a child (validity and cost).

    Our server over HTTP on the real default model (``response_format`` on
    ``/v1/chat/completions``): the same prompts and output lengths with and
    without a grammar, at concurrency 16 by default.
    """
    out = args.out or ROOT / "figures" / "structured" / "results.json"
    cmd = [sys.executable, str(ROOT / "benchmark_scripts" / "benchmark_structured.py"),
           "--concurrency", str(max(args.concurrency)), "--rounds", str(args.rounds),
           "--out", str(out)]
    return subprocess.run(cmd, cwd=ROOT, env=child_env(preload=True)).returncode


def main() -> int:
    args = parse_args()
    if args.workload == "constrained":
        return main_constrained(args)
    model = ensure_model(args.preset)
    env = child_env(preload=True)
    env["PYTHONPATH"] = str(ROOT)
    if args.workload == "mixed":
        out = args.out or DEFAULT_OUT.with_name("kv_memory.json")
        result = {"benchmark": "benchmark_scripts/benchmark_server.py --workload mixed",
                  "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "revision": git_revision(), "model": args.preset,
                  **main_mixed(args, model, env)}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result["ratios_ours_over_peer"]), f"wrote {out}")
        return 0
    args.out = args.out or DEFAULT_OUT
    backend = subprocess.run([sys.executable, "-c", _BACKEND], env=env, capture_output=True,
                             text=True, check=True).stdout.strip()
    print(f"backend: {backend}", flush=True)
    per_round = sum(args.requests_per_level or max(12, 2 * c) for c in args.concurrency)
    prompts = make_prompts(model, per_round * args.rounds + 2, args.prompt_tokens)
    ceiling = json.loads(subprocess.run(
        [sys.executable, "-c", LOAD_FIRST + _CEILING, str(model), prompts[0],
         str(args.max_tokens)],
        env=env, capture_output=True, text=True, check=True).stdout)
    print(f"  mlx_lm.generate single stream: {ceiling['generation_tps_median']:.1f} tok/s",
          flush=True)
    envs = {OURS: env, PEER: env}
    if args.out_of_the_box:
        # Each server as a user gets it. Ours loads the optimized BLAS itself
        # (cpu.optimized_blas); the peer keeps MLX's bundled reference BLAS.
        plain = {k: v for k, v in child_env(preload=False).items() if k != OPT_OUT_ENV}
        plain["PYTHONPATH"] = str(ROOT)
        envs = {OURS: plain, PEER: dict(plain, **{OPT_OUT_ENV: "1"})}
    servers = bench_servers(model, envs, prompts, args)
    result = {
        "benchmark": "benchmark_scripts/benchmark_server.py",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "revision": git_revision(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version()},
        "backend": backend,
        "blas_setup": "out of the box: ours loads its optimized BLAS itself, the peer "
                      "runs MLX's bundled BLAS" if args.out_of_the_box
                      else "same optimized BLAS loaded by both",
        "model": {"preset": args.preset, "path": str(model.relative_to(ROOT))
                  if model.is_relative_to(ROOT) else str(model),
                  "dtype": ceiling["model_dtype"]},
        "load": {"prompt_tokens_target": args.prompt_tokens, "max_tokens": args.max_tokens,
                 "temperature": 0.0, "streaming": True, "concurrency": args.concurrency,
                 "requests_per_level_per_round": args.requests_per_level
                 or "max(12, 2 x concurrency)", "rounds": args.rounds,
                 "order": "servers alternate first/second each round; no prompt repeats",
                 "time_limit_s": args.time_limit},
        "single_stream_mlx_lm_generate": ceiling,
        "servers": servers,
        "ratios_ours_over_peer": ratios(servers[OURS], servers[PEER]),
        "targets_issue_4_c1": TARGETS_C1,
    }
    c1 = result["ratios_ours_over_peer"].get("c1")
    if c1 and c1["tok_per_s"] and c1["ttft_p50"]:
        result["targets_issue_4_c1"]["met"] = (
            c1["tok_per_s"] >= TARGETS_C1["tok_per_s_ratio_min"]
            and c1["ttft_p50"] <= TARGETS_C1["ttft_p50_ratio_max"]
            and all(lv["errors"] == 0 for lv in servers[OURS]["levels"]))  # ours: no errors
    result["targets_issue_5_batching"] = batching_targets(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["ratios_ours_over_peer"], indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
