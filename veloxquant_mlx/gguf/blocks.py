"""Decode ggml's quantized blocks: into MLX's affine layout where it is exact, else float32.

A ggml block type stores a row as blocks of 32 or 256 values. Where every
32 consecutive values share one scale and one offset (``w = scale * code +
bias``), the block is exactly MLX's affine quantization with group size 32,
and we keep it packed:

    type   codes   per group of 32              scales and biases
    Q8_0   8 bit   d * q, q signed              float16 (mx.load's layout)
    Q4_0   4 bit   d * (q - 8)                  float16
    Q4_1   4 bit   d * q + m                    float16
    Q5_0   5 bit   d * (q - 16)                 float16
    Q5_1   5 bit   d * q + m                    float16
    Q4_K   4 bit   (d * sc) * q - dmin * m      float32: d * sc is not a float16
    Q5_K   5 bit   as Q4_K, a fifth bit in qh   float32

Q2_K, Q3_K and Q6_K give each 16 values their own scale, and MLX has no
group size below 32, so those tensors are decoded to float32 (exact: the
values ggml's own dequantization computes). Their codes are kept too, as an
affine triple with group size 16 (``codes16``, ``scales16``, ``biases16``:
8-bit codes ``u``, ``w = scale * u + bias``), which MLX cannot load but the
CPU's decode kernel serves (:mod:`veloxquant_mlx.quant_weights`)::

    type   value per 16                  code u            scale     bias
    Q6_K   d * sc * (q - 32)             q - 32 + 128      d * sc    -128 * scale
    Q3_K   d * sc * (q - 4 * (1 - h))    q - 4 + 4h + 128  d * sc    -128 * scale
    Q2_K   d * sc_lo * q - dmin * sc_hi  q + 128           d * sc_lo -dmin * sc_hi - 128 * scale

Every decoder follows the block layouts of ggml's ``ggml-common.h`` and works
on whole arrays of blocks at once; rows are decoded a slab at a time to bound
the temporary memory.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import GGUFError
from .ggml_types import GROUP_SIZE, QUANT_BITS
from .header import TensorInfo

# Bytes of packed input decoded at a time (the temporaries are a few times this).
_SLAB_BYTES = 32 << 20


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 field at byte ``start`` of each block, ``(n, 1)``."""
    return blocks[:, start:start + 2].copy().view("<f2")


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 field at byte ``start`` of each block, as float32 ``(n, 1)``."""
    return _half(blocks, start).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``(n, 16)`` bytes -> ``(n, 32)`` codes: low nibbles are values 0-15, high 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """``(n, 4)`` bytes of a little-endian uint32 -> ``(n, 32)`` bits, value j at bit j."""
    return np.unpackbits(qh, axis=1, bitorder="little")


def _legacy(blocks: np.ndarray, kind: str):
    """The 32-value types: codes ``(n, 32)``, one float16 scale and bias per block."""
    d = _half(blocks, 0)
    if kind == "Q8_0":
        codes = (blocks[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return codes, d, -d * np.float16(128)
    if kind == "Q4_0":
        return _nibbles(blocks[:, 2:18]), d, -d * np.float16(8)
    if kind == "Q4_1":
        return _nibbles(blocks[:, 4:20]), d, _half(blocks, 2)
    if kind == "Q5_0":
        codes = _nibbles(blocks[:, 6:22]) | (_high_bits(blocks[:, 2:6]) << 4)
        return codes, d, -d * np.float16(16)
    # Q5_1
    codes = _nibbles(blocks[:, 8:24]) | (_high_bits(blocks[:, 4:8]) << 4)
    return codes, d, _half(blocks, 2)


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins, ``(n, 8)`` each.

    Sub-blocks 0-3 keep theirs in the low 6 bits of bytes 0-3 (scales) and
    4-7 (mins); sub-blocks 4-7 take a nibble of bytes 8-11 and the top two bits
    of the byte that holds sub-block ``j - 4``'s value.
    """
    low, mid, top = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([low & 63, (top & 0x0F) | ((low >> 6) << 4)], axis=1)
    mins = np.concatenate([mid & 63, (top >> 4) | ((mid >> 6) << 4)], axis=1)
    return scales, mins


def _k_affine(blocks: np.ndarray, fifth_bit: bool):
    """Q4_K/Q5_K: codes ``(n, 256)`` and float32 scales and biases ``(n, 8)``.

    Each 64 values are 32 bytes of ``qs``: their low nibbles are sub-block
    ``2c``, their high nibbles ``2c + 1``. Q5_K adds bit ``k`` of ``qh[l]`` as
    the fifth bit of value ``l`` of sub-block ``k``.
    """
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    qs = blocks[:, 48:176] if fifth_bit else blocks[:, 16:144]
    qs = qs.reshape(n, 4, 1, 32)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32)
    if fifth_bit:
        qh = blocks[:, 16:48]  # (n, 32): bit k of byte l
        bits = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
        codes = codes | (bits << 4)
    # As ggml: the float32 product d * sc scales the code, dmin * m is subtracted.
    return (codes.reshape(n, 256), d * scales.astype(np.float32),
            -(dmin * mins.astype(np.float32)))


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    """Q6_K: ``d * sc * (q - 32)``, one int8 scale per 16 values (see :func:`_sixteens`).

    Each half of 128 values takes 64 bytes of ``ql`` and 32 of ``qh``: its
    quarters are the low nibbles of ``ql[0:32]``, of ``ql[32:64]``, then their
    high nibbles, each with two more bits from ``qh`` (bits 0-1, 2-3, 4-5, 6-7).
    """
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 2, 32)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # (n, half, quarter, 32)
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    q = (low | (((qh >> shifts) & 3) << 4)).astype(np.int8) - np.int8(32)
    return q.reshape(n, 256), _f16(blocks, 208) * sc, None


def _two_bit_quarters(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K's 64 bytes -> 256 two-bit values.

    Half ``h`` reads bytes ``32h .. 32h + 31``; its quarter ``j`` is bits
    ``2j, 2j + 1`` of each of them.
    """
    n = qs.shape[0]
    q = qs.reshape(n, 2, 1, 32)
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    return ((q >> shifts) & 3).reshape(n, 256)


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """Q3_K's 12 bytes -> sixteen signed 6-bit scales ``(n, 16)``.

    The low nibbles of bytes 0-7 are scales 0-7, their high nibbles 8-15; the
    two top bits of each come from bytes 8-11, two bits per scale.
    """
    low, top = packed[:, 0:8], packed[:, 8:12]
    tops = np.concatenate([(top >> s) & 3 for s in (0, 2, 4, 6)], axis=1)  # scale order
    nibbles = np.concatenate([low & 0x0F, low >> 4], axis=1)
    return (nibbles | (tops << 4)).astype(np.int8) - np.int8(32)


def _q3_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    """Q3_K: ``d * sc * (q - 4 * (1 - h))`` (see :func:`_sixteens`).

    ``q`` is two bits from ``qs``; ``h``, the high-mask bit, is bit ``4 * half +
    quarter`` of ``hmask[l]`` for value ``l`` of each 32.
    """
    n = blocks.shape[0]
    q = _two_bit_quarters(blocks[:, 32:96]).astype(np.int8)
    hmask = blocks[:, 0:32].reshape(n, 1, 32)
    hbits = (hmask >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # (n, 8, 32)
    q = q - ((1 - hbits.reshape(n, 256).astype(np.int8)) * 4).astype(np.int8)
    return q, _f16(blocks, 108) * _q3_k_scales(blocks[:, 96:108]).astype(np.float32), None


def _q2_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q2_K: ``d * (sc & 15) * q - dmin * (sc >> 4)`` per 16 values (see :func:`_sixteens`)."""
    sc = blocks[:, 0:16]
    q = _two_bit_quarters(blocks[:, 16:80]).astype(np.int8)
    dl = _f16(blocks, 80) * (sc & 0x0F).astype(np.float32)
    ml = _f16(blocks, 82) * (sc >> 4).astype(np.float32)
    return q, dl, -ml


def _sixteens(blocks: np.ndarray, kind: str, rows: int, cols: int) -> dict[str, np.ndarray]:
    """A 16-value type: the float32 ``weight``, and its codes as a group-16 affine triple.

    Each decoder gives signed codes ``v`` ``(n, 256)``, one float32 scale per 16
    values and an offset per 16 (None: 0), ``w = scale * v + offset``, the
    order of ggml's own float arithmetic, so ``weight`` is its dequantization.
    """
    v, scale, offset = _SIXTEEN_DECODERS[kind](blocks)
    weight = np.repeat(scale, 16, axis=1) * v.astype(np.float32)
    if offset is not None:
        weight = weight + np.repeat(offset, 16, axis=1)
    bias = -128.0 * scale if offset is None else offset - 128.0 * scale
    codes = (v.astype(np.int16) + 128).astype(np.uint8)
    return {"weight": weight.reshape(rows, cols),
            "codes16": pack_codes(codes.reshape(rows, cols), 8),
            "scales16": scale.reshape(rows, cols // 16),
            "biases16": bias.astype(np.float32).reshape(rows, cols // 16)}


_SIXTEEN_DECODERS = {"Q6_K": _q6_k, "Q3_K": _q3_k, "Q2_K": _q2_k}
DECODED_TYPES = tuple(QUANT_BITS) + tuple(_SIXTEEN_DECODERS)
# Parts of a 16-value type's tensor beside its float32 weight (see the module docstring).
GROUP16_PARTS = ("codes16", "scales16", "biases16")


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes ``(rows, cols)`` -> MLX's packed words ``(rows, cols * bits / 32)`` uint32.

    MLX lays a row out as one little-endian bit stream, value ``j`` in bits
    ``j * bits`` upwards, read as uint32 words (for every bit width).
    """
    rows, cols = codes.shape
    if bits == 8:
        return np.ascontiguousarray(codes, dtype=np.uint8).view(np.uint32)
    if bits == 4:
        pairs = codes.reshape(rows, cols // 2, 2).astype(np.uint8)
        return np.ascontiguousarray(pairs[..., 0] | (pairs[..., 1] << 4)).view(np.uint32)
    planes = (codes[..., None] >> np.arange(bits, dtype=np.uint8)) & 1
    stream = np.packbits(planes.reshape(rows, cols * bits).astype(np.uint8), axis=1,
                         bitorder="little")
    return stream.view(np.uint32)


def _decode_rows(raw: np.ndarray, kind: str, cols: int, block_bytes: int) -> dict[str, np.ndarray]:
    """One slab of rows of raw blocks -> ``weight`` (packed or float32), ``scales``, ``biases``.

    A 16-value type gives its float32 ``weight`` and :data:`GROUP16_PARTS`.
    """
    rows = raw.shape[0]
    blocks = raw.reshape(-1, block_bytes)
    if kind in _SIXTEEN_DECODERS:
        return _sixteens(blocks, kind, rows, cols)
    if kind in ("Q4_K", "Q5_K"):
        codes, scales, biases = _k_affine(blocks, fifth_bit=kind == "Q5_K")
    else:
        codes, scales, biases = _legacy(blocks, kind)
    return {"weight": pack_codes(codes.reshape(rows, cols), QUANT_BITS[kind]),
            "scales": scales.reshape(rows, cols // GROUP_SIZE),
            "biases": biases.reshape(rows, cols // GROUP_SIZE)}


def decode_tensor(path: Path, info: TensorInfo) -> dict[str, np.ndarray]:
    """Read one quantized tensor of a GGUF file and decode it.

    Args:
        path: The GGUF file.
        info: The tensor's entry from the validated header.

    Returns:
        ``{"weight": packed uint32, "scales", "biases"}`` for the affine types
        (:data:`QUANT_BITS` bits, group size 32); for the others ``{"weight":
        float32}`` and, for a matrix, its codes (:data:`GROUP16_PARTS`).

    Raises:
        GGUFError: The type is not one of :data:`DECODED_TYPES`, or an affine
            tensor is not a matrix.
    """
    kind = info.ggml_type.name
    if kind not in DECODED_TYPES:
        raise GGUFError(path, f"tensor {info.name!r}: no decoder for type {kind}")
    if kind in QUANT_BITS and len(info.shape) != 2:
        raise GGUFError(path, f"tensor {info.name!r}: a {kind} tensor must be a matrix, "
                              f"not shape {info.shape}")
    cols = info.shape[-1]
    rows = int(np.prod(info.shape[:-1], dtype=np.int64))
    row_bytes = info.ggml_type.nbytes(cols)
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=info.offset,
                    shape=(rows, row_bytes))
    step = max(1, _SLAB_BYTES // row_bytes)
    slabs = [_decode_rows(np.asarray(raw[r:r + step]), kind, cols, info.ggml_type.type_size)
             for r in range(0, rows, step)]
    out = {key: np.concatenate([s[key] for s in slabs]) for key in slabs[0]}
    out["weight"] = out["weight"].reshape(*info.shape[:-1], -1)
    if len(info.shape) != 2:  # the decode kernel serves matrices only
        for key in GROUP16_PARTS:
            out.pop(key, None)
    return out
