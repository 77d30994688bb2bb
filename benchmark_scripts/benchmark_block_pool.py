"""Block pool benchmark: naive per-token allocation vs the pool, vs vLLM, and scaling.

Writes figures/block_pool/results.json and prints a short table. Three parts:

1. The reference workload: 200 requests x 256 tokens (K and V, head_dim 128,
   float16), block_size 16. "naive" gives every token's K and V vectors a
   fresh array; "pool" writes them into pre-allocated per-block buffers and
   checks one block out per 16 tokens, returning all of a request's blocks
   when it ends. Tokens/s, allocations per request, reuse, peak, fragmentation.
2. Raw allocate+free throughput in block-ops/s against vLLM v1's BlockPool,
   measured in one interpreter that can import vLLM (see
   setup_vllm_peer.sh); runs interleaved, median of --reps.
3. Scaling: CPU ns per block-op with 1,000 vs 1,000,000 blocks and 10 vs
   10,000 live owners; O(1) per block means large/small stays near 1.

Usage: python benchmark_scripts/benchmark_block_pool.py [--reps 5] [--vllm-python PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmark_scripts"))

from block_pool_workloads import cpu_seconds, scaling_ns_per_block  # noqa: E402

from veloxquant_mlx.memory import NATIVE_ALLOCATOR, BlockPoolAllocator, PoolConfig  # noqa: E402

N_REQUESTS, N_TOKENS, BLOCK_SIZE, HEAD_DIM = 200, 256, 16, 128
DEFAULT_PEER = ROOT / ".bench" / "vllm-venv" / "bin" / "python"


def naive_run(k_tokens: np.ndarray, v_tokens: np.ndarray) -> dict:
    """Every token's K and V get a new array (what a cache without a pool does)."""
    allocations = peak_bytes = 0
    for _ in range(N_REQUESTS):
        keys, values = [], []
        for t in range(N_TOKENS):
            keys.append(k_tokens[t].copy())
            values.append(v_tokens[t].copy())
        allocations += 2 * N_TOKENS
        peak_bytes = max(peak_bytes, sum(a.nbytes for a in keys) * 2)
    return {"allocations_per_request": allocations / N_REQUESTS, "peak_kv_bytes": peak_bytes}


def pool_run(k_tokens: np.ndarray, v_tokens: np.ndarray) -> dict:
    """Tokens go into pre-allocated block buffers; one block per 16 tokens per stream."""
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=64))
    # One buffer per block id, made up front: the pool's whole point.
    store = np.empty((64, BLOCK_SIZE, HEAD_DIM), dtype=k_tokens.dtype)
    allocate, free_all = pool.allocate, pool.free_all
    mid_fragmentation = []
    for owner in range(N_REQUESTS):
        for t in range(N_TOKENS):
            slot = t % BLOCK_SIZE
            if slot == 0:
                k_buf = store[allocate("k", BLOCK_SIZE, owner)[0].block_id]
                v_buf = store[allocate("v", BLOCK_SIZE, owner)[0].block_id]
            k_buf[slot] = k_tokens[t]
            v_buf[slot] = v_tokens[t]
        mid_fragmentation.append(pool.stats.fragmentation())
        free_all(owner)
    s = pool.stats
    return {
        "allocations_per_request": s.n_allocations / N_REQUESTS,
        "n_reused": s.n_reused,
        "reuse_fraction": s.n_reused / s.n_allocations,
        "peak_blocks": s.peak_blocks_in_use,
        "peak_kv_bytes": s.peak_blocks_in_use * BLOCK_SIZE * HEAD_DIM * k_tokens.itemsize,
        "fragmentation_at_request_end": statistics.mean(mid_fragmentation),
        "blocks_in_use_after": s.blocks_in_use(),
    }


def reference_workload(reps: int) -> dict:
    rng = np.random.default_rng(0)
    k_tokens = rng.standard_normal((N_TOKENS, HEAD_DIM)).astype(np.float16)
    v_tokens = rng.standard_normal((N_TOKENS, HEAD_DIM)).astype(np.float16)
    runs: dict[str, list[float]] = {"naive": [], "pool": []}
    details = {}
    for _ in range(reps):  # interleaved, so drift on a shared machine hits both
        for name, fn in (("naive", naive_run), ("pool", pool_run)):
            box = {}
            seconds = cpu_seconds(lambda fn=fn, box=box: box.update(fn(k_tokens, v_tokens)))
            runs[name].append(N_REQUESTS * N_TOKENS / seconds)
            details[name] = box
    out = {name: {"tokens_per_s": statistics.median(v), "runs": v, **details[name]}
           for name, v in runs.items()}
    out["pool_over_naive_tokens_per_s"] = out["pool"]["tokens_per_s"] / out["naive"][
        "tokens_per_s"]
    return out


def vllm_comparison(peer_python: Path | None, reps: int, processes: int = 3) -> dict:
    """Our pool vs vLLM's in ``processes`` fresh interpreters, runs pooled.

    Separate processes because the compiled allocator's speed moves by up to
    ~30% from one process to the next (where its objects land in memory),
    far more than between reps within one process.
    """
    if peer_python is None or not peer_python.exists():
        return {"measured": False,
                "why": "no interpreter with vLLM; run benchmark_scripts/setup_vllm_peer.sh"}
    cmd = [str(peer_python), str(ROOT / "benchmark_scripts" / "block_pool_workloads.py"),
           "--compare", str(reps)]
    outputs = [json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
               for _ in range(processes)]
    result: dict = {"measured": True, "processes": processes, "reps_per_process": reps,
                    "vllm_version": outputs[0]["vllm_version"], "python": outputs[0]["python"]}
    for label in ("one_block_per_call", "16_blocks_per_call"):
        case = {}
        for adapter in ("veloxquant", "vllm"):
            runs = [r for out in outputs for r in out[label][adapter]["runs"]]
            per_process = [out[label][adapter]["median"] for out in outputs]
            case[adapter] = {"median": statistics.median(runs), "runs": runs,
                             "per_process_medians": per_process}
        case["ours_over_vllm"] = case["veloxquant"]["median"] / case["vllm"]["median"]
        result[label] = case
    return result


def scaling(reps: int) -> dict:
    cases = {"blocks_1k": (1_000, 10), "blocks_1m": (1_000_000, 10),
             "owners_10": (20_000, 10), "owners_10k": (20_000, 10_000)}
    ns = {name: statistics.median(scaling_ns_per_block(*args) for _ in range(reps))
          for name, args in cases.items()}
    return {
        "ns_per_block_op": ns,
        "pool_size_ratio_1m_over_1k": ns["blocks_1m"] / ns["blocks_1k"],
        "owners_ratio_10k_over_10": ns["owners_10k"] / ns["owners_10"],
    }


def print_table(results: dict) -> None:
    ref = results["reference_workload"]
    print(f"{'reference workload':<34}{'naive':>14}{'pool':>14}")
    print(f"{'tokens/s':<34}{ref['naive']['tokens_per_s']:>14,.0f}"
          f"{ref['pool']['tokens_per_s']:>14,.0f}")
    print(f"{'allocations per request':<34}{ref['naive']['allocations_per_request']:>14.0f}"
          f"{ref['pool']['allocations_per_request']:>14.0f}")
    print(f"{'peak KV bytes':<34}{ref['naive']['peak_kv_bytes']:>14,}"
          f"{ref['pool']['peak_kv_bytes']:>14,}")
    print(f"pool/naive tokens/s: {ref['pool_over_naive_tokens_per_s']:.2f}x, "
          f"reuse fraction {ref['pool']['reuse_fraction']:.3f}")
    peer = results["vs_vllm"]
    if peer["measured"]:
        for label in ("one_block_per_call", "16_blocks_per_call"):
            case = peer[label]
            print(f"{label:<22} ours {case['veloxquant']['median']:>12,.0f} block-ops/s  "
                  f"vLLM {case['vllm']['median']:>12,.0f}  ratio {case['ours_over_vllm']:.2f}x")
    else:
        print("vLLM comparison:", peer["why"])
    sc = results["scaling"]
    print("scaling ns/block-op:", {k: round(v) for k, v in sc["ns_per_block_op"].items()},
          f"pool 1M/1k {sc['pool_size_ratio_1m_over_1k']:.2f}, "
          f"owners 10k/10 {sc['owners_ratio_10k_over_10']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--vllm-python", type=Path, default=DEFAULT_PEER)
    parser.add_argument("--out", type=Path,
                        default=ROOT / "figures" / "block_pool" / "results.json")
    args = parser.parse_args()
    results = {
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "native_allocator": NATIVE_ALLOCATOR, "timer": "thread CPU time"},
        "reps": args.reps,
        "reference_workload": reference_workload(args.reps),
        "vs_vllm": vllm_comparison(args.vllm_python, args.reps),
        "scaling": scaling(args.reps),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
