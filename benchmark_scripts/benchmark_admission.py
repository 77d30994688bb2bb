"""What admission's capacity check costs with many long requests running.

Every arriving request, and every step that admits, asks the
:class:`~server.engine.capacity.CapacityPlanner` how many blocks the running
requests reserved but do not hold yet (``outstanding``): per request, the
blocks it holds on each stream, from the pool and from the prefix cache. It
runs on the engine thread, outside the step clock. This times it for
``--rows`` requests of ``--tokens`` tokens on a ``--layers``-layer layout
(the GPU benchmark's 1b model: 16), each holding ``--cached`` prompt blocks
from the prefix cache, against the previous revision's count (every held block
walked in Python over copied lists), measured in the same run on the same
pool; both must give the same answer.

Usage: python benchmark_scripts/benchmark_admission.py [--rows 64] [--reps 50]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from server.engine.capacity import CapacityPlanner, Reservation  # noqa: E402
from veloxquant_mlx.memory import NATIVE_ALLOCATOR, BlockPoolAllocator, PoolConfig  # noqa: E402
from veloxquant_mlx.memory.prefix_cache import PrefixCache, chain_hashes  # noqa: E402

BS = 16
DEFAULT_OUT = ROOT / "figures" / "admission" / "results.json"


def recount(pool: BlockPoolAllocator, cache: PrefixCache, streams: list[str],
            running: list[tuple[int, Reservation]]) -> dict[str, int]:
    """The previous count: every held block walked in Python, per request."""
    out = dict.fromkeys(streams, 0)
    for owner, reservation in running:
        held = dict.fromkeys(streams, 0)
        counts: Counter[str] = Counter()
        for entry in cache._held.get(owner, ()):
            counts.update(entry.per_stream)
        held.update(counts)
        for block in pool.blocks_for(owner):
            held[block.stream] = held.get(block.stream, 0) + 1
        for stream, blocks in reservation.per_stream.items():
            out[stream] += max(blocks - held.get(stream, 0), 0)
    return out


def build(rows: int, layers: int, tokens: int, cached: int):
    per_stream = -(-tokens // BS)
    pool = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=4 * rows * layers * per_stream))
    cache = pool.prefix_cache
    reservation = Reservation({"k": layers * (per_stream + 8), "v": layers * (per_stream + 8)})
    for owner in range(1, rows + 1):
        pool.register_owner(owner)
        blocks = {s: [pool.allocate(s, BS, owner)[0] for _ in range(layers * per_stream)]
                  for s in ("k", "v")}
        keys = chain_hashes(list(range(owner * 10_000, owner * 10_000 + cached * BS)), BS,
                            owner.to_bytes(8, "little"))
        for j, key in enumerate(keys):  # its first `cached` positions go to the cache
            position = [blocks[s][layer * per_stream + j] for layer in range(layers)
                        for s in ("k", "v")]
            cache.publish(owner, key, position)
    return pool, cache, [(o, reservation) for o in range(1, rows + 1)]


def timed(fn, reps: int) -> float:
    fn()
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--cached", type=int, default=4, help="prompt blocks per request cached")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    pool, cache, running = build(args.rows, args.layers, args.tokens, args.cached)
    planner = CapacityPlanner(pool, args.layers)
    now, before = planner.outstanding(running), recount(pool, cache, ["k", "v"], running)
    if now != before:
        raise SystemExit(f"the two counts differ: {now} vs {before}")
    new_s = timed(lambda: planner.outstanding(running), args.reps)
    old_s = timed(lambda: recount(pool, cache, ["k", "v"], running), args.reps)
    held = sum(pool.n_blocks_held(o) for o, _ in running) + cache.cached_blocks
    result = {
        "benchmark": "benchmark_scripts/benchmark_admission.py",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "native_allocator": NATIVE_ALLOCATOR},
        "load": {"rows": args.rows, "layers": args.layers, "tokens": args.tokens,
                 "cached_positions": args.cached, "blocks_held": held, "reps": args.reps},
        "outstanding": now,
        "ms_per_check": {"walk_every_block_in_python": round(1000 * old_s, 3),
                         "pool_and_cache_counts": round(1000 * new_s, 3)},
        "speedup": round(old_s / new_s, 2),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{args.rows} requests x {args.layers} layers x {args.tokens} tokens ({held} blocks "
          f"held): {1000 * old_s:.2f} -> {1000 * new_s:.2f} ms per check "
          f"({result['speedup']}x); wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
