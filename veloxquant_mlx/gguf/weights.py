"""Load GGUF tensors with MLX, rename them for mlx-lm, and save safetensors."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from .errors import GGUFError
from .header import GGUFHeader, TensorInfo
from .layout import ArchSpec, rename, unpermute_rows


def _read_bf16(path: Path, info: TensorInfo) -> mx.array:
    """A BF16 tensor read straight from the file.

    mx.load converts BF16 GGUF tensors to float16, which overflows above
    65504 and flushes tiny values; reading the raw 16-bit words keeps the
    values exact.
    """
    raw = np.fromfile(path, dtype="<u2", count=info.nbytes // 2, offset=info.offset)
    return mx.array(raw.reshape(info.shape)).view(mx.bfloat16)


def load_gguf_tensors(header: GGUFHeader) -> dict[str, mx.array]:
    """All tensors of a validated file, keyed by their GGUF (mx.load) names.

    Q4_0/Q4_1/Q8_0 weights arrive as MLX affine triples: ``X.weight`` (packed
    uint32), ``X.scales`` and ``X.biases`` (float16), group size 32.

    Raises:
        GGUFError: MLX could not read the file.
    """
    try:
        tensors = mx.load(str(header.path))
    except (RuntimeError, ValueError) as exc:
        raise GGUFError(header.path, f"MLX could not read the tensors ({exc})") from exc
    for info in header.tensors:
        if info.ggml_type.name == "BF16":
            tensors[info.name] = _read_bf16(header.path, info)
    return tensors


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
        if new_name is None:  # validated already; only reachable if mx.load adds keys
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


def save_weights(weights: dict[str, mx.array], folder: Path) -> None:
    """Write ``model.safetensors`` (the name mlx-lm's loader globs for)."""
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
