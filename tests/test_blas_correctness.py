"""The optimized BLAS changes speed, not answers.

The tiny offline model runs in two child processes, one on MLX's bundled reference BLAS and
one that loads the optimized BLAS first, as the server does (``cpu_backend.child_env``,
``cpu_backend.LOAD_FIRST``). Each child:

* computes the float32 logits of a fixed 48-token prompt, and
* decodes 12 tokens greedily twice, once with mlx-lm's stock ``KVCache`` and once with the
  pool-backed caches of ``build_pooled_caches``, and checks the two runs are bit-identical
  (same tokens, logits equal with ``np.array_equal``), since the pool changes only where
  keys/values live, never the arithmetic.

Across the two BLAS libraries the logits cannot be bit-identical (OpenBLAS sums in another
order and with FMA), so they must agree within :data:`LOGIT_ATOL` + :data:`LOGIT_RTOL` *
|logit|. Measured on the tiny model (logits up to ~5): max |difference| 3.8e-6, i.e.
float32 rounding accumulated over four layers. The bounds leave ~25x room and still catch a
wrong kernel (errors of O(1)).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from veloxquant_mlx import cpu_backend as cb
from veloxquant_mlx.blas_finder import find_optimized_blas

LOGIT_ATOL = 1e-4
LOGIT_RTOL = 1e-4

LIB = find_optimized_blas()
pytestmark = pytest.mark.skipif(
    LIB is None, reason="no optimized BLAS installed (pip install scipy-openblas32)",
)

CHILD = """
import json, sys
import mlx.core as mx
import mlx_lm
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from veloxquant_mlx.blas_status import active_blas
from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig, build_pooled_caches

model_path, out = sys.argv[1], sys.argv[2]
model, _ = mlx_lm.load(model_path)
vocab = model.args.vocab_size
prompt = mx.array([(7 * i + 11) % vocab for i in range(48)])


def greedy(caches, steps=12):
    logits = model(prompt[None], cache=caches)[:, -1, :]
    tokens, rows = [], []
    for _ in range(steps):
        mx.eval(logits)
        rows.append(np.array(logits[0]))
        tokens.append(int(mx.argmax(logits, axis=-1).item()))
        logits = model(mx.array([[tokens[-1]]]), cache=caches)[:, -1, :]
    return tokens, np.stack(rows)


full = model(prompt[None])
mx.eval(full)
stock_tokens, stock_logits = greedy(make_prompt_cache(model))
pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=64))
pooled = build_pooled_caches(model, pool, owner=1)
pooled_tokens, pooled_logits = greedy(pooled)
pooled[0].release()
np.savez(out, full=np.array(full[0]), stock=stock_logits)
print(json.dumps({
    "loaded": active_blas().loaded,
    "dtype": str(full.dtype),
    "stock_tokens": stock_tokens,
    "pooled_tokens": pooled_tokens,
    "pooled_bit_identical": bool(np.array_equal(stock_logits, pooled_logits)),
    "blocks_in_use_after_release": pool.stats.blocks_in_use(),
}))
"""


def _run_child(model_path: Path, out: Path, preload: bool) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", cb.LOAD_FIRST + CHILD, str(model_path), str(out)],
        env=cb.child_env(preload=preload), capture_output=True, text=True, timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Both children's reports and arrays, keyed "bundled" / "optimized"."""
    folder = tmp_path_factory.mktemp("blas")
    result = {}
    for label, preload in (("bundled", False), ("optimized", True)):
        out = folder / f"{label}.npz"
        report = _run_child(tiny_model_path, out, preload)
        with np.load(out) as arrays:
            report["arrays"] = {key: arrays[key] for key in arrays.files}
        result[label] = report
    return result


def test_children_ran_on_the_blas_they_claim(runs: dict) -> None:
    assert runs["bundled"]["loaded"] is False
    assert runs["optimized"]["loaded"] is True
    assert runs["optimized"]["dtype"] == "mlx.core.float32"


@pytest.mark.parametrize("key", ["full", "stock"])
def test_logits_agree_across_blas_within_tolerance(runs: dict, key: str) -> None:
    bundled = runs["bundled"]["arrays"][key]
    optimized = runs["optimized"]["arrays"][key]
    assert bundled.shape == optimized.shape and np.isfinite(optimized).all()
    np.testing.assert_allclose(optimized, bundled, atol=LOGIT_ATOL, rtol=LOGIT_RTOL)
    # Not vacuous: a different BLAS really computed these (bit-identity would mean no swap).
    assert not np.array_equal(optimized, bundled)


@pytest.mark.parametrize("label", ["bundled", "optimized"])
def test_pooled_caches_bit_identical_to_stock(runs: dict, label: str) -> None:
    report = runs[label]
    assert report["pooled_tokens"] == report["stock_tokens"]
    assert report["pooled_bit_identical"] is True
    assert report["blocks_in_use_after_release"] == 0


def test_greedy_tokens_agree_across_blas(runs: dict) -> None:
    assert runs["optimized"]["stock_tokens"] == runs["bundled"]["stock_tokens"]
