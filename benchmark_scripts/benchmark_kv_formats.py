"""KV formats on the real default model (SmolLM2-135M-Instruct): quality, bytes, speed.

Ours: ``[kv] format`` = native (float32 on this CPU), q8 and q4 (affine codes,
float16 scale and bias per 64 values), turboquant_mse and polar (the compression
methods the pool stores: rotated 4-bit codes and a norm; polar angle codes).
Peer: llama.cpp's ``llama-server`` on the same GGUF with ``-ctk/-ctv`` f16 (its
default), q8_0 and q4_0 (flash attention on: llama.cpp needs it for a quantized
V cache). Per format:

- perplexity on the fixed English text of the real-model tests, teacher-forced
  one token per model call through the paged KV of that format
  (``kv_format_quality.py``, in a child with OpenBLAS), and its delta vs native;
  llama-server exposes no prompt-token log-probabilities, so it has none;
- greedy agreement with the native (llama: f16) KV over 20 prompts x 64 new
  tokens: the share of positions whose token equals native's, and the mean
  number of tokens before the first difference;
- KV bytes per token, its ratio to float16 KV of the same model, and how many
  requests of ``--request-tokens`` (prompt + max_tokens) fit ``--kv-memory``
  (ours: the pool's block arithmetic; llama.cpp: the same bytes per token);
- tok/s at concurrency 16 (streaming completions, ~64-token prompts, 64 new
  tokens, greedy; every server started at once, the first one rotating each
  round) and its ratio to native in the same run.

Usage::

    flock /tmp/vq-bench.lock .venv/bin/python benchmark_scripts/benchmark_kv_formats.py

Writes ``figures/kv_formats/results.json`` and prints the table.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_real_model import (  # noqa: E402
    LLAMA,
    OURS,
    PEERS,
    commands,
    llama_server_binary,
)
from benchmark_server import (  # noqa: E402
    Running,
    free_port,
    git_revision,
    make_prompts,
    peak_rss_mb,
    run_levels,
    stop_server,
    wait_up,
)
from server_load import run_requests  # noqa: E402

from veloxquant_mlx.cpu_backend import child_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "figures" / "kv_formats" / "results.json"
OUR_FORMATS = ("native", "q8", "q4", "turboquant_mse", "polar")
LLAMA_TYPES = ("f16", "q8_0", "q4_0")
# llama.cpp block types: bytes per 32 values (q8_0: 32 int8 + fp16 scale; q4_0: 16 + 2).
LLAMA_BYTES_PER_32 = {"f16": 64, "q8_0": 34, "q4_0": 18}
TARGETS = {"q8": {"perplexity_delta_max": 0.01, "tokens_per_byte_vs_fp16_min": 1.9,
                  "tok_per_s_vs_native_min": 0.9},
           "q4": {"perplexity_delta_max": 0.05, "tokens_per_byte_vs_fp16_min": 3.5,
                  "tok_per_s_vs_native_min": 0.8}}


def start_ours(fmt: str, env: dict[str, str], kv_memory: str) -> Running:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = Path(tempfile.mkstemp(prefix=f"bench-kv-{fmt}-", suffix=".log")[1])
    log_file = log_path.open("w")
    proc_env = {**env, "VELOXQUANT_KV_FORMAT": fmt, "VELOXQUANT_POOL_KV_MEMORY": kv_memory}
    cmd = commands(Path("unused.gguf"), Path("unused"), port)[OURS]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=proc_env, stdout=log_file, stderr=log_file,
                            text=True)
    wait_up(base, proc, timeout=300)
    model_id = httpx.get(base + "/v1/models").json()["data"][0]["id"]
    return Running(f"{OURS} {fmt}", proc, base, model_id, log_path, log_file)


def start_llama(cache_type: str, gguf: Path, env: dict[str, str], llama_bin: str) -> Running:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = Path(tempfile.mkstemp(prefix=f"bench-llama-{cache_type}-", suffix=".log")[1])
    log_file = log_path.open("w")
    cmd = ["bash", str(PEERS / "serve_llama_server.sh"), str(port), str(gguf), "--log-disable",
           "-ctk", cache_type, "-ctv", cache_type, "-fa", "on"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**env, "LLAMA_SERVER": llama_bin},
                            stdout=log_file, stderr=log_file, text=True)
    wait_up(base, proc, timeout=300)
    return Running(f"{LLAMA} {cache_type}", proc, base, "smollm2", log_path, log_file)


def llama_greedy(server: Running, prompts: list[str], n_new: int) -> list[list[int]]:
    """Greedy token ids of each prompt, one request at a time (batch-independent)."""
    out = []
    with httpx.Client(base_url=server.base, timeout=300) as client:
        for prompt in prompts:
            body = {"prompt": prompt, "n_predict": n_new, "temperature": 0, "top_k": 1,
                    "cache_prompt": False, "return_tokens": True, "ignore_eos": True}
            reply = client.post("/completion", json=body).json()
            tokens = reply.get("tokens")
            if not tokens:  # older builds: tokenize the text instead
                tokens = client.post("/tokenize", json={"content": reply["content"]}).json()[
                    "tokens"]
            out.append(list(tokens)[:n_new])
    return out


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict:
    """Share of positions equal to the reference, and mean tokens before the first difference."""
    same = total = 0
    prefixes = []
    for got, ref in zip(tokens, reference, strict=True):
        n = min(len(got), len(ref))
        same += sum(a == b for a, b in zip(got[:n], ref[:n], strict=True))
        total += n
        first = next((i for i in range(n) if got[i] != ref[i]), n)
        prefixes.append(first)
    return {"token_agreement": round(same / max(total, 1), 4),
            "mean_tokens_before_first_difference": round(sum(prefixes) / len(prefixes), 1),
            "identical_continuations": sum(p == len(r) for p, r in
                                           zip(prefixes, reference, strict=True))}


def our_capacity(bytes_per_token: int, n_layers: int, kv_memory: int, request_tokens: int,
                 block_size: int = 16) -> int:
    """Requests of ``request_tokens`` the pool admits at once (separate k and v streams)."""
    per_block = bytes_per_token * block_size // (2 * n_layers)
    per_stream = (kv_memory // per_block) // 2
    return per_stream // (n_layers * -(-request_tokens // block_size))


def quality(env: dict[str, str], prompts: list[str], n_new: int) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"prompts": prompts, "new_tokens": n_new}, f)
    try:
        out = subprocess.run([sys.executable, str(ROOT / "benchmark_scripts" /
                                                  "kv_format_quality.py"), f.name,
                              *OUR_FORMATS], env=env, cwd=ROOT, capture_output=True,
                             text=True, check=True)
    finally:
        os.unlink(f.name)
    return json.loads(out.stdout.strip().splitlines()[-1])


def seed_methods(env: dict[str, str], q8_step_ms: float, n_layers: int) -> dict:
    """The seed's methods timed as one layer of a 16-row decode (``kv_seed_methods.py``).

    A method's decode step is estimated as q8's measured step with each layer's
    q8 KV work replaced by the method's: ``q8_step + layers x (method - q8)``.
    """
    out = subprocess.run([sys.executable, str(ROOT / "benchmark_scripts" /
                                              "kv_seed_methods.py"), "16", "160"],
                         env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    timing = json.loads(out.stdout.strip().splitlines()[-1])
    for row in timing["methods"].values():
        step = q8_step_ms + n_layers * (row["layer_ms"] - timing["q8_layer_ms"])
        row["estimated_step_over_q8"] = round(step / q8_step_ms, 2)
        row["within_1_5x_of_q8"] = step / q8_step_ms <= 1.5
    timing["q8_step_ms"] = q8_step_ms
    return timing


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[16])
    p.add_argument("--requests", type=int, default=32, help="requests per level and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--time-limit", type=float, default=240.0)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--quality-prompts", type=int, default=20)
    p.add_argument("--quality-tokens", type=int, default=64)
    p.add_argument("--kv-memory", default="256MiB", help="pool.kv_memory of every server")
    p.add_argument("--request-tokens", type=int, default=1024,
                   help="prompt + max_tokens of the request counted in the capacity column")
    p.add_argument("--llama-server", help="llama-server binary (default: build/find it)")
    p.add_argument("--skip-llama", action="store_true")
    p.add_argument("--quality-from", type=Path,
                   help="reuse the in-process quality figures a run saved (quality_raw.json)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args()


def main() -> int:  # noqa: PLR0915 (one linear script)
    args = parse_args()
    from server.settings_sections import parse_bytes
    from veloxquant_mlx.gguf import convert_gguf, smollm2_gguf_path
    from veloxquant_mlx.paths import models_dir

    gguf = smollm2_gguf_path()
    folder = convert_gguf(gguf, models_dir())
    env = child_env(preload=True)
    env["PYTHONPATH"] = str(ROOT)
    kv_memory = parse_bytes(args.kv_memory)
    per_round = max(args.requests, max(args.concurrency)) * len(args.concurrency)
    load_prompts = make_prompts(folder, per_round * args.rounds + 2, args.prompt_tokens)
    quality_prompts = make_prompts(folder, 200, 32)[-args.quality_prompts:]

    print("quality (in process) ...", flush=True)
    if args.quality_from:
        ours_q = json.loads(args.quality_from.read_text())
    else:
        ours_q = quality(env, quality_prompts, args.quality_tokens)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        # Every greedy token, kept apart from the summary (and reusable by --quality-from).
        (args.out.parent / "quality_raw.json").write_text(json.dumps(ours_q) + "\n")
    print("seed methods (in process) ...", flush=True)
    seeds = seed_methods(env, ours_q["formats"]["q8"]["decode_step_ms_median"],
                         ours_q["formats"]["q8"]["layout"][0])
    llama_bin = None if args.skip_llama else llama_server_binary(args.llama_server)
    servers: list[Running] = []
    try:
        for fmt in OUR_FORMATS:
            servers.append(start_ours(fmt, env, args.kv_memory))
        if llama_bin:
            for cache_type in LLAMA_TYPES:
                servers.append(start_llama(cache_type, gguf, env, llama_bin))
        meta = {s.name: httpx.get(s.base + "/v1/models").json()["data"][0].get("meta")
                for s in servers if s.name.startswith(OURS)}
        llama_tokens = {s.name: llama_greedy(s, quality_prompts, args.quality_tokens)
                        for s in servers if s.name.startswith(LLAMA)}
        for s in servers:  # warm-up, not measured
            asyncio.run(run_requests(s.base, s.model_id, load_prompts[-2:], 1, 2, 8, 120,
                                     keep_alive=False))
        levels = run_levels(servers, load_prompts[:-2], args, lambda name, c: args.requests,
                            keep_alive=False)
        rss = {s.name: peak_rss_mb(s.proc.pid) for s in servers}
    finally:
        logs = {s.name: stop_server(s) for s in servers}

    formats = ours_q["formats"]
    n_layers, heads, dim = formats["native"]["layout"]
    fp16_per_token = 2 * n_layers * heads * dim * 2
    native_ppl = formats["native"]["perplexity"]
    native_tps = {lv["concurrency"]: lv["tok_per_s"] for lv in levels[f"{OURS} native"]}
    rows = {}
    for fmt in OUR_FORMATS:
        f = formats[fmt]
        tps = {lv["concurrency"]: lv["tok_per_s"] for lv in levels[f"{OURS} {fmt}"]}
        rows[f"{OURS} {fmt}"] = {
            "format_tag": f["format_tag"], "perplexity": f["perplexity"],
            "perplexity_delta_vs_native": round(f["perplexity"] / native_ppl - 1, 4),
            **agreement(f["greedy_tokens"], formats["native"]["greedy_tokens"]),
            "kv_bytes_per_token": f["kv_bytes_per_token"],
            "tokens_per_byte_vs_fp16": round(fp16_per_token / f["kv_bytes_per_token"], 3),
            "max_concurrent_requests": our_capacity(f["kv_bytes_per_token"], n_layers,
                                                    kv_memory, args.request_tokens),
            "tok_per_s": tps, "tok_per_s_vs_native": {
                c: round(tps[c] / native_tps[c], 3) if native_tps[c] else None for c in tps},
            "decode_step_ms_in_process": f["decode_step_ms_median"],
            "decode_step_vs_native_in_process": round(
                f["decode_step_ms_median"] / formats["native"]["decode_step_ms_median"], 3),
            "server_meta": meta.get(f"{OURS} {fmt}"), "peak_rss_mib": rss[f"{OURS} {fmt}"]}
    if llama_bin:
        ref_tokens = llama_tokens[f"{LLAMA} f16"]
        ref_tps = {lv["concurrency"]: lv["tok_per_s"] for lv in levels[f"{LLAMA} f16"]}
        for cache_type in LLAMA_TYPES:
            name = f"{LLAMA} {cache_type}"
            per_token = 2 * n_layers * heads * dim * LLAMA_BYTES_PER_32[cache_type] // 32
            tps = {lv["concurrency"]: lv["tok_per_s"] for lv in levels[name]}
            rows[name] = {
                "format_tag": cache_type, "perplexity": None,
                "perplexity_delta_vs_native": None,
                **agreement(llama_tokens[name], ref_tokens),
                "kv_bytes_per_token": per_token,
                "tokens_per_byte_vs_fp16": round(fp16_per_token / per_token, 3),
                "max_concurrent_requests": kv_memory // (per_token * args.request_tokens),
                "tok_per_s": tps, "tok_per_s_vs_native": {
                    c: round(tps[c] / ref_tps[c], 3) if ref_tps[c] else None for c in tps},
                "peak_rss_mib": rss[name]}
    c_top = max(args.concurrency)
    targets = {}
    for fmt, goal in TARGETS.items():
        row = rows[f"{OURS} {fmt}"]
        ratio = row["tok_per_s_vs_native"].get(c_top)
        targets[fmt] = {
            "perplexity_delta": {"target_max": goal["perplexity_delta_max"],
                                 "measured": row["perplexity_delta_vs_native"],
                                 "met": row["perplexity_delta_vs_native"]
                                 <= goal["perplexity_delta_max"]},
            "tokens_per_byte_vs_fp16": {"target_min": goal["tokens_per_byte_vs_fp16_min"],
                                        "measured": row["tokens_per_byte_vs_fp16"],
                                        "met": row["tokens_per_byte_vs_fp16"]
                                        >= goal["tokens_per_byte_vs_fp16_min"]},
            f"tok_per_s_vs_native_c{c_top}": {"target_min": goal["tok_per_s_vs_native_min"],
                                              "measured": ratio,
                                              "met": None if ratio is None else
                                              ratio >= goal["tok_per_s_vs_native_min"]}}
    result = {
        "benchmark": "benchmark_scripts/benchmark_kv_formats.py",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "revision": git_revision(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "model": {"gguf": gguf.name, "layers_kv_heads_head_dim": [n_layers, heads, dim],
                  "our_compute_dtype": ours_q["dtype"]},
        "quality": {"text_tokens": ours_q["text_tokens"], "perplexity": "teacher-forced, "
                    "one token per model call (every logit reads stored KV)",
                    "greedy_prompts": len(quality_prompts),
                    "greedy_new_tokens": args.quality_tokens,
                    "llama_reference": "llama-server f16 KV, one request at a time"},
        "capacity": {"kv_memory_bytes": kv_memory, "request_tokens": args.request_tokens,
                     "float16_kv_bytes_per_token": fp16_per_token},
        "load": {"concurrency": args.concurrency, "requests_per_level_per_round": args.requests,
                 "rounds": args.rounds, "prompt_tokens_target": args.prompt_tokens,
                 "max_tokens": args.max_tokens, "temperature": 0.0, "streaming": True},
        "rows": rows,
        "speed_raw": levels,
        "targets": targets,
        "seed_methods_as_formats": seeds,
        "log_tails": {name: tail[-400:] for name, tail in logs.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'server':22s} {'ppl':>8s} {'dppl':>7s} {'agree':>6s} {'B/tok':>6s} "
          f"{'x fp16':>6s} {'fit':>5s} {'tok/s':>7s} {'x nat':>6s}")
    for name, row in rows.items():
        ppl = "-" if row["perplexity"] is None else f"{row['perplexity']:.3f}"
        dppl = "-" if row["perplexity_delta_vs_native"] is None else \
            f"{100 * row['perplexity_delta_vs_native']:+.2f}%"
        print(f"{name:22s} {ppl:>8s} {dppl:>7s} {row['token_agreement']:6.3f} "
              f"{row['kv_bytes_per_token']:6d} {row['tokens_per_byte_vs_fp16']:6.2f} "
              f"{row['max_concurrent_requests']:5d} {row['tok_per_s'].get(c_top, 0):7.1f} "
              f"{row['tok_per_s_vs_native'].get(c_top) or 0:6.2f}")
    print(json.dumps(targets, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
