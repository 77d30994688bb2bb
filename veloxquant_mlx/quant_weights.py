"""Quantized weights in the layout of the codes kernel (``veloxquant_mlx/kernels``).

MLX packs a quantized layer's codes in uint32 words; the kernel reads them per group
of 32 columns (``codes_kernel.c``'s header). This module repacks them, spreads their
scales and biases per kernel group, and widens 2, 3, 5 and 6-bit codes to bytes (the
same numbers), so the 8-bit kernel serves them. A scale and bias cover 32 columns, or
16 for 8-bit codes: ggml's Q6_K, Q3_K and Q2_K, which MLX cannot hold, arrive that way
from the GGUF converter's ``codes16.safetensors`` (:func:`load_group16_parts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

GROUP = 32
# The GGUF converter's codes of 16-value types, beside a model folder's weights (written by
# veloxquant_mlx.gguf.weights.save_weights, read by load_group16_parts).
GROUP16_FILE = "codes16.safetensors"


@dataclass(frozen=True, slots=True)
class QuantizedParts:
    """A quantized layer's packed weight, as MLX stores it.

    Attributes:
        packed: uint32 words of ``32 // bits`` codes each, lowest bits first.
        scales: One scale per group of ``group_size`` columns (rows x cols/group_size).
        biases: One bias per group: w = scale * code + bias.
        group_size: Columns a scale covers (a multiple of 32, or 16 for 8 bits).
        bits: 4 or 8 (other widths arrive widened to 8).
    """

    packed: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    group_size: int
    bits: int


def kernel_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """Repack MLX's words into the kernel's layout (see ``kernels/codes_kernel.c``).

    MLX puts column j of a word at bits ``bits*j`` upwards. For 8 bits that is one byte a
    column in order; the kernel wants them signed (code - 128; it adds 128 * scale to
    each bias). For 4 bits byte i of a row holds columns 2i and
    2i+1; the kernel wants, per group of 32 columns, 16 bytes whose low nibbles are
    columns 0..15 and high nibbles columns 16..31 (one unpack for all 32).

    Returns:
        uint8 (int8 bit patterns for 8 bits), rows x cols*bits/8.
    """
    rows = packed.shape[0]
    as_bytes = np.ascontiguousarray(packed, dtype="<u4").view(np.uint8).reshape(rows, -1)
    if bits == 8:
        return as_bytes ^ np.uint8(0x80)  # code - 128 as a two's-complement byte
    codes = np.empty((rows, as_bytes.shape[1] * 2), np.uint8)
    codes[:, 0::2] = as_bytes & 0x0F
    codes[:, 1::2] = as_bytes >> 4
    groups = codes.reshape(rows, -1, GROUP)
    return (groups[..., :16] | (groups[..., 16:] << 4)).reshape(rows, -1)


def kernel_group(parts: QuantizedParts) -> int:
    """Columns per scale in the kernel: 16 stays 16, larger groups are spread over 32."""
    return parts.group_size if parts.group_size < GROUP else GROUP


def kernel_groups(parts: QuantizedParts) -> tuple[np.ndarray, np.ndarray]:
    """Scales and biases per :func:`kernel_group` columns (float32), of the unsigned codes:
    w = scale * code + bias. (The kernel holds 8-bit codes signed and adds 128 * scale
    to the bias itself, in float32: folded in beforehand, the sum would lose the bias's
    precision once stored as float16.)"""
    def per_group(values: np.ndarray) -> np.ndarray:
        return np.repeat(values.astype(np.float32), parts.group_size // kernel_group(parts),
                         axis=1)

    return (np.ascontiguousarray(per_group(parts.scales)),
            np.ascontiguousarray(per_group(parts.biases)))


def widen_to_8_bits(packed: np.ndarray, bits: int) -> np.ndarray:
    """MLX words of ``bits``-bit codes -> words of the same codes, one byte each.

    MLX stores a row as one little-endian bit stream (value j at bits ``j * bits``);
    a byte per code is the 8-bit layout, so with the same scales and biases the
    weights are unchanged: 2, 3, 5 and 6-bit layers (Q5_0, Q5_1, Q5_K from GGUF)
    can use the 8-bit kernel, reading 1 byte a weight instead of float32's 4.
    """
    rows = packed.shape[0]
    stream = np.unpackbits(np.ascontiguousarray(packed, "<u4").view(np.uint8).reshape(rows, -1),
                           axis=1, bitorder="little")
    planes = stream.reshape(rows, -1, bits)
    codes = np.zeros(planes.shape[:2], np.uint8)
    for bit in range(bits):
        codes |= planes[:, :, bit] << bit
    return codes.view(np.uint32)


def load_group16_parts(folder: Any) -> dict[str, QuantizedParts]:
    """The 16-column codes a GGUF conversion kept beside float32 weights, by module path.

    ``folder /`` :data:`GROUP16_FILE` (see :mod:`veloxquant_mlx.gguf.blocks`): 8-bit
    affine triples of group size 16 for Q6_K, Q3_K and Q2_K matrices, whose ``weight``
    in the model is their exact float32 dequantization. Empty when the file is absent.
    """
    from pathlib import Path

    import mlx.core as mx

    path = Path(folder) / GROUP16_FILE
    if not path.is_file():
        return {}
    arrays = mx.load(str(path))
    modules = {key.rsplit(".", 1)[0] for key in arrays}
    return {module: QuantizedParts(np.array(arrays[f"{module}.weight"]),
                                   np.array(arrays[f"{module}.scales"]),
                                   np.array(arrays[f"{module}.biases"]), 16, 8)
            for module in sorted(modules)}
