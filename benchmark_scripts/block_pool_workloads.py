"""Allocator workloads for benchmark_block_pool.py.

Run as a script (``python block_pool_workloads.py --compare REPS``) inside an
interpreter that can import vLLM, it measures our pool and vLLM's v1
``BlockPool`` side by side, interleaved, and prints one JSON object. The
allocator half of ``veloxquant_mlx`` imports without MLX, so any interpreter
that can see the repository runs it.

Timing uses ``time.thread_time()``: these loops are single-threaded and
CPU-bound, and thread CPU time is not inflated when other processes on a
shared 2-core machine take the CPU away.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class OursAdapter:
    """Our BlockPoolAllocator on one shared stream (like vLLM's single free list)."""

    def __init__(self, n_blocks: int, block_size: int = 16) -> None:
        from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig

        self.pool = BlockPoolAllocator(
            PoolConfig(block_size=block_size, n_blocks=n_blocks, separate_kv=False)
        )
        self.block_size = block_size

    def grow_and_free(self, owners: range, rounds: int, per_call: int) -> None:
        allocate = self.pool.allocate
        n_tokens = per_call * self.block_size
        for _ in range(rounds):
            for owner in owners:
                allocate("kv", n_tokens, owner)
        free_all = self.pool.free_all
        for owner in owners:
            free_all(owner)


class VllmAdapter:
    """vLLM v1 ``BlockPool`` with prefix caching off: get_new_blocks / free_blocks."""

    def __init__(self, n_blocks: int, block_size: int = 16) -> None:
        from vllm.v1.core.block_pool import BlockPool

        # +1: vLLM reserves one block as its null block.
        self.pool = BlockPool(n_blocks + 1, enable_caching=False, hash_block_size=block_size)

    def grow_and_free(self, owners: range, rounds: int, per_call: int) -> None:
        # vLLM keeps per-request block lists in its KVCacheManager, outside
        # the pool; one list per owner is the cheapest stand-in for that.
        held: dict[int, list] = {owner: [] for owner in owners}
        get_new_blocks = self.pool.get_new_blocks
        for _ in range(rounds):
            for owner in owners:
                held[owner].extend(get_new_blocks(per_call))
        free_blocks = self.pool.free_blocks
        for owner in owners:
            free_blocks(held.pop(owner))


ADAPTERS = {"veloxquant": OursAdapter, "vllm": VllmAdapter}


def cpu_seconds(fn) -> float:
    """Thread CPU seconds one call of ``fn`` takes, garbage collector paused."""
    gc.collect()
    gc.disable()
    try:
        start = time.thread_time()
        fn()
        return time.thread_time() - start
    finally:
        gc.enable()


def block_ops_per_s(pool, n_owners: int, rounds: int, per_call: int) -> float:
    """Allocate+free throughput (block-ops/s) for owners growing together."""
    owners = range(n_owners)
    seconds = cpu_seconds(lambda: pool.grow_and_free(owners, rounds, per_call))
    return 2 * n_owners * rounds * per_call / seconds


# (label, owners, rounds, blocks per call): 200 owners growing together.
THROUGHPUT_CASES = (("one_block_per_call", 200, 32, 1), ("16_blocks_per_call", 200, 4, 16))


def compare(adapters: list[str], reps: int) -> dict:
    """Median block-ops/s per adapter and case, runs interleaved rep by rep.

    Each pool is made once per case and reused by every rep, as a server
    makes its pool once at start-up: each run leaves it empty again, and a
    warm-up run has touched every block before timing starts.
    """
    runs: dict[str, dict[str, list[float]]] = {}
    for label, owners, rounds, per_call in THROUGHPUT_CASES:
        pools = {a: ADAPTERS[a](n_blocks=owners * rounds * per_call) for a in adapters}
        for pool in pools.values():
            pool.grow_and_free(range(owners), rounds, per_call)  # warm-up
        runs[label] = {a: [] for a in adapters}
        for _ in range(reps):
            for a, pool in pools.items():
                runs[label][a].append(block_ops_per_s(pool, owners, rounds, per_call))
    return {
        label: {a: {"median": statistics.median(v), "runs": v} for a, v in per.items()}
        for label, per in runs.items()
    }


def scaling_ns_per_block(pool_blocks: int, live_owners: int, ops: int = 40_000) -> float:
    """CPU ns per block-op of one-block allocate/free cycles in a loaded pool.

    ``live_owners`` owners each hold one block throughout (owner map and
    stacks at full size) while 100 churning owners allocate and release.
    """
    pool = OursAdapter(n_blocks=pool_blocks).pool
    for owner in range(live_owners):
        pool.allocate("kv", 1, owner)
    churn = range(live_owners, live_owners + 100)
    rounds = ops // (2 * len(churn))

    def cycle() -> None:
        allocate, free_all = pool.allocate, pool.free_all
        for _ in range(rounds):
            for owner in churn:
                allocate("kv", 1, owner)
            for owner in churn:
                free_all(owner)

    cycle()
    return cpu_seconds(cycle) * 1e9 / (2 * rounds * len(churn))


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--compare":
        sys.exit("usage: block_pool_workloads.py --compare REPS")
    import vllm

    result = compare(["veloxquant", "vllm"], int(sys.argv[2]))
    result["vllm_version"] = vllm.__version__
    result["python"] = sys.version.split()[0]
    print(json.dumps(result))
