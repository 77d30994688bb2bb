"""What decoding from the quantized codes costs in quality, file by file.

On a CPU the server computes a quantized model's layers from the checkpoint's codes
(``veloxquant_mlx/codes_linear.py``): decode-sized products with int8 activations.
Here the fixed English paragraph of ``tests/e2e/test_real_model.py`` is fed one
token at a time (every product one row: int8 activations), its perplexity taken, then
again on the exact float32 weights (``model.max_dequantized_bytes`` above their size),
and the two log-probability tables compared. The text is also fed through the server's
decode path (a paged batch, blocks compiled), once with the native block operations
(``codes_decode.py``) and once with the compiled halves. Each GGUF file runs in a child
with the BLAS forward loaded, as the server runs. Writes
``figures/real_model/codes_quality.json``.

Usage::

    .venv/bin/python benchmark_scripts/codes_quality.py FILE.gguf [FILE.gguf ...]
    (no file: the default model's Q4_1)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmark_scripts")]
DEFAULT_OUT = ROOT / "figures" / "real_model" / "codes_quality.json"
EXACT_FLOAT32 = 10**12  # model.max_dequantized_bytes above any float32 copy: exact weights


def child(path: str) -> dict:
    """Measure ``path`` in this process (on the optimized BLAS and its forward)."""
    import math

    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from server.model_loader import load_model
    from server.settings import ModelSection
    from tests.e2e.test_real_model import ENGLISH_TEXT

    loaded = load_model(ModelSection(path=path))
    if not loaded.codes_layers:
        raise RuntimeError("no layer computes from codes: can the codes_matmul operation "
                           "be built here (cmake, a C++ compiler)?")
    ids = loaded.tokenizer.encode(ENGLISH_TEXT)

    def one_token_at_a_time(model) -> tuple[float, np.ndarray]:
        cache = make_prompt_cache(model)
        rows = []
        for token in ids[:-1]:
            logits = model(mx.array([[token]]), cache=cache)[0, -1].astype(mx.float32)
            rows.append(np.array(logits - mx.logsumexp(logits)))
        table = np.stack(rows)
        nll = -table[np.arange(len(ids) - 1), ids[1:]].mean()
        return math.exp(float(nll)), table

    def served_decode(model, native_blocks: bool) -> float:
        """Perplexity through the server's decode path: the text one token a call on a
        paged batch, blocks compiled (native block operations or compiled halves)."""
        from veloxquant_mlx.compiled_decode import compile_decode_blocks
        from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig
        from veloxquant_mlx.memory.kv_arena import KVArena, probe_kv_layout
        from veloxquant_mlx.memory.request_blocks import make_batch_caches

        compile_decode_blocks(model, codes_blocks=native_blocks)
        pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=8192))
        batch = make_batch_caches(model, KVArena(pool, probe_kv_layout(model)), [1])
        nll = 0.0
        for token, following in zip(ids[:-1], ids[1:], strict=True):
            logits = model(mx.array([[token]]), cache=batch.caches)[0, -1]
            nll -= float((logits - mx.logsumexp(logits))[following])
        batch.release()
        return math.exp(nll / (len(ids) - 1))

    layers = loaded.codes_layers
    ppl_codes, codes = one_token_at_a_time(loaded.model)
    from veloxquant_mlx.llama_model import own_model

    served = own_model(loaded.model)
    ppl_halves = served_decode(served, native_blocks=False)
    ppl_native = served_decode(served, native_blocks=True)
    del loaded, served
    exact_model = load_model(ModelSection(path=path, max_dequantized_bytes=EXACT_FLOAT32)).model
    ppl_float, exact = one_token_at_a_time(exact_model)
    top5 = np.argsort(-exact, axis=1)[:, :5]
    moved = np.take_along_axis(codes - exact, top5, axis=1)
    return {"tokens": len(ids), "layers_from_codes": layers,
            "perplexity_codes": round(ppl_codes, 3), "perplexity_float32": round(ppl_float, 3),
            "perplexity_ratio": round(ppl_codes / ppl_float, 4),
            "served_decode": {"perplexity_native_blocks": round(ppl_native, 3),
                              "perplexity_compiled_halves": round(ppl_halves, 3),
                              "native_ratio_to_float32": round(ppl_native / ppl_float, 4)},
            "top5_logprob_mean_abs_diff": round(float(np.abs(moved).mean()), 4),
            "top5_logprob_max_abs_diff": round(float(np.abs(moved).max()), 4),
            "same_argmax_share": round(float((codes.argmax(1) == exact.argmax(1)).mean()), 4)}


def run_child(path: Path) -> dict:
    from veloxquant_mlx.cpu_backend import child_env

    env = child_env(preload=True)
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, __file__, "--child", str(path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{path.name}: child failed\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        from veloxquant_mlx.cpu_backend import load_optimized_blas

        load_optimized_blas()  # before child() imports MLX, as the server does
        print(json.dumps(child(sys.argv[2])))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="*", type=Path)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    from benchmark_revisions import checkout_revision

    from veloxquant_mlx.gguf import smollm2_gguf_path

    files = args.files or [smollm2_gguf_path()]
    results = {}
    for path in files:
        results[path.name] = run_child(path)
        print(f"{path.name}: {results[path.name]}", flush=True)
    out = {"benchmark": "benchmark_scripts/codes_quality.py",
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "revision": checkout_revision(ROOT), "files": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
