"""MLX on a Linux CPU: bundled reference BLAS vs an optimized (loaded) BLAS, per dtype.

Measures, in one run, a float32/bfloat16/float16 matmul (768x768 @ 768x2048) and its
gemv twin (1x768 @ 768x2048), then prompt tok/s, decode tok/s and time to first token
for the offline ``small`` model in float32, bfloat16, float16 and 4-bit quantized form
(float32 or bfloat16 scales).
Each BLAS runs in its own child process (the optimized one loaded before MLX by
``veloxquant_mlx.cpu_backend.load_optimized_blas``, the other opted out through
``child_env``), so both see the same machine state.

Usage::

    flock /tmp/velox-bench.lock .venv/bin/python benchmark_scripts/benchmark_cpu_backend.py

Writes ``figures/cpu_backend/results.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from veloxquant_mlx.blas_finder import find_optimized_blas
from veloxquant_mlx.blas_status import active_blas
from veloxquant_mlx.cpu_backend import child_env, load_optimized_blas

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "figures" / "cpu_backend" / "results.json"
MATMUL = (768, 768, 2048)  # M, K, N: one hidden-size projection of a 768-wide model
VARIANTS = ("float32", "bfloat16", "float16", "q4", "q4-bfloat16")
REPEATS = 3  # generation timings: median of up to this many runs (the CPU is shared) ...
REPEAT_BUDGET_S = 20.0  # ... stopping early once a variant has used this much time
TARGETS = {"prompt_tps": 8.0, "decode_tps": 1.4}


def _matmul_gflops(m: int, k: int, n: int, dtype_name: str, repeats: int) -> float:
    """Best-of-``repeats`` GFLOP/s of an ``(m, k) @ (k, n)`` MLX matmul."""
    import mlx.core as mx

    dtype = getattr(mx, dtype_name)
    a = mx.random.normal((m, k)).astype(dtype)
    b = mx.random.normal((k, n)).astype(dtype)
    mx.eval(a, b, a @ b)  # warm-up: allocation and any lazy set-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(a @ b)
        best = min(best, time.perf_counter() - start)
    return 2.0 * m * k * n / best / 1e9


def _load_variant(model_path: Path, variant: str):
    """Load the model and convert it to ``variant``: a float dtype, or "q4[-dtype]"."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.utils import load_model

    model, _ = load_model(model_path)
    if variant.startswith("q4"):
        # 4-bit weights (group 64); scales and activations in float32 unless the suffix
        # says otherwise (mlx-community checkpoints ship bfloat16). No BLAS in these matmuls.
        model.set_dtype(getattr(mx, variant.partition("-")[2] or "float32"))
        nn.quantize(model, group_size=64, bits=4)
    else:
        model.set_dtype(getattr(mx, variant))
    mx.eval(model.parameters())
    return model


def _generate_timings(model, prompt_tokens: int, decode_tokens: int, vocab: int) -> dict:
    """Greedy generation from a fixed pseudo-random prompt, timed as mlx-lm reports it."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    def run(n_prompt: int, n_decode: int) -> tuple[float, float]:
        prompt = mx.random.randint(0, vocab, (n_prompt,), key=mx.random.key(0))
        start = time.perf_counter()
        steps = generate_step(prompt, model, max_tokens=n_decode)
        next(steps)  # generate_step has evaluated the first token when it yields
        first = time.perf_counter()
        for _ in steps:
            pass
        return first - start, time.perf_counter() - first

    run(16, 4)  # warm-up at a small size
    timings: list[tuple[float, float]] = []
    while len(timings) < REPEATS and sum(map(sum, timings)) < REPEAT_BUDGET_S:
        timings.append(run(prompt_tokens, decode_tokens))
    ttft = statistics.median(t for t, _ in timings)
    decode_s = statistics.median(d for _, d in timings)
    return {
        "ttft_s": ttft,
        "prompt_tps": prompt_tokens / ttft,  # mlx-lm's prompt_tps: prompt / time to 1st token
        "decode_tps": (decode_tokens - 1) / decode_s,
        "runs_s": [[round(t, 4), round(d, 4)] for t, d in timings],
    }


def child_main(args: argparse.Namespace) -> None:
    """Measure everything under this process's BLAS; print one JSON line."""
    load_optimized_blas()  # before MLX loads; the bundled child's environment opts out
    import mlx.core as mx

    out: dict = {"matmul_gflops": {}, "gemv_gflops": {}, "models": {}}
    m, k, n = MATMUL
    for dtype in ("float32", "bfloat16", "float16"):
        out["matmul_gflops"][dtype] = _matmul_gflops(m, k, n, dtype, repeats=5)
        out["gemv_gflops"][dtype] = _matmul_gflops(1, k, n, dtype, repeats=50)
    config = json.loads((args.model_path / "config.json").read_text())
    for variant in args.variants:
        model = _load_variant(args.model_path, variant)
        out["models"][variant] = _generate_timings(
            model, args.prompt_tokens, args.decode_tokens, config["vocab_size"]
        )
        del model
        mx.clear_cache()
    blas = active_blas()  # after MLX ran a matmul, so the bundled library is mapped too
    out["blas"] = {"path": str(blas.path), "loaded": blas.loaded, "config": blas.config,
                   "threads": blas.threads}
    out["mlx_version"] = mx.__version__
    print(json.dumps(out))


def _run_child(label: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model-path", str(args.model_path),
           "--prompt-tokens", str(args.prompt_tokens), "--decode-tokens", str(args.decode_tokens),
           "--variants", ",".join(args.variants)]
    env = child_env(preload=(label == "optimized"))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{label} child failed ({done.returncode}):\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["blas"]["loaded"] != (label == "optimized"):
        raise SystemExit(f"{label} child ran with the wrong BLAS: {result['blas']}")
    return result


def _table(runs: dict) -> str:
    base = runs["bundled"]["models"]["float32"]
    rows = [f"{'BLAS':10} {'model':11} {'prompt tok/s':>12} {'x f32':>6} {'decode tok/s':>12} "
            f"{'x f32':>6} {'TTFT s':>7}"]
    for label, run in runs.items():
        for variant, r in run["models"].items():
            rows.append(
                f"{label:10} {variant:11} {r['prompt_tps']:12.1f} "
                f"{r['prompt_tps'] / base['prompt_tps']:6.1f} {r['decode_tps']:12.1f} "
                f"{r['decode_tps'] / base['decode_tps']:6.2f} {r['ttft_s']:7.2f}"
            )
    rows.append("")
    rows.append(f"{'BLAS':10} {'dtype':9} {'matmul GFLOP/s':>15} {'gemv GFLOP/s':>13}")
    for label, run in runs.items():
        for dtype, g in run["matmul_gflops"].items():
            rows.append(f"{label:10} {dtype:9} {g:15.1f} {run['gemv_gflops'][dtype]:13.2f}")
    return "\n".join(rows)


def parent_main(args: argparse.Namespace) -> None:
    """Run both children, compare against the targets, print and save."""
    if find_optimized_blas() is None:
        raise SystemExit("no optimized BLAS installed; pip install scipy-openblas32")
    if args.model_path is None:
        from veloxquant_mlx.offline_model import ensure_model

        args.model_path = Path(ensure_model(args.model))
    runs = {label: _run_child(label, args) for label in ("bundled", "optimized")}
    base, opt = runs["bundled"]["models"]["float32"], runs["optimized"]["models"]["float32"]
    ratios = {key: opt[key] / base[key] for key in TARGETS}
    result = {
        "benchmark": "cpu_backend",
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": _cpu_count()},
        "model": {"preset": args.model, "path": str(args.model_path)},
        "settings": {"prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
                     "matmul_mkn": list(MATMUL),
                     "timing": f"generation: median of up to {REPEATS} runs "
                     f"(fewer past {REPEAT_BUDGET_S} s) after a warm-up; matmul best of 5, "
                     "gemv best of 50",
                     "optimized_blas": str(find_optimized_blas())},
        "runs": runs,
        "ratios_optimized_float32_vs_bundled_float32": ratios,
        "targets": {key: {"min_ratio": need, "met": ratios[key] >= need}
                    for key, need in TARGETS.items()},
    }
    print(_table(runs))
    print("optimized/bundled float32:", {k: round(v, 2) for k, v in ratios.items()},
          "targets", TARGETS)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small", help="offline model preset")
    parser.add_argument("--model-path", type=Path, default=None,
                        help="an mlx-lm model directory instead of the preset")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--variants", type=lambda s: tuple(s.split(",")), default=VARIANTS)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args)
    else:
        parent_main(args)


if __name__ == "__main__":
    main()
