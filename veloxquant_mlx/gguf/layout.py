"""Architectures we convert, and how GGUF tensor names and rows map to mlx-lm.

Supported architectures (``general.architecture``):

* ``llama`` -> mlx-lm ``llama``. llama.cpp's converter also writes Mistral,
  SmolLM and other Llama-shaped models under this name (there is no separate
  ``mistral`` GGUF architecture for them). Its q/k rows are permuted for
  llama.cpp's interleaved RoPE, so we undo that.
* ``qwen2`` -> mlx-lm ``qwen2``: the same tensors plus q/k/v biases. llama.cpp
  runs Qwen2 with NeoX-style (rotate-half) RoPE and does *not* permute q/k, so
  the rows are already in the layout mlx-lm expects.
* ``qwen3`` -> mlx-lm ``qwen3``: no biases, but an RMSNorm over each head of
  q and k before RoPE (``attn_q_norm``/``attn_k_norm``); rows not permuted, as
  for qwen2, and the head size need not be ``embedding_length / head_count``.

Anything else (gpt2, bert, phi3, gemma, ...) has different tensors or blocks and
is refused up front.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class ArchSpec:
    """How one GGUF architecture converts.

    Attributes:
        model_type: The mlx-lm ``model_type`` written to config.json.
        permuted_qk: Whether llama.cpp stored q/k rows permuted for
            interleaved RoPE (so they must be un-permuted).
        qkv_bias: Whether q/k/v projections carry a ``.bias`` tensor.
        head_norms: Whether each block normalises q and k per head.
    """

    model_type: str
    permuted_qk: bool
    qkv_bias: bool
    head_norms: bool = False


ARCHITECTURES = {
    "llama": ArchSpec(model_type="llama", permuted_qk=True, qkv_bias=False),
    "qwen2": ArchSpec(model_type="qwen2", permuted_qk=False, qkv_bias=True),
    "qwen3": ArchSpec(model_type="qwen3", permuted_qk=False, qkv_bias=False, head_norms=True),
}

_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_PER_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_HEAD_NORMS = ("attn_q_norm", "attn_k_norm")
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)")
# .weight/.bias come from the GGUF file; .scales/.biases are the extra arrays
# the block decoder emits for quantized weights. All follow their module's new name.
_SUFFIXES = ("weight", "bias", "scales", "biases")


def module_name(gguf_module: str) -> str | None:
    """The mlx-lm module path for a GGUF tensor base name, or None if unknown.

    Args:
        gguf_module: A tensor name without its suffix (``"blk.3.attn_q"``).
    """
    if gguf_module in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_module]
    match = _BLOCK_RE.fullmatch(gguf_module)
    if match and match.group(2) in _PER_BLOCK:
        return f"model.layers.{match.group(1)}.{_PER_BLOCK[match.group(2)]}"
    return None


def rename(gguf_name: str) -> str | None:
    """The mlx-lm name of a GGUF tensor key (or a decoded part's), or None if unknown.

    Args:
        gguf_name: ``"blk.0.ffn_down.scales"`` and the like.
    """
    base, _, suffix = gguf_name.rpartition(".")
    if suffix not in _SUFFIXES:
        return None
    module = module_name(base)
    return f"{module}.{suffix}" if module else None


def tensor_problem(gguf_name: str, spec: ArchSpec) -> str | None:
    """Why a GGUF tensor cannot be converted for ``spec``, or None if it can."""
    new_name = rename(gguf_name)
    if new_name is None or gguf_name.endswith((".scales", ".biases")):
        return f"tensor {gguf_name!r} has no mlx-lm counterpart (unsupported layout)"
    if not spec.head_norms and gguf_name.rsplit(".", 2)[-2] in _HEAD_NORMS:
        return f"tensor {gguf_name!r} is a head norm that mlx-lm {spec.model_type} has no place for"
    if gguf_name.endswith(".bias"):
        is_qkv = new_name.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj")
        if not (spec.qkv_bias and is_qkv):
            return f"tensor {gguf_name!r} is a bias that mlx-lm {spec.model_type} has no place for"
    return None


def unpermute_rows(x: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's q/k row permutation for interleaved RoPE.

    llama.cpp's converter turns the rotate-half layout (pairs ``i`` and
    ``i + d/2`` of each head) into the interleaved one (pairs ``2i``, ``2i+1``)
    with ``w.reshape(n_head, 2, d // 2, ...).swapaxes(1, 2)``. Swapping the same
    two axes after splitting rows the other way round inverts it. It works on
    packed quantized weights, scales and biases alike, because quantization
    groups run along the input dimension and each row moves as a whole.

    Args:
        x: An array whose first axis holds ``n_head * head_dim`` rows.
        n_head: Heads in ``x`` (the KV head count for k).

    Returns:
        ``x`` with its rows in mlx-lm's (HF) order.
    """
    rows = x.shape[0]
    half = rows // n_head // 2
    return x.reshape(n_head, half, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)
