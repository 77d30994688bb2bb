#!/usr/bin/env python3
"""PoolBackedKVCache vs mlx-lm's stock KVCache on real generation.

On the offline ``small`` model (or ``--model PATH``), each round runs, in a
rotating order:

* ``stock``         -- ``make_prompt_cache(model)``;
* ``pooled_a``      -- ``build_pooled_caches`` on a fresh pool (cold: no block reused);
* ``pooled_b``      -- right after A on the same pool, new owner (warm: reuses A's blocks);
* ``pooled_buf16``  -- pooled with the buffer also grown per 16 tokens
  (``buffer_step=16``), the design this cache avoids: it copies the whole
  cache every block;
* ``pooled_storage`` -- ``build_pooled_caches(..., storage=arena)``: the form the
  server builds, keys and values in the pool's blocks (gathered each step)
  instead of the contiguous buffer.

Greedy decoding, ~64 prompt tokens, 150 generated. Reported: medians over the
rounds of prompt and generation tok/s, the median of per-round paired ratios
against ``stock``, process peak memory (``mx.get_peak_memory``), KV buffer
bytes and pool-accounted KV bytes per request, identical tokens, pool stats
and B's reuse fraction. Then, because whole runs seconds apart are at the
mercy of other processes on a shared machine, a *lockstep* measurement:
stock and pooled decode one token each in turn, and the ratio of their summed
step times is reported per round and as a median.

Run (takes ~4 minutes on 2 CPU cores):
    flock /tmp/velox-bench.lock .venv/bin/python benchmark_scripts/benchmark_pool_backed_kvcache.py

Writes ``figures/block_pool/pool_backed_kvcache_results.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from veloxquant_mlx.blas_status import describe_backend  # noqa: E402
from veloxquant_mlx.cpu_backend import load_optimized_blas  # noqa: E402

DEFAULT_OUT = ROOT / "figures" / "block_pool" / "pool_backed_kvcache_results.json"
PROMPT_TEXT = (
    "Return a new list containing all items from the iterable in ascending order. "
    "A custom key function can be supplied to customize the sort order, and the "
    "reverse flag can be set to request the result in descending order. "
) * 4
UNITS = ("stock", "pooled", "pooled_buf16", "pooled_storage")  # "pooled" runs A then B on one pool


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: offline small)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=150)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return parser.parse_args(argv)


def run_once(model, tokenizer, prompt, max_tokens, cache) -> dict:
    """One greedy generation into ``cache``; returns speed, memory and tokens."""
    import mlx.core as mx
    import mlx_lm

    mx.clear_cache()
    mx.reset_peak_memory()
    tokens, last = [], None
    cpu_start = 0.0
    for last in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens, prompt_cache=cache):
        if not tokens:
            cpu_start = time.process_time()  # decode phase starts after the first token
        tokens.append(last.token)
    cpu_seconds = time.process_time() - cpu_start
    return {
        "prompt_tps": last.prompt_tps,
        "generation_tps": last.generation_tps,
        # Tokens per CPU-second of this process: far less disturbed than wall
        # time by other processes sharing the machine's cores.
        "generation_tps_cpu": (len(tokens) - 1) / cpu_seconds,
        "peak_memory_bytes": mx.get_peak_memory(),
        "kv_buffer_bytes": sum(c.nbytes for c in cache),
        "cache_tokens": cache[0].size(),
        "tokens": tokens,
    }


def kv_bytes_per_block(model, pool) -> int:
    """Bytes one block stands for: block_size token rows of one layer's K (or V)."""
    attn = model.layers[0].self_attn
    return pool.config.block_size * attn.n_kv_heads * attn.head_dim * 4  # float32


def run_pooled(model, tokenizer, prompt, args, owner, buffer_step=None,
               storage: bool = False) -> dict:
    """Request(s) on a fresh pool: A, and B after it unless ``buffer_step`` is set.

    ``storage``: the caches keep their KV in the pool's block storage (an arena).
    """
    from veloxquant_mlx.memory import (
        BlockPoolAllocator,
        PoolBackedKVCache,
        PoolConfig,
        build_pooled_caches,
    )
    from veloxquant_mlx.memory.kv_arena import KVArena, probe_kv_layout

    # The storage is preallocated for every block: size the pool to one request.
    tokens = len(prompt) + args.max_tokens + args.block_size
    n_blocks = 2 * len(model.layers) * -(-tokens // args.block_size) if storage else 8192
    pool = BlockPoolAllocator(PoolConfig(block_size=args.block_size, n_blocks=n_blocks))
    arena = KVArena(pool, probe_kv_layout(model)) if storage else None
    per_block = kv_bytes_per_block(model, pool)
    out = {}
    for name in ("a", "b") if buffer_step is None else ("a",):
        before = pool.stats.snapshot()
        if buffer_step is None:
            cache = build_pooled_caches(model, pool, owner=owner, storage=arena)
        else:
            cache = [
                PoolBackedKVCache(pool, owner, buffer_step=buffer_step)
                for _ in range(len(model.layers))
            ]
        result = run_once(model, tokenizer, prompt, args.max_tokens, cache)
        stats = pool.stats
        allocated = stats.n_allocations - before.n_allocations
        result.update(
            kv_accounted_bytes=stats.blocks_in_use() * per_block,
            blocks_allocated=allocated,
            blocks_reused=stats.n_reused - before.n_reused,
            reuse_fraction=(stats.n_reused - before.n_reused) / allocated,
            pool_stats_after_request=stats.as_dict(),
        )
        cache[0].release()
        result["pool_stats_after_release"] = pool.stats.as_dict()
        out[name] = result
        owner += 1
    return out


def run_lockstep(model, prompt, max_tokens, pooled_first: bool, block_size: int) -> dict:
    """Decode with a stock and a pooled cache in lockstep, one token each in turn.

    Both generations see the same moment of machine load, so the ratio of
    their summed decode-step times is robust against other processes, unlike
    two whole runs a few seconds apart.
    """
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig, build_pooled_caches

    pool = BlockPoolAllocator(PoolConfig(block_size=block_size, n_blocks=8192))
    pooled_cache = build_pooled_caches(model, pool, owner=1)
    prompt_array = mx.array(prompt)
    gens = {
        "stock": generate_step(prompt_array, model, max_tokens=max_tokens,
                               prompt_cache=make_prompt_cache(model)),
        "pooled": generate_step(prompt_array, model, max_tokens=max_tokens,
                                prompt_cache=pooled_cache),
    }
    order = ["pooled", "stock"] if pooled_first else ["stock", "pooled"]
    seconds = {name: 0.0 for name in order}
    tokens: dict[str, list[int]] = {name: [] for name in order}
    for step in range(max_tokens):
        for name in order:
            start = time.perf_counter()
            token, _ = next(gens[name])
            if step:  # step 0 is the prefill
                seconds[name] += time.perf_counter() - start
            tokens[name].append(token)
    pooled_cache[0].release()
    return {
        "stock_over_pooled_decode_time": seconds["pooled"] / seconds["stock"],
        "tps_ratio": seconds["stock"] / seconds["pooled"],
        "identical_tokens": tokens["stock"] == tokens["pooled"],
    }


def summarise(runs: list[dict], stock: list[dict], stock_tokens: list[int]) -> dict:
    """Medians over rounds plus paired ratios against the same round's stock run."""
    def med(key):
        return statistics.median(r[key] for r in runs)

    summary = {
        "prompt_tps_median": med("prompt_tps"),
        "generation_tps_median": med("generation_tps"),
        "generation_tps_ratio_vs_stock": statistics.median(
            r["generation_tps"] / s["generation_tps"] for r, s in zip(runs, stock, strict=True)
        ),
        "generation_tps_cpu_median": med("generation_tps_cpu"),
        "generation_tps_cpu_ratio_vs_stock": statistics.median(
            r["generation_tps_cpu"] / s["generation_tps_cpu"]
            for r, s in zip(runs, stock, strict=True)
        ),
        "prompt_tps_ratio_vs_stock": statistics.median(
            r["prompt_tps"] / s["prompt_tps"] for r, s in zip(runs, stock, strict=True)
        ),
        "peak_memory_bytes_max": max(r["peak_memory_bytes"] for r in runs),
        "kv_buffer_bytes": max(r["kv_buffer_bytes"] for r in runs),
        "identical_tokens": all(r["tokens"] == stock_tokens for r in runs),
        "generation_tps_per_round": [r["generation_tps"] for r in runs],
        "generation_tps_cpu_per_round": [r["generation_tps_cpu"] for r in runs],
    }
    for key in ("kv_accounted_bytes", "reuse_fraction", "blocks_allocated", "blocks_reused"):
        if key in runs[0]:
            summary[key] = runs[-1][key]
    for key in ("pool_stats_after_request", "pool_stats_after_release"):
        if key in runs[0]:
            summary[key] = runs[-1][key]
    if "reuse_fraction" in runs[0]:
        summary["reuse_fraction_min"] = min(r["reuse_fraction"] for r in runs)
    return summary


def main(argv: list[str] | None = None) -> int:
    """Run the interleaved rounds, print a table, write the JSON."""
    args = parse_args(argv)
    load_optimized_blas()  # OpenBLAS under MLX where available (MLX not imported before)
    import mlx.core as mx
    import mlx_lm

    from veloxquant_mlx.offline_model import ensure_model

    model_path = args.model or str(ensure_model("small"))
    model, tokenizer = mlx_lm.load(model_path)
    prompt = tokenizer.encode(PROMPT_TEXT)[: args.prompt_tokens]
    from mlx_lm.models.cache import make_prompt_cache

    run_once(model, tokenizer, prompt, args.max_tokens, make_prompt_cache(model))  # warm-up
    rounds: dict[str, list[dict]] = {"stock": [], "pooled_a": [], "pooled_b": [],
                                     "pooled_buf16": [], "pooled_storage": []}
    owner = 1
    for r in range(args.rounds):
        k = r % len(UNITS)
        order = UNITS[k:] + UNITS[:k]  # rotate so no variant always runs first
        for unit in order:
            if unit == "stock":
                rounds["stock"].append(
                    run_once(model, tokenizer, prompt, args.max_tokens, make_prompt_cache(model))
                )
            elif unit == "pooled":
                res = run_pooled(model, tokenizer, prompt, args, owner)
                rounds["pooled_a"].append(res["a"])
                rounds["pooled_b"].append(res["b"])
            elif unit == "pooled_buf16":
                res = run_pooled(model, tokenizer, prompt, args, owner, buffer_step=16)
                rounds["pooled_buf16"].append(res["a"])
            else:
                res = run_pooled(model, tokenizer, prompt, args, owner, storage=True)
                rounds["pooled_storage"].append(res["a"])
            owner += 2
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    lockstep = [
        run_lockstep(model, prompt, args.max_tokens, r % 2 == 1, args.block_size)
        for r in range(args.rounds)
    ]
    stock_tokens = rounds["stock"][0]["tokens"]
    results = {
        name: summarise(runs, rounds["stock"], stock_tokens) for name, runs in rounds.items()
    }
    report = {
        "benchmark": "benchmark_pool_backed_kvcache",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": f"{platform.system()} {platform.machine()}",
        "backend": describe_backend("float32"),
        "mlx_version": mx.__version__,
        "mlx_lm_version": mlx_lm.__version__,
        "model": model_path if args.model else "offline small (ensure_model('small'))",
        "n_layers": len(model.layers),
        "prompt_tokens": len(prompt),
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "block_size": args.block_size,
        "stock_kvcache_step": 256,
        "results": results,
        "lockstep": {
            "what": "stock and pooled (A) decode in lockstep, one token each in turn; "
            "ratio = stock decode seconds / pooled decode seconds (pooled/stock tok/s)",
            "generation_tps_ratio_median": statistics.median(r["tps_ratio"] for r in lockstep),
            "generation_tps_ratio_per_round": [r["tps_ratio"] for r in lockstep],
            "identical_tokens": all(r["identical_tokens"] for r in lockstep),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print_table(report)
    ls = report["lockstep"]
    print(f"lockstep pooled/stock generation tok/s: median {ls['generation_tps_ratio_median']:.3f} "
          f"over {args.rounds} rounds, identical tokens {ls['identical_tokens']}")
    print(f"wrote {args.out}")
    return 0


def print_table(report: dict) -> None:
    """A short human-readable summary of ``report``."""
    head = f"{'variant':<14}{'prompt tok/s':>13}{'gen tok/s':>11}{'gen ratio':>11}{'cpu ratio':>11}"
    head += f"{'KV buf KiB':>12}{'KV acct KiB':>13}{'peak MiB':>10}{'same':>6}{'reuse':>7}"
    print(head)
    for name, r in report["results"].items():
        acct = r.get("kv_accounted_bytes")
        reuse = r.get("reuse_fraction_min")
        print(
            f"{name:<14}{r['prompt_tps_median']:>13.1f}{r['generation_tps_median']:>11.2f}"
            f"{r['generation_tps_ratio_vs_stock']:>11.3f}"
            f"{r['generation_tps_cpu_ratio_vs_stock']:>11.3f}{r['kv_buffer_bytes'] / 1024:>12.0f}"
            f"{(acct / 1024 if acct is not None else float('nan')):>13.0f}"
            f"{r['peak_memory_bytes_max'] / 2**20:>10.1f}{str(r['identical_tokens']):>6}"
            f"{(reuse if reuse is not None else float('nan')):>7.2f}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
