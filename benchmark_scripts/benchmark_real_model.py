"""The real default model (SmolLM2-135M-Instruct) served three ways, side by side.

- ours: ``python -m server --model smollm2`` (the GGUF converted once, then on
  CPU computed from its 4-bit codes by ``model.dtype = "auto"``);
- llama.cpp's ``llama-server`` on the very same GGUF (built by
  ``../shared/peers/build_llama_server.sh``, started by ``serve_llama_server.sh``:
  2 threads, 16 continuous-batching slots);
- ``mlx_lm.server`` on our MLX conversion of the GGUF (4-bit weights as stored:
  mlx-lm cannot read GGUF itself).

Same load shape as ``benchmark_server.py``: streaming completions of ~64-token
prompts cut from the offline corpus, 64 new tokens, greedy, at each
concurrency level, in rounds where the servers take turns going first and no
server sees a prompt twice. Every request opens its own connection, for every
server: llama-server drops a kept-alive connection now and then, which the
client would count as its error. ``mlx_lm.server`` runs fewer requests per level
(``--peer-requests``): on quantized CPU weights it is ~20x slower, and its
figures are rates, so fewer requests change their noise, not their meaning.

``--servers`` picks who runs (ours always). ``veloxquant-float32`` is ours with
``model.max_dequantized_bytes`` above the float32 size: every product on dequantized
float32 weights, without the codes (``veloxquant_mlx/codes_linear.py``), to measure
what they buy;
``veloxquant-write-every-step`` is ours with ``batch.kv_write_back = 1`` (the decode
batch writes its KV into the arena every step instead of every 32 steps);
``veloxquant-uncompiled`` is ours with ``batch.compile_decode = false`` (decode
runs mlx-lm's blocks as written, not as compiled halves);
``veloxquant-no-prefill-slice`` is ours with ``batch.max_prefill_s_per_step = 0``
(prefill by the token bound alone, whole chunks).

Then ``profile_decode`` times where a decode step goes on our model (model
forward, its matmuls alone, attention alone, sampling) at batch 1 and 16, so
the next speed step is chosen from data.

Usage::

    .venv/bin/python benchmark_scripts/benchmark_real_model.py [--concurrency 1 16]

Writes ``figures/real_model/results.json`` and prints a table.
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
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
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

from veloxquant_mlx.cpu_backend import LOAD_FIRST, child_env, module_command  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT.parent / "shared" / "peers"
DEFAULT_OUT = ROOT / "figures" / "real_model" / "results.json"
OURS, LLAMA, MLX_LM = "veloxquant", "llama-server", "mlx_lm.server"
OURS_F32 = "veloxquant-float32"  # ours with every product on the float32 weights
OURS_WRITE = "veloxquant-write-every-step"  # ours writing each decode step's KV at once
OURS_UNCOMPILED = "veloxquant-uncompiled"  # ours running mlx-lm's blocks as written
OURS_NO_SLICE = "veloxquant-no-prefill-slice"  # ours prefilling by the token bound alone
EXTRA_ENV = {OURS_F32: {"VELOXQUANT_MODEL_MAX_DEQUANTIZED_BYTES": str(10**12)},
             OURS_WRITE: {"VELOXQUANT_BATCH_KV_WRITE_BACK": "1"},
             OURS_UNCOMPILED: {"VELOXQUANT_BATCH_COMPILE_DECODE": "false"},
             OURS_NO_SLICE: {"VELOXQUANT_BATCH_MAX_PREFILL_S_PER_STEP": "0"}}
# Ours, told apart by EXTRA_ENV.
VARIANTS = (OURS_F32, OURS_WRITE, OURS_UNCOMPILED, OURS_NO_SLICE)
# Ours over each peer: the tok/s ratio to reach.
TARGETS = {LLAMA: {"c16": 0.8, "c1": 0.2}, MLX_LM: {"c16": 5.0, "c1": 5.0}}


def llama_server_binary(explicit: str | None) -> str:
    """The llama-server binary: given, or built (once, cached) by the peers script."""
    if explicit:
        return explicit
    out = subprocess.run(["bash", str(PEERS / "build_llama_server.sh")], check=True,
                         capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def commands(gguf: Path, folder: Path, port: int) -> dict[str, list[str]]:
    """The command line that starts each server on ``port`` (llama-server's binary via
    ``LLAMA_SERVER`` in the environment)."""
    py = sys.executable
    ours = [py, "-m", "server", "--model", "smollm2", "--port", str(port), "--log-level", "warning"]
    return {
        OURS: ours,
        **dict.fromkeys(VARIANTS, ours),
        LLAMA: ["bash", str(PEERS / "serve_llama_server.sh"), str(port), str(gguf),
                "--log-disable"],
        # On the same BLAS as ours (loaded by the launcher, as the server loads it).
        MLX_LM: module_command("mlx_lm", "server", "--model", str(folder), "--port", str(port),
                               "--log-level", "WARNING"),
    }


def start(name: str, gguf: Path, folder: Path, env: dict[str, str], llama_bin: str) -> Running:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = Path(tempfile.mkstemp(prefix=f"bench-{name}-", suffix=".log")[1])
    log_file = log_path.open("w")
    proc_env = {**env, "LLAMA_SERVER": llama_bin, **EXTRA_ENV.get(name, {})}
    proc = subprocess.Popen(commands(gguf, folder, port)[name], cwd=ROOT,
                            env=proc_env, stdout=log_file, stderr=log_file, text=True)
    wait_up(base, proc, timeout=300)
    # mlx_lm.server treats an unknown model id as a hub id: name its own folder.
    # llama-server answers to any id; ours to the one it reports.
    if name in (OURS, *VARIANTS):
        model_id = httpx.get(base + "/v1/models").json()["data"][0]["id"]
    else:
        model_id = str(folder) if name == MLX_LM else "smollm2"
    return Running(name, proc, base, model_id, log_path, log_file)


def requests_per_round(args: argparse.Namespace) -> Callable[[str, int], int]:
    """Requests per level and round: ``--requests``, fewer for mlx_lm.server."""
    return lambda name, c: max(args.peer_requests, c) if name == MLX_LM else args.requests


def ratios_over(ours: dict, peer: dict) -> dict:
    """Ours over a peer per level: tok/s (higher is better) and TTFT (lower is better)."""
    out = {}
    for a, b in zip(ours, peer, strict=True):
        def ratio(key, a=a, b=b):
            return round(a[key] / b[key], 3) if a[key] and b[key] else None
        out[f"c{a['concurrency']}"] = {"tok_per_s": ratio("tok_per_s"),
                                       "ttft_p50": ratio("ttft_p50_s"),
                                       "ttft_p99": ratio("ttft_p99_s")}
    return out


def targets(ratios: dict) -> dict:
    """Each tok/s target with the measured ratio and whether it was met."""
    out = {}
    for peer, levels in TARGETS.items():
        for level, minimum in levels.items():
            if peer not in ratios:
                continue
            value = ratios[peer].get(level, {}).get("tok_per_s")
            out[f"{level}_tok_per_s_over_{peer}_min"] = {
                "target": minimum, "measured": value,
                "met": None if value is None else value >= minimum}
    return out


_PROFILE = r"""
import json, sys, time
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from server.model_loader import load_model
from server.settings import load_settings

loaded = load_model(load_settings(None, overrides={"model": {"path": "smollm2"}}, env={}).model)
model = loaded.model
args = model.args
n_ctx, reps = int(sys.argv[1]), 20
heads, kv_heads = args.num_attention_heads, args.num_key_value_heads
head_dim = args.hidden_size // heads

def timed(fn):
    mx.eval(fn())
    t0 = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
    return 1000 * (time.perf_counter() - t0) / reps

rows = {}
for batch in (1, 16):
    cache = make_prompt_cache(model)
    prompt = mx.random.randint(0, args.vocab_size, (batch, n_ctx))
    mx.eval(model(prompt, cache=cache))
    token = mx.random.randint(0, args.vocab_size, (batch, 1))
    def step():
        out = model(token, cache=cache)
        for c in cache:  # keep the context length fixed across repetitions
            c.offset -= 1
        return out
    weights = [m.weight for _, m in model.named_modules() if type(m).__name__ == "Linear"]
    if args.tie_word_embeddings:  # the LM head is the embedding matrix
        weights.append(model.model.embed_tokens.weight)
    inputs = {w.shape[1]: mx.random.normal((batch, w.shape[1])) for w in weights}
    def matmuls():
        return [inputs[w.shape[1]] @ w.T for w in weights]
    q = mx.random.normal((batch, heads, 1, head_dim))
    k = mx.random.normal((batch, kv_heads, n_ctx, head_dim))
    def attention():
        return [mx.fast.scaled_dot_product_attention(q, k, k, scale=head_dim ** -0.5)
                for _ in range(args.num_hidden_layers)]
    logits = mx.random.normal((batch, args.vocab_size))
    def sampling():
        return mx.random.categorical(logits * 1.25)
    rows[f"batch_{batch}"] = {"model_step_ms": round(timed(step), 2),
                              "matmuls_ms": round(timed(matmuls), 2),
                              "attention_ms": round(timed(attention), 2),
                              "sampling_ms": round(timed(sampling), 2)}
print(json.dumps({"context_tokens": n_ctx, "weights": loaded.weights, "ms_per_step": rows}))
"""


def profile_decode(env: dict[str, str], n_ctx: int) -> dict:
    """Time one decode step and its parts on our model, in a child process."""
    out = subprocess.run([sys.executable, "-c", LOAD_FIRST + _PROFILE, str(n_ctx)], env=env,
                         cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def where_time_goes(profile: dict, ours_levels: list[dict]) -> dict:
    """Per generated token: the model step vs what the server adds (Python, HTTP)."""
    out = {}
    for level in ours_levels:
        c = level["concurrency"]
        row = profile["ms_per_step"].get(f"batch_{16 if c >= 16 else 1}")
        if not row or not level["tok_per_s"]:
            continue
        per_step_served = 1000 * min(c, 16) / level["tok_per_s"]
        out[f"c{c}"] = {"served_ms_per_step": round(per_step_served, 2),
                        "model_step_ms": row["model_step_ms"],
                        "outside_model_ms": round(per_step_served - row["model_step_ms"], 2)}
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--requests", type=int, default=32, help="requests per level and round")
    p.add_argument("--peer-requests", type=int, default=4,
                   help="mlx_lm.server's requests per level and round (at least c)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--time-limit", type=float, default=240.0)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--llama-server", help="llama-server binary (default: build/find it)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--servers", nargs="+", default=[OURS, LLAMA, MLX_LM],
                   choices=[OURS, LLAMA, MLX_LM, *VARIANTS], help="ours always runs")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    from veloxquant_mlx.gguf import convert_gguf, smollm2_gguf_path
    from veloxquant_mlx.paths import models_dir

    gguf = smollm2_gguf_path()
    folder = convert_gguf(gguf, models_dir())
    names = [OURS] + [n for n in args.servers if n != OURS]
    llama_bin = llama_server_binary(args.llama_server) if LLAMA in names else ""
    env = child_env(preload=True)
    env["PYTHONPATH"] = str(ROOT)
    # Each round's servers share one batch of prompts, the size of the largest count.
    per_round = sum(max(args.requests, args.peer_requests, c) for c in args.concurrency)
    prompts = make_prompts(folder, per_round * args.rounds + 2, args.prompt_tokens)
    servers: list[Running] = []
    try:
        for name in names:
            servers.append(start(name, gguf, folder, env, llama_bin))
        for s in servers:  # warm-up, not measured
            asyncio.run(run_requests(s.base, s.model_id, prompts[-2:], 1, 2, 8, 120,
                                     keep_alive=False))
        # A fresh connection per request for every server (see the module docstring).
        levels = run_levels(servers, prompts[:-2], args, requests_per_round(args),
                            keep_alive=False)
        rss = {s.name: peak_rss_mb(s.proc.pid) for s in servers}
    finally:
        logs = {s.name: stop_server(s) for s in servers}
    ratios = {peer: ratios_over(levels[OURS], levels[peer]) for peer in names[1:]}
    profile = profile_decode(env, args.prompt_tokens + args.max_tokens // 2)
    result = {
        "benchmark": "benchmark_scripts/benchmark_real_model.py",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "revision": git_revision(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "model": {"gguf": gguf.name, "mlx_folder_for_mlx_lm": folder.name},
        "load": {"prompt_tokens_target": args.prompt_tokens, "max_tokens": args.max_tokens,
                 "temperature": 0.0, "streaming": True, "concurrency": args.concurrency,
                 "requests_per_level_per_round": args.requests,
                 "mlx_lm_requests_per_level_per_round": f"max({args.peer_requests}, c)",
                 "rounds": args.rounds, "order": "first server rotates each round"},
        "servers": {s.name: {"levels": levels[s.name], "peak_rss_mib": rss[s.name],
                             "log_tail": logs[s.name][-600:]} for s in servers},
        "ratios_ours_over": ratios,
        "targets": targets(ratios),
        "decode_profile": profile,
        "where_time_goes": where_time_goes(profile, levels[OURS]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"ratios_ours_over": ratios, "targets": result["targets"],
                      "decode_profile": profile, "where_time_goes": result["where_time_goes"]},
                     indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
