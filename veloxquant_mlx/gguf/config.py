"""Build mlx-lm's config.json from the GGUF metadata and tensor types."""

from __future__ import annotations

from collections import Counter
from typing import Any

from .errors import GGUFError
from .ggml_types import GROUP_SIZE, QUANT_BITS
from .header import GGUFHeader
from .layout import ArchSpec, module_name

_REQUIRED = object()


def meta(header: GGUFHeader, key: str, default: Any = _REQUIRED) -> Any:
    """A metadata value, or ``default``; a missing required key is an error.

    Args:
        header: The parsed file header.
        key: Full metadata key; a leading ``"{arch}."`` is filled in.
        default: Value when the key is absent (omit to make it required).
    """
    full_key = key.format(arch=header.architecture)
    if full_key in header.metadata:
        return header.metadata[full_key]
    if default is _REQUIRED:
        raise GGUFError(header.path, f"required metadata key {full_key!r} is missing")
    return default


def _head_dim(header: GGUFHeader, spec: ArchSpec, hidden: int, n_heads: int) -> int:
    """Head size, checked against what mlx-lm's model can represent."""
    head_dim = int(meta(header, "{arch}.attention.key_length", hidden // n_heads))
    value_dim = int(meta(header, "{arch}.attention.value_length", head_dim))
    rope_dim = int(meta(header, "{arch}.rope.dimension_count", head_dim))
    if value_dim != head_dim:
        raise GGUFError(header.path, f"key/value head sizes differ ({head_dim} vs {value_dim})")
    if rope_dim != head_dim:
        # Partial rotary embeddings are not part of mlx-lm's llama/qwen2 models.
        raise GGUFError(header.path, f"RoPE covers {rope_dim} of {head_dim} head dims")
    if spec.model_type == "qwen2" and head_dim * n_heads != hidden:
        raise GGUFError(header.path, "qwen2 needs head_dim * head_count == embedding_length")
    return head_dim


def _rope_scaling(header: GGUFHeader) -> dict[str, Any] | None:
    """mlx-lm's rope_scaling entry; only linear scaling maps over."""
    kind = meta(header, "{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"type": "linear", "factor": float(meta(header, "{arch}.rope.scaling.factor"))}
    raise GGUFError(header.path, f"RoPE scaling {kind!r} is not supported (supported: linear)")


def quantization_entry(header: GGUFHeader) -> dict[str, Any] | None:
    """The ``quantization`` entry of config.json, or None when nothing is quantized.

    The most common bit width becomes the default; every matrix that differs
    (another bit width, or a float tensor: ``False``) gets an entry keyed by
    its module path, which mlx-lm's loader looks up before the default.
    """
    per_module: dict[str, Any] = {}
    for info in header.tensors:
        if not info.name.endswith(".weight") or len(info.shape) != 2:
            continue  # norms and biases are never quantized
        bits = QUANT_BITS.get(info.ggml_type.name)
        params = {"group_size": GROUP_SIZE, "bits": bits} if bits else False
        per_module[module_name(info.name[: -len(".weight")])] = params
    counts = Counter(p["bits"] for p in per_module.values() if p)
    if not counts:
        return None
    default_bits = counts.most_common(1)[0][0]
    entry: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": default_bits}
    for module, params in per_module.items():
        if not params or params["bits"] != default_bits:
            entry[module] = params
    return entry


def build_config(header: GGUFHeader, spec: ArchSpec) -> dict[str, Any]:
    """The config.json dict for mlx-lm.

    Raises:
        GGUFError: A required hyper-parameter is missing or not representable.
    """
    hidden = int(meta(header, "{arch}.embedding_length"))
    n_heads = int(meta(header, "{arch}.attention.head_count"))
    embd = next(t for t in header.tensors if t.name == "token_embd.weight")
    config: dict[str, Any] = {
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(meta(header, "{arch}.block_count")),
        "intermediate_size": int(meta(header, "{arch}.feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta(header, "{arch}.attention.head_count_kv", n_heads)),
        "head_dim": _head_dim(header, spec, hidden, n_heads),
        "rms_norm_eps": float(meta(header, "{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta(header, "{arch}.rope.freq_base", 10000.0)),
        "vocab_size": int(meta(header, "{arch}.vocab_size", embd.shape[0])),
        "max_position_embeddings": int(meta(header, "{arch}.context_length", 4096)),
        "tie_word_embeddings": all(t.name != "output.weight" for t in header.tensors),
        "rope_traditional": False,  # q/k rows are in rotate-half order after conversion
    }
    if (scaling := _rope_scaling(header)) is not None:
        config["rope_scaling"] = scaling
    if (quantization := quantization_entry(header)) is not None:
        config["quantization"] = quantization
    return config
