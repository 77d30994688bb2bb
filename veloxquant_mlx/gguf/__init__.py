"""Convert GGUF models (llama.cpp's format) to mlx-lm model folders.

Usage::

    from veloxquant_mlx.gguf import convert_gguf
    folder = convert_gguf("model.Q4_0.gguf", cache_root)
    model, tokenizer = mlx_lm.load(str(folder))

Supported: architectures ``llama``, ``qwen2`` and ``qwen3``; tensor types
F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants Q2_K to Q6_K;
byte-level BPE (``gpt2``) and SentencePiece (``llama``) vocabularies. Anything
else raises :class:`GGUFError` before a file is written.

Modules: :mod:`.header` parses the header, :mod:`.validate` checks it,
:mod:`.config` writes config.json, :mod:`.weights` reads/renames tensors,
:mod:`.blocks` decodes quantized blocks, :mod:`.tokenizer` (and :mod:`.spm`)
rebuild the tokenizer, :mod:`.cache` builds folders atomically,
:mod:`.convert` ties them together.
"""

from __future__ import annotations

from .convert import convert_gguf
from .errors import GGUFError
from .ggml_types import SUPPORTED_TYPES
from .header import GGUFHeader, TensorInfo, read_header
from .layout import ARCHITECTURES
from .smollm2 import smollm2_gguf_path
from .validate import inspect_gguf

__all__ = [
    "ARCHITECTURES",
    "GGUFError",
    "GGUFHeader",
    "SUPPORTED_TYPES",
    "TensorInfo",
    "convert_gguf",
    "inspect_gguf",
    "read_header",
    "smollm2_gguf_path",
]
