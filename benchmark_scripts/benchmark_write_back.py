"""Decode steps with the KV write-back on and off, same run: host time and arena writes.

What ``batch.kv_write_back`` changes is host work and the number of arena
writes (each of which copies the whole arena on a GPU). This drives the
server's runner (:class:`server.harness.RunnerHarness`) on an offline model
(default ``tiny``, where a step is mostly host work, as on a GPU) for 1, 16
and 64 rows, with write-back 1 (every step writes) and 32, alternating the
two so drift hits both, and records per decode step: wall time, the step
clock's phases (``decode_graph`` is building the model's graph, paged-KV
bookkeeping included) and the arena writes. First, ``copy_probe`` shows
what one arena write costs when the step also reads the arena (a full copy),
and ``bookkeeping`` times ``PagedKVBatch.begin`` alone at 64 rows on the 1b
preset's KV layout (16 layers).

Usage::

    .venv/bin/python benchmark_scripts/benchmark_write_back.py [--rows 1 16 64] [--steps 60]
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import platform
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from veloxquant_mlx.blas_status import active_blas  # noqa: E402
from veloxquant_mlx.cpu_backend import load_optimized_blas  # noqa: E402

DEFAULT_OUT = ROOT / "figures" / "write_back" / "results.json"


def timed_decode(harness, steps: int,
                 sync_steps: int = 8) -> tuple[dict, list[tuple[int, int]]]:
    """Five warm-up decode steps (joins, first traces), ``steps`` timed ones, then synced ones.

    The timed steps run as the engine runs them (each one's device work
    overlaps the next one's host work). The ``sync_steps`` after them wait
    for the device at the end of each step, which splits a step into the
    host's part (building and submitting the graph) and the device's (what
    is left once the host is done): on a GPU, which of the two bounds a step.

    Returns:
        Wall and step-clock milliseconds per step, the arena writes of the
        timed steps, the synced steps' median host and device milliseconds,
        and the graph nodes of one more step (:func:`counted_step`); and the
        ``(owner, token)`` pairs every timed and synced step handed back.
    """
    import statistics

    import mlx.core as mx

    clock = harness.clock
    for _ in range(5):
        harness.decode()
    mx.synchronize()
    writes = harness.arena.writes
    _, before = clock.totals()
    tokens = []
    t = time.perf_counter()
    for _ in range(steps):
        clock.start()
        tokens += [(s.owner, s.token) for s in harness.decode().tokens]
    mx.synchronize()
    wall = time.perf_counter() - t
    _, after = clock.totals()
    phases = {k: round((after[k] - before[k]) / steps * 1e3, 3) for k in after
              if after[k] != before[k]}
    arena_writes = harness.arena.writes - writes
    host, device = [], []
    for _ in range(sync_steps):
        t0 = time.perf_counter()
        tokens += [(s.owner, s.token) for s in harness.decode().tokens]
        t1 = time.perf_counter()
        mx.synchronize()
        host.append(t1 - t0)
        device.append(time.perf_counter() - t1)
    synced = {"host_ms": round(statistics.median(host) * 1e3, 3),
              "device_ms": round(statistics.median(device) * 1e3, 3)} if sync_steps else {}
    nodes = counted_step(harness)
    return {"ms_per_step": round(wall / steps * 1e3, 3), "phases_ms_per_step": phases,
            "arena_writes": arena_writes, "synced_steps": synced,
            "graph_nodes": sum(nodes.values()), "nodes_by_primitive": nodes}, tokens


def count_nodes(arrays) -> dict[str, int]:
    """Unevaluated graph nodes behind ``arrays``, by primitive (from ``mx.export_to_dot``)."""
    import mlx.core as mx

    dot = io.StringIO()
    mx.export_to_dot(dot, *arrays)
    return dict(collections.Counter(re.findall(r'label\s*=\s*"(\w+)', dot.getvalue())))


def counted_step(harness) -> dict[str, int]:
    """One more decode step; the nodes of the graphs it hands to ``mx.async_eval``.

    Each node is built by the host, walked by the evaluation and run as one
    kernel (views aside), so their number is a step's fixed cost.
    """
    import mlx.core as mx

    counts: collections.Counter = collections.Counter()
    submit = mx.async_eval

    def counting(*arrays):
        counts.update(count_nodes([a for a in arrays if isinstance(a, mx.array)]))
        return submit(*arrays)

    mx.async_eval = counting
    try:
        harness.decode()
    finally:
        mx.async_eval = submit
    return dict(counts.most_common())


def save_figures(out: Path, script: str, fields: dict) -> None:
    """Write a decode benchmark's ``fields`` to ``out`` as JSON, after what ran where.

    The header (script, UTC date, platform, MLX device, BLAS) is the same for
    this benchmark and benchmark_compiled_decode.py, which drive the runner
    the same way (:func:`timed_decode`).
    """
    import mlx.core as mx

    result = {"benchmark": f"benchmark_scripts/{script}",
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": {"platform": platform.platform(), "device": str(mx.default_device()),
                          "blas": str(active_blas())},
              **fields}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


def measure(model, rows: int, write_back: int, steps: int, n_blocks: int) -> dict:
    """Decode ``steps`` steps of ``rows`` rows (32-token prompts, temperature 0.7)."""
    from server.harness import RunnerHarness
    from server.protocol import SamplingParams

    with RunnerHarness.for_model(model, n_blocks, prefill_chunk=64,
                                 kv_write_back=write_back) as harness:
        result, _ = decode_rows(harness, rows, 32, steps,
                                SamplingParams(max_tokens=steps + 32, temperature=0.7))
        return {**result, "arena_mib": round(harness.arena.nbytes / 2**20, 1)}


def decode_rows(harness, rows: int, prompt_tokens: int, steps: int,
                params) -> tuple[dict, list[tuple[int, int]]]:
    """``rows`` rows of ``prompt_tokens``-token prompts started and prefilled, then
    :func:`timed_decode`'s steps; the rows leave after."""
    prompts = {owner: [5 + (owner * 7 + j) % 200 for j in range(prompt_tokens)]
               for owner in range(1, rows + 1)}
    harness.start(prompts, params)
    harness.prefill()
    timed = timed_decode(harness, steps)
    harness.finish(prompts)
    return timed


def copy_probe(mib: int = 256, steps: int = 10) -> dict:
    """Why arena writes cost: one scatter of 8 slots into a ``mib`` MiB array, per step.

    With a read of the same array in the step's graph (what every decode
    step has: the layers gather from the arena), MLX cannot update it in
    place and copies all of it; without one, the scatter is in place. On a
    GPU the kernels in flight always hold the arena, so every write copies.
    """
    import mlx.core as mx

    slots = mib * 2**20 // (8 * 64 * 4)
    heads = mx.arange(8)[:, None]
    out = {}
    for name, read in (("scatter_with_a_read_ms", True), ("scatter_alone_ms", False)):
        arena = mx.zeros((8, slots, 64))
        mx.eval(arena)
        t = time.perf_counter()
        for step in range(steps):
            seen = arena[:, :128].sum() if read else mx.array(0.0)
            arena[heads, mx.array([[step]])] = mx.ones((8, 1, 64))
            mx.eval(seen, arena)
        out[name] = round((time.perf_counter() - t) / steps * 1e3, 3)
        del arena
    return {"arena_mib": mib, **out}


def bookkeeping(rows: int = 64, calls: int = 120, rounds: int = 3) -> dict:
    """Host time of ``PagedKVBatch.begin`` alone, on the 1b preset's KV layout.

    16 layers (32 block streams a row), 8 KV heads x 64, bfloat16: what a
    decode call's paged-KV bookkeeping costs at ``rows`` rows, without a
    model (held columns stand in as zeros of the right shape).
    """
    import mlx.core as mx

    from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig
    from veloxquant_mlx.memory.kv_arena import KVArena, KVLayout
    from veloxquant_mlx.memory.paged_batch import PagedKVBatch

    def once(write_back: int) -> float:
        pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=1 << 16))
        arena = KVArena(pool, KVLayout(16, 8, 64, mx.bfloat16))
        batch = PagedKVBatch(arena, list(range(1, rows + 1)), write_back=write_back)
        batch.begin(128)  # a prompt each
        t = time.perf_counter()
        for _ in range(calls):
            batch.begin(1)
            if batch.held.count:  # what the layers would have appended
                batch.held._layers = [mx.zeros((2 * rows, 8, batch.held.count, 64),
                                               mx.bfloat16)] * 16
        spent = (time.perf_counter() - t) / calls
        batch.release()
        return spent

    best = {wb: min(once(wb) for _ in range(rounds)) for wb in (1, 32)}
    return {"rows": rows, "layout": "16 layers, 8 KV heads x 64, bfloat16",
            "begin_us_write_every_step": round(best[1] * 1e6, 1),
            "begin_us_write_back_32": round(best[32] * 1e6, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--n-blocks", type=int, default=16384)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    load_optimized_blas(True)  # as the server does (MLX not imported before)
    from mlx_lm import load

    from veloxquant_mlx.llama_model import own_model
    from veloxquant_mlx.offline_model import ensure_model

    model = own_model(load(str(ensure_model(args.preset)))[0])  # the model as served
    probe = copy_probe()
    print(f"a write into a {probe['arena_mib']} MiB array: {probe['scatter_with_a_read_ms']} ms "
          f"with a read in the same graph, {probe['scatter_alone_ms']} ms without")
    books = bookkeeping(rounds=args.rounds + 1)
    print(f"begin() at {books['rows']} rows ({books['layout']}): "
          f"{books['begin_us_write_every_step']} us writing every step, "
          f"{books['begin_us_write_back_32']} us with write-back")
    levels = []
    for rows in args.rows:
        runs: dict[int, list[dict]] = {1: [], 32: []}
        for _ in range(args.rounds):
            for write_back in (1, 32):
                runs[write_back].append(measure(model, rows, write_back, args.steps,
                                                args.n_blocks))
        best = {wb: min(r, key=lambda m: m["ms_per_step"]) for wb, r in runs.items()}
        levels.append({"rows": rows, "write_every_step": best[1], "write_back_32": best[32],
                       "step_ratio": round(best[1]["ms_per_step"] / best[32]["ms_per_step"], 3),
                       "all_runs": {str(k): v for k, v in runs.items()}})
        print(f"rows {rows}: every step {best[1]['ms_per_step']} ms "
              f"({best[1]['arena_writes']} writes), write-back 32 "
              f"{best[32]['ms_per_step']} ms ({best[32]['arena_writes']} writes); "
              f"decode_graph {best[1]['phases_ms_per_step'].get('decode_graph')} -> "
              f"{best[32]['phases_ms_per_step'].get('decode_graph')} ms; synced host/device "
              f"ms {best[1]['synced_steps']} -> {best[32]['synced_steps']}")
    save_figures(args.out, "benchmark_write_back.py", {
        "preset": args.preset, "steps": args.steps, "rounds": args.rounds,
        "note": "best of the rounds per setting; ratio = every-step over write-back",
        "copy_probe": probe, "bookkeeping": books, "levels": levels})
    return 0


if __name__ == "__main__":
    sys.exit(main())
