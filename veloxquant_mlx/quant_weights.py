"""Quantized copies of dequantized weights, for small products on the CPU (Linux x86-64).

On MLX's CPU backend a quantized model is dequantized to float32 so that its matmuls
run on OpenBLAS (``server/model_weights.py``). Decode then streams 4 bytes a weight from
memory where the checkpoint needed ~0.6 (4-bit) or ~1.1 (8-bit). This module hands each
dequantized weight's codes to the loaded BLAS forward (``veloxquant_mlx/quant_matmul.c``),
keyed by the float32 buffer's address; products of at most ``max_rows`` rows against
that weight (decode steps) are then computed from the codes, with the rows quantized to
int8 per group of 32 as llama.cpp does. Larger products (prefill) stay on OpenBLAS.
The kernel reads 4- or 8-bit codes; 2, 3, 5 and 6-bit ones are widened to 8 bits
(the same numbers, a byte each). A scale and bias cover 32 columns, or 16 for 8-bit
codes: ggml's Q6_K, Q3_K and Q2_K, which MLX cannot hold, arrive that way from the GGUF
converter's ``codes16.safetensors`` (:func:`load_group16_parts`).

The copy holds the checkpoint's own codes, scales and biases, so the weights are
exactly the ones the float32 copy was made from; only the activations are rounded
(int8, one scale per 32 values: ~0.5% relative error on a random product).

Needs the forward loaded (``veloxquant_mlx/cpu_backend.py``) and AVX2 + FMA;
:func:`quant_library` says None otherwise and the float32 path serves everything. The
products use one thread per online CPU (at most 8; ``VELOXQUANT_QMM_THREADS`` overrides).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

GROUP = 32
# The GGUF converter's codes of 16-value types, beside a model folder's weights (written by
# veloxquant_mlx.gguf.weights.save_weights, read by load_group16_parts).
GROUP16_FILE = "codes16.safetensors"
# Return codes of vq_qmm_register / vq_qmm_unregister (quant_matmul.h).
_ERRORS = {
    -1: "the CPU lacks AVX2 and FMA",
    -2: "the weight's columns are not a multiple of 32, its bits not 4 or 8, or its group "
        "not 32 (or 16 for 8 bits)",
    -3: "out of memory",
    -4: "the registry is full",
    -5: "the weight is not registered",
}


class QuantizedCopyError(RuntimeError):
    """The forward refused a quantized copy (the message says why)."""


@dataclass(frozen=True, slots=True)
class QuantizedParts:
    """A quantized layer's packed weight, as MLX stores it, before dequantization.

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


def quant_library() -> Any | None:
    """The loaded forward's entry points, or None when this process lacks them."""
    handle = ctypes.CDLL(None)
    if not hasattr(handle, "vq_qmm_register") or not handle.vq_qmm_supported():
        return None
    ptr, num = ctypes.c_void_p, ctypes.c_int
    handle.vq_qmm_register.argtypes = [ptr, num, num, num, num, ptr, ptr, ptr]
    handle.vq_qmm_unregister.argtypes = [ptr]
    handle.vq_qmm_set_max_rows.argtypes = [ctypes.c_int]
    handle.vq_qmm_served.restype = ctypes.c_long
    return handle


def kernel_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """Repack MLX's words into the kernel's layout (see ``quant_matmul.c``).

    MLX puts column j of a word at bits ``bits*j`` upwards. For 8 bits that is one byte a
    column in order; the kernel wants them signed (code - 128; :func:`kernel_groups`
    moves the 128 into the biases). For 4 bits byte i of a row holds columns 2i and
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
    """Scales and biases per :func:`kernel_group` columns (float32), the biases shifted for
    signed 8-bit codes."""
    def per_group(values: np.ndarray) -> np.ndarray:
        return np.repeat(values.astype(np.float32), parts.group_size // kernel_group(parts),
                         axis=1)

    scales, biases = per_group(parts.scales), per_group(parts.biases)
    if parts.bits == 8:  # s * q + b == s * (q - 128) + (b + 128 s)
        biases = biases + 128.0 * scales
    return np.ascontiguousarray(scales), np.ascontiguousarray(biases)


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


def capture_quantized_layers(model: Any) -> dict[str, QuantizedParts]:
    """Every affine layer's packed parts, by path (call before dequantizing).

    4- and 8-bit codes are kept as stored; other widths are widened to 8 bits
    (:func:`widen_to_8_bits`), which the kernel serves too.
    """
    import mlx.core as mx
    import mlx.nn as nn

    parts = {}
    for path, module in model.named_modules():
        if not isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            continue
        if (module.bits not in (2, 3, 4, 5, 6, 8) or getattr(module, "mode", "affine") != "affine"
                or module.group_size % GROUP or module.biases is None):
            continue
        scales, biases = (np.array(v.astype(mx.float32)) for v in (module.scales, module.biases))
        packed, bits = np.array(module.weight), module.bits
        if bits not in (4, 8):
            packed, bits = widen_to_8_bits(packed, bits), 8
        parts[path] = QuantizedParts(packed, scales, biases, module.group_size, bits)
    return parts


class QuantizedCopies:
    """The quantized copies registered for one model; :meth:`close` takes them back.

    Each registered float32 array is held here, so its buffer (the registry's key) can
    never be freed and reused by another array while the copy is registered.
    """

    def __init__(self, library: Any, max_rows: int) -> None:
        self._lib = library
        self._held: dict[int, Any] = {}
        library.vq_qmm_set_max_rows(max_rows)

    def add(self, weight: Any, parts: QuantizedParts) -> None:
        """Register ``parts`` as the quantized form of the float32 ``weight`` (rows x cols)."""
        import mlx.core as mx

        mx.eval(weight)
        if weight.dtype != mx.float32 or weight.ndim != 2:
            raise QuantizedCopyError(
                f"expected a 2-D float32 weight, got {weight.dtype} {weight.shape}")
        buffer = np.asarray(weight)  # shares the array's memory: its address is the key
        rows, cols = weight.shape
        group_ok = parts.group_size % GROUP == 0 or (parts.group_size == 16 and parts.bits == 8)
        if cols % GROUP or not group_ok or parts.bits not in (4, 8):
            raise QuantizedCopyError(_ERRORS[-2])
        if parts.packed.shape != (rows, cols * parts.bits // 32):
            raise QuantizedCopyError(f"packed weight {parts.packed.shape} does not match "
                                     f"{weight.shape} at {parts.bits} bits")
        codes = kernel_codes(parts.packed, parts.bits)
        scales, biases = kernel_groups(parts)
        code = self._lib.vq_qmm_register(buffer.ctypes.data, rows, cols, parts.bits,
                                         kernel_group(parts), codes.ctypes.data,
                                         scales.ctypes.data,
                                         biases.ctypes.data)
        if code != 0:
            raise QuantizedCopyError(_ERRORS.get(code, f"error {code}"))
        self._held[buffer.ctypes.data] = weight

    def __len__(self) -> int:
        return len(self._held)

    def served(self) -> int:
        """Products served from quantized copies in this process so far (all models)."""
        return int(self._lib.vq_qmm_served())

    def close(self) -> None:
        """Unregister every copy (products fall back to the float32 weights)."""
        for address in list(self._held):
            self._lib.vq_qmm_unregister(address)
            del self._held[address]  # only now may the buffer be freed

    def __del__(self) -> None:  # a dropped model must not leave its copies registered
        self.close()


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


def float32_matrices(model: Any, parts: dict[str, QuantizedParts]) -> dict[str, QuantizedParts]:
    """The ``parts`` whose module holds a 2-D float32 ``weight`` now (others cannot be served)."""
    import mlx.core as mx

    modules = dict(model.named_modules())
    return {path: p for path, p in parts.items()
            if path in modules and getattr(modules[path], "weight", None) is not None
            and modules[path].weight.dtype == mx.float32 and modules[path].weight.ndim == 2}


def attach_quantized_copies(library: Any, model: Any, parts: dict[str, QuantizedParts],
                            max_rows: int) -> QuantizedCopies | None:
    """Register the captured parts against the dequantized ``model``'s float32 weights.

    Args:
        library: :func:`quant_library`'s handle (None: nothing is registered).
        model: The model after dequantization (same module paths as when captured).
        parts: :func:`capture_quantized_layers`'s result.
        max_rows: Largest product (rows of activations) to serve from the copies.

    Returns:
        The registered copies; None when there is nothing to register, no library (this
        process has no forward to serve them: not loaded, not x86-64, no AVX2), or the
        forward refused one (logged: the float32 weights then serve every product).
    """
    if library is None or not parts or max_rows <= 0:
        return None
    modules = dict(model.named_modules())
    copies = QuantizedCopies(library, max_rows)
    try:
        for path, quantized in parts.items():
            copies.add(modules[path].weight, quantized)
    except QuantizedCopyError as exc:
        copies.close()
        log.warning("quantized copies not used (%s: %s); every product runs in float32",
                    path, exc)
        return None
    return copies
