"""Ours (quantized products from the codes) vs llama-server on one GGUF, and our previous revision.

Every server serves the very same GGUF file:

- ``veloxquant``: this checkout, ``python -m server --model GGUF`` (the GGUF is converted
  once beforehand in a child process, so start-up and memory are the server's alone);
- ``llama-server``: llama.cpp's, started by ``../shared/peers/serve_llama_server.sh``
  (2 threads, 16 continuous-batching slots);
- ``veloxquant-old`` (with ``--old-root DIR``): another checkout of ours, started with
  ``PYTHONPATH=DIR`` and ``cwd=DIR``, the environment otherwise the same (its own converter
  converts the file beforehand too, into its own cache folder).

The load is ``benchmark_server.run_levels``': at each ``--concurrency`` level, ``--rounds``
rounds in which the servers take turns going first; in a round all take the same prompts
(``--requests`` of about ``--prompt-tokens`` tokens cut from the offline corpus), and no
prompt is seen twice. Streaming completions, greedy, ``--max-tokens`` new tokens, a fresh
connection per request for every server (llama-server drops kept-alive connections now and
then). Per server and level: tok/s, TTFT p50/p99 and the rest of ``summarize``'s fields.

Memory, per server: the resident set (VmRSS, with its anonymous and file-backed parts) of the
server's process tree after load and warm-up, read once every server has been quiet for
``SETTLE_S`` seconds (ours gives a step's freed buffers back after one idle second; the
llama-server process itself is found by name under the script's pid), and its peak (VmHWM)
at the end. Ratios are ours over each peer;
``targets`` holds the issue's bars (``--target``, ``--target-ttft``, ``--target-rss``,
``--target-old``) with the measured value and whether it was met.

Usage (2 cores: nothing else heavy at the same time)::

    flock /tmp/velox-bench.lock .venv/bin/python benchmark_scripts/benchmark_codes.py \\
        [--gguf FILE] [--concurrency 1 16] [--requests 16] [--rounds 2] \\
        [--old-root /tmp/prev] [--target c1=0.8 --target c16=1.2] [--target-rss 1.3]

Writes ``figures/cpu/codes_<gguf stem>.json`` (``--out``) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_real_model import llama_server_binary, ratios_over  # noqa: E402
from benchmark_revisions import checkout_revision  # noqa: E402
from benchmark_server import (  # noqa: E402
    Running,
    free_port,
    make_prompts,
    run_levels,
    stop_server,
    wait_up,
)
from replica_set import default_signals  # noqa: E402
from server_load import run_requests  # noqa: E402

from veloxquant_mlx.cpu_backend import child_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT.parent / "shared" / "peers"
NEW, OLD, LLAMA = "veloxquant", "veloxquant-old", "llama-server"
DEFAULT_TARGETS = {"c1": 0.8, "c16": 1.2}  # SmolLM2-135M Q4_1's bars, tok/s ours / llama-server
SETTLE_S = 2.0  # quiet seconds before the after-warm-up memory is read

_CONVERT = ("import sys; from veloxquant_mlx.gguf import convert_gguf; "
            "from veloxquant_mlx.paths import models_dir; "
            "print(convert_gguf(sys.argv[1], models_dir()))")


def level_ratio(text: str) -> tuple[str, float]:
    """``c16=1.2`` (or ``16=1.2``) of ``--target``/``--target-ttft``."""
    level, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected LEVEL=RATIO (e.g. c16=1.2), got {text!r}")
    level = level if level.startswith("c") else f"c{level}"
    try:
        return level, float(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from exc


def server_env(root: Path, base: dict[str, str]) -> dict[str, str]:
    return {**base, "PYTHONPATH": str(root)}


def llama_kv_bytes(gguf: Path, args: argparse.Namespace) -> int:
    """The bytes of llama-server's KV cache for ``gguf`` as serve_llama_server.sh starts it:
    float16 keys and values for PARALLEL x CTX_PER_SLOT tokens (16 x 256) of every layer."""
    import gguf as gguf_lib

    fields = gguf_lib.GGUFReader(str(gguf)).fields

    def value(key: str) -> int:
        field = fields[key]
        return int(field.parts[field.data[0]][0])

    arch = "llama"
    heads = value(f"{arch}.attention.head_count")
    head_dim = value(f"{arch}.embedding_length") // heads
    kv_heads = value(f"{arch}.attention.head_count_kv")
    tokens = int(os.environ.get("PARALLEL", 16)) * int(os.environ.get("CTX_PER_SLOT", 256))
    return 2 * 2 * tokens * value(f"{arch}.block_count") * kv_heads * head_dim


def convert_first(root: Path, gguf: Path, env: dict[str, str]) -> dict:
    """Convert ``gguf`` with ``root``'s converter in a child (cached); its folder and time."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _CONVERT, str(gguf)], cwd=root,
                         env=server_env(root, env), capture_output=True, text=True)
    seconds = round(time.perf_counter() - t0, 1)
    if out.returncode != 0:  # the server converts at start-up instead
        print(f"  conversion with {root} failed (the server will convert): "
              f"{out.stderr.strip()[-400:]}", flush=True)
        return {"folder": None, "seconds": seconds, "error": out.stderr.strip()[-400:]}
    return {"folder": out.stdout.strip().splitlines()[-1], "seconds": seconds}


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (Linux)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                children = (task / "children").read_text().split()
                todo += [int(c) for c in children]
        except OSError:
            continue
    return out


def proc_status(pid: int) -> dict[str, float]:
    """VmRSS, VmHWM, RssAnon, RssFile of a live process, in MiB; comm as ``comm``."""
    out: dict = {}
    try:
        out["comm"] = Path(f"/proc/{pid}/comm").read_text().strip()
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = round(int(rest.split()[0]) / 1024, 1)
    except OSError:
        pass
    return out


def memory(server: Running) -> dict:
    """The server's resident memory now: its main process (llama-server: the process of that
    name under the started pid) and the sum over its process tree."""
    tree = process_tree(server.proc.pid)
    stats = {p: proc_status(p) for p in tree}
    main = server.proc.pid
    if server.name == LLAMA:
        main = next((p for p, s in stats.items() if s.get("comm") == "llama-server"), main)
    total = {key: round(sum(s.get(key, 0.0) for s in stats.values()), 1)
             for key in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}
    return {"pid": main, "comm": stats.get(main, {}).get("comm"), "processes": len(tree),
            "main": {k: v for k, v in stats.get(main, {}).items() if k != "comm"},
            "tree": total}


def startup_line(log_path: Path) -> str | None:
    """Our start-up line that says how the weights are held (``model ... loaded (...)``)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return None
    lines = [line for line in text.splitlines() if re.search(r"model .* loaded \(", line)]
    return lines[-1].split(": ", 1)[-1] if lines else None


def start(name: str, gguf: Path, env: dict[str, str], args: argparse.Namespace,
          llama_bin: str) -> tuple[Running, dict]:
    """Start one server on a free port and wait until it answers /v1/models; the server, and
    its start-up seconds and /v1/models entry."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = Path(tempfile.mkstemp(prefix=f"bench-codes-{name}-", suffix=".log")[1])
    log_file = log_path.open("w")
    if name == LLAMA:
        cmd = ["bash", str(PEERS / "serve_llama_server.sh"), str(port), str(gguf),
               *args.llama_arg]
        root, proc_env = ROOT, {**env, "LLAMA_SERVER": llama_bin}
    else:
        root = ROOT if name == NEW else args.old_root
        cmd = [sys.executable, "-m", "server", "--model", str(gguf), "--port", str(port),
               "--log-level", "info"]
        proc_env = server_env(root, env)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=root, env=proc_env, stdout=log_file, stderr=log_file,
                            text=True, preexec_fn=default_signals)  # stopped with SIGINT
    try:
        wait_up(base, proc, timeout=args.start_timeout)
    except RuntimeError as exc:
        proc.kill()
        proc.wait()
        log_file.close()
        tail = log_path.read_text(errors="replace")[-1500:]
        raise RuntimeError(f"{name}: {exc}; log tail:\n{tail}") from exc
    started = round(time.perf_counter() - t0, 1)
    models = httpx.get(base + "/v1/models", timeout=10).json()
    model_id = models["data"][0]["id"] if name != LLAMA else gguf.name
    return (Running(name, proc, base, model_id, log_path, log_file),
            {"start_s": started, "models_entry": models["data"][0]})


def targets(args: argparse.Namespace, ratios: dict, mem_ratio: float | None) -> dict:
    """Each bar with its measured value and whether it was met (None: not measured)."""
    out = {}

    def put(key: str, target: float, measured: float | None, at_least: bool) -> None:
        met = None if measured is None else (measured >= target if at_least
                                             else measured <= target)
        out[key] = {"target": target, "measured": measured, "met": met}

    over_llama = ratios.get(LLAMA, {})
    for level, minimum in args.target:
        put(f"{level}_tok_per_s_over_llama_min", minimum,
            over_llama.get(level, {}).get("tok_per_s"), True)
    for level, maximum in args.target_ttft:
        put(f"{level}_ttft_p50_over_llama_max", maximum,
            over_llama.get(level, {}).get("ttft_p50"), False)
    if args.target_rss:
        put("rss_after_warmup_over_llama_max", args.target_rss, mem_ratio, False)
    if OLD in ratios and args.target_old:
        for level, row in ratios[OLD].items():
            put(f"{level}_tok_per_s_over_old_min", args.target_old, row.get("tok_per_s"), True)
    return out


def print_table(result: dict) -> None:
    print(f"\n{'server':16s} {'level':>5s} {'tok/s':>8s} {'ttft p50':>9s} {'ttft p99':>9s} "
          f"{'errors':>6s}")
    for name, row in result["servers"].items():
        for lv in row["levels"]:
            print(f"{name:16s} {'c' + str(lv['concurrency']):>5s} {lv['tok_per_s']:8.2f} "
                  f"{lv['ttft_p50_s'] or 0:9.3f} {lv['ttft_p99_s'] or 0:9.3f} "
                  f"{lv['errors']:6d}")
    print(f"\n{'server':16s} {'start s':>8s} {'RSS MiB':>8s} {'anon':>8s} {'file':>8s} "
          f"{'peak MiB':>9s}")
    for name, row in result["servers"].items():
        warm, end = row["memory_after_warmup"]["tree"], row["memory_at_end"]["tree"]
        print(f"{name:16s} {row['start_s']:8.1f} {warm['VmRSS']:8.0f} {warm['RssAnon']:8.0f} "
              f"{warm['RssFile']:8.0f} {end['VmHWM']:9.0f}")
    for peer, levels in result["ratios_ours_over"].items():
        for level, r in levels.items():
            print(f"ours / {peer:14s} {level:>4s}: tok/s {r['tok_per_s']}  "
                  f"ttft p50 {r['ttft_p50']}  p99 {r['ttft_p99']}")
    for peer, r in result["memory_ratios_ours_over"].items():
        print(f"ours / {peer:14s} RSS after warm-up {r['rss_after_warmup']}  "
              f"peak {r['peak_rss']}")
    for key, t in result["targets"].items():
        mark = {True: "met", False: "MISSED", None: "n/a"}[t["met"]]
        print(f"target {key}: {t['measured']} vs {t['target']}: {mark}")
    if result["servers"].get(NEW, {}).get("startup_line"):
        print(f"ours: {result['servers'][NEW]['startup_line']}")


def add_server_args(p: argparse.ArgumentParser, figures: str) -> None:
    """The flags of every run on one GGUF: the file, the servers besides ours, where the
    figures go (see :func:`gguf_run`)."""
    p.add_argument("--gguf", type=Path, default=None, help="default: SmolLM2-135M's Q4_1")
    p.add_argument("--old-root", type=Path, default=None,
                   help="another checkout of ours to run too (PYTHONPATH and cwd = DIR)")
    p.add_argument("--no-llama", action="store_true", help="ours (and old) only")
    p.add_argument("--llama-server", help="llama-server binary (default: build/find it)")
    p.add_argument("--llama-arg", action="append", default=[],
                   help="extra llama-server flag (repeatable; e.g. --llama-arg=--log-disable)")
    p.add_argument("--start-timeout", type=float, default=1200.0)
    p.add_argument("--out", type=Path, default=None,
                   help=f"default figures/cpu/{figures}_<gguf stem>.json")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_server_args(p, "codes")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--requests", type=int, default=16, help="per server, level and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--warmup-tokens", type=int, default=8,
                   help="tokens per warm-up request (max(2, c) of them at each level c)")
    p.add_argument("--time-limit", type=float, default=600.0,
                   help="stop launching requests in one server's round after this many s")
    p.add_argument("--match-kv", action="store_true",
                   help="size our KV pool (pool.kv_memory) to llama-server's KV cache bytes, "
                        "so resident memory compares weights and runtime, not KV budgets")
    p.add_argument("--target", type=level_ratio, action="append", default=None,
                   help="LEVEL=RATIO: tok/s ours / llama-server at least this (repeatable; "
                        "default c1=0.8 c16=1.2, SmolLM2's)")
    p.add_argument("--target-ttft", type=level_ratio, action="append", default=[],
                   help="LEVEL=RATIO: TTFT p50 ours / llama-server at most this (repeatable)")
    p.add_argument("--target-rss", type=float, default=1.3,
                   help="resident set after warm-up, ours / llama-server, at most (0: none)")
    p.add_argument("--target-old", type=float, default=1.0,
                   help="tok/s ours / old revision at least this at every level (0: none)")
    args = p.parse_args()
    if args.target is None:
        args.target = list(DEFAULT_TARGETS.items())
    return args


def gguf_run(args: argparse.Namespace, figures: str) -> tuple[Path, Path, dict[str, str],
                                                              list[str], str]:
    """What a run on one GGUF starts from: the file (``--gguf``, else SmolLM2's), where its
    figures go (``--out``, else ``figures/cpu/<figures>_<stem>.json``), the servers'
    environment, the servers to run, and llama-server's binary ("" when it does not run)."""
    from veloxquant_mlx.gguf import smollm2_gguf_path

    if args.old_root is not None:
        args.old_root = args.old_root.resolve()
    gguf = (args.gguf or smollm2_gguf_path()).resolve()
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", gguf.name.removesuffix(".gguf"))
    out_path = args.out or ROOT / "figures" / "cpu" / f"{figures}_{stem}.json"
    names = [NEW] + ([OLD] if args.old_root else []) + ([] if args.no_llama else [LLAMA])
    llama_bin = llama_server_binary(args.llama_server) if LLAMA in names else ""
    return gguf, out_path, child_env(preload=True), names, llama_bin


def main() -> int:
    args = parse_args()
    gguf, out_path, env, names, llama_bin = gguf_run(args, "codes")
    if args.match_kv:  # ours' KV pool holds as many bytes as llama-server's KV cache
        env["VELOXQUANT_POOL_KV_MEMORY"] = str(llama_kv_bytes(gguf, args))
    conversions = {NEW: convert_first(ROOT, gguf, env)}
    if args.old_root:
        conversions[OLD] = convert_first(args.old_root, gguf, env)
    folder = conversions[NEW]["folder"]
    if folder is None:
        raise SystemExit(f"this checkout cannot convert {gguf}: {conversions[NEW]['error']}")
    # Warm-up prompts (the last ones) are never measured; at every level, so that shapes
    # first met at a batch size are not paid inside the measured rounds.
    n_warm = max(2, *args.concurrency)
    prompts = make_prompts(Path(folder),
                           args.requests * args.rounds * len(args.concurrency) + n_warm,
                           args.prompt_tokens)
    servers: list[Running] = []
    info: dict[str, dict] = {}
    try:
        for name in names:
            print(f"starting {name}", flush=True)
            server, info[name] = start(name, gguf, env, args, llama_bin)
            servers.append(server)
        for s in servers:  # warm-up, not measured (prompts outside the measured pool)
            for c in args.concurrency:
                asyncio.run(run_requests(s.base, s.model_id, prompts[-n_warm:], c,
                                         max(2, c), args.warmup_tokens, 600,
                                         keep_alive=False))
        time.sleep(SETTLE_S)
        mem_warm = {s.name: memory(s) for s in servers}
        startup = {s.name: startup_line(s.log_path) for s in servers if s.name != LLAMA}
        levels = run_levels(servers, prompts[:-n_warm], args, lambda name, c: args.requests,
                            keep_alive=False)
        mem_end = {s.name: memory(s) for s in servers}
    finally:
        logs = {s.name: stop_server(s) for s in servers}
    ratios = {peer: ratios_over(levels[NEW], levels[peer]) for peer in names[1:]}

    def mem_ratio(peer: str, which: dict, key: str) -> float | None:
        a, b = which[NEW]["tree"].get(key), which[peer]["tree"].get(key)
        return round(a / b, 3) if a and b else None

    mem_ratios = {peer: {"rss_after_warmup": mem_ratio(peer, mem_warm, "VmRSS"),
                         "rss_anon_after_warmup": mem_ratio(peer, mem_warm, "RssAnon"),
                         "peak_rss": mem_ratio(peer, mem_end, "VmHWM")}
                  for peer in names[1:]}
    llama_version = None
    if llama_bin:
        v = subprocess.run([llama_bin, "--version"], capture_output=True, text=True)
        llama_version = (v.stdout + v.stderr).strip()[-300:]
    result = {
        "benchmark": "benchmark_scripts/benchmark_codes.py",
        "argv": sys.argv[1:],
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "revisions": {NEW: checkout_revision(ROOT),
                      **({OLD: checkout_revision(args.old_root)} if args.old_root else {})},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version()},
        "model": {"gguf": str(gguf), "bytes": gguf.stat().st_size,
                  "conversion": conversions},
        "llama_server": {"binary": llama_bin, "version": llama_version,
                         "script": "serve_llama_server.sh", "extra_args": args.llama_arg,
                         "threads": os.environ.get("THREADS", "2"),
                         "parallel": os.environ.get("PARALLEL", "16")} if llama_bin else None,
        "load": {"prompt_tokens_target": args.prompt_tokens, "max_tokens": args.max_tokens,
                 "temperature": 0.0, "streaming": True, "concurrency": args.concurrency,
                 "requests_per_level_per_round": args.requests, "rounds": args.rounds,
                 "order": "first server rotates each round; same prompts for all in a "
                          "round; no prompt seen twice; a fresh connection per request",
                 "warmup": f"per level c: max(2, c) requests of {args.warmup_tokens} tokens "
                           "at concurrency c, before any measured round",
                 "time_limit_s": args.time_limit,
                 "our_kv_memory_bytes": env.get("VELOXQUANT_POOL_KV_MEMORY",
                                                "default (pool sized at start-up)")},
        "servers": {s.name: {"levels": levels[s.name], **info[s.name],
                             "startup_line": startup.get(s.name),
                             "memory_after_warmup": mem_warm[s.name],
                             "memory_at_end": mem_end[s.name],
                             "log_tail": logs[s.name][-600:]} for s in servers},
        "ratios_ours_over": ratios,
        "memory_ratios_ours_over": mem_ratios,
        "memory_note": "MiB, summed over the server's process tree (llama-server: one "
                       "process); after warm-up = VmRSS after load and the warm-up; "
                       "peak = VmHWM at the end. RssFile counts mapped file pages "
                       "(llama-server maps the GGUF).",
    }
    result["targets"] = targets(args, ratios,
                                mem_ratios.get(LLAMA, {}).get("rss_after_warmup"))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
