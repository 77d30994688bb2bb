"""Build tiny synthetic GGUF files with the ``gguf`` package (llama.cpp's own writer).

The weights are random and written as they would be *stored* in a GGUF file
(q/k rows already in llama.cpp's interleaved-RoPE order), so the reference
forward in :mod:`tests.gguf.reference` can run them with llama.cpp semantics
without knowing anything about the converter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from gguf.quants import dequantize, quantize
from tokenizers import pre_tokenizers

Q = gguf.GGMLQuantizationType

HIDDEN, FFN, N_LAYERS, N_HEAD, N_HEAD_KV = 64, 128, 2, 4, 2
# K-quant blocks hold 256 values of a row, so files using them are this wide.
K_HIDDEN, K_FFN = 256, 512

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<tool>"]
# Merges over the byte-level alphabet ("Ġ" is the byte-level space).
MERGES = [
    "h e", "l l", "o Ġ", "Ġ t", "Ġt he", "i n", "e r", "Ġ w", "o r", "he ll",
    "hell o", "Ġw or", "Ġwor l", "Ġworl d", "a t", "Ġ a", "o n", "r e", "Ġ i", "Ġi n",
]  # fmt: skip
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def vocabulary() -> tuple[list[str], list[int], list[str]]:
    """Tokens, llama.cpp token types and merges of the small test vocabulary."""
    tokens = list(SPECIALS) + sorted(pre_tokenizers.ByteLevel.alphabet())
    for merge in MERGES:
        left, right = merge.split(" ")
        assert left in tokens and right in tokens, merge
        tokens.append(left + right)
    tokens += USER_DEFINED
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS) - 1) + [4]
    return tokens, types, list(MERGES)


@dataclass
class Spec:
    """What to write: the default type of matrices, per-tensor overrides, layout."""

    default_type: str = "F32"
    overrides: dict[str, str] = field(default_factory=dict)
    arch: str = "llama"
    tied: bool = True
    tokenizer_model: str = "gpt2"
    hidden: int = HIDDEN
    ffn: int = FFN
    head_dim: int | None = None  # None: hidden / heads (and no key_length key written)
    # A SentencePiece vocabulary instead of the BPE one: (pieces, token types, scores).
    spm: tuple[list[str], list[int], list[float]] | None = None
    # Another byte-level BPE vocabulary: (tokens, token types, merges), and its split.
    bpe: tuple[list[str], list[int], list[str]] | None = None
    pre: str = "default"

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // N_HEAD


# Byte offsets of the float16 ``d`` (and ``dmin``) fields in each K-quant block,
# and the ``dmin / d`` ratio that centres its values near zero.
_K_FIELDS = {"Q2_K": (84, 80, 82, 1.5), "Q3_K": (110, 108, None, 0.0),
             "Q4_K": (144, 0, 2, 7.5), "Q5_K": (176, 0, 2, 15.5),
             "Q6_K": (210, 208, None, 0.0)}  # fmt: skip


def _random_k_blocks(rows: int, cols: int, type_name: str, std: float,
                     rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks whose values have about ``std`` spread.

    ``gguf`` cannot quantize to the K types, so codes and sub-block scales are
    random bytes; the values are linear in the block's ``d`` and ``dmin``, so
    both are set to one, measured, and rescaled.
    """
    size, d_at, dmin_at, centre = _K_FIELDS[type_name]
    blocks = rng.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)

    def set_scale(c: float) -> None:
        blocks[:, d_at:d_at + 2] = np.frombuffer(np.float16(c).tobytes(), np.uint8)
        if dmin_at is not None:
            blocks[:, dmin_at:dmin_at + 2] = np.frombuffer(np.float16(c * centre).tobytes(),
                                                           np.uint8)

    set_scale(1.0)
    spread = dequantize(blocks, Q[type_name]).std()
    set_scale(std / spread)
    return blocks.reshape(rows, -1)


def _add_tensor(writer: gguf.GGUFWriter, name: str, data: np.ndarray, type_name: str,
                rng: np.random.Generator) -> None:
    """Write ``data`` (float32) as ggml type ``type_name`` (K types: random, same spread)."""
    if type_name == "F32":
        writer.add_tensor(name, data.astype(np.float32))
    elif type_name == "F16":
        writer.add_tensor(name, data.astype(np.float16))
    elif type_name in _K_FIELDS:
        blocks = _random_k_blocks(*data.shape, type_name, float(data.std()), rng)
        writer.add_tensor(name, blocks, raw_dtype=Q[type_name])
    else:
        writer.add_tensor(name, quantize(data, Q[type_name]), raw_dtype=Q[type_name])


def _matrices(vocab: int, spec: Spec) -> dict[str, tuple[int, int]]:
    """Name -> (rows, cols) of every matrix in the model."""
    hidden, ffn = spec.hidden, spec.ffn
    shapes = {"token_embd.weight": (vocab, hidden)}
    if not spec.tied:
        shapes["output.weight"] = (vocab, hidden)
    q, kv = N_HEAD * spec.head_size, N_HEAD_KV * spec.head_size
    for i in range(N_LAYERS):
        shapes |= {
            f"blk.{i}.attn_q.weight": (q, hidden),
            f"blk.{i}.attn_k.weight": (kv, hidden),
            f"blk.{i}.attn_v.weight": (kv, hidden),
            f"blk.{i}.attn_output.weight": (hidden, q),
            f"blk.{i}.ffn_gate.weight": (ffn, hidden),
            f"blk.{i}.ffn_up.weight": (ffn, hidden),
            f"blk.{i}.ffn_down.weight": (hidden, ffn),
        }
    return shapes


def _write_metadata(writer: gguf.GGUFWriter, spec: Spec, vocab: list[str], types, merges,
                    scores) -> None:
    writer.add_block_count(N_LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(spec.hidden)
    writer.add_feed_forward_length(spec.ffn)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    if spec.head_dim:
        writer.add_key_length(spec.head_dim)
        writer.add_value_length(spec.head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(vocab))
    writer.add_tokenizer_model(spec.tokenizer_model)
    writer.add_tokenizer_pre(spec.pre)
    writer.add_token_list(vocab)
    writer.add_token_types(types)
    if scores is None:
        writer.add_token_merges(merges)
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(2)
        writer.add_pad_token_id(0)
    else:  # SentencePiece's default ids: <unk> 0, <s> 1, </s> 2
        writer.add_token_scores(scores)
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHATML)


def write_model(path: Path, spec: Spec, seed: int = 0) -> Path:
    """Write a 2-layer model (hidden ``spec.hidden``, 4 heads / 2 KV heads) to ``path``."""
    rng = np.random.default_rng(seed)
    vocab, types, merges = spec.bpe or vocabulary()
    scores = None
    if spec.spm is not None:
        vocab, types, scores = spec.spm
    writer = gguf.GGUFWriter(str(path), spec.arch)
    _write_metadata(writer, spec, vocab, types, merges, scores)
    for name, (rows, cols) in _matrices(len(vocab), spec).items():
        scale = 1.0 if name == "token_embd.weight" else cols**-0.5
        data = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        _add_tensor(writer, name, data, spec.overrides.get(name, spec.default_type), rng)
    norms = ["output_norm.weight"]
    norms += [f"blk.{i}.{n}.weight" for i in range(N_LAYERS) for n in ("attn_norm", "ffn_norm")]
    for name in norms:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(spec.hidden)).astype(np.float32))
    if spec.arch == "qwen3":  # RMSNorm weights over each head of q and k
        for name in [f"blk.{i}.attn_{p}_norm.weight" for i in range(N_LAYERS) for p in "qk"]:
            norm = 1.0 + 0.1 * rng.standard_normal(spec.head_size)
            writer.add_tensor(name, norm.astype(np.float32))
    if spec.arch == "qwen2":
        kv_rows = N_HEAD_KV * spec.head_size
        for i in range(N_LAYERS):
            for proj, rows in (("q", spec.hidden), ("k", kv_rows), ("v", kv_rows)):
                bias = (0.5 * rng.standard_normal(rows)).astype(np.float32)
                writer.add_tensor(f"blk.{i}.attn_{proj}.bias", bias)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _stdlib_docstrings() -> list[str]:
    """Training text: docstrings of a few standard-library modules (fixed per Python)."""
    import collections
    import inspect
    import json
    import string
    import textwrap

    lines = []
    for module in (collections, json, string, textwrap):
        for _, obj in inspect.getmembers(module):
            doc = inspect.getdoc(obj)
            if doc:
                lines += [line for line in doc.splitlines() if line.strip()]
    return lines


def train_sentencepiece():
    """A SentencePiece BPE model set up as Llama's and Mistral's were (byte fallback,
    no normalization, a dummy space prefix), with ``<tool>`` as a user-defined piece."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_stdlib_docstrings()), model_writer=model, model_type="bpe",
        vocab_size=700, byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, split_digits=True,
        user_defined_symbols=["<tool>"], minloglevel=2, num_threads=1)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def _piece_type(sp, i: int) -> int:
    """llama.cpp's token type of piece ``i`` (its converter reads the same flags)."""
    if sp.is_unknown(i):
        return 2
    if sp.is_control(i):
        return 3
    if sp.is_byte(i):
        return 6
    if sp.is_unused(i):
        return 5
    return 4 if sp.id_to_piece(i) == "<tool>" else 1


def sentencepiece_vocabulary(sp) -> tuple[list[str], list[int], list[float]]:
    """``(pieces, token types, scores)`` of a model, as llama.cpp's converter writes them."""
    n = sp.get_piece_size()
    return ([sp.id_to_piece(i) for i in range(n)], [_piece_type(sp, i) for i in range(n)],
            [sp.get_score(i) for i in range(n)])


def write_minimal(path: Path, arch: str = "llama", tensors: dict | None = None, **kv) -> Path:
    """A small file with given raw tensors ``{name: (uint8/float array, type name)}``."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in kv.items():
        writer.add_string(key, value)
    for name, (data, type_name) in (tensors or {}).items():
        if type_name in ("F32", "F16"):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=Q[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# The synthetic variants the logits test runs, by id.
VARIANTS = {
    "F32": Spec("F32", tied=False),
    "F16": Spec("F16"),
    "BF16": Spec("BF16"),
    "Q8_0": Spec("Q8_0"),
    "Q4_0": Spec("Q4_0"),
    "Q4_1": Spec("Q4_1"),
    "mixed": Spec(
        "Q4_0",
        overrides={
            "token_embd.weight": "Q4_1",
            "output.weight": "F16",
            "blk.0.ffn_down.weight": "Q8_0",
            "blk.1.attn_v.weight": "BF16",
            "blk.1.attn_k.weight": "F32",
        },
        tied=False,
    ),
    "qwen2-Q8_0": Spec("Q8_0", arch="qwen2"),
    # Qwen3's heads are wider than hidden / heads (e.g. 0.6B: 16 x 128 over 1024).
    "qwen3-Q4_K": Spec("Q4_K", arch="qwen3", hidden=K_HIDDEN, ffn=K_FFN, head_dim=128),
    "Q5_0": Spec("Q5_0"),
    "Q5_1": Spec("Q5_1"),
    **{kind: Spec(kind, hidden=K_HIDDEN, ffn=K_FFN)
       for kind in ("Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K")},
    # Laid out as llama.cpp's Q4_K_M: Q4_K, Q6_K for the output and some value
    # and down projections; plus a Q5_0 matrix (its fallback type) and float norms.
    "Q4_K_M": Spec(
        "Q4_K",
        overrides={
            "output.weight": "Q6_K",
            "blk.0.attn_v.weight": "Q6_K",
            "blk.0.ffn_down.weight": "Q6_K",
            "blk.1.ffn_down.weight": "Q5_0",
        },
        tied=False, hidden=K_HIDDEN, ffn=K_FFN,
    ),
}
