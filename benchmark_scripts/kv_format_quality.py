"""Quality and decode speed of each KV format on the real model, in this process.

Run by ``benchmark_kv_formats.py`` as a child (on OpenBLAS, as the server); prints one
JSON line. Everything goes through the server's own paged KV batch on an arena
of the format under test, so stored tokens are read back from quantized
blocks exactly as when serving:

- perplexity on the fixed English text of ``tests/e2e/test_real_model.py``,
  teacher-forced ONE token per model call: every token's logits come from
  keys and values read back from the blocks (a single prefill call would see
  its own columns unquantized and measure nothing);
- greedy continuations of the given prompts, all in one batch, and the
  median decode step time of that batch (a same-process ratio to native).

Usage: python kv_format_quality.py PROMPTS.json FORMAT [FORMAT ...]
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from veloxquant_mlx.cpu_backend import load_optimized_blas  # noqa: E402

load_optimized_blas()  # before MLX loads, as the server does
import mlx.core as mx  # noqa: E402

from server.model_loader import load_model  # noqa: E402
from server.settings import load_settings  # noqa: E402
from tests.e2e.test_real_model import ENGLISH_TEXT  # noqa: E402
from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig  # noqa: E402
from veloxquant_mlx.memory.kv_arena import KVArena, probe_kv_layout  # noqa: E402
from veloxquant_mlx.memory.kv_format import KVFormat  # noqa: E402
from veloxquant_mlx.memory.request_blocks import make_batch_caches  # noqa: E402

N_BLOCKS = 30 * 2 * 20 * 16  # 20 rows of up to 256 tokens, 30 layers, k and v


def arena_for(model, fmt: KVFormat) -> KVArena:
    return KVArena(BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=N_BLOCKS)),
                   probe_kv_layout(model, fmt))


def perplexity(model, ids: list[int], fmt: KVFormat) -> float:
    """exp(mean NLL) of ``ids[1:]``, each predicted in its own one-token model call."""
    batch = make_batch_caches(model, arena_for(model, fmt), 1)
    nll = []
    for pos in range(len(ids) - 1):
        logits = model(mx.array([[ids[pos]]]), cache=batch.caches)[0, -1].astype(mx.float32)
        nll.append(mx.logsumexp(logits) - logits[ids[pos + 1]])
        if pos % 16 == 15:
            mx.eval(nll)
    value = mx.mean(mx.stack(nll)).item()
    batch.release()
    return math.exp(value)


def greedy(model, prompts: list[list[int]], n_new: int, fmt: KVFormat) -> tuple[list, list]:
    """Greedy tokens of every prompt (one batch, left-padded) and each decode step's ms."""
    width = max(map(len, prompts))
    pads = [width - len(p) for p in prompts]
    batch = make_batch_caches(model, arena_for(model, fmt), list(range(1, len(prompts) + 1)),
                             pads)
    logits = model(mx.array([[0] * q + p for q, p in zip(pads, prompts, strict=True)]),
                   cache=batch.caches)[:, -1]
    token = mx.argmax(logits, -1)
    mx.eval(token)
    out, steps = [token], []
    for _ in range(n_new - 1):
        start = time.perf_counter()
        token = mx.argmax(model(token[:, None], cache=batch.caches)[:, -1], -1)
        mx.eval(token)
        steps.append(1000 * (time.perf_counter() - start))
        out.append(token)
    batch.release()
    return mx.stack(out, axis=1).tolist(), steps


def main() -> int:
    prompts_text = json.loads(Path(sys.argv[1]).read_text())
    settings = load_settings(None, overrides={"model": {"path": "smollm2"}}, env={})
    loaded = load_model(settings.model)
    model, tok = loaded.model, loaded.tokenizer
    text_ids = tok.encode(ENGLISH_TEXT)
    prompts = [tok.encode(p) for p in prompts_text["prompts"]]
    result = {"text_tokens": len(text_ids), "dtype": loaded.dtype, "formats": {}}
    for name in sys.argv[2:]:
        fmt = KVFormat(name, prompts_text.get("group_size", 64))
        layout = probe_kv_layout(model, fmt)
        ppl = perplexity(model, text_ids, fmt)
        tokens, steps = greedy(model, prompts, prompts_text["new_tokens"], fmt)
        result["formats"][name] = {
            "format_tag": layout.format_tag, "kv_bytes_per_token": layout.bytes_per_token(),
            "layout": [layout.n_layers, layout.n_kv_heads, layout.head_dim],
            "perplexity": round(ppl, 4), "greedy_tokens": tokens,
            "decode_step_ms_median": round(statistics.median(steps), 2),
            "decode_rows": len(prompts)}
        print(f"{name}: ppl {ppl:.4f}, step {statistics.median(steps):.1f} ms",
              file=sys.stderr, flush=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
