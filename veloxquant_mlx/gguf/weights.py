"""Read GGUF tensors, rename them for mlx-lm, and save safetensors."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from ..quant_weights import GROUP16_FILE
from .blocks import GROUP16_PARTS, decode_tensor
from .errors import GGUFError
from .header import GGUFHeader, TensorInfo
from .layout import ArchSpec, rename, unpermute_rows

_FLOAT_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}
# A 16-value type's codes under the names of an MLX affine triple (group size 16).
_GROUP16_NAMES = dict(zip(GROUP16_PARTS, ("weight", "scales", "biases"), strict=True))


def _read_float(path: Path, info: TensorInfo) -> mx.array:
    """An F32/F16/BF16 tensor as stored.

    BF16 is read as its raw 16-bit words and viewed as bfloat16, so every value
    stays exact (mx.load's GGUF reader turned BF16 into float16, which overflows
    above 65504 and flushes tiny values).
    """
    kind = info.ggml_type.name
    count = int(np.prod(info.shape, dtype=np.int64))
    raw = np.fromfile(path, dtype=_FLOAT_DTYPES[kind], count=count, offset=info.offset)
    array = mx.array(raw.reshape(info.shape))
    return array.view(mx.bfloat16) if kind == "BF16" else array


def load_gguf_tensors(header: GGUFHeader) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
    """All tensors of a validated file, keyed by their GGUF names; and the 16-value codes.

    Quantized weights with an exact MLX layout arrive as affine triples
    (``X.weight`` packed uint32, ``X.scales``, ``X.biases``; group size 32), the
    others (Q2_K, Q3_K, Q6_K) as float32 ``X.weight``: see :mod:`.blocks`.
    The second dict holds those matrices' codes as affine triples of group
    size 16 and 8 bits, under the same names.

    Raises:
        GGUFError: A tensor could not be read.
    """
    tensors: dict[str, mx.array] = {}
    group16: dict[str, mx.array] = {}
    for info in header.tensors:
        try:
            if info.ggml_type.name in _FLOAT_DTYPES:
                tensors[info.name] = _read_float(header.path, info)
                continue
            base = info.name.removesuffix(".weight")
            for key, value in decode_tensor(header.path, info).items():
                if key in _GROUP16_NAMES:
                    group16[f"{base}.{_GROUP16_NAMES[key]}"] = mx.array(value)
                    continue
                tensors[info.name if key == "weight" else f"{base}.{key}"] = mx.array(value)
        except (OSError, ValueError) as exc:
            raise GGUFError(header.path, f"tensor {info.name!r} could not be read ({exc})") from exc
    return tensors, group16


def _head_counts(config: dict) -> dict[str, int]:
    """Heads per projection whose rows llama.cpp permuted."""
    return {
        "self_attn.q_proj": config["num_attention_heads"],
        "self_attn.k_proj": config["num_key_value_heads"],
    }


def to_mlx_lm(
    tensors: dict[str, mx.array], header: GGUFHeader, spec: ArchSpec, config: dict
) -> dict[str, mx.array]:
    """Rename tensors to mlx-lm names and undo the q/k permutation if needed.

    Args:
        tensors: Output of :func:`load_gguf_tensors`.
        header: The validated header (for error messages).
        spec: The architecture's conversion spec.
        config: The config.json dict (head counts).

    Returns:
        mlx-lm weights, quantized triples kept as they are.
    """
    heads = _head_counts(config) if spec.permuted_qk else {}
    out: dict[str, mx.array] = {}
    for name, array in tensors.items():
        new_name = rename(name)
        if new_name is None:  # validated already
            raise GGUFError(header.path, f"tensor {name!r} has no mlx-lm counterpart")
        module = new_name.rsplit(".", 1)[0]
        for proj, n_head in heads.items():
            if module.endswith(proj):
                if array.shape[0] != n_head * config["head_dim"]:
                    raise GGUFError(
                        header.path,
                        f"tensor {name!r} has {array.shape[0]} rows, expected "
                        f"{n_head} heads x {config['head_dim']}",
                    )
                array = unpermute_rows(array, n_head)
        out[new_name] = array
    return out


def save_weights(weights: dict[str, mx.array], folder: Path,
                 group16: dict[str, mx.array] | None = None) -> None:
    """Write ``model.safetensors`` (the name mlx-lm's loader globs for), and the 16-value codes
    beside it (mlx-lm reads ``model*.safetensors`` only, so never those).

    ``group16`` (mlx-lm names, affine triples of group size 16 and 8 bits) goes to
    :data:`GROUP16_FILE` when there is any.
    """
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    if group16:
        mx.save_safetensors(str(folder / GROUP16_FILE), group16,
                            metadata={"format": "mlx", "group_size": "16", "bits": "8"})
