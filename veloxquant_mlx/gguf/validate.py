"""Up-front checks: is this a GGUF file we can convert, and if not, why not.

Everything here runs on the header alone, before any tensor is loaded or any
file is written, so a bad file fails fast and leaves nothing behind.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from .errors import GGUFError
from .ggml_types import SUPPORTED_TYPES
from .header import GGUFHeader, read_header
from .layout import ARCHITECTURES, ArchSpec, tensor_problem
from .tokenizer import pre_tokenizer_for

# gpt2: byte-level BPE with merges; llama: SentencePiece pieces with scores.
SUPPORTED_TOKENIZERS = ("gpt2", "llama")


def arch_spec(header: GGUFHeader) -> ArchSpec:
    """The conversion spec of the file's architecture.

    Raises:
        GGUFError: ``general.architecture`` is missing or not supported.
    """
    arch = header.architecture
    supported = ", ".join(sorted(ARCHITECTURES))
    if arch is None:
        problem = f"metadata has no general.architecture (supported: {supported})"
        raise GGUFError(header.path, problem)
    if arch not in ARCHITECTURES:
        problem = f"architecture {arch!r} is not supported (supported: {supported})"
        raise GGUFError(header.path, problem)
    return ARCHITECTURES[arch]


def check_tensors(header: GGUFHeader, spec: ArchSpec) -> None:
    """Every tensor must have a supported type and an mlx-lm counterpart.

    Raises:
        GGUFError: Naming the first offending tensor.
    """
    for info in header.tensors:
        if info.ggml_type.name not in SUPPORTED_TYPES:
            raise GGUFError(
                header.path,
                f"tensor {info.name!r} has type {info.ggml_type.name}; "
                f"supported: {', '.join(SUPPORTED_TYPES)}",
            )
        problem = tensor_problem(info.name, spec)
        if problem:
            raise GGUFError(header.path, problem)
    names = {info.name for info in header.tensors}
    for required in ("token_embd.weight", "output_norm.weight", *block_tensors(header, spec)):
        if required not in names:
            raise GGUFError(header.path, f"required tensor {required!r} is missing")


def block_tensors(header: GGUFHeader, spec: ArchSpec) -> list[str]:
    """The tensors every block of ``spec`` needs, for ``{arch}.block_count`` blocks."""
    count = header.metadata.get(f"{header.architecture}.block_count")
    if not isinstance(count, int) or count < 1:
        raise GGUFError(header.path, f"metadata {header.architecture}.block_count is missing "
                                     "or not a positive integer")
    parts = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
             "ffn_gate", "ffn_up", "ffn_down"]
    names = [f"{part}.weight" for part in parts]
    if spec.qkv_bias:
        names += [f"attn_{p}.bias" for p in "qkv"]
    if spec.head_norms:
        names += ["attn_q_norm.weight", "attn_k_norm.weight"]
    return [f"blk.{i}.{name}" for i in range(count) for name in names]


def check_tokenizer(header: GGUFHeader) -> None:
    """The vocabulary must be one we can rebuild as a ``tokenizers`` tokenizer.

    Raises:
        GGUFError: No vocabulary, another kind of vocabulary, or one missing
            its merges (BPE) or scores (SentencePiece).
    """
    model = header.metadata.get("tokenizer.ggml.model")
    if model is None or "tokenizer.ggml.tokens" not in header.metadata:
        raise GGUFError(header.path, "metadata has no tokenizer (tokenizer.ggml.model/tokens)")
    if model not in SUPPORTED_TOKENIZERS:
        raise GGUFError(
            header.path,
            f"tokenizer model {model!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_TOKENIZERS)})",
        )
    if model == "gpt2" and "tokenizer.ggml.merges" not in header.metadata:
        raise GGUFError(header.path, "BPE tokenizer has no tokenizer.ggml.merges")
    if model == "gpt2":
        try:
            pre_tokenizer_for(header.metadata.get("tokenizer.ggml.pre"))
        except ValueError as exc:  # a split we do not reproduce
            raise GGUFError(header.path, str(exc)) from exc
    if model == "llama" and "tokenizer.ggml.scores" not in header.metadata:
        raise GGUFError(header.path, "SentencePiece tokenizer has no tokenizer.ggml.scores")


def tensor_type_counts(header: GGUFHeader) -> dict[str, int]:
    """How many tensors of each ggml type the file holds."""
    return dict(Counter(info.ggml_type.name for info in header.tensors))


def inspect_gguf(path: str | Path) -> GGUFHeader:
    """Read a GGUF header and check that :func:`convert_gguf` can convert it.

    Args:
        path: The GGUF file.

    Returns:
        The parsed header (metadata and tensor infos).

    Raises:
        GGUFError: The file is unreadable, truncated or malformed, or its
            architecture, a tensor type or its tokenizer is not supported.
    """
    header = read_header(path)
    spec = arch_spec(header)
    check_tensors(header, spec)
    check_tokenizer(header)
    return header
