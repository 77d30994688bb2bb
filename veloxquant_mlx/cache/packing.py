"""Bit-packing of low-bit integer codes into ``uint8`` rows.

Every compressed cache stores its codes through :func:`pack_bits`, so a
``b``-bit code costs ``b`` bits of memory (plus at most 7 bits of padding at
the end of each row) instead of a whole byte.

Layout of one packed row (LSB first), for ``bits=3`` and codes ``c0, c1, c2``::

    bit stream : c0.b0 c0.b1 c0.b2 c1.b0 c1.b1 c1.b2 c2.b0 c2.b1 | c2.b2 pad...
    bytes      : <-------------- byte 0 ----------------------> | <- byte 1 ->

Rows are packed independently so a chunk of tokens can be appended without
touching earlier rows.
"""

from __future__ import annotations

import mlx.core as mx


def packed_row_bytes(n_codes: int, bits: int) -> int:
    """Bytes one packed row of ``n_codes`` codes of ``bits`` bits occupies.

    Args:
        n_codes: Codes per row.
        bits: Bits per code (1..8).

    Returns:
        ``ceil(n_codes * bits / 8)``.
    """
    return -(-n_codes * bits // 8)


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8 to pack into uint8 rows, got {bits}")


def pack_bits(codes: mx.array, bits: int) -> mx.array:
    """Pack integer codes row by row into a dense bit stream.

    Args:
        codes: Integer array of shape ``(n, c)`` with values in ``[0, 2**bits)``.
        bits: Bits per code, 1..8.

    Returns:
        ``uint8`` array of shape ``(n, packed_row_bytes(c, bits))``.

    Raises:
        ValueError: If ``bits`` is outside 1..8 or ``codes`` is not 2-D.
    """
    _check_bits(bits)
    if codes.ndim != 2:
        raise ValueError(f"pack_bits expects a 2-D (rows, codes) array, got shape {codes.shape}")
    n, c = codes.shape
    if bits == 4 and c % 2 == 0:
        # The same bytes as the bit planes below, in two operations: nibbles, low first.
        nibbles = codes.astype(mx.uint8)
        return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    shifts = mx.arange(bits, dtype=mx.uint8)
    planes = (codes.astype(mx.uint8)[..., None] >> shifts) & 1
    stream = planes.reshape(n, c * bits)
    n_bytes = packed_row_bytes(c, bits)
    pad = n_bytes * 8 - c * bits
    if pad:
        stream = mx.concatenate([stream, mx.zeros((n, pad), dtype=mx.uint8)], axis=1)
    weights = mx.left_shift(mx.array(1, dtype=mx.uint8), mx.arange(8, dtype=mx.uint8))
    # The bits of one byte are disjoint, so a sum is the same as a bitwise OR.
    return (stream.reshape(n, n_bytes, 8) * weights).sum(axis=-1).astype(mx.uint8)


def unpack_bits(packed: mx.array, bits: int, n_codes: int) -> mx.array:
    """Inverse of :func:`pack_bits`.

    Args:
        packed: ``uint8`` array of shape ``(n, packed_row_bytes(n_codes, bits))``.
        bits: Bits per code the rows were packed with.
        n_codes: Codes per row (drops the padding).

    Returns:
        ``uint8`` array of shape ``(n, n_codes)``.
    """
    _check_bits(bits)
    n = packed.shape[0]
    if bits == 4:
        # Read on every attention step by the pool's 4-bit formats: two operations,
        # not a plane per bit.
        return mx.stack([packed & 15, packed >> 4], axis=-1).reshape(n, -1)[:, :n_codes]
    planes = (packed[..., None] >> mx.arange(8, dtype=mx.uint8)) & 1
    stream = planes.reshape(n, -1)[:, : n_codes * bits].reshape(n, n_codes, bits)
    weights = mx.left_shift(mx.array(1, dtype=mx.uint8), mx.arange(bits, dtype=mx.uint8))
    return (stream * weights).sum(axis=-1).astype(mx.uint8)
