"""This server vs ``mlx_lm.server`` on one NVIDIA GPU (MLX's CUDA backend), one bounded run.

Made to fit one 10-minute command on a GPU machine with no network: it builds
the offline ``1b`` model there (random bfloat16 weights, Llama-3.2-1B-like
shape), then runs the two servers ONE AFTER THE OTHER (never both resident, so
neither competes for GPU memory or the CPU that feeds it). Each server: start,
two warm-up requests, then concurrency levels 1, 16, 64 of streaming
``/v1/completions`` (prompts of ~128 tokens, 128 new tokens, temperature 0;
the random model rarely emits EOS, and generated counts are recorded;
completions rather than chat so a prompt is exactly the tokens cut for it, no
template around it). Both servers get the same prompts and no server sees a
prompt twice. Ours is then
stopped with SIGTERM and its exit checked. Around each of our levels the
engine's step clock is read from ``/metrics`` (server/engine/run_output.py),
so each level records where a decode step's time went under that load.

Every phase is bounded: a level stops launching requests at its time limit
(shared out of ``--budget-s``) and is abandoned if it does not drain; the JSON
is rewritten after every level, so a run killed from outside still leaves its
figures. Ratios are ours over the peer, measured in the same run.

Usage (GPU machine, from a source checkout)::

    PYTHONPATH=$(pwd) python3 benchmark_scripts/benchmark_gpu.py --out $OUT/results.json

Check the flow on a CPU (tiny model, a few requests, ~15 s)::

    .venv/bin/python benchmark_scripts/benchmark_gpu.py --smoke --out /tmp/gpu_smoke.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_server import OURS, PEER, git_revision, level_summary, make_prompts  # noqa: E402
from benchmark_server import peak_rss_mb as peak_rss_mib  # noqa: E402
from gpu_phases import (  # noqa: E402
    Budget,
    build_and_describe,
    drive_bounded,
    engine_clock,
    nvidia_smi,
    start,
    step_profile,
    stop,
    warm_up,
)

from veloxquant_mlx.cpu_backend import child_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "figures" / "gpu" / "results.json"
TARGETS = {"c64_tok_per_s_ratio_min": 2.0, "c64_tok_per_s_min": 5000.0,
           "c1_tok_per_s_ratio_min": 1.3, "errors_max": 0, "sigterm_exit_code": 0}


def run_levels(s, entry: dict, ctx: dict, args: argparse.Namespace, save) -> None:
    """Every level on one started server, each bounded by its share of the budget."""
    offset = 0
    for i, (c, n) in enumerate(zip(args.concurrency, args.requests, strict=True)):
        batch = ctx["prompts"][offset: offset + n]
        offset += n  # both servers get the same prompts; none repeats on a server
        levels_left = len(args.concurrency) - i + ctx["levels_after"][s.name]
        limit = ctx["budget"].level_limit(args.time_limit, levels_left)
        if limit is None:
            entry["levels"].append({"concurrency": c, "skipped": "time budget spent"})
            continue
        try:
            clock = engine_clock(s.base) if s.name == OURS else None
            got, wall, cpu, main_cpu = drive_bounded(s, batch, c, n, args.max_tokens, limit,
                                                     args.drain_s)
            level = level_summary(s.name, c, got, wall, cpu, main_cpu)
            if clock is not None:  # where our engine's step time went at this level
                level["step_profile"] = step_profile(clock, engine_clock(s.base))
                print(f"    step profile: {level['step_profile']}", flush=True)
        except TimeoutError:
            level = {"concurrency": c,
                     "error": f"not drained {args.drain_s}s after its {limit}s limit"}
        level.update(requests_planned=n, time_limit_s=limit)
        entry["levels"].append(level)
        save()


def run_server(name: str, ctx: dict, args: argparse.Namespace, result: dict, save) -> None:
    """Start, warm up, run every level, stop one server; record into ``result``."""
    entry = result["servers"][name] = {"levels": [], "extra_args": ctx["extra"][name]}
    if ctx["budget"].left() < 30:
        entry["start_error"] = "time budget spent before start"
        save()
        return
    t0 = time.monotonic()
    try:
        s = start(name, ctx["model"], ctx["env"], ctx["log_dir"], ctx["extra"][name])
    except Exception as exc:  # noqa: BLE001 - a server that fails to start is a result
        entry["start_error"] = f"{type(exc).__name__}: {exc}"
        log = ctx["log_dir"] / f"{name}.log"
        entry["log_tail"] = log.read_text(errors="replace")[-1500:] if log.exists() else ""
        result["phases_s"][name] = round(time.monotonic() - t0, 2)
        save()
        return
    entry["start_s"] = round(time.monotonic() - t0, 2)
    try:
        # Warm-up prompts lie outside the measured ones.
        entry["warmup_s"] = warm_up(s, ctx["prompts"][-2:], args.max_tokens, args.drain_s)
        run_levels(s, entry, ctx, args, save)
        entry["peak_rss_mib"] = peak_rss_mib(s.proc.pid)
        entry["gpu_memory_used"] = nvidia_smi("memory.used")
    except Exception:  # noqa: BLE001 - record it, stop the server, go on to the next phase
        entry["error"] = traceback.format_exc()[-1500:]
    finally:
        t = time.monotonic()
        # Ours is stopped the way a service manager does (SIGTERM); the peer as before.
        entry["stop"] = stop(s, signal.SIGTERM if name == OURS else signal.SIGINT,
                             60 if name == OURS else 30)
        if name == OURS:
            result["sigterm"] = {k: entry["stop"][k]
                                 for k in ("exit_code", "stderr_tail", "clean")}
        result["phases_s"][f"{name}_stop"] = round(time.monotonic() - t, 2)
        result["phases_s"][name] = round(time.monotonic() - t0, 2)
        save()


def _level(entry: dict, c: int) -> dict:
    return next((lv for lv in entry.get("levels", []) if lv.get("concurrency") == c
                 and "tok_per_s" in lv), {})


def ratios(result: dict, levels: list[int]) -> dict:
    """Ours over the peer at each level both measured (TTFT: lower is better)."""
    ours, peer = result["servers"].get(OURS, {}), result["servers"].get(PEER, {})
    out = {}
    for c in levels:
        a, b = _level(ours, c), _level(peer, c)
        out[f"c{c}"] = {k: round(a[key] / b[key], 3) if a.get(key) and b.get(key) else None
                        for k, key in (("tok_per_s", "tok_per_s"), ("ttft_p50", "ttft_p50_s"),
                                       ("ttft_p99", "ttft_p99_s"))}
    return out


def targets(result: dict) -> dict:
    """The GPU run's targets, each with its measured value and whether it was met."""
    r, ours = result["ratios_ours_over_peer"], result["servers"].get(OURS, {})
    # A level abandoned undrained counts all its planned requests as errors.
    counts = [lv["errors"] if "errors" in lv else lv["requests_planned"]
              for lv in ours.get("levels", []) if "errors" in lv or "error" in lv]
    errors = sum(counts) if counts else None
    measured = {
        "c64_tok_per_s_ratio_min": (r.get("c64") or {}).get("tok_per_s"),
        "c64_tok_per_s_min": _level(ours, 64).get("tok_per_s"),
        "c1_tok_per_s_ratio_min": (r.get("c1") or {}).get("tok_per_s"),
        "errors_max": errors,
        "sigterm_exit_code": (result.get("sigterm") or {}).get("exit_code"),
    }
    out = {}
    for key, target in TARGETS.items():
        value = measured[key]
        if value is None:
            met = None
        elif key.endswith("_min"):
            met = value >= target
        elif key.endswith("_max"):
            met = value <= target
        else:
            met = value == target
        out[key] = {"target": target, "measured": value, "met": met}
    return out


def print_table(result: dict, levels: list[int]) -> None:
    ours, peer = result["servers"].get(OURS, {}), result["servers"].get(PEER, {})
    print(f"\n{'level':>5} {'ours tok/s':>11} {'peer tok/s':>11} {'ratio':>6} "
          f"{'ttft p99 ours':>13} {'peer':>7} {'errors o/p':>10} {'tokens o/p':>12}")
    for c in levels:
        a, b = _level(ours, c), _level(peer, c)
        ratio = result["ratios_ours_over_peer"][f"c{c}"]["tok_per_s"]

        def pair(key: str, a=a, b=b) -> str:
            return f"{a.get(key, '-')}/{b.get(key, '-')}"
        print(f"{'c' + str(c):>5} {a.get('tok_per_s', '-'):>11} {b.get('tok_per_s', '-'):>11} "
              f"{ratio if ratio is not None else '-':>6} {a.get('ttft_p99_s', '-'):>13} "
              f"{b.get('ttft_p99_s', '-'):>7} {pair('errors'):>10} "
              f"{pair('generated_tokens'):>12}")
    sig = result.get("sigterm") or {}
    print(f"sigterm: exit {sig.get('exit_code')} clean {sig.get('clean')}")
    for key, t in result.get("targets", {}).items():
        print(f"target {key}: {t['measured']} vs {t['target']} met={t['met']}")
    print("phases (s):", json.dumps(result["phases_s"]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--smoke", action="store_true",
                   help="CPU check of the flow: tiny model, few requests, short budget")
    p.add_argument("--preset", default=None, help="offline model preset (default 1b)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--requests", type=int, nargs="+", default=None,
                   help="requests per level, one per --concurrency (default 8 48 192)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="default 128")
    p.add_argument("--max-tokens", type=int, default=None, help="default 128")
    p.add_argument("--time-limit", type=float, default=120.0,
                   help="most seconds a level launches requests for (per server)")
    p.add_argument("--drain-s", type=float, default=60.0,
                   help="a level not done this long after its limit is abandoned")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall budget of the whole run (default 390; smoke 170)")
    p.add_argument("--reserve-s", type=float, default=None,
                   help="budget kept back for stops and the peer's start")
    # 64 on both sides: at concurrency 64 every request decodes in the batch
    # (each server's default is 32, which would queue half of them).
    p.add_argument("--max-batch", type=int, default=64,
                   help="decode batch of both servers (ours: batch.max_batch_size, peer: "
                        "--decode-concurrency); 0 = each server's default (32 both)")
    p.add_argument("--kv-memory", default=None,
                   help="our pool.kv_memory (default 1GiB on the 1b run, the config's in smoke)")
    p.add_argument("--kv-write-back", type=int, default=None,
                   help="our batch.kv_write_back (default: the server's, 32; 1 writes the "
                        "arena every step, the A/B of the write-back)")
    p.add_argument("--ours-only", action="store_true",
                   help="run our server alone (an A/B pass of our settings; no peer ratios)")
    p.add_argument("--uncompiled-decode", action="store_true",
                   help="our batch.compile_decode = false (mlx-lm's blocks as written, the "
                        "A/B of the compiled decode halves)")
    p.add_argument("--unfused-projections", action="store_true",
                   help="our batch.fuse_projections = false (q/k/v and gate/up as separate "
                        "matmuls, the A/B of the fused projections)")
    p.add_argument("--events-at-once", action="store_true",
                   help="our batch.events_at_submit = false (a step's events go out as soon "
                        "as they are ready, the A/B of sending them at the next submit)")
    p.add_argument("--mlx-env", action="append", default=[], metavar="MLX_NAME=VALUE",
                   help="an MLX setting for the servers' environment, repeatable (e.g. "
                        "MLX_MAX_OPS_PER_BUFFER=120: kernels per CUDA graph, 30 on an "
                        "H100/H200; MLX_CUDA_GRAPH_CACHE_SIZE, MLX_USE_CUDA_GRAPHS=0)")
    p.add_argument("--revision", default="", help="recorded revision (default: git's)")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="where the servers' stderr logs go (default: a new temp folder)")
    args = p.parse_args(argv)
    for item in args.mlx_env:
        name, sep, _ = item.partition("=")
        if not (sep and name.startswith("MLX_")):
            p.error(f"--mlx-env takes MLX_NAME=VALUE, got {item!r}")
    smoke = args.smoke
    defaults = {"preset": "tiny" if smoke else "1b", "requests": [2, 4, 8] if smoke else
                [8, 48, 192], "prompt_tokens": 32 if smoke else 128,
                "max_tokens": 16 if smoke else 128, "budget_s": 170.0 if smoke else 390.0,
                "kv_memory": "" if smoke else "1GiB",
                "reserve_s": 45.0 if smoke else 90.0}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if len(args.requests) != len(args.concurrency):
        p.error("--requests needs one count per --concurrency level")
    return args


def revision(given: str) -> str:
    if given:
        return given
    try:
        return git_revision()
    except OSError:  # no git on the machine (a copied tree)
        return "unknown"



def describe(args: argparse.Namespace, result: dict, facts: dict) -> Path:
    """Record machine and model facts from the build child; the model folder."""
    model = Path(facts.pop("folder"))
    cfg = facts.pop("config")
    print(f"model {args.preset} ({facts['n_params'] / 1e9:.3f} B params, "
          f"{cfg['torch_dtype']}) on {facts['device']}, built in {facts['build_s']}s", flush=True)
    result["machine"] = {**facts, "platform": platform.platform(), "cpus": os.cpu_count(),
                         "python": platform.python_version(),
                         "gpu": nvidia_smi("name,memory.total,driver_version")}
    result["model"] = {"preset": args.preset, "path": str(model), "dtype": cfg["torch_dtype"],
                       "n_params": facts["n_params"], "shape": {k: cfg[k] for k in (
                           "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "num_key_value_heads", "head_dim", "intermediate_size",
                           "vocab_size")}}
    result["load"] = {"endpoint": "/v1/completions", "streaming": True, "temperature": 0.0,
                      "prompt_tokens_target": args.prompt_tokens,
                      "max_tokens": args.max_tokens, "concurrency": args.concurrency,
                      "requests": args.requests, "time_limit_s": args.time_limit,
                      "budget_s": args.budget_s, "max_batch": args.max_batch or "defaults",
                      "our_pool_kv_memory": args.kv_memory or "config default",
                      "order": "one server fully, stopped, then the other; same prompts, "
                               "none repeated on a server"}
    return model


def server_context(args: argparse.Namespace, model: Path, prompts: list[str], on_gpu: bool,
                   budget: Budget) -> dict:
    """What both server phases share: model, environment, log folder, prompts, budget."""
    # The optimized CPU BLAS only matters on the CPU backend (the smoke run).
    env = child_env(preload=not on_gpu)
    env["PYTHONPATH"] = str(ROOT)
    extra: dict[str, list[str]] = {OURS: [], PEER: []}
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-gpu-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    if args.max_batch:
        env["VELOXQUANT_BATCH_MAX_BATCH_SIZE"] = str(args.max_batch)
        extra[PEER] = ["--decode-concurrency", str(args.max_batch)]
    if args.kv_memory:
        # Our pool bounds KV memory; its default (16384 blocks, 256 MiB of the 1b model's
        # KV) admits 32 requests of 256 tokens. 1 GiB holds 64 of them twice over.
        env["VELOXQUANT_POOL_KV_MEMORY"] = args.kv_memory
    if args.kv_write_back is not None:
        env["VELOXQUANT_BATCH_KV_WRITE_BACK"] = str(args.kv_write_back)
    if args.uncompiled_decode:
        env["VELOXQUANT_BATCH_COMPILE_DECODE"] = "false"
    if args.unfused_projections:
        env["VELOXQUANT_BATCH_FUSE_PROJECTIONS"] = "false"
    if args.events_at_once:
        env["VELOXQUANT_BATCH_EVENTS_AT_SUBMIT"] = "false"
    env.update(item.split("=", 1) for item in args.mlx_env)
    return {"model": model, "env": env, "prompts": prompts, "budget": budget, "extra": extra,
            "log_dir": log_dir,
            # levels still to come after a server's own (shares out the budget)
            "levels_after": {OURS: 0 if args.ours_only else len(args.concurrency), PEER: 0}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # An outer `timeout` sends SIGTERM: exit through the finally blocks, which
    # stop the running server and save its figures, instead of dying at once.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    budget = Budget(args.budget_s, args.reserve_s)
    t_run = time.monotonic()
    result: dict = {"benchmark": "benchmark_scripts/benchmark_gpu.py",
                    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "revision": revision(args.revision), "smoke": args.smoke,
                    "kv_write_back": args.kv_write_back or "server default",
                    "compile_decode": not args.uncompiled_decode,
                    "fuse_projections": not args.unfused_projections,
                    "events_at_submit": not args.events_at_once,
                    "mlx_env": dict(item.split("=", 1) for item in args.mlx_env),
                    "ours_only": args.ours_only,
                    "phases_s": {}, "servers": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        result["ratios_ours_over_peer"] = ratios(result, args.concurrency)
        result["targets"] = targets(result)
        result["phases_s"]["total"] = round(time.monotonic() - t_run, 2)
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(args.out)  # a reader (or a kill) never sees half a file

    t = time.monotonic()
    try:
        facts = build_and_describe(args.preset, args.seed, os.environ | {"PYTHONPATH": str(ROOT)})
    except RuntimeError as exc:
        result["error"] = str(exc)
        save()
        print(exc, file=sys.stderr)
        return 1
    result["phases_s"]["build_model"] = round(time.monotonic() - t, 2)
    on_gpu = facts["on_gpu"]
    model = describe(args, result, facts)
    t = time.monotonic()
    prompts = make_prompts(model, sum(args.requests) + 2, args.prompt_tokens)
    result["phases_s"]["prompts"] = round(time.monotonic() - t, 2)
    save()
    ctx = server_context(args, model, prompts, on_gpu, budget)
    result["log_dir"] = str(ctx["log_dir"])
    for name in (OURS,) if args.ours_only else (OURS, PEER):
        run_server(name, ctx, args, result, save)
    print_table(result, args.concurrency)
    print(f"wrote {args.out} (server logs in {ctx['log_dir']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
