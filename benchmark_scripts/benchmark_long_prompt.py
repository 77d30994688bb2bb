"""Long prompts on the default model: time to the first token, ours against llama-server.

Two parts, both on SmolLM2-135M-Instruct (Q4_1 GGUF; ours dequantized to float32):

- ``engine``: one prompt's prefill through our ``ModelRunner`` (512-token chunks,
  as served), in a child that loads the BLAS forward first, with the prompt kernels
  in C (attention: ``veloxquant_mlx/prefill_attention.c``; SwiGLU: ``swiglu.c``)
  and with MLX's own ops (the kernels switched off in that child), alternating
  which goes first;
- ``served``: one non-streaming completion with ``max_tokens`` 1 per length to
  ``python -m server`` and to llama.cpp's ``llama-server`` (one slot, 8,192-token
  context) on the same GGUF; every server and length gets its own cut of the corpus,
  so no prompt cache of either side helps.

Usage::

    .venv/bin/python benchmark_scripts/benchmark_long_prompt.py [--lengths 1024 4096 7168]

Writes ``figures/real_model/long_prompt.json`` and prints a table.
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
from benchmark_real_model import llama_server_binary  # noqa: E402
from benchmark_server import free_port, git_revision, make_prompts, wait_up  # noqa: E402

from veloxquant_mlx.cpu_backend import LOAD_FIRST, child_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT.parent / "shared" / "peers"
DEFAULT_OUT = ROOT / "figures" / "real_model" / "long_prompt.json"

_ENGINE = r"""
import json, sys, time
import mlx.core as mx
from server.harness import RunnerHarness
from server.protocol import SamplingParams
from server.model_loader import load_model
from server.settings import load_settings
from veloxquant_mlx import native_swiglu
from veloxquant_mlx.memory import native_attention

n, use_kernel = int(sys.argv[1]), sys.argv[2] == "kernel"
if not use_kernel:
    native_attention.MIN_QUERIES = 1 << 30  # every call stays on MLX's attention
    native_swiglu.MIN_COLUMNS = 1 << 30  # and on MLX's SwiGLU
elif native_attention.kernel() is None or native_swiglu.kernel() is None:
    raise SystemExit("the prompt kernels are not loaded: is the BLAS forward built?")
loaded = load_model(load_settings(None, overrides={"model": {"path": "smollm2"}}, env={}).model)
harness = RunnerHarness.for_model(loaded.model, 2 * 30 * (n // 16 + 8) + 64, loaded=loaded)
prompt = [5 + (j * 7919) % 40000 for j in range(n)]

def first_token(owner, ids):
    start = time.perf_counter()
    harness.start({owner: ids}, SamplingParams(max_tokens=2, temperature=0.0))
    if not harness.prefill(512).tokens:
        harness.decode()  # older revisions read the first token with the first decode
    seconds = time.perf_counter() - start
    harness.finish([owner])
    return seconds

first_token(1, prompt[:600])  # warm-up: traces the chunk shapes
print(json.dumps({"seconds": round(first_token(2, prompt), 2)}))
"""


def engine_prefill(n: int, mode: str, env: dict[str, str]) -> float:
    out = subprocess.run([sys.executable, "-c", LOAD_FIRST + _ENGINE, str(n), mode], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(f"engine child ({n}, {mode}) failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def start_server(name: str, gguf: Path, env: dict[str, str], llama_bin: str):
    port = free_port()
    log = open(tempfile.mkstemp(prefix=f"long-{name}-", suffix=".log")[1], "w")  # noqa: SIM115
    if name == "llama-server":
        cmd = ["bash", str(PEERS / "serve_llama_server.sh"), str(port), str(gguf), "--log-disable"]
        extra = {"LLAMA_SERVER": llama_bin, "PARALLEL": "1", "CTX_PER_SLOT": "8192"}
    else:
        cmd = [sys.executable, "-m", "server", "--model", "smollm2", "--port", str(port),
               "--log-level", "warning"]
        extra = {}
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**env, **extra}, stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    wait_up(base, proc, timeout=300)
    model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
    return proc, base, model, log


def served_first_token(base: str, model: str, prompt: str) -> dict:
    start = time.perf_counter()
    r = httpx.post(base + "/v1/completions", timeout=900,
                   json={"model": model, "prompt": prompt, "max_tokens": 1,
                         "temperature": 0})
    seconds = time.perf_counter() - start
    r.raise_for_status()
    usage = r.json().get("usage", {})
    return {"seconds": round(seconds, 2), "prompt_tokens": usage.get("prompt_tokens")}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="*", default=[1024, 4096, 7168])
    p.add_argument("--served-lengths", type=int, nargs="*", default=[4096, 7168])
    p.add_argument("--llama-server", help="llama-server binary (default: build/find it)")
    p.add_argument("--skip-served", action="store_true")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    from veloxquant_mlx.gguf import convert_gguf, smollm2_gguf_path
    from veloxquant_mlx.paths import models_dir

    env = child_env(preload=True)
    env["PYTHONPATH"] = str(ROOT)
    engine = []
    for i, n in enumerate(args.lengths):
        order = ["kernel", "mlx"] if i % 2 == 0 else ["mlx", "kernel"]
        times = {mode: engine_prefill(n, mode, env) for mode in order}
        engine.append({"prompt_tokens": n, "kernel_s": times["kernel"], "mlx_s": times["mlx"],
                       "speedup": round(times["mlx"] / times["kernel"], 2)})
        print(json.dumps(engine[-1]), flush=True)
    served = []
    if not args.skip_served:
        gguf = smollm2_gguf_path()
        folder = convert_gguf(gguf, models_dir())
        # Each server its own prompts (no prompt cache helps), after one short warm-up.
        names = ["veloxquant", "llama-server"]
        llama_bin = llama_server_binary(args.llama_server)
        for name_index, name in enumerate(names):
            proc, base, model, log = start_server(name, gguf, env, llama_bin)
            try:
                served_first_token(base, model, f"A warm-up for {name}: say hello.")
                lengths = args.served_lengths
                for k, n in enumerate(lengths):
                    # Disjoint cuts of the corpus for every server and length: no prefix is
                    # shared, so neither side's prompt cache helps. A ~5% margin keeps the
                    # text's tokens under n.
                    cuts = make_prompts(folder, len(names) * len(lengths), int(n * 0.95))
                    text = cuts[name_index * len(lengths) + k]
                    row = {"server": name, "target_tokens": n,
                           **served_first_token(base, model, text)}
                    served.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
                log.close()
    ratios = {}
    for n in args.served_lengths:
        ours = next((r for r in served if r["server"] == "veloxquant" and r["target_tokens"] == n),
                    None)
        peer = next((r for r in served if r["server"] == "llama-server"
                     and r["target_tokens"] == n), None)
        if ours and peer:
            ratios[f"{n}"] = round(peer["seconds"] / ours["seconds"], 2)
    result = {
        "what": "time to the first token of one long prompt on SmolLM2-135M-Instruct",
        "revision": git_revision(), "machine": platform.platform(), "cpus": os.cpu_count(),
        "engine_prefill": engine, "served": served,
        "llama_server_s_over_ours_s": ratios,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'tokens':>7} {'C kernels s':>11} {'MLX ops s':>11} {'speedup':>8}")
    for row in engine:
        print(f"{row['prompt_tokens']:>7} {row['kernel_s']:>11} {row['mlx_s']:>11} "
              f"{row['speedup']:>8}")
    for row in served:
        print(f"served {row['server']:>13} {row['prompt_tokens']} tokens: {row['seconds']} s")
    print(f"llama-server time / ours: {ratios}  -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
