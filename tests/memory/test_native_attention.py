"""The C prompt attention (veloxquant_mlx/prefill_attention.c, memory/native_attention.py).

Each check runs in a child that loads the BLAS forward first, as the server does: only
there is the kernel loaded. The kernel is compared with a float64 NumPy attention over
the concatenated parts and masks, across the shapes a paged prefill hands it (a first
chunk, a chunk over stored tokens, left padding, rows that see different stored
lengths, grouped and ungrouped heads, tiles that split the queries); then a paged
prefill of the tiny model is checked to go through the kernel and to give mlx-lm's
stock-cache logits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.test_quant_weights import _has_avx2_fma
from veloxquant_mlx import cpu_backend as cb
from veloxquant_mlx.blas_finder import find_optimized_blas, find_sgemv_forward
from veloxquant_mlx.memory import native_attention

ROOT = Path(__file__).resolve().parents[2]
LIB = find_optimized_blas()
FORWARD = find_sgemv_forward()
needs_forward = pytest.mark.skipif(
    LIB is None or FORWARD is None or not _has_avx2_fma(),
    reason="needs OpenBLAS (scipy-openblas32 or a distribution's), the BLAS forward that "
    "`pip install -e .` builds, and AVX2+FMA",
)

KERNEL_CHECK = textwrap.dedent(
    """
    import json
    import mlx.core as mx
    import numpy as np
    from veloxquant_mlx.memory import native_attention as na

    def reference(q, ks, vs, ms, scale):
        '''float64 attention over the parts concatenated, masks broadcast per part.'''
        b, hq, n, d = q.shape
        k = np.concatenate([np.asarray(x, np.float64) for x in ks], axis=2)
        v = np.concatenate([np.asarray(x, np.float64) for x in vs], axis=2)
        mask = np.concatenate([np.ones((b, 1, n, x.shape[2]), bool) if m is None else
                               np.broadcast_to(np.asarray(m), (b, 1, n, x.shape[2]))
                               for m, x in zip(ms, ks)], axis=-1)
        rep = hq // k.shape[1]
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.asarray(q, np.float64) @ k.swapaxes(-1, -2) * scale
        s = np.where(mask, s, -np.inf)
        w = np.exp(s - s.max(axis=-1, keepdims=True))
        return (w / w.sum(axis=-1, keepdims=True)) @ v

    rng = np.random.default_rng(3)
    report = []
    # (rows, query heads, kv heads, new columns, stored, head dim, left pads, stored seen)
    cases = [(1, 9, 3, 40, 0, 64, [0], None),
             (1, 9, 3, 64, 100, 64, [0], None),
             (3, 4, 4, 33, 48, 32, [0, 5, 32], [48, 17, 0]),
             (2, 8, 2, 20, 0, 16, [7, 0], None),
             (1, 9, 3, 300, 1100, 64, [0], None)]  # several tiles of queries
    for rows, hq, hkv, n, stored, d, pads, seen in cases:
        q = mx.array(rng.standard_normal((rows, hq, n, d)).astype(np.float32))
        own_k = mx.array(rng.standard_normal((rows, hkv, n, d)).astype(np.float32))
        own_v = mx.array(rng.standard_normal((rows, hkv, n, d)).astype(np.float32))
        c = np.arange(n)
        lead = np.array(pads)[:, None, None]
        own_mask = (c[None, :] <= c[:, None])[None] & ((c[None, None, :] >= lead)
                                                       | (c[None, :] == c[:, None])[None])
        ks, vs, ms = [own_k], [own_v], [mx.array(own_mask[:, None])]
        if stored:
            far = 3 * rng.standard_normal((rows, hkv, stored, d))  # wider scores
            ks.insert(0, mx.array(far.astype(np.float32)))
            vs.insert(0, mx.array(rng.standard_normal((rows, hkv, stored, d)).astype(np.float32)))
            ms.insert(0, None if seen is None else mx.array(
                np.arange(stored)[None, None, None, :] < np.array(seen)[:, None, None, None]))
        got = np.asarray(na.causal_attention(q, ks, vs, ms, d ** -0.5))
        want = reference(q, ks, vs, ms, d ** -0.5)
        report.append({"case": [rows, hq, hkv, n, stored, d],
                       "max_error": float(np.abs(got - want).max()),
                       "finite": bool(np.isfinite(got).all())})
    try:
        na.causal_attention(mx.zeros((1, 5, 16, 8)), [mx.zeros((1, 2, 16, 8))],
                            [mx.zeros((1, 2, 16, 8))], [None], 1.0)
        refused = ""
    except na.NativeAttentionError as exc:
        refused = str(exc)
    print(json.dumps({"cases": report, "refused": refused}))
    """
)

PREFILL_CHECK = textwrap.dedent(
    """
    import json, sys
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache
    from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig, native_attention
    from veloxquant_mlx.memory.kv_arena import KVArena, probe_kv_layout
    from veloxquant_mlx.memory.request_blocks import make_batch_caches

    from veloxquant_mlx.llama_model import own_model
    model = own_model(mlx_lm.load(sys.argv[1])[0])
    calls = []
    wrapped = native_attention.causal_attention
    def counting(*args, **kwargs):
        calls.append(args[0].shape[2])
        return wrapped(*args, **kwargs)
    native_attention.causal_attention = counting
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=4096))
    arena = KVArena(pool, probe_kv_layout(model))
    prompts = [[5 + (7 * j) % 900 for j in range(430)], [11 + (3 * j) % 700 for j in range(401)]]
    width = max(map(len, prompts))
    pads = [width - len(p) for p in prompts]
    batch = make_batch_caches(model, arena, [1, 2], pads)
    padded = [[0] * p + ids for p, ids in zip(pads, prompts)]
    first = model(mx.array([r[:230] for r in padded]), cache=batch.caches)  # a first chunk
    last = model(mx.array([r[230:] for r in padded]), cache=batch.caches)  # over stored tokens
    errors = []
    for i, ids in enumerate(prompts):
        cache = make_prompt_cache(model)
        want = model(mx.array([ids]), cache=cache)[0, -1]
        errors.append(float(mx.abs(last[i, -1] - want).max() / mx.abs(want).max()))
    batch.close()
    from veloxquant_mlx.blas_status import describe_backend
    print(json.dumps({"kernel": native_attention.kernel() is not None, "calls": calls,
                      "described": "prompt attention and SwiGLU in C" in describe_backend(),
                      "errors": errors, "free": pool.blocks_held_by_owner() == {}}))
    """
)


def _run_child(script: str, *args: str, preload: bool = True) -> dict:
    env = cb.child_env(preload=preload, base=dict(os.environ))
    env.pop(cb.FORWARD_OPT_OUT_ENV, None)
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-c", cb.LOAD_FIRST + script, *args], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_forward
@pytest.mark.slow
def test_kernel_is_float64_attention_within_float32_rounding() -> None:
    report = _run_child(KERNEL_CHECK)
    assert len(report["cases"]) == 5
    for case in report["cases"]:
        assert case["finite"], case
        assert case["max_error"] < 2e-5, case  # float32 sums over up to 1,400 keys
    # 5 query heads over 2 KV heads is not grouped-query attention: refused, typed.
    assert "bad shape" in report["refused"]


@needs_forward
@pytest.mark.slow
def test_a_paged_prefill_goes_through_the_kernel_with_stock_logits(tiny_model_path) -> None:
    report = _run_child(PREFILL_CHECK, str(tiny_model_path))
    assert report["kernel"] and report["described"]  # the start-up line says so
    # Every layer of both chunks (230 and 200 columns) used the kernel.
    layers = len(report["calls"]) // 2
    assert layers >= 1 and report["calls"] == [230] * layers + [200] * layers
    assert max(report["errors"]) < 1e-4, report["errors"]
    assert report["free"]


@pytest.mark.slow
def test_without_the_preload_the_kernel_is_absent_and_mlx_attends(tiny_model_path) -> None:
    report = _run_child(PREFILL_CHECK, str(tiny_model_path), preload=False)
    assert not report["kernel"] and report["calls"] == [] and not report["described"]
    assert max(report["errors"]) < 1e-4, report["errors"]


def test_no_kernel_in_a_plain_test_process_means_no_native_call() -> None:
    """Without the forward loaded in this process, the router must not try the kernel."""
    if native_attention.kernel() is not None:
        pytest.skip("this process runs with the forward loaded")
    assert native_attention.try_causal_attention(None, [], [], [], 1.0) is None
