"""One decode step of the served model, from this checkout and another, same run.

What a decode step costs once the model is small next to the machine is mostly
graph nodes: each one is built by the host, walked by ``async_eval`` and run
as a kernel (on this CPU several microseconds each, on a GPU a launch). This
drives the server's runner (:class:`server.harness.RunnerHarness`) on the model as
the server loads it (``server.model_loader``: the default SmolLM2 dequantized
to float32 with its codes on the CPU) with the server's decode settings, for
1 and 16 rows of 64-token prompts (``--prompt-tokens``), greedy, and records per step:

- wall milliseconds and the step clock's phases (``timed_decode``);
- the nodes of the graphs one step hands to ``async_eval``, in total and by
  primitive (``benchmark_write_back.counted_step``);
- the tokens, so the two checkouts can be compared;
- before the steps, how long the rows' prompts take to their first
  tokens (prefill and the step that reads them; a first batch of other
  prompts runs before, untimed, so shapes are traced).

Each measurement runs in a child process whose ``PYTHONPATH`` is the checkout
measured; rounds alternate which checkout goes first.

Usage::

    git worktree add /tmp/base <rev>   # copy veloxquant_mlx/memory/*.so into it
    .venv/bin/python benchmark_scripts/benchmark_decode_step.py --old-root /tmp/base \\
        [--model smollm2] [--rows 1 16] [--steps 60] [--rounds 5] [--prompt-tokens 64]
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmark_scripts"))
DEFAULT_OUT = ROOT / "figures" / "decode_step" / "results.json"


def _first_of(modules: tuple[str, ...], name: str):
    """``name`` from the first of ``modules`` this checkout has."""
    for module in modules:
        try:
            return getattr(importlib.import_module(module), name)
        except (ModuleNotFoundError, AttributeError):
            continue
    raise ImportError(f"{name} is in none of {modules}")


def child(model_name: str, rows: int, steps: int, prompt_tokens: int = 64) -> dict:
    """Measure in this process, on the checkout its ``PYTHONPATH`` (and cwd) names."""
    import server
    from server.settings import load_settings

    SamplingParams = _first_of(("server.protocol", "server.engine.protocol"), "SamplingParams")
    # Imported after the checkout's packages: it puts this checkout first on sys.path.
    timed_decode = importlib.import_module("benchmark_write_back").timed_decode

    if not Path(server.__file__).resolve().is_relative_to(Path.cwd().resolve()):
        raise RuntimeError(f"server imported from {server.__file__}, not {Path.cwd()}")
    settings = load_settings(None, overrides={"model": {"path": model_name}}, env={})
    n_blocks = rows * 2 * 16 * 64 + 64
    # Asked by path: the editable install's finder would hand an older checkout this
    # checkout's server.harness.
    if (Path.cwd() / "server" / "harness.py").exists():
        from server.harness import RunnerHarness

        harness = RunnerHarness.for_settings(settings, n_blocks)
    else:  # a revision from before the harness
        harness = _PreHarness(settings, n_blocks)
    n = prompt_tokens
    warm = {1000 + o: [5 + (o * 11 + j) % 200 for j in range(n)] for o in range(rows)}
    prompts = {1 + o: [5 + (o * 7 + j) % 200 for j in range(n)] for o in range(rows)}
    params = SamplingParams(max_tokens=steps + 64, temperature=0.0)
    prefill_ms = []
    for batch in (warm, prompts):  # the first batch traces the shapes
        start = time.perf_counter()
        harness.start(batch, params)
        read = len(harness.prefill().tokens) == len(batch)
        if not read:
            harness.decode()  # older revisions read the first tokens with the first decode
        prefill_ms.append(round((time.perf_counter() - start) * 1e3, 3))
        if read:  # that decode, untimed: both revisions' rows then stand at the same token
            harness.decode()
        if batch is warm:
            harness.finish(warm)
    result, tokens = timed_decode(harness, steps)
    harness.finish(prompts)
    return {**result, "prompts_to_first_tokens_ms": prefill_ms[1], "tokens": tokens}


class _PreHarness:
    """The moves of ``server.harness.RunnerHarness``, on a revision that predates it."""

    def __init__(self, settings, n_blocks: int) -> None:
        from server.engine.runner import ModelRunner
        from server.model_loader import load_model
        from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig
        from veloxquant_mlx.memory.kv_arena import KVArena, probe_kv_layout

        StepClock = _first_of(("server.engine.run_output", "server.engine.step_clock"),
                              "StepClock")
        self.loaded = load_model(settings.model)  # kept: it owns the model's codes
        pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=n_blocks))
        self.clock = StepClock()
        self.runner = ModelRunner(self.loaded.model, pool, 512,
                                  KVArena(pool, probe_kv_layout(self.loaded.model)), self.clock,
                                  kv_write_back=settings.batch.kv_write_back,
                                  compile_decode=settings.batch.compile_decode)
        self.arena = self.runner.arena

    def start(self, prompts, params) -> None:
        for owner, ids in prompts.items():
            self.runner.add(owner, ids, params)

    def prefill(self):
        """Every prompt in; what the calls handed back (first tokens, where they read them)."""
        out = self.runner.prefill(1 << 20)
        while self.runner.prefilling or self.runner.group is not None:
            out.tokens += self.runner.prefill(1 << 20).tokens
        return out

    def decode(self):
        return self.runner.decode()

    def finish(self, owners) -> None:
        self.runner.remove(owners)


def run_child(root: Path, model: str, rows: int, steps: int, prompt_tokens: int) -> dict:
    from veloxquant_mlx.cpu_backend import child_env

    env = child_env(preload=True)
    env["PYTHONPATH"] = str(root)
    out = subprocess.run([sys.executable, __file__, "--child", model, str(rows), str(steps),
                          str(prompt_tokens)],
                         cwd=root, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{root}: child failed\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old-root", type=Path, required=True)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    roots = {"new": ROOT, "old": args.old_root.resolve()}
    levels = []
    for rows in args.rows:
        runs: dict[str, list[dict]] = {"new": [], "old": []}
        for r in range(args.rounds):
            for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
                runs[name].append(run_child(roots[name], args.model, rows, args.steps,
                                            args.prompt_tokens))
        same = all(run["tokens"] == runs["old"][0]["tokens"] for rs in runs.values()
                   for run in rs)
        for run in runs["old"] + runs["new"]:
            run.pop("tokens")
        # Noise on a shared machine only ever adds time: the best round is the
        # figure compared, the median is kept beside it.
        best = {k: min(run["ms_per_step"] for run in rs) for k, rs in runs.items()}
        median = {k: statistics.median(run["ms_per_step"] for run in rs)
                  for k, rs in runs.items()}
        nodes = {k: rs[0]["graph_nodes"] for k, rs in runs.items()}
        first = {k: min(run["prompts_to_first_tokens_ms"] for run in rs)
                 for k, rs in runs.items()}
        levels.append({"rows": rows, "same_tokens": same, "ms_per_step_best": best,
                       "ms_per_step_median": median, "graph_nodes": nodes,
                       "step_speedup": round(best["old"] / best["new"], 3),
                       "step_speedup_median": round(median["old"] / median["new"], 3),
                       "node_ratio": round(nodes["new"] / nodes["old"], 3),
                       "prompts_to_first_tokens_ms_best": first,
                       "first_tokens_speedup": round(first["old"] / first["new"], 3),
                       "runs": runs})
        print(f"rows {rows}: best {best['old']:.2f} -> {best['new']:.2f} ms a step "
              f"({best['old'] / best['new']:.3f}x; medians {median['old']:.2f} -> "
              f"{median['new']:.2f}), graph nodes {nodes['old']} -> {nodes['new']}, "
              f"{args.prompt_tokens}-token prompts to first tokens {first['old']:.0f} -> "
              f"{first['new']:.0f} ms, "
              f"same tokens: {same}")
    from benchmark_revisions import checkout_revision
    from benchmark_write_back import save_figures

    save_figures(args.out, "benchmark_decode_step.py", {
        "model": args.model, "steps": args.steps, "rounds": args.rounds,
        "prompt_tokens": args.prompt_tokens,
        "revisions": {k: checkout_revision(v) for k, v in roots.items()},
        "note": "step_speedup = old / new ms a step, best round of each (medians beside)",
        "levels": levels})
    return 0


def load_checkout_blas() -> None:
    """Put MLX on the optimized BLAS the way the checkout under test does, before MLX loads."""
    from veloxquant_mlx import cpu_backend

    if hasattr(cpu_backend, "load_optimized_blas"):
        cpu_backend.load_optimized_blas()
    else:  # an older checkout re-executes this child under its own preload
        cpu_backend.ensure_optimized_blas(True)


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        load_checkout_blas()
        print(json.dumps(child(sys.argv[2], *map(int, sys.argv[3:]))))
        sys.exit(0)
    sys.exit(main())
