"""Could the seed's compression methods serve as pool formats? One layer's decode, timed.

Run by ``benchmark_kv_formats.py`` as a child; prints one JSON line. The seed's
caches (``veloxquant_mlx.cache``) hold ONE head of ONE sequence each and are
driven from Python: a batched decode step of ``rows`` requests on a model with
``kv_heads`` KV heads calls ``append`` and ``attend`` ``rows x kv_heads`` times
per layer. This times exactly that, at SmolLM2's shapes (3 KV heads of 64, 3
query heads per KV head) and a ``context``-token history, against the q8 arena
path for the same layer (gather the rows' blocks, decode, one batched
attention, store the new column), and reports each method over q8. A method
is kept as a format only within 1.5x of q8's decode step (the caller
turns these layer times into step estimates). The history is 160 tokens, past
``spectral``'s 128 calibration tokens, so every method holds compressed KV.

Usage: python kv_seed_methods.py [ROWS CONTEXT]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veloxquant_mlx.cpu_backend import load_optimized_blas  # noqa: E402

load_optimized_blas()  # before MLX loads, as the server does
import mlx.core as mx  # noqa: E402

from veloxquant_mlx import KVCacheBuilder  # noqa: E402
from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig  # noqa: E402
from veloxquant_mlx.memory.kv_arena import KVArena, KVLayout  # noqa: E402
from veloxquant_mlx.memory.kv_format import KVFormat  # noqa: E402

KV_HEADS, HEAD_DIM, GQA, BS = 3, 64, 3, 16
METHODS = [("kivi", 4), ("turboquant_mse", 4), ("turboquant_prod", 4), ("qjl", 3),
           ("polar", 4), ("spectral", 4)]


def median_ms(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def q8_layer(rows: int, context: int):
    """One layer of a batched q8 decode step through the arena."""
    blocks = -(-(context + 1) // BS)
    pool = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=2 * rows * blocks + 2))
    arena = KVArena(pool, KVLayout(1, KV_HEADS, HEAD_DIM, mx.float32, KVFormat("q8")))
    ids = mx.arange(2 * rows * blocks, dtype=mx.int32).reshape(2 * rows, blocks)
    heads_g, heads_w = mx.arange(KV_HEADS)[None, :, None], mx.arange(KV_HEADS)[:, None]
    index = arena.gather_index(heads_g, ids)
    slots = (ids[:, -1:] * BS).reshape(1, -1)
    arena.store(heads_w, slots,
                mx.random.normal((KV_HEADS, 2 * rows, HEAD_DIM)))
    q = mx.random.normal((rows, KV_HEADS * GQA, 1, HEAD_DIM))
    new = mx.random.normal((KV_HEADS, 2 * rows, HEAD_DIM))

    def step():
        both = arena.gather(index, 2 * rows, blocks * BS)
        out = mx.fast.scaled_dot_product_attention(q, both[:rows], both[rows:],
                                                   scale=HEAD_DIM ** -0.5)
        arena.store(heads_w, slots, new)
        mx.eval(out, arena.data)
    return step


def seed_layer(method: str, bits: int, rows: int, context: int):
    """One layer of the same step with one seed cache per (row, KV head)."""
    caches = []
    for r in range(rows * KV_HEADS):
        cache = (KVCacheBuilder().with_method(method).with_head_dim(HEAD_DIM)
                 .with_bits(bits).with_seed(r).build())
        cache.append(mx.random.normal((context, HEAD_DIM)), mx.random.normal((context,
                                                                              HEAD_DIM)))
        caches.append(cache)
    k, v = mx.random.normal((HEAD_DIM,)), mx.random.normal((HEAD_DIM,))
    q = mx.random.normal((GQA, HEAD_DIM))

    def step():
        outs = []
        for cache in caches:
            cache.append(k, v)
            outs.append(cache.attend(q))
        mx.eval(outs)
    return step


def main() -> int:
    rows, context = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (16, 160)
    q8 = median_ms(q8_layer(rows, context))
    out = {"rows": rows, "context_tokens": context, "q8_layer_ms": round(q8, 3), "methods": {}}
    for method, bits in METHODS:
        ms = median_ms(seed_layer(method, bits, rows, context), reps=3)
        out["methods"][f"{method}{bits}"] = {"layer_ms": round(ms, 2),
                                             "layer_over_q8": round(ms / q8, 1)}
        print(f"{method}{bits}: {ms:.1f} ms/layer ({ms / q8:.0f}x q8)", file=sys.stderr,
              flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
