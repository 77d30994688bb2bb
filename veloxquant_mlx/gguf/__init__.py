"""Convert GGUF models (llama.cpp's format) to mlx-lm model folders.

Usage::

    from veloxquant_mlx.gguf import convert_gguf
    folder = convert_gguf("model.Q4_0.gguf", cache_root)
    model, tokenizer = mlx_lm.load(str(folder))

Supported: architectures ``llama`` and ``qwen2``; tensor types F32, F16,
BF16, Q8_0, Q4_0, Q4_1; byte-level BPE (``gpt2``) vocabularies. Anything else
raises :class:`GGUFError` before a file is written.

Modules: :mod:`.header` parses the header, :mod:`.validate` checks it,
:mod:`.config` writes config.json, :mod:`.weights` loads/renames tensors,
:mod:`.tokenizer` rebuilds the tokenizer, :mod:`.cache` builds folders
atomically, :mod:`.convert` ties them together.
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
