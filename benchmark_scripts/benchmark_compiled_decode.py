"""Decode steps with mlx-lm's blocks as written and as compiled halves, same run.

``batch.compile_decode`` (veloxquant_mlx/compiled_decode.py) changes how much
host work building a decode step's graph takes. This drives the server's
runner (:class:`~server.harness.RunnerHarness`; greedy, write-back 32) for 1, 16
and 64 rows, the two settings alternating so drift hits both, on two models:

- ``tiny`` (4 layers, float32): the CPU serving path (our paged attention);
- ``thin16`` (16 layers like the 1b preset, hidden 128, bfloat16): the path a
  GPU takes (mlx-lm's attention, bfloat16), with the 1b preset's layer count
  but a graph cheap to run, so ``decode_graph`` (building the step's graph,
  paged-KV bookkeeping included) is the host cost a GPU step pays per layer;
- ``1b`` (the GPU benchmark's model; too slow for this CPU): on a GPU, where
  the synced steps split a step into host and device time.

Per step it records the wall time and the step clock's phases, and checks that
both settings sampled the same tokens.

Usage::

    .venv/bin/python benchmark_scripts/benchmark_compiled_decode.py [--rows 1 16 64] [--steps 40]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmark_write_back import decode_rows, save_figures  # noqa: E402

from veloxquant_mlx.cpu_backend import load_optimized_blas  # noqa: E402

DEFAULT_OUT = ROOT / "figures" / "compiled_decode" / "results.json"


def measure(model, rows: int, compiled: bool, steps: int) -> dict:
    """Decode ``steps`` greedy steps of ``rows`` rows (64-token prompts)."""
    from server.harness import RunnerHarness
    from server.protocol import SamplingParams

    with RunnerHarness.for_model(model, rows * 16 * 2 * 12 + 64, kv_write_back=32,
                                 compile_decode=compiled) as harness:
        result, tokens = decode_rows(harness, rows, 64, steps,
                                     SamplingParams(max_tokens=steps + 32, temperature=0.0))
        return {**result, "compiled_blocks": harness.compiled_blocks, "tokens": tokens}


def model_folder(name: str, scratch: Path) -> Path:
    """The model's folder (thin16 is built into ``scratch``: no preset names it)."""
    from veloxquant_mlx.offline_model import ModelPreset, build_model, ensure_model

    if name in ("tiny", "1b"):  # offline presets (1b: the GPU benchmark's model)
        return ensure_model(name)
    folder = scratch / name
    build_model(ModelPreset(name, 128, 16, 4, 1, 256, 4096, dtype="bfloat16"), folder)
    return folder


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--models", nargs="+", default=["tiny", "thin16"],
                   choices=["tiny", "thin16", "1b"])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    load_optimized_blas(True)  # as the server does (MLX not imported before)
    from mlx_lm import load

    from veloxquant_mlx.llama_model import own_model

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            folder = model_folder(name, Path(tmp))
            # Two instances: compiling changes a model's blocks for good.
            pair = {c: own_model(load(str(folder))[0]) for c in (False, True)}  # as served
            for rows in args.rows:
                runs: dict[bool, list[dict]] = {False: [], True: []}
                for _ in range(args.rounds):
                    for compiled in (False, True):
                        runs[compiled].append(measure(pair[compiled], rows, compiled,
                                                      args.steps))
                same = all(r["tokens"] == runs[False][0]["tokens"] for rs in runs.values()
                           for r in rs)
                best = {c: min(r, key=lambda m: m["ms_per_step"]) for c, r in runs.items()}
                for r in runs[False] + runs[True]:
                    r.pop("tokens")
                graph = {c: best[c]["phases_ms_per_step"].get("decode_graph") for c in best}
                results.append({"model": name, "rows": rows, "same_tokens": same,
                                "as_written": best[False], "compiled": best[True],
                                "step_ratio": round(best[False]["ms_per_step"]
                                                    / best[True]["ms_per_step"], 3),
                                "decode_graph_ratio": round(graph[False] / graph[True], 3),
                                "all_runs": {"as_written": runs[False],
                                             "compiled": runs[True]}})
                print(f"{name} rows {rows}: step {best[False]['ms_per_step']} -> "
                      f"{best[True]['ms_per_step']} ms, decode_graph {graph[False]} -> "
                      f"{graph[True]} ms, same tokens: {same}; synced host/device ms "
                      f"{best[False]['synced_steps']} -> {best[True]['synced_steps']}")
    save_figures(args.out, "benchmark_compiled_decode.py", {
        "steps": args.steps, "rounds": args.rounds,
        "note": "best of the rounds per setting; ratios = as written over compiled",
        "levels": results})
    return 0 if all(level["same_tokens"] for level in results) else 1


if __name__ == "__main__":
    sys.exit(main())
